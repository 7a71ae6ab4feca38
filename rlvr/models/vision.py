"""A vision-language model in the layout of Qwen2.5-VL, pure-functional like the decoder.

Reading order: `ImageInputs` (what a batch carries for its images, built on the host by
`image_inputs` from the processor's patches and grids), `VisionTransformer` (the ViT: patch
embedding, blocks with 2-D RoPE and windowed or full attention, the 2x2 patch merger),
`rlvr.models.transformer.VisionLanguageModel` (the decoder with image features written at the
`<|image_pad|>` placeholders and M-RoPE positions from `mrope_positions`; it lives beside the decoder,
which runs it from `forward(cfg, params, ..., images=ImageInputs)`).

Layout, as HF's `Qwen2_5_VLForConditionalGeneration`:
* patches arrive flattened [channels*2*14*14] in merge-block order (the 4 patches of each 2x2
  block adjacent: `rlvr.data.images.patchify`); each row of a batch carries its own images'
  patches, padded to a capacity, so images shard and split into micro-batches with their tokens;
* ViT attention is within one image (full-attention layers) or within one window of
  `window_size` pixels (the others). HF permutes the patches window by window and runs attention
  per window; here the patches stay in place and a [N, N] mask says which may attend (same
  result: attention is permutation-equivariant given the mask, and rotary angles travel with
  their patch);
* the merger turns each 2x2 block into one decoder-width vector, in the order of the
  placeholders; the decoder is Qwen2's (q/k/v biases) with M-RoPE: a placeholder's rotary
  position is (t, row, column) of its block offset by the text before it, text after an image
  continues from the image's largest id + 1.
Parameters: the decoder's tree (same paths as the text model, so LoRA, sharding rules and the
text HF table apply unchanged) plus `visual/...`, with logical axes from the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rlvr.models.config import VisionConfig
from rlvr.models.layers import Linear, RMSNorm, apply_rope, dot_product_attention

Params = dict[str, Any]


class ImageInputs(NamedTuple):
    """The images of a batch, each row's own (so a batch shards and splits into micro-batches by
    row like its tokens), laid out on the host by `image_inputs`; a pytree of arrays.

    patches [B, P, patch_dim] float: row b's images' patches, then padding up to the capacity P;
    vit_positions [B, P, 2] (row, column of each patch in its image); frame_ids [B, P] (full
    attention: same frame of the same image); window_ids [B, P] (windowed attention); padding
    patches have ids of their own (they attend to themselves only, and their merged features
    come after the row's placeholders' so are never used); rope_positions [B, T, 3] M-RoPE ids."""

    patches: Any
    vit_positions: Any
    frame_ids: Any
    window_ids: Any
    rope_positions: Any


# --- host-side layout ----------------------------------------------------------------------


def patch_layout(vcfg: VisionConfig, grids: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
    """(vit_positions [N, 2], frame_ids [N], window_ids [N]) for images of `grids` [(t, h, w)] in
    patches, the patches in merge-block order (HF's `get_vision_position_ids` /
    `get_vision_window_index`)."""
    m = vcfg.spatial_merge_size
    window = vcfg.window_size // m // vcfg.patch_size  # merged blocks per window side
    positions, frames, windows = [], [], []
    frame_base = window_base = 0
    for t, h, w in grids:
        if h % m or w % m:
            raise ValueError(f"image grid {(t, h, w)}: height and width in patches must be multiples of "
                             f"spatial_merge_size={m}; resize with rlvr.data.images.smart_resize.")
        grid = np.stack(np.meshgrid(np.arange(h), np.arange(w), indexing="ij"), -1)  # [h, w, 2]
        rows, cols = grid.reshape(h // m, m, w // m, m, 2).transpose(0, 2, 1, 3, 4).reshape(-1, 2).T
        per_side = -(-(w // m) // window)
        win = (rows // m // window) * per_side + (cols // m // window)
        n_windows = (-(-(h // m) // window)) * per_side
        for frame in range(t):
            positions.append(np.stack([rows, cols], -1))
            frames.append(np.full(h * w, frame_base + frame))
            windows.append(win + window_base + frame * n_windows)
        frame_base += t
        window_base += t * n_windows
    return (np.concatenate(positions).astype(np.int32), np.concatenate(frames).astype(np.int32),
            np.concatenate(windows).astype(np.int32))


def mrope_positions(vcfg: VisionConfig, tokens: np.ndarray, segment_ids: np.ndarray,
                    grids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(M-RoPE ids [B, T, 3], deltas [B]) as HF's `get_rope_index` for images: each segment (a run
    of one non-zero segment id: a packed sequence) counts from 0; a run of placeholders takes the
    next grid of `grids` (in order over the batch). `deltas[b]` is what decoding adds to a
    token's index to get its M-RoPE id after the prompt of row b (its last segment)."""
    tokens, segment_ids = np.asarray(tokens), np.asarray(segment_ids)
    out = np.zeros((*tokens.shape, 3), np.int32)
    deltas = np.zeros(tokens.shape[0], np.int32)
    grid_iter = iter(grids)
    m = vcfg.spatial_merge_size
    for b in range(tokens.shape[0]):
        i, length = 0, tokens.shape[1]
        while i < length:
            if segment_ids[b, i] == 0:
                i += 1
                continue
            start, pos, seg = i, 0, segment_ids[b, i]
            while i < length and segment_ids[b, i] == seg:
                if tokens[b, i] != vcfg.image_token_id:
                    out[b, i] = pos
                    pos, i = pos + 1, i + 1
                    continue
                t, h, w = next(grid_iter, (0, 0, 0))
                n = t * (h // m) * (w // m)
                if n == 0 or not (tokens[b, i:i + n] == vcfg.image_token_id).all():
                    raise ValueError(f"row {b}: the image placeholders at {i} do not match the next image grid "
                                     f"{(t, h, w)} ({n} tokens); build prompts with rlvr.data.images.")
                tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
                out[b, i:i + n] = pos + np.stack([tt, hh, ww], -1).reshape(n, 3)
                pos, i = pos + max(h, w) // m, i + n
            deltas[b] = pos - (i - start)
    if next(grid_iter, None) is not None:
        raise ValueError("more image grids than runs of image placeholders in the tokens.")
    return out, deltas


def image_inputs(vcfg: VisionConfig, patches: Sequence[np.ndarray], grids: Sequence[Sequence[Sequence[int]]],
                 tokens: np.ndarray, segment_ids: np.ndarray, capacity: int | None = None) -> ImageInputs:
    """The `ImageInputs` of a batch: per row, its images' `patches` [n, patch_dim] and `grids`
    [(t, h, w)] as the image processor gives them (rlvr.data.images.preprocess), in the order their
    placeholders appear in the row's tokens. `capacity`: patches per row (default: the most any
    row has); a fixed capacity keeps shapes, and so the compiled step, the same across batches."""
    rows = len(tokens)
    if len(patches) != rows or len(grids) != rows:
        raise ValueError(f"image_inputs: {len(patches)} patch arrays and {len(grids)} grid lists for {rows} rows; "
                         "give one of each per row (empty for a row without images).")
    counts = [sum(t * h * w for t, h, w in g) for g in grids]
    need = max(counts)
    capacity = -(-max(need, vcfg.merge_unit) // vcfg.merge_unit) * vcfg.merge_unit if capacity is None else capacity
    if need > capacity or capacity % vcfg.merge_unit:
        raise ValueError(f"data.image_patches={capacity}: must be a multiple of {vcfg.merge_unit} and hold the "
                         f"{need} patches of the row with the most; raise it or use fewer/smaller images.")
    out = np.zeros((rows, capacity, vcfg.patch_dim), np.float32)
    pos = np.zeros((rows, capacity, 2), np.int32)
    pad_ids = -1 - np.arange(capacity, dtype=np.int32)  # one attention group per padding patch
    frames, windows = np.tile(pad_ids, (rows, 1)), np.tile(pad_ids, (rows, 1))
    rope = np.zeros((*np.shape(tokens), 3), np.int32)
    for b in range(rows):
        grid = [tuple(int(v) for v in g) for g in grids[b]]
        if len(patches[b]) != counts[b]:
            raise ValueError(f"row {b}: {len(patches[b])} patches for grids {grid}: expected one per patch.")
        rope[b] = mrope_positions(vcfg, tokens[b:b + 1], segment_ids[b:b + 1], grid)[0][0]
        if grid:
            n = counts[b]
            out[b, :n] = patches[b]
            pos[b, :n], frames[b, :n], windows[b, :n] = patch_layout(vcfg, grid)
    return ImageInputs(out, pos, frames, windows, rope)


# --- the vision encoder --------------------------------------------------------------------


def vision_rope(vcfg: VisionConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """2-D RoPE cos/sin [..., head_dim] of positions [..., 2]: the first half of the frequencies turn
    with the row, the second with the column (HF's axial rope), duplicated in rotate-half layout."""
    half = vcfg.head_dim // 2
    inv_freq = 1.0 / (vcfg.rope_theta ** (jnp.arange(0, half, 2, dtype=jnp.float32) / half))
    angles = (positions.astype(jnp.float32)[..., None] * inv_freq).reshape(*positions.shape[:-1], -1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


class VisionBlock(nn.Module):
    vcfg: VisionConfig
    dtype: str = "float32"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x, cos, sin, masks, is_full):
        v = self.vcfg
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype, use_bias=True)
        norm = dict(dim=v.hidden_size, eps=v.rms_norm_eps, param_dtype=self.param_dtype)
        e, h, d = v.hidden_size, v.num_heads, v.head_dim
        mask = jnp.where(is_full, masks[0], masks[1])
        qkv = Linear((e,), (3, h, d), ("embed",), (None, "heads", "head_dim"), name="qkv", **dense)(
            RMSNorm(**norm, name="norm1")(x))
        q, k = (apply_rope(qkv[:, :, i], cos, sin) for i in (0, 1))
        out = dot_product_attention(q, k, qkv[:, :, 2], mask[:, None, None])
        x = x + Linear((h, d), (e,), ("heads", "head_dim"), ("embed",), name="proj", **dense)(out)
        y = RMSNorm(**norm, name="norm2")(x)
        gate = Linear((e,), (v.intermediate_size,), ("embed",), ("mlp",), name="gate_proj", **dense)(y)
        up = Linear((e,), (v.intermediate_size,), ("embed",), ("mlp",), name="up_proj", **dense)(y)
        x = x + Linear((v.intermediate_size,), (e,), ("mlp",), ("embed",), name="down_proj", **dense)(
            nn.silu(gate) * up)
        return x, None


class VisionTransformer(nn.Module):
    """Patches [B, P, patch_dim] -> decoder-width features [B, P / merge_unit, out_hidden_size]."""

    vcfg: VisionConfig
    dtype: str = "float32"  # the decoder's compute and parameter dtypes
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, patches, vit_positions, frame_ids, window_ids):
        v = self.vcfg
        dense = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        pixels = patches.reshape(*patches.shape[:2], v.in_channels, v.temporal_patch_size, v.patch_size,
                                 v.patch_size)
        x = Linear(pixels.shape[2:], (v.hidden_size,), (None,) * 4, ("embed",), name="patch_embed", **dense)(pixels)
        cos, sin = vision_rope(v, vit_positions)
        masks = jnp.stack([ids[:, :, None] == ids[:, None, :] for ids in (frame_ids, window_ids)])  # [2, B, P, P]
        is_full = jnp.isin(jnp.arange(v.num_layers), jnp.asarray(v.full_attention_layers, jnp.int32))
        blocks = nn.scan(VisionBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0), length=v.num_layers,
                         metadata_params={nn.PARTITION_NAME: "layers"})(v, **dense, name="blocks")
        x, _ = blocks(x, cos, sin, masks, is_full)
        x = RMSNorm(v.hidden_size, v.rms_norm_eps, param_dtype=self.param_dtype, name="ln_q")(x)
        x = x.reshape(x.shape[0], -1, v.hidden_size * v.merge_unit)
        x = Linear((x.shape[-1],), (x.shape[-1],), (None,), ("mlp",), use_bias=True, name="merger_fc1", **dense)(x)
        x = nn.gelu(x, approximate=False)
        return Linear((x.shape[-1],), (v.out_hidden_size,), ("mlp",), ("embed",), use_bias=True, name="merger_fc2",
                      **dense)(x)


def scatter_image_features(embeds: jax.Array, tokens: jax.Array, features: jax.Array, image_token_id: int):
    """`embeds` [B, T, E] with each row's placeholders replaced, in order, by the rows of its
    `features` [B, M, E] (HF's `masked_scatter`); the counts are checked on the host (`image_inputs`)."""
    is_image = tokens == image_token_id
    index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, features.shape[1] - 1)
    gathered = jnp.take_along_axis(features.astype(embeds.dtype), index[..., None], axis=1)
    return jnp.where(is_image[..., None], gathered, embeds)


IMAGE_KEYS = ImageInputs._fields


def batch_images(batch: dict[str, Any]) -> ImageInputs | None:
    """The `ImageInputs` a training batch carries under `image_*` keys (rlvr.data.images), or None."""
    if "image_patches" not in batch:
        return None
    return ImageInputs(*(batch[f"image_{k}"] for k in IMAGE_KEYS))
