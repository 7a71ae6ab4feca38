"""A pure-functional decoder (Llama / Qwen2 / Qwen3 / Mistral) in Flax linen.

Parameters are a plain nested dict; `forward(cfg, params, tokens, positions,
segment_ids, cache) -> (logits, cache)` is a pure function. Layers are scanned
(parameters stacked on a leading `layers` axis) so compile time does not grow with
depth. Every parameter carries logical axis names (see `rlvr.sharding`).

The KV cache is paged and position-indexed: `cache = {"k", "v": [layers, pages, page_size,
kv_heads, head_dim], "page_table": [batch, pages_per_row]}`; the token at position `p` of
row `b` lives in page `page_table[b, p // page_size]` at offset `p % page_size`. Writing by
position makes ragged prompts, chunked prefill and one-token decode steps the same code
path; tokens with segment id 0 (padding) are never written. A contiguous per-row cache
(`init_cache`) is the special case of one page per row; the rollout engine shares prompt
pages between the samples of a group.

Without a cache (training, scoring), `cfg.attention` picks the attention: "xla" (a dense mask),
"flash" (the flash kernel from segment ids and positions), or context parallelism over the
mesh's `sequence` axis, "ring" or "ulysses" (`rlvr.kernels.context_parallel`). With a cache
(decoding) it is always the dense path.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from rlvr.kernels.bits import as_bits, from_bits, kv_float, take_rows
from rlvr.kernels.chunked_logprob.reference import project
from rlvr.kernels.packed_matmul import PANEL, pack_weight, packed_swiglu
from rlvr.models.config import SHARED_PROMPT_ATTENTION, ModelConfig
from rlvr.models.layers import _INIT, Linear, RMSNorm, _dtype, apply_rope, dot_product_attention
from rlvr.models.vision import ImageInputs, VisionTransformer, image_inputs, scatter_image_features
from rlvr.sharding import constrain

Params = dict[str, Any]
Cache = dict[str, jax.Array]

_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse RoPE frequencies, including linear and Llama-3 scaling (as in HF)."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if cfg.rope_scaling_type == "linear":
        return inv_freq / cfg.rope_scaling_factor
    if cfg.rope_scaling_type == "llama3":
        factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        old_len = cfg.rope_original_max_position
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return jnp.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape [batch, length, head_dim] in HF's rotate-half layout. `positions` is
    [batch, length], or [batch, length, 3] (temporal, height, width) for M-RoPE (`cfg.mrope_section`:
    the first section of frequencies turns with the temporal id, the next with height, the last with
    width; text tokens have three equal ids, so it is 1-D RoPE on them)."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
    if positions.ndim == 3:
        axis = np.repeat(np.arange(3), cfg.mrope_section)  # the position id each frequency reads
        angles = angles[..., axis, np.arange(len(axis))]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def attention_mask(q_pos, q_seg, kv_pos, kv_seg, sliding_window: int = 0, q_branch=None,
                   kv_branch=None) -> jax.Array:
    """Boolean [batch, 1, 1, q_len, kv_len]: causal by position, same segment, not padding. With
    branch ids (a shared-prompt batch, `rlvr.rl.batching`: a group's prompt once, branch 0, then each
    completion, branches 1, 2, ...), a token also sees only its own branch and branch 0."""
    mask = kv_pos[:, None, :] <= q_pos[:, :, None]
    mask &= q_seg[:, :, None] == kv_seg[:, None, :]
    mask &= kv_seg[:, None, :] != 0
    if q_branch is not None:
        mask &= (kv_branch[:, None, :] == 0) | (kv_branch[:, None, :] == q_branch[:, :, None])
    if sliding_window:
        mask &= (q_pos[:, :, None] - kv_pos[:, None, :]) < sliding_window
    return mask[:, None, None, :, :]


# The training path's causal attention cuts rows of 2 blocks or more into query blocks of at
# least CAUSAL_BLOCK tokens (at most MAX_CAUSAL_BLOCKS of them: each is its own pair of products
# in the compiled program). Short rows gain too: fwd+bwd of one layer's attention on this CPU,
# against the dense form, 0.55x at 8 x 256 tokens (4 blocks) and 0.60x at 32 x 128 (2 blocks):
# the blocks' score tiles stay in cache besides skipping the masked half.
CAUSAL_BLOCK, MAX_CAUSAL_BLOCKS = 64, 8


def causal_attention(q, k, v, mask) -> jax.Array:
    """`dot_product_attention` for a mask that is causal in token order (the training path's:
    `attention_mask` of positions that rise along each segment, cut to key index <= query index by
    `in_token_order`). A long row is cut into query blocks, each attending only to the keys up to
    its own end: the keys after it are masked for all of its queries, so the result is the same,
    for about half the score and value products of the dense [T, T] form and a fraction of its
    memory (fwd+bwd at 8 rows x 3,584 tokens on this CPU: 2.2x faster, benchmarks/attention.py;
    1.8x at the SFT benchmark's 8 x 256)."""
    t = q.shape[1]
    if t < 2 * CAUSAL_BLOCK or k.shape[1] != t:
        return dot_product_attention(q, k, v, mask)
    size = max(CAUSAL_BLOCK, -(-t // MAX_CAUSAL_BLOCKS))
    return jnp.concatenate([dot_product_attention(q[:, start:start + size], k[:, :start + size], v[:, :start + size],
                                                  mask[..., start:start + size, :start + size])
                            for start in range(0, t, size)], axis=1)


def native_training_attention(q: jax.Array, k: jax.Array) -> bool:
    """Whether the training path's attention (a dense mask in token order, no cache) runs as the native
    XLA:CPU kernels (`rlvr.kernels.causal_attention`, RoPE applied inside): programs compiled for CPU,
    float32, on one device (a custom call has no partitioning rule: under a larger mesh XLA would
    gather its operands), and the kernels built. Their speed against the plain-XLA query-block form, at
    the SFT benchmark's and the realistic RL shape's attention: `benchmarks/attention.py`
    (results/attention_native_cpu.json)."""
    from rlvr.kernels import causal_attention as native
    from rlvr.kernels.target import target_platform
    from rlvr.sharding import active_mesh

    if target_platform() != "cpu" or not native.supports(q, k):
        return False
    mesh = active_mesh()
    if (mesh.size if mesh is not None else jax.device_count()) != 1:
        return False
    return native.native_unavailable_reason() is None


def in_token_order(mask: jax.Array) -> jax.Array:
    """`mask` [B, 1, 1, T, T] and key index <= query index: what `attention_mask` already gives for
    positions that rise along each segment (every training input), stated so `causal_attention`
    may rely on it whatever the positions."""
    t = mask.shape[-1]
    return mask & jnp.tril(jnp.ones((t, t), jnp.bool_))


class SegmentInfo(NamedTuple):
    """The mask of the training path for `attention != "xla"`: stated by positions and segment
    ids [B, T] (same semantics as `attention_mask`) instead of a dense [B, 1, 1, T, T] mask."""

    positions: jax.Array
    segment_ids: jax.Array
    branch_ids: jax.Array | None = None  # a shared-prompt batch's (`attention_mask`)


BRANCH_STRIDE = 1 << 16  # segment id x this + branch: one id per completion of a shared-prompt row


def shared_prompt_attention(q, k, v, info: SegmentInfo, **kwargs) -> jax.Array:
    """The flash path's attention for a shared-prompt row (`attention_mask` with branch ids): the flash
    kernel's mask is one segment id per token, so two calls merged by their log-sum-exp (online
    softmax): every token over its group's prompt (keys of branch 0), and every completion token over
    its own branch (prompt tokens see no key there). About twice the attention of an unshared row of
    the same width; the prompt's other FLOPs are what sharing saves."""
    from rlvr.kernels import context_parallel as cp
    from rlvr.kernels.context_parallel.ring import merge

    seg, branch, pos = info.segment_ids, info.branch_ids, info.positions
    in_prompt = branch == 0
    own = seg * BRANCH_STRIDE + branch
    over_prompt = cp.local_attention(q, k, v, seg, jnp.where(in_prompt, seg, -1), pos, pos, **kwargs)
    over_branch = cp.local_attention(q, k, v, own, jnp.where(in_prompt, -1, own), pos, pos, **kwargs)
    return merge(*over_prompt, *over_branch)[0].astype(q.dtype)


def _context_mesh(cfg: ModelConfig, warn: bool = True):
    """The mesh ring/Ulysses attention shards over, or None (then they use the flash path)."""
    from rlvr.kernels.context_parallel import layout, reference

    mesh = layout.sequence_mesh()
    if mesh is None and warn:
        reference.log_once(f"model.attention={cfg.attention!r} without a mesh 'sequence' axis > 1 (a call "
                             "outside the sharded train step, or mesh.sequence=1): attention runs unsharded on "
                             "the flash path.")
    return mesh


def segment_attention(cfg: ModelConfig, q, k, v, info: SegmentInfo, warn: bool = True) -> jax.Array:
    """Attention of the training path from segment ids and positions (`cfg.attention` chooses):
    ring/Ulysses over the mesh's `sequence` axis, or the flash kernel on the local sequence.
    For ring attention the caller (`Transformer`) has laid the sequence out zig-zag."""
    from rlvr.kernels import context_parallel as cp

    kwargs = dict(causal=True, sliding_window=cfg.sliding_window)
    if info.branch_ids is not None:
        return shared_prompt_attention(q, k, v, info, **kwargs)
    ids = (info.segment_ids, info.segment_ids, info.positions, info.positions)
    if cfg.attention in ("ring", "ulysses"):
        mesh = _context_mesh(cfg, warn)
        if mesh is not None and cfg.attention == "ring":
            return cp.ring_attention(q, k, v, *ids, **kwargs, mesh=mesh, layout_of_inputs="zigzag")
        if mesh is not None:
            return cp.ulysses_attention(q, k, v, *ids, **kwargs, mesh=mesh)
    return cp.local_attention(q, k, v, *ids, **kwargs, return_lse=False)


def _zigzag_order(cfg: ModelConfig, length: int) -> np.ndarray | None:
    """Ring attention under a sequence mesh: the (padded) zig-zag order of the sequence, else None."""
    if cfg.attention != "ring":
        return None
    from rlvr.kernels.context_parallel import layout

    mesh = layout.sequence_mesh()
    if mesh is None:
        return None
    n = mesh.shape["sequence"]
    return layout.zigzag_order(layout.padded_length(length, 2 * n), n)


def _paged_decode(cfg: ModelConfig, q, pool, read_idx, columns, layer_id, ragged=None) -> jax.Array:
    """Decode attention read straight from the page pool (rlvr.kernels.paged_attention): the
    rows' page tables and lengths come from the engine's gather indices; no [B, S] k/v copy.
    With `ragged` (the rows' pages as a flat list) the XLA path works on those pages only;
    NativeDecode() runs the native CPU kernel over the page table."""
    from rlvr.kernels.paged_attention import paged_attention

    page_size = pool["k"].shape[2]
    table = read_idx[:, ::page_size] // page_size
    lengths = jnp.where(columns[:, 0] < read_idx.shape[1], columns[:, 0] + 1, 0)
    return paged_attention(q, pool["k"], pool["v"], table, lengths, layer=layer_id,
                           sliding_window=cfg.sliding_window, ragged=ragged).astype(q.dtype)


def _is_native(ragged) -> bool:
    from rlvr.kernels.paged_attention import NativeDecode

    return isinstance(ragged, NativeDecode)


def _native_prefill_attention(cfg: ModelConfig, q, pool, read_idx, columns, layer_id, last=None) -> jax.Array:
    """A prefill chunk's attention by the native CPU kernel (the engine's choice where its decode
    runs it: the realistic rollout's prefill calls 1.3x faster than with `_paged_prefill_attention`).
    A chunk's valid tokens come first in each row at consecutive positions from columns[b, 0], so
    the kernel's "one past the last query" is columns[b, 0] + T (padding queries past the row's
    tokens see its keys and are dropped by the caller), or with `last` (the last layer: one query
    per row) that query's column + 1; a row without tokens gets 0 (zeros)."""
    from rlvr.kernels.paged_attention.native import native_paged_attention

    page_size, capacity = pool["k"].shape[2], read_idx.shape[1]
    table = read_idx[:, ::page_size] // page_size
    if last is None:
        lengths = columns[:, 0] + q.shape[1]
    else:
        q, lengths = _at(q, last), jnp.take_along_axis(columns, last[:, None], axis=1)[:, 0] + 1
    lengths = jnp.where(columns[:, 0] < capacity, lengths, 0)
    return native_paged_attention(q, pool["k"], pool["v"], table, lengths, layer=layer_id,
                                  sliding_window=cfg.sliding_window).astype(q.dtype)


def _at(x: jax.Array, last) -> jax.Array:
    """x [B, T, ...] at index `last` [B] of each row, [B, 1, ...] (x itself when `last` is None)."""
    return x if last is None else jnp.take_along_axis(x, last.reshape(-1, *([1] * (x.ndim - 1))), axis=1)


PREFILL_KEY_BLOCK = 64  # tokens of keys a prefill's attention reads per loop step (rounded to whole pages)


def _paged_prefill_attention(q, pool, layer_id, read_idx, mask, key_block: int = PREFILL_KEY_BLOCK) -> jax.Array:
    """Attention of a chunk's queries q [B, T, H, D] over the rows' pages (already holding the
    chunk's own k/v), mask [B, 1, 1, T, S]: the keys are read in blocks of whole pages (rows of the
    pool's [L·N, P, KVH, D] view: memcpy speed, not a per-token gather), only up to the last column
    any query sees, in a loop whose trip count is traced, and the softmax is combined across blocks
    online (flash attention). So a prefill's work follows the chunk's positions, not the rows'
    capacity (max_len): one program for every chunk, and a 64-token prompt in a 4k-token row reads
    64 tokens of keys, not 4k. `key_block`: the block's tokens, at most (a divisor of the rows'
    pages). Returns [B, T, H, D] in q's dtype (float32 softmax)."""
    b, t, h, d = q.shape
    layers, num_pages, page_size, kvh, _ = pool["k"].shape
    g, table = h // kvh, read_idx[:, ::page_size] // page_size  # [B, R] page ids
    per_block = max(p for p in range(1, table.shape[1] + 1)
                    if table.shape[1] % p == 0 and p * page_size <= max(key_block, page_size))
    width = per_block * page_size
    columns = mask[:, 0, 0]  # [B, T, S]
    reach = jnp.max(jnp.where(jnp.any(columns, axis=(0, 1)), jnp.arange(columns.shape[-1]) + 1, 0))
    q = (q * (1.0 / math.sqrt(d))).reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    flat = {name: as_bits(pool[name].reshape(layers * num_pages, page_size, kvh, d)) for name in ("k", "v")}

    def block(i, carry):
        peak, total, acc = carry
        pages = layer_id * num_pages + jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        k, v = (from_bits(jnp.take(flat[name], pages.reshape(-1), axis=0, mode="clip"), pool[name].dtype)
                .reshape(b, width, kvh, d).transpose(0, 2, 1, 3).astype(q.dtype) for name in ("k", "v"))
        seen = jax.lax.dynamic_slice_in_dim(columns, i * width, width, axis=2)[:, None, None]  # [B, 1, 1, T, W]
        scores = jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32).reshape(b, kvh, g, t, width)
        scores = jnp.where(seen, scores, jnp.finfo(jnp.float32).min)
        new_peak = jnp.maximum(peak, jnp.max(scores, axis=-1))
        weights = jnp.where(seen, jnp.exp(scores - new_peak[..., None]), 0.0)
        rescale = jnp.exp(peak - new_peak)
        out = jnp.einsum("bkqs,bksd->bkqd", weights.reshape(b, kvh, g * t, width).astype(v.dtype), v,
                         preferred_element_type=jnp.float32).reshape(b, kvh, g, t, d)
        return new_peak, total * rescale + jnp.sum(weights, axis=-1), acc * rescale[..., None] + out

    start = (jnp.full((b, kvh, g, t), jnp.finfo(jnp.float32).min), jnp.zeros((b, kvh, g, t), jnp.float32),
             jnp.zeros((b, kvh, g, t, d), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, (reach + width - 1) // width, block, start)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def _window_decode(cfg: ModelConfig, q, k, v, pool, columns, layer_id):
    """Decode attention over the slots' contiguous KV window (`pool["window_k"/"window_v"]`: per
    layer keys [B, KVH, D, S] and values [B, KVH, S, D], each row's pages in position order,
    gathered once per multi-step decode call by `rlvr.rollout.device_fns.decode`): the new token's
    k/v go in at its position (idle rows' out-of-range column is dropped), then dense attention
    over the row, with no gather. One array per layer, so each is updated in place (a stacked
    [L, ...] one was copied)."""
    from rlvr.kernels.paged_attention import contiguous_attention

    rows, pos = jnp.arange(q.shape[0]), columns[:, 0]
    window = {}
    for name, new in (("window_k", k), ("window_v", v)):
        layers = list(pool[name])
        at = layers[layer_id].at[rows, :, :, pos] if name == "window_k" else layers[layer_id].at[rows, :, pos]
        layers[layer_id] = at.set(new[:, 0].astype(layers[layer_id].dtype), mode="drop")
        window[name] = tuple(layers)
    lengths = jnp.where(pos < window["window_v"][layer_id].shape[2], pos + 1, 0)
    out = contiguous_attention(q, window["window_k"][layer_id], window["window_v"][layer_id], lengths,
                               sliding_window=cfg.sliding_window, keys_last=True)
    return out.astype(q.dtype), window


class Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask, kv_index, pool, layer_id, last=None):
        """(output, new k/v). `last` [B] (a prefill's last layer, see `Transformer.hidden_states`):
        every token's k/v are computed and written, but only the query at index `last` of each
        row attends: the output is [B, 1, E]."""
        cfg = self.cfg
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, lora=cfg.lora,
                     cpu_weight_grad=cfg.remat_policy == "none")
        h, kvh, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        if self.has_variable("params", "qkv_proj"):  # the rollout engine's fused tree (`fuse_projections`)
            qkv = Linear((e,), (h + 2 * kvh, d), ("embed",), ("heads", "head_dim"), cfg.qkv_bias, name="qkv_proj",
                         **{**dense, "lora": None})(x)
            q, k, v = jnp.split(qkv, (h, h + kvh), axis=-2)
        else:
            q = Linear((e,), (h, d), ("embed",), ("heads", "head_dim"), cfg.qkv_bias, name="q_proj", **dense)(x)
            k = Linear((e,), (kvh, d), ("embed",), ("kv_heads", "head_dim"), cfg.qkv_bias, name="k_proj",
                       **dense)(x)
            v = Linear((e,), (kvh, d), ("embed",), ("kv_heads", "head_dim"), cfg.qkv_bias, name="v_proj",
                       **dense)(x)
        if cfg.qk_norm:
            q = RMSNorm(d, cfg.rms_norm_eps, "head_dim", cfg.param_dtype, name="q_norm")(q)
            k = RMSNorm(d, cfg.rms_norm_eps, "head_dim", cfg.param_dtype, name="k_norm")(k)
        if pool is None and not isinstance(mask, SegmentInfo) and native_training_attention(q, k):
            from rlvr.kernels.causal_attention import native_causal_attention

            out = native_causal_attention(q, k, v, mask, cos, sin)  # applies RoPE; keys after the query unseen
            return Linear((h, d), (e,), ("heads", "head_dim"), ("embed",), cfg.o_bias, name="o_proj",
                          **dense)(out.astype(q.dtype)), None
        q = constrain(apply_rope(q, cos, sin), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, cos, sin), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        new_kv = None
        if pool is not None and not cfg.scan_layers:
            # Unscanned (decoding): write this layer's new k/v into the pool in place, then
            # read the row's pages from the updated pool; no copy of the pool is needed.
            write_idx, read_idx, columns, ragged = kv_index
            new_kv = {name: _scatter_layer(pool[name], layer_id, write_idx, val)
                      for name, val in (("k", k), ("v", v))}
            if "window_k" in pool and x.shape[1] == 1:  # one new token per row, contiguous window
                out, window = _window_decode(cfg, q, k, v, pool, columns, layer_id)
                return Linear((h, d), (e,), ("heads", "head_dim"), ("embed",), cfg.o_bias, name="o_proj",
                              **dense)(out), {**new_kv, **window}
            if (cfg.attention != "xla" or ragged is not None) and x.shape[1] == 1:  # one new token per row
                out = _paged_decode(cfg, q, new_kv, read_idx, columns, layer_id, ragged)
                return Linear((h, d), (e,), ("heads", "head_dim"), ("embed",), cfg.o_bias, name="o_proj",
                              **dense)(out), new_kv
            if _is_native(ragged):
                out = _native_prefill_attention(cfg, q, new_kv, read_idx, columns, layer_id, last)
            else:
                if last is not None:
                    q, mask = _at(q, last), jnp.take_along_axis(mask, last[:, None, None, None, None], axis=3)
                out = _paged_prefill_attention(q, new_kv, layer_id, read_idx, mask)
            return Linear((h, d), (e,), ("heads", "head_dim"), ("embed",), cfg.o_bias, name="o_proj",
                          **dense)(out), new_kv
        elif pool is not None:
            # Read this layer's pages (the pool itself is not rewritten here: the new k/v are
            # returned and scattered into the pool once, after all layers), then put the
            # current tokens' k/v into the gathered view at their positions.
            new_kv = (k.astype(kv_float(pool["k"].dtype)), v.astype(kv_float(pool["v"].dtype)))
            _, read_idx, columns, _ = kv_index
            offset = layer_id * (pool["k"].shape[1] * pool["k"].shape[2])
            rows = jnp.arange(x.shape[0])[:, None]
            k, v = (from_bits(as_bits(pool[name].reshape(-1, kvh, d))[offset + read_idx]
                              .at[rows, columns].set(as_bits(kv), mode="drop"), kv.dtype).astype(q.dtype)
                    for name, kv in zip(("k", "v"), new_kv, strict=True))
        if isinstance(mask, SegmentInfo):
            out = segment_attention(cfg, q, k, v, mask, warn=not self.is_initializing())
        elif pool is None:  # the training path: a mask in token order (`in_token_order`)
            out = causal_attention(q, k, v, mask)
        else:
            out = dot_product_attention(q, k, v, mask)
        out = Linear((h, d), (e,), ("heads", "head_dim"), ("embed",), cfg.o_bias, name="o_proj", **dense)(out)
        return out, new_kv


class MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dense = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, use_bias=cfg.mlp_bias, lora=cfg.lora,
                     cpu_weight_grad=cfg.remat_policy == "none")
        e, m = cfg.hidden_size, cfg.intermediate_size
        fused = self.variables.get("params", {}).get("gate_up_proj", {})
        if "kernel_packed" in fused and not cfg.mlp_bias and m % PANEL == 0:  # packed: gate and up combined natively
            hidden = packed_swiglu(x.reshape(-1, e), fused["kernel_packed"], m).reshape(*x.shape[:-1], m)
            hidden = constrain(hidden.astype(cfg.dtype), ("batch", "length", "mlp"))
            return Linear((m,), (e,), ("mlp",), ("embed",), name="down_proj", **dense)(hidden)
        if self.has_variable("params", "gate_up_proj"):  # the rollout engine's fused tree (`fuse_projections`)
            gate, up = jnp.split(Linear((e,), (2 * m,), ("embed",), ("mlp",), name="gate_up_proj",
                                        **{**dense, "lora": None})(x), 2, axis=-1)
        else:
            gate = Linear((e,), (m,), ("embed",), ("mlp",), name="gate_proj", **dense)(x)
            up = Linear((e,), (m,), ("embed",), ("mlp",), name="up_proj", **dense)(x)
        hidden = constrain(nn.silu(gate) * up, ("batch", "length", "mlp"))
        return Linear((m,), (e,), ("mlp",), ("embed",), name="down_proj", **dense)(hidden)


class DecoderLayer(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask, kv_index, pool, layer_id, last=None):
        """(x, new k/v); with `last` [B], x only at index `last` of each row, [B, 1, E] (see `Attention`)."""
        cfg = self.cfg
        norm = dict(dim=cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        attn_out, new_kv = Attention(cfg, name="self_attn")(
            RMSNorm(**norm, name="input_layernorm")(x), cos, sin, mask, kv_index, pool, layer_id, last)
        x = _at(x, last) + attn_out
        x = x + MLP(cfg, name="mlp")(RMSNorm(**norm, name="post_attention_layernorm")(x))
        return constrain(x, ("batch", "length", "embed")), new_kv


class Transformer(nn.Module):
    """The decoder. `__call__` returns (logits, cache); `with_values` adds the value head."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        layer_cls = DecoderLayer
        if cfg.remat_policy != "none":
            layer_cls = nn.remat(DecoderLayer, prevent_cse=False, policy=_REMAT_POLICIES[cfg.remat_policy])
        if cfg.scan_layers:
            self.layers = nn.scan(
                layer_cls,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, 0),
                length=cfg.num_layers,
                unroll=cfg.scan_unroll,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="layers")
        else:  # one module per layer (params `layers_0`, …): used for decoding, see unstack_layers
            self.layer_list = [layer_cls(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.embed_tokens = self.param(
            "embed_tokens", nn.with_logical_partitioning(_INIT, ("vocab", "embed")),
            (cfg.vocab_size, cfg.hidden_size), _dtype(cfg.param_dtype))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype, name="norm")
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear((cfg.hidden_size,), (cfg.vocab_size,), ("embed",), ("vocab",),
                                  dtype=cfg.dtype, param_dtype=cfg.param_dtype, float32_output=True,
                                  cpu_weight_grad=True)
        if cfg.value_head:
            self.value_proj = Linear((cfg.hidden_size,), (1,), ("embed",), (None,), use_bias=True,
                                     dtype="float32", param_dtype=cfg.param_dtype)

    def hidden_states(self, tokens, positions=None, segment_ids=None, cache=None, embeds=None, rope_positions=None,
                      last=None, branch_ids=None):
        """Final-norm hidden states [B, T, E] and the updated cache. `embeds` [B, T, E] replaces the
        token embeddings (a VLM's, with image features at the placeholders); `rope_positions` (e.g.
        M-RoPE's [B, T, 3]) replaces `positions` in the rotary tables only: masks and cache slots
        always follow `positions`, the order of the tokens. `last` [B]: the hidden states at index
        `last` of each row only, [B, 1, E]; with a cache (a prefill, which needs one position's
        logits per row) the last decoder layer then runs its query, output projection and MLP on
        those positions alone (every layer's k/v are still written), ~1/num_layers of the
        prefill's FLOPs saved. `branch_ids` [B, T]: a shared-prompt training batch's branches
        (`attention_mask`; the "xla" and "flash" attention: `shared_prompt_attention`)."""
        cfg = self.cfg
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        if segment_ids is None:
            segment_ids = jnp.ones_like(tokens)
        if rope_positions is None:
            rope_positions = positions
        if branch_ids is not None and (cache is not None or cfg.attention not in SHARED_PROMPT_ATTENTION):
            raise ValueError(f"a shared-prompt batch (rl.share_prompts) needs model.attention in "
                             f"{SHARED_PROMPT_ATTENTION} and no cache; got attention={cfg.attention!r}: set "
                             "rl.share_prompts=False or model.attention='xla' or 'flash'.")
        if cache is None and cfg.attention != "xla":
            return _at(self._segment_hidden_states(tokens, positions, segment_ids, embeds, rope_positions,
                                                   branch_ids), last), None
        x = self.embed(tokens) if embeds is None else embeds.astype(cfg.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        # a decode loop passes its step's tables (`cache["rope"]`, computed once per call: fused into
        # the layers, XLA:CPU evaluated cos and sin again for every element of q and k in every layer)
        cos, sin = cache["rope"] if cache is not None and "rope" in cache else rope_tables(cfg, rope_positions)
        if cache is None:
            mask = in_token_order(attention_mask(positions, segment_ids, positions, segment_ids, cfg.sliding_window,
                                                 branch_ids, branch_ids))
            x, _ = self._run_layers(x, cos, sin, mask, None, None)
            return _at(self.norm(x), last), None
        mask, kv_index = paged_indices(cache, positions, segment_ids, cfg.sliding_window)
        pool = {name: cache[name] for name in ("k", "v", "window_k", "window_v") if name in cache}
        x, updated = self._run_layers(x, cos, sin, mask, kv_index, pool, last)
        if cfg.scan_layers:  # the scan returned each layer's new k/v: write them all at once
            new_k, new_v = updated
            updated = {name: _scatter_pages(pool[name], kv_index[0], new)
                       for name, new in (("k", new_k), ("v", new_v))}
        return self.norm(x), {**updated, "page_table": cache["page_table"]}

    def embed(self, tokens):
        """Token embeddings [B, T, E] in the compute dtype."""
        return take_rows(self.embed_tokens, tokens).astype(self.cfg.dtype)

    def _segment_hidden_states(self, tokens, positions, segment_ids, embeds, rope_positions, branch_ids=None):
        """The training path for attention "flash", "ring" and "ulysses": masks from segment ids
        and positions. Ring attention wants the zig-zag layout (causal load balance); everything
        but attention is per token, so the inputs are permuted into it (padded with segment id 0
        to a multiple of 2·mesh.sequence) once here and the hidden states permuted back at the end,
        instead of once per layer."""
        cfg = self.cfg
        length = tokens.shape[1]
        order = _zigzag_order(cfg, length)
        x = self.embed(tokens) if embeds is None else embeds.astype(cfg.dtype)
        if order is not None:
            def permute(a):
                pad = ((0, 0), (0, len(order) - length)) + ((0, 0),) * (a.ndim - 2)
                return jnp.take(jnp.pad(a, pad), order, axis=1)
            x, positions, segment_ids, rope_positions = map(permute, (x, positions, segment_ids, rope_positions))
        x = constrain(x, ("batch", "length", "embed"))
        cos, sin = rope_tables(cfg, rope_positions)
        x, _ = self._run_layers(x, cos, sin, SegmentInfo(positions, segment_ids, branch_ids), None, None)
        if order is not None:
            x = constrain(jnp.take(x, np.argsort(order), axis=1)[:, :length], ("batch", "length", "embed"))
        return self.norm(x)

    def _run_layers(self, x, cos, sin, mask, kv_index, pool, last=None):
        """(x, pool) after every layer; with `last` [B], x at index `last` of each row only."""
        if self.cfg.scan_layers:
            x, pool = self.layers(x, cos, sin, mask, kv_index, pool, jnp.arange(self.cfg.num_layers))
            return _at(x, last), pool
        for i, layer in enumerate(self.layer_list):
            x, updated = layer(x, cos, sin, mask, kv_index, pool, i, last if i == len(self.layer_list) - 1 else None)
            pool = updated if pool is not None else None
        return x, pool

    def logits(self, x):
        """float32 logits [B, T, V]: the output projection in float32 products whatever model.dtype
        (`rlvr.kernels.chunked_logprob.reference.project`, as the chunked log-probs compute them), so
        the engine, the full-logits and the chunked trainer paths agree under bf16."""
        if self.cfg.tie_word_embeddings:
            logits = project(x, self.embed_tokens.astype(x.dtype), vocab_major=True)
        else:
            logits = self.lm_head(x)
        return constrain(logits, ("batch", "length", "vocab"))

    def __call__(self, tokens, positions=None, segment_ids=None, cache=None, rope_positions=None):
        x, cache = self.hidden_states(tokens, positions, segment_ids, cache, rope_positions=rope_positions)
        if self.cfg.value_head and self.is_initializing():
            self.value_proj(x.astype(jnp.float32))  # create the value head's parameters
        return self.logits(x), cache

    def last_logits(self, tokens, positions, segment_ids, cache, last, embeds=None, rope_positions=None):
        """(logits [B, V] at position index `last` [B] of each row, cache): a prefill needs
        the next-token distribution of one position per row, not the [B, T, V] of all.
        `embeds`, `rope_positions`: as `hidden_states` (a VLM's image prompt)."""
        x, cache = self.hidden_states(tokens, positions, segment_ids, cache, embeds, rope_positions, last)
        return self.logits(x)[:, 0], cache

    def with_values(self, tokens, positions=None, segment_ids=None, cache=None):
        """(logits, values [B, T], cache); needs `value_head=True`."""
        if not self.cfg.value_head:
            raise ValueError("model.value_head is False; set it to True to use value predictions.")
        x, cache = self.hidden_states(tokens, positions, segment_ids, cache)
        values = self.value_proj(x.astype(jnp.float32))[..., 0]
        return self.logits(x), values, cache


def _scatter_layer(pages, layer: int, write_idx, new):
    """pages [L, N, P, KVH, D] with layer `layer`'s new [B, T, KVH, D] written at write_idx [B, T]."""
    shape = pages.shape
    flat = as_bits(pages.reshape(shape[0], shape[1] * shape[2], *shape[3:]))
    out = flat.at[layer, write_idx].set(as_bits(new.astype(kv_float(pages.dtype))), mode="drop")
    return _stored(out, pages.dtype).reshape(shape)


def _scatter_pages(pages, write_idx, new):
    """pages [L, N, P, KVH, D] with new [L, B, T, KVH, D] written at flat slots write_idx [B, T]."""
    shape = pages.shape
    flat = as_bits(pages.reshape(shape[0], shape[1] * shape[2], *shape[3:]))
    out = flat.at[:, write_idx].set(as_bits(new.astype(kv_float(pages.dtype))), mode="drop")
    return _stored(out, pages.dtype).reshape(shape)


def _stored(bits, dtype):
    """Scattered bits back in the pool's stored dtype (a bits pool stays uint16)."""
    return bits if jnp.dtype(dtype) == jnp.uint16 else from_bits(bits, dtype)


def paged_indices(cache: Cache, positions, segment_ids, sliding_window: int = 0):
    """(mask [B,1,1,T,S], (write_idx [B,T], read_idx [B,S], columns [B,T])) for a paged cache.

    Row b reads its S = pages_per_row · page_size slots in position order (so the gathered
    view's column is the position); a token writes to its position's slot unless it is
    padding or beyond the row's capacity (then its index is out of bounds and dropped)."""
    num_pages, page_size = cache["k"].shape[1], cache["k"].shape[2]
    table = cache["page_table"]
    capacity = table.shape[1] * page_size
    kv_pos = jnp.broadcast_to(jnp.arange(capacity), (table.shape[0], capacity))
    valid = (segment_ids != 0) & (positions < capacity)
    mask = attention_mask(positions, valid.astype(jnp.int32), kv_pos, jnp.ones_like(kv_pos), sliding_window)
    page = jnp.take_along_axis(table, jnp.clip(positions // page_size, 0, table.shape[1] - 1), axis=1)
    write_idx = jnp.where(valid, page * page_size + positions % page_size, num_pages * page_size)
    read_idx = (table[:, :, None] * page_size + jnp.arange(page_size)).reshape(table.shape[0], capacity)
    columns = jnp.where(valid, positions, capacity)
    return mask, (write_idx, read_idx, columns, cache.get("ragged"))


def init_cache(cfg: ModelConfig, batch: int, max_length: int, dtype: str | None = None) -> Cache:
    """An empty contiguous cache: one page of `max_length` slots per row."""
    return init_paged_cache(cfg, batch, max_length, dtype,
                            page_table=jnp.arange(batch, dtype=jnp.int32)[:, None])


def init_paged_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: str | None = None,
                     page_table=None) -> Cache:
    """An empty page pool: k/v [layers, num_pages, page_size, kv_heads, head_dim]."""
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    dt = _dtype(dtype or cfg.dtype)
    table = page_table if page_table is not None else jnp.zeros((1, 1), jnp.int32)
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt), "page_table": table}



def unstack_layers(params: Params) -> Params:
    """Scanned params (`layers/...` stacked on axis 0) -> per-layer `layers_i/...`, for a
    `scan_layers=False` model; a tree already per layer is returned as it is. Decoding many small
    steps is faster with per-layer weights: nothing is re-sliced from the stack inside the decode loop."""
    if "layers" not in params:
        return params
    params = dict(params)
    stacked = params.pop("layers")
    count = jax.tree.leaves(stacked)[0].shape[0]
    for i in range(count):
        params[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return params


def stack_layers(params: Params) -> Params:
    """`unstack_layers`' inverse: per-layer `layers_i/...` -> `layers/...` stacked on axis 0 (numpy
    arrays stay numpy); a tree without `layers_0` is returned as it is. The layout that checkpoint
    conversion (HF, PEFT) reads."""
    if "layers_0" not in params:
        return params
    params = dict(params)
    count = sum(1 for name in params if re.fullmatch(r"layers_\d+", name))
    layers = [params.pop(f"layers_{i}") for i in range(count)]
    params["layers"] = jax.tree.map(
        lambda *xs: np.stack(xs) if isinstance(xs[0], np.ndarray) else jnp.stack(xs), *layers)
    return params


def in_layout(cfg: ModelConfig, params: Params) -> Params:
    """`params` in the layer layout `cfg` runs: stacked when `cfg.scan_layers`, else per layer."""
    return stack_layers(params) if cfg.scan_layers else unstack_layers(params)


FUSED_PROJECTIONS = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), -2), "gate_up_proj": (("gate_proj", "up_proj"), -1)}


def fuse_projections(params: Params) -> Params:
    """Per-layer params (`unstack_layers`) with the decoder layers' q/k/v and gate/up kernels (and
    biases) concatenated along their output axis into `qkv_proj` / `gate_up_proj`, which
    `Attention` and `MLP` then run as one matmul each: XLA:CPU runs one wider product faster than
    two or three narrow ones (the rollout engine's fixed workload: 1.19x per call). The vision
    tower is left alone. A group is left as it is when any member
    holds more than a float kernel and bias (LoRA adapters, a quantised base) or lives on more than
    one device (concatenating sharded weights would reshard them)."""
    def fuse(tree):
        if not isinstance(tree, dict):
            return tree
        tree = {name: fuse(sub) for name, sub in tree.items()}
        for fused, (names, axis) in FUSED_PROJECTIONS.items():
            members = [tree.get(name) for name in names]
            if not all(isinstance(m, dict) and set(m) == set(members[0]) <= {"kernel", "bias"} for m in members):
                continue
            leaves = [leaf for m in members for leaf in m.values()]
            if any(not isinstance(leaf, jax.Array) or not jnp.issubdtype(leaf.dtype, jnp.floating)
                   or len(leaf.devices()) > 1 for leaf in leaves):
                continue
            tree[fused] = {key: jnp.concatenate([m[key] for m in members], axis=axis) for key in members[0]}
            for name in names:
                del tree[name]
        return tree

    return {name: fuse(sub) if name.startswith("layers_") else sub for name, sub in params.items()}


PACKED_IN_DIMS = {"o_proj": 2}  # a packed kernel's input dims (`Linear.in_shape`'s length), 1 when not named


def pack_projections(params: Params) -> Params:
    """The rollout engine's decode tree (`unstack_layers`, `fuse_projections`) with every float32
    `kernel` of the decoder layers and of `lm_head` replaced by `kernel_packed`, its [K, N] matrix
    in column panels (`rlvr.kernels.packed_matmul.pack_weight`), which `Linear` multiplies through
    the native kernel: packed once per weight load instead of by XLA:CPU at every decode step.
    Adapters, biases and a quantised base are left as they are (a module holding `kernel_scale`
    keeps its kernel); the vision tower too."""
    def pack(name, tree):
        if not isinstance(tree, dict):
            return tree
        tree = {key: pack(key, sub) for key, sub in tree.items()}
        kernel = tree.get("kernel")
        if isinstance(kernel, jax.Array) and kernel.dtype == jnp.float32 and "kernel_scale" not in tree:
            n_in = PACKED_IN_DIMS.get(name, 1)
            tree["kernel_packed"] = pack_weight(kernel.reshape(math.prod(kernel.shape[:n_in]), -1))
            del tree["kernel"]
        return tree

    return {name: pack(name, sub) if name.startswith("layers_") or name == "lm_head" else sub
            for name, sub in params.items()}


# --- the vision-language model (rlvr.models.vision's encoder in front of this decoder) ----------------------

class VisionLanguageModel(Transformer):
    """The decoder (`Transformer`, its parameters at the same paths) with a `visual` encoder
    (`cfg.vision`)."""

    def setup(self):
        super().setup()
        self.visual = VisionTransformer(self.cfg.vision, self.cfg.dtype, self.cfg.param_dtype)

    def __call__(self, tokens, positions=None, segment_ids=None, images: ImageInputs | None = None, cache=None):
        """(logits float32 [B, T, V], cache); without `images`, the text model."""
        if images is None:
            return super().__call__(tokens, positions, segment_ids, cache)
        x, cache = self.image_hidden_states(tokens, positions, segment_ids, images, cache)
        return self.logits(x), cache

    def image_hidden_states(self, tokens, positions, segment_ids, images: ImageInputs, cache=None):
        """`hidden_states` with the images' features at the placeholders and M-RoPE positions."""
        features = self.visual(images.patches, images.vit_positions, images.frame_ids, images.window_ids)
        embeds = scatter_image_features(self.embed(tokens), tokens, features, self.cfg.vision.image_token_id)
        return self.hidden_states(tokens, positions, segment_ids, cache, embeds, images.rope_positions)


def init_vlm_boxed(cfg: ModelConfig, rng: jax.Array):
    """The VLM's params with their logical-axis boxes, from a one-image dummy batch."""
    v = cfg.vision
    grid = [(1, v.spatial_merge_size, v.spatial_merge_size)]
    tokens = np.full((1, 1), v.image_token_id)
    dummy = image_inputs(v, [np.zeros((v.merge_unit, v.patch_dim), np.float32)], [grid], tokens, np.ones_like(tokens))
    return VisionLanguageModel(cfg).init(rng, jnp.asarray(tokens), None, None, dummy)["params"]


def dropout_rngs(cfg: ModelConfig, rng: jax.Array | None) -> dict[str, jax.Array] | None:
    """The `rngs` of a training forward pass: adapter dropout (`lora.dropout`) draws from `rng`;
    without it (or with rng None: evaluation, sampling) nothing is dropped."""
    return {"dropout": rng} if rng is not None and cfg.lora.enabled and cfg.lora.dropout else None


def forward(cfg: ModelConfig, params: Params, tokens, positions=None, segment_ids=None, cache=None, rng=None,
            images=None, rope_positions=None):
    """Pure forward pass: (logits float32 [B, T, V], updated cache or None). `rng`: training
    randomness (adapter dropout), None to run deterministically. `images`: a VLM's
    (`rlvr.models.vision.ImageInputs`; needs `cfg.vision`); `rope_positions`: rotary positions other
    than `positions` (a VLM decoding after an image prompt: position + the prompt's M-RoPE delta)."""
    if images is not None:
        return VisionLanguageModel(cfg).apply({"params": params}, tokens, positions, segment_ids, images, cache,
                                              rngs=dropout_rngs(cfg, rng))
    return Transformer(cfg).apply({"params": params}, tokens, positions, segment_ids, cache, rope_positions,
                                  rngs=dropout_rngs(cfg, rng))


def forward_last(cfg: ModelConfig, params: Params, tokens, positions, segment_ids, cache, last, embeds=None,
                 rope_positions=None):
    """(logits float32 [B, V] at index `last` [B] of each row, updated cache): see `last_logits`."""
    return Transformer(cfg).apply({"params": params}, tokens, positions, segment_ids, cache, last, embeds,
                                  rope_positions, method=Transformer.last_logits)


def forward_with_values(cfg: ModelConfig, params: Params, tokens, positions=None, segment_ids=None,
                        cache=None, rng=None):
    return Transformer(cfg).apply({"params": params}, tokens, positions, segment_ids, cache,
                                  method=Transformer.with_values, rngs=dropout_rngs(cfg, rng))
