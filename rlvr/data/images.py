"""Images for the VLM (rlvr.models.vision): load, resize, normalise, patchify; placeholders.

`preprocess` reproduces the Qwen2-VL / Qwen2.5-VL image processor (transformers'
`Qwen2VLImageProcessorPil`): RGB, `smart_resize` to multiples of patch*merge pixels within
[min_pixels, max_pixels] (PIL bicubic on uint8), scale to [0, 1], normalise by the CLIP mean and
std, then cut into 14x14 patches repeated over the 2 frames of the temporal patch and laid out
block by block (the 4 patches of each 2x2 merge block adjacent), one row per patch.

An image content part of a chat record is `{"type": "image", "image": <path | data URL | base64>}`
(or `{"type": "image_url", "image_url": {"url": ...}}`); `expand_placeholders` turns the one
`<|image_pad|>` a chat template writes per image into one per merged patch; `encode_image_record`
and `ImageTokenStream` do that for SFT records, batches carrying each row's images.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from rlvr.data.chat import render_chat
from rlvr.data.packing import empty_batch, pack_examples
from rlvr.data.stream import TokenStream
from rlvr.models.config import VisionConfig
from rlvr.models.tokenizer import Tokenizer

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
IMAGE_PAD = "<|image_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, area within
    [min_pixels, max_pixels], aspect ratio kept as nearly as possible (Qwen2-VL's rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {width}x{height}: aspect ratio over 200 is not supported; crop or pad it.")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(source: Any) -> Image.Image:
    """A PIL image from a PIL image, a file path, a `data:image/...;base64,` URL or bare base64."""
    if isinstance(source, Image.Image):
        return source
    if not isinstance(source, str):
        raise ValueError(f"image: expected a path, a data URL or base64 text, got {type(source).__name__}.")
    if source.startswith("data:"):
        source = source.split(",", 1)[-1]
    elif os.path.exists(source):
        return Image.open(source)
    try:
        return Image.open(io.BytesIO(base64.b64decode(source, validate=True)))
    except (ValueError, OSError):
        raise ValueError(f"image: {source[:60]!r} is neither a file nor base64 image data; give a path, a "
                         "data:image/...;base64 URL or base64 text.") from None


def patchify(image: np.ndarray, vcfg: VisionConfig) -> np.ndarray:
    """[C, H, W] float -> [H/p * W/p, C * frames * p * p], rows in merge-block order."""
    c, h, w = image.shape
    p, m = vcfg.patch_size, vcfg.spatial_merge_size
    patches = image.reshape(c, h // p // m, m, p, w // p // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], vcfg.temporal_patch_size,
                                                              *patches.shape[5:]))
    return patches.reshape((h // p) * (w // p), vcfg.patch_dim)


def preprocess(images: Sequence[Any], vcfg: VisionConfig, min_pixels: int = MIN_PIXELS,
               max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(patches float32 [N, patch_dim], grids [(1, h, w)] in patches) of `images`, concatenated."""
    all_patches, grids = [], []
    factor = vcfg.patch_size * vcfg.spatial_merge_size
    for source in images:
        image = load_image(source).convert("RGB")
        height, width = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
        pixels = np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC))
        pixels = (pixels.astype(np.float64) / 255.0).astype(np.float32)
        pixels = (pixels - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)
        all_patches.append(patchify(pixels.transpose(2, 0, 1), vcfg))
        grids.append((1, height // vcfg.patch_size, width // vcfg.patch_size))
    return np.concatenate(all_patches).astype(np.float32), grids


def image_grid(source: Any, vcfg: VisionConfig, max_pixels: int = MAX_PIXELS) -> tuple[int, int, int]:
    """The (t, h, w) patch grid `preprocess` gives an image, from its size alone (no pixels decoded)."""
    image = load_image(source)
    factor = vcfg.patch_size * vcfg.spatial_merge_size
    height, width = smart_resize(image.height, image.width, factor, MIN_PIXELS, max_pixels)
    return 1, height // vcfg.patch_size, width // vcfg.patch_size


def chat_prompt_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], vcfg: VisionConfig | None,
                    max_pixels: int = MAX_PIXELS) -> tuple[list[int], list[Any]]:
    """(generation prompt ids, image sources) of chat messages whose contents may hold image parts:
    the chat template's one `<|image_pad|>` per image expanded to the image's placeholder count,
    as the rollout engine and the trainer see them."""
    messages, sources = split_image_parts(messages)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not sources:
        return ids, []
    if vcfg is None:
        raise ValueError("a prompt with image content parts needs a VLM policy (model.vision, e.g. a Qwen2.5-VL "
                         "checkpoint); this model reads text only.")
    out, k = [], 0
    for token in ids:
        if token == vcfg.image_token_id and k < len(sources):
            out += [token] * placeholder_count(image_grid(sources[k], vcfg, max_pixels), vcfg)
            k += 1
        else:
            out.append(token)
    if k != len(sources):
        raise ValueError(f"{len(sources)} image parts but {k} {IMAGE_PAD} tokens after the chat template: does the "
                         "tokenizer have the image tokens as special tokens?")
    return out, sources


def placeholder_count(grid: Sequence[int], vcfg: VisionConfig) -> int:
    """Decoder tokens of one image: its patches over the merge unit."""
    t, h, w = grid
    return t * h * w // vcfg.merge_unit


def expand_placeholders(text: str, grids: Sequence[Sequence[int]], vcfg: VisionConfig) -> str:
    """`text` with its i-th `<|image_pad|>` repeated once per merged patch of image i (as the HF processor)."""
    pieces = text.split(IMAGE_PAD)
    if len(pieces) - 1 != len(grids):
        raise ValueError(f"{len(pieces) - 1} {IMAGE_PAD} placeholders in the text for {len(grids)} images; "
                         "each image content part needs one.")
    out = [pieces[0]]
    for grid, piece in zip(grids, pieces[1:], strict=True):
        out += [IMAGE_PAD * placeholder_count(grid, vcfg), piece]
    return "".join(out)


# --- chat records with image content parts ------------------------------------------------------------


class ImageExample(NamedTuple):
    """One encoded record: token ids and loss mask with expanded placeholders, its images' patches
    [n, patch_dim] and grids [(t, h, w)] in placeholder order."""

    ids: list[int]
    mask: list[int]
    patches: np.ndarray
    grids: list[tuple[int, int, int]]


_IMAGE_PART_TYPES = ("image", "image_url")


def _image_source(part: Mapping[str, Any]) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, Mapping) else url
    return part.get("image")


def split_image_parts(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict], list[Any]]:
    """(messages with string content, image sources in order): a list content's text parts are
    joined and each image part becomes `<|vision_start|><|image_pad|><|vision_end|>` (as the
    Qwen2.5-VL chat template writes it)."""
    out, sources = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        text = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                text.append(part.get("text", ""))
            elif kind in _IMAGE_PART_TYPES:
                text.append(VISION_START + IMAGE_PAD + VISION_END)
                sources.append(_image_source(part))
            else:
                raise ValueError(f"message content part {part!r}: type must be 'text', 'image' or 'image_url'.")
        out.append({**message, "content": "".join(text)})
    return out, sources


def uses_images(record: Mapping[str, Any]) -> bool:
    """A chat record with an image content part."""
    return any(isinstance(p, Mapping) and p.get("type") in _IMAGE_PART_TYPES
               for m in record.get("messages", ()) if isinstance(m, Mapping) and isinstance(m.get("content"), list)
               for p in m["content"])


def check_image_tokens(tokenizer: Tokenizer, vcfg: VisionConfig) -> None:
    """Raises ValueError unless the tokenizer has the model's placeholder tokens as single ids."""
    for token, want in ((IMAGE_PAD, vcfg.image_token_id), (VISION_START, vcfg.vision_start_token_id),
                        (VISION_END, vcfg.vision_end_token_id)):
        got = tokenizer.tok.token_to_id(token)
        if got != want:
            raise ValueError(f"tokenizer: {token} is id {got}, the model's vision config says {want}; use the "
                             "VLM checkpoint's own tokenizer (tokenizer.path), which has the image tokens.")


def encode_image_record(tokenizer: Tokenizer, vcfg: VisionConfig, record: Mapping[str, Any],
                        max_pixels: int = MAX_PIXELS) -> ImageExample:
    """A `{"messages": [...]}` record whose contents may hold image parts -> `ImageExample`
    (loss on the assistant turns, as `rlvr.data.chat.render_chat`; never on placeholders)."""
    messages, sources = split_image_parts(record["messages"])
    ids, mask = render_chat(tokenizer, messages, record.get("tools"))
    patches, grids = (preprocess(sources, vcfg, max_pixels=max_pixels) if sources
                      else (np.zeros((0, vcfg.patch_dim), np.float32), []))
    out_ids, out_mask, k = [], [], 0
    for token, m in zip(ids, mask, strict=True):
        if token != vcfg.image_token_id:
            out_ids.append(token)
            out_mask.append(m)
            continue
        if k == len(grids):
            raise ValueError(f"record has more {IMAGE_PAD} tokens than image parts ({len(grids)}); the text must "
                             "not contain the placeholder itself.")
        n = placeholder_count(grids[k], vcfg)
        out_ids += [token] * n
        out_mask += [0] * n
        k += 1
    if k != len(grids):
        raise ValueError(f"{len(grids)} image parts but {k} {IMAGE_PAD} tokens after the chat template: does "
                         "tokenizer.json have the image tokens as special tokens?")
    return ImageExample(out_ids, out_mask, patches, grids)


class ImageTokenStream(TokenStream):
    """`TokenStream` over records with images: each batch adds the rows' `image_*` arrays
    (rlvr.models.vision.ImageInputs; `capacity` patches per row, 0 = the batch's most)."""

    def __init__(self, source, encode, batch_size: int, seq_len: int, pad_id: int, seed: int,
                 vision: VisionConfig, capacity: int = 0, pack: bool = True, shuffle: bool = True,
                 one_epoch: bool = False):
        super().__init__(source, encode, batch_size, seq_len, pad_id, seed, pack, shuffle, one_epoch)
        self.vision, self.capacity = vision, capacity

    def _batch(self) -> tuple[dict[str, np.ndarray], list[int]]:
        """The next batch (every row, each packed from its own record stream: rlvr.data.stream) and the
        records each row consumed."""
        from rlvr.models.vision import IMAGE_KEYS, image_inputs

        batch = empty_batch(self.batch_size, self.seq_len, self.pad_id)
        patches, grids, consumed = [], [], []
        for row in range(self.batch_size):
            seen: list[ImageExample] = []

            def texts(row=row, seen=seen):
                for example in self._row_examples(row):
                    if len(example.ids) > self.seq_len and example.grids:
                        raise ValueError(f"data.seq_len={self.seq_len} cuts a record with images ({len(example.ids)} "
                                         "tokens); raise data.seq_len or lower data.image_max_pixels.")
                    seen.append(example)
                    yield example.ids, example.mask

            one, n = pack_examples(texts(), 1, self.seq_len, self.pad_id, self.pack)
            for key in batch:
                batch[key][row] = one[key][0]
            examples = seen[:n]
            patches.append(np.concatenate([e.patches for e in examples] or [np.zeros((0, self.vision.patch_dim))]))
            grids.append([g for e in examples for g in e.grids])
            consumed.append(n)
        images = image_inputs(self.vision, patches, grids, batch["tokens"], batch["segment_ids"],
                              self.capacity or None)
        return batch | {f"image_{key}": np.asarray(value) for key, value in zip(IMAGE_KEYS, images, strict=True)}, \
            consumed

    def __next__(self) -> dict[str, np.ndarray]:
        batch, consumed = self._batch()
        for row, n in enumerate(consumed):
            self.cursors[row] += n
        return batch

    def next_rows(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """Rows `rows` of the next batch. Not sharded: the image arrays' size is the batch's most patches
        (capacity 0), so every process builds the whole batch (docs/how-to/launch-on-a-pod.md,
        "Running across hosts")."""
        return {key: value[list(rows)] for key, value in next(self).items()}

    def peek(self) -> dict[str, np.ndarray]:
        return self._batch()[0]

    def shapes(self) -> dict[str, Any]:
        import jax

        return {key: jax.ShapeDtypeStruct(value.shape, value.dtype) for key, value in self.peek().items()}
