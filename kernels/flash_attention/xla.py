"""The "xla" implementation: memory-efficient blockwise attention in plain jnp.

A `lax.scan` over key tiles with an online softmax (the flash algorithm, without a kernel), under a
`jax.custom_vjp` whose backward pass is a second scan that recomputes each tile's probabilities
from the saved log-sum-exp. Peak memory is O(G*T * block_kv) per (batch, KV head) instead of the
reference's O(T * S): this is the fallback wherever Pallas is not used (by default, on CPU). It
computes every tile (no causal skipping) at the backend's default matmul precision, accumulating
in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .common import (
    EMPTY_ROW_LSE,
    MASK_VALUE,
    AttentionSpec,
    cap,
    cap_grad,
    fold_heads,
    heads_to_kv_major,
    unfold_heads,
    unfold_lse,
    visible,
)
from .config import BlockSizes, effective


@dataclasses.dataclass(frozen=True)
class _Plan:
    spec: AttentionSpec
    block_kv: int
    block_kv_bwd: int


def flash_attention_xla(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, spec: AttentionSpec,
                        blocks: BlockSizes) -> tuple[jax.Array, jax.Array]:
    """Same contract as `pallas.flash_attention_pallas` (inputs already defaulted and validated)."""
    t, h = q.shape[1], q.shape[2]
    s, kvh = k.shape[1], k.shape[2]
    groups = h // kvh
    bk, bkb = effective(blocks.block_kv, s, "cpu"), effective(blocks.kv_bwd, s, "cpu")
    tile = math.lcm(bk, bkb)
    s_pad = -(-s // tile) * tile
    pad = ((0, 0), (0, s_pad - s))
    k = heads_to_kv_major(jnp.pad(k, pad + ((0, 0), (0, 0))))
    v = heads_to_kv_major(jnp.pad(v, pad + ((0, 0), (0, 0))))
    kv_seg, kv_pos = jnp.pad(kv_seg, pad), jnp.pad(kv_pos, pad)  # padded keys: segment 0, never visible
    q_seg = jnp.tile(q_seg, (1, groups))[:, None, :, None]  # [B, 1, G*T, 1], rows as in fold_heads
    q_pos = jnp.tile(q_pos, (1, groups))[:, None, :, None]
    out, lse = _blockwise(fold_heads(q, kvh), k, v, q_seg, q_pos, kv_seg, kv_pos, _Plan(spec, bk, bkb))
    return unfold_heads(out, groups, t), unfold_lse(lse, groups, t)


def _tiles(x, block: int):
    """[B, KVH, S, ...] -> [S/block, B, KVH, block, ...] (the scan's leading axis)."""
    b, kvh, s = x.shape[:3]
    return jnp.moveaxis(x.reshape(b, kvh, s // block, block, *x.shape[3:]), 2, 0)


def _kv_meta_tiles(x, block: int):
    """[B, S] -> [S/block, B, 1, 1, block] (broadcasts against [B, KVH, G*T, block])."""
    return _tiles(x[:, None], block)[:, :, :, None, :]


def _logits_and_mask(q, k, q_seg, q_pos, kv_seg, kv_pos, spec: AttentionSpec):
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * spec.scale
    return cap(logits, spec), visible(q_seg, q_pos, kv_seg, kv_pos, spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _blockwise(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan: _Plan):
    return _forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan)


def _forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan: _Plan):
    bk = plan.block_kv

    def step(carry, tile):
        m, denom, acc = carry
        k_t, v_t, seg_t, pos_t = tile
        logits, mask = _logits_and_mask(q, k_t, q_seg, q_pos, seg_t, pos_t, plan.spec)
        logits = jnp.where(mask, logits, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = alpha * acc + jnp.einsum("bhqk,bhkd->bhqd", p.astype(v_t.dtype), v_t,
                                       preferred_element_type=jnp.float32)
        return (m_new, alpha * denom + jnp.sum(p, axis=-1, keepdims=True), acc), None

    rows = q.shape[:3] + (1,)
    init = (jnp.full(rows, MASK_VALUE, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(q.shape, jnp.float32))
    tiles = (_tiles(k, bk), _tiles(v, bk), _kv_meta_tiles(kv_seg, bk), _kv_meta_tiles(kv_pos, bk))
    (m, denom, acc), _ = lax.scan(step, init, tiles)
    seen = denom > 0.0
    denom = jnp.where(seen, denom, 1.0)
    return (acc / denom).astype(q.dtype), jnp.where(seen, m + jnp.log(denom), -jnp.inf)[..., 0]


def _blockwise_fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan: _Plan):
    # checkpointed: under a differentiated layer scan, JAX would otherwise hoist every tile's mask
    # out of the scan and keep them all (O(T^2) booleans); this forward is never differentiated itself
    out, lse = jax.checkpoint(_forward, static_argnums=(7,))(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan)
    return (out, lse), (q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse)


def _blockwise_bwd(plan: _Plan, residuals, cotangents):
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse = residuals
    d_out, d_lse = cotangents
    empty = lse == -jnp.inf
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - jnp.where(empty, 0.0, d_lse)
    lse = jnp.where(empty, EMPTY_ROW_LSE, lse)[..., None]
    delta = delta[..., None]
    spec, bk = plan.spec, plan.block_kv_bwd

    def step(dq, tile):
        k_t, v_t, seg_t, pos_t = tile
        logits, mask = _logits_and_mask(q, k_t, q_seg, q_pos, seg_t, pos_t, spec)
        p = jnp.exp(jnp.where(mask, logits - lse, MASK_VALUE))
        dp = jnp.einsum("bhqd,bhkd->bhqk", d_out, v_t, preferred_element_type=jnp.float32)
        ds = cap_grad(p * (dp - delta), logits, spec)
        dq = dq + jnp.einsum("bhqk,bhkd->bhqd", ds.astype(k_t.dtype), k_t, preferred_element_type=jnp.float32)
        dk = jnp.einsum("bhqk,bhqd->bhkd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
        dv = jnp.einsum("bhqk,bhqd->bhkd", p.astype(d_out.dtype), d_out, preferred_element_type=jnp.float32)
        return dq, (dk * spec.scale, dv)

    tiles = (_tiles(k, bk), _tiles(v, bk), _kv_meta_tiles(kv_seg, bk), _kv_meta_tiles(kv_pos, bk))
    dq, (dk, dv) = lax.scan(step, jnp.zeros(q.shape, jnp.float32), tiles)
    untile = lambda x, like: jnp.moveaxis(x, 0, 2).reshape(like.shape).astype(like.dtype)
    return (dq * spec.scale).astype(q.dtype), untile(dk, k), untile(dv, v), None, None, None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
