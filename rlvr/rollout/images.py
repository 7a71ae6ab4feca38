"""Image prompts in the rollout engine (a VLM, rlvr.models.vision): what a request's images become
before its prompt is prefilled.

`prepare` runs once per request, at submit: the images (`Request.image_data`: paths, data URLs or
base64, as SGLang's `image_data`) go through the processor (rlvr.data.images.preprocess), a
prompt's single `<|image_pad|>` per image is expanded to one per merged patch (as the HF processor
and SGLang do; prompts already expanded are kept), the vision tower runs (`device_fns.encode_images`)
and the result is a `PromptImages`:
  * `features` [capacity, E] on device: row i is the decoder input of the i-th placeholder; the
    prefill writes them in place of the placeholders' token embeddings, chunk by chunk. They belong
    to the weights of `epoch` (the engine's `weights_epoch` at encoding): a weight update between
    submit and prefill makes the engine re-encode them (`encoded`) from the kept `encoder_inputs`,
    so an image is always read by the same weights as the text around it;
  * `rope` [T, 3] the prompt's M-RoPE ids and `delta`: decoding uses position + delta (text after
    the image), exactly as `rlvr.models.vision.mrope_positions` defines them;
  * `keys`: the prompt as the prefix cache sees it: each placeholder of image j is replaced by a
    negative id derived from the image's content hash, so two different images behind the same
    placeholder tokens never share pages, and the same image (any request) does.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlvr.models.config import ModelConfig, VisionConfig


@dataclasses.dataclass(frozen=True)
class PromptImages:
    """One request's images, ready for prefill (see the module docstring)."""

    features: Any  # jax.Array [capacity, E]
    rope: np.ndarray  # [T, 3] int32
    delta: int
    keys: list[int]
    feature_index: np.ndarray  # [T] the placeholder's row of `features` (0 for text tokens)
    patches: np.ndarray  # [n, patch_dim] (prompt log-probs rerun the full VLM)
    grids: list[tuple[int, int, int]]
    encoder_inputs: tuple  # the vision tower's inputs (NumPy): `features` again under new weights
    epoch: int  # the engine's weights_epoch `features` were encoded under

    def encoded(self, cfg: ModelConfig, params, epoch: int) -> PromptImages:
        """The same images with `features` encoded by `params` (the weights of `epoch`)."""
        from rlvr.rollout import device_fns

        features = device_fns.encode_images(cfg, params["visual"], *(jnp.asarray(a) for a in self.encoder_inputs))[0]
        return dataclasses.replace(self, features=features, epoch=epoch)

    def extended(self, output: list[int]) -> PromptImages:
        """The same images for the prompt followed by `output` (a retracted sequence)."""
        start = len(self.keys)
        text = np.arange(start, start + len(output), dtype=np.int32) + self.delta
        return dataclasses.replace(self, rope=np.concatenate([self.rope, np.repeat(text[:, None], 3, 1)]),
                                   keys=self.keys + list(output),
                                   feature_index=np.concatenate([self.feature_index, np.zeros(len(output), np.int32)]))

    def chunk(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(M-RoPE ids [n, 3], feature rows [n]) of prompt positions [start, end)."""
        return self.rope[start:end], self.feature_index[start:end]


def image_key(patches: np.ndarray, grid: tuple[int, ...]) -> int:
    """A negative id from the content of one preprocessed image (its patches and grid)."""
    digest = hashlib.sha256(np.ascontiguousarray(patches, np.float32).tobytes() + repr(tuple(grid)).encode())
    return -1 - int.from_bytes(digest.digest()[:8], "little") % (1 << 62)


def expand_prompt(input_ids: list[int], grids: list[tuple[int, int, int]], vcfg: VisionConfig) -> list[int]:
    """`input_ids` with each image's placeholder run expanded to its merged-patch count: a run of
    one placeholder is expanded (a chat template's output); a run of the right length is kept."""
    from rlvr.data.images import placeholder_count

    image = vcfg.image_token_id
    out, i, k = [], 0, 0
    while i < len(input_ids):
        if input_ids[i] != image:
            out.append(input_ids[i])
            i += 1
            continue
        run = i
        while run < len(input_ids) and input_ids[run] == image:
            run += 1
        if k >= len(grids):
            raise ValueError(f"input_ids has more runs of the image token {image} than image_data has images "
                             f"({len(grids)}); give one image per placeholder.")
        n = placeholder_count(grids[k], vcfg)
        if run - i not in (1, n):
            raise ValueError(f"input_ids: image {k} has {run - i} placeholder tokens; its {grids[k]} grid needs "
                             f"{n} (or 1, expanded here).")
        out += [image] * n
        i, k = run, k + 1
    if k != len(grids):
        raise ValueError(f"image_data has {len(grids)} images but input_ids has {k} runs of the image token "
                         f"{image}; the prompt needs one <|image_pad|> per image.")
    return out


def prepare(cfg: ModelConfig, params, input_ids: list[int], image_data: list[Any], max_pixels: int, epoch: int
            ) -> tuple[list[int], PromptImages]:
    """(expanded input_ids, `PromptImages`) of one request (`params`: the engine's decode params,
    those of weights `epoch`)."""
    from rlvr.data.images import preprocess
    from rlvr.models.vision import image_inputs, mrope_positions

    if cfg.vision is None:
        raise ValueError("request has image_data but the served model has no vision encoder (model.vision).")
    vcfg = cfg.vision
    patches, grids = preprocess(image_data, vcfg, max_pixels=max_pixels)
    ids = expand_prompt(list(input_ids), grids, vcfg)
    tokens = np.asarray(ids, np.int32)[None]
    _, deltas = mrope_positions(vcfg, tokens, np.ones_like(tokens), grids)
    units = -(-len(patches) // vcfg.merge_unit)
    capacity = (1 << (units - 1).bit_length()) * vcfg.merge_unit  # a few compiled shapes
    inputs = image_inputs(vcfg, [patches], [grids], tokens, np.ones_like(tokens), capacity)
    rope = inputs.rope_positions
    is_image = tokens[0] == vcfg.image_token_id
    keys, start = list(ids), 0
    for grid in grids:
        count = int(np.prod(grid))
        keys = _replace_run(keys, vcfg.image_token_id, count // vcfg.merge_unit,
                            image_key(patches[start:start + count], grid))
        start += count
    feature_index = np.where(is_image, np.cumsum(is_image) - 1, 0).astype(np.int32)
    images = PromptImages(None, rope[0], int(deltas[0]), keys, feature_index, patches, list(grids),
                          tuple(np.asarray(a) for a in inputs[:4]), epoch)
    return ids, images.encoded(cfg, params, epoch)


def _replace_run(keys: list[int], image: int, n: int, key: int) -> list[int]:
    """`keys` with the first run of `n` placeholder ids `image` replaced by `key`."""
    i = keys.index(image)
    return keys[:i] + [key] * n + keys[i + n:]
