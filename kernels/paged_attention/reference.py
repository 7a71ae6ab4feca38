"""Plain-jnp paged decode attention (the "xla" implementation): gather each row's pages into a
dense [B, S, KVH, D] view, as `rlvr.models.transformer.Attention` does, then masked GQA softmax.

Conventions shared with the Pallas kernel (`pallas.py`):
  q [B, Q, H, D]            the last Q tokens of each row (positions lengths-Q .. lengths-1)
  k_pages, v_pages          the engine's pool: [N, P, KVH, D] (one layer) or [L, N, P, KVH, D]
                            with `layer` selecting the layer (no slice of the pool is copied)
  page_table [B, R] int32   position p of row b lives in page page_table[b, p // P], slot p % P
  lengths [B] int32         valid KV tokens per row, the queries' own included; 0 = idle row
Query i of row b sees keys at positions kv <= lengths[b] - Q + i (and, with a sliding window W,
kv > that - W). A query that sees no key (an idle row) gets zeros.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from rlvr.kernels.bits import from_bits

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def query_positions(lengths: jax.Array, num_queries: int) -> jax.Array:
    """[B, Q] positions of the queries: the last `num_queries` tokens of each row."""
    return lengths[:, None] - num_queries + jnp.arange(num_queries, dtype=lengths.dtype)


def visible(q_pos: jax.Array, kv_pos: jax.Array, lengths: jax.Array, sliding_window: int) -> jax.Array:
    """Boolean [B, Q, S]: key position kv_pos [S] (or [B, S]) is visible to query q_pos [B, Q]."""
    kv = kv_pos if kv_pos.ndim == 2 else kv_pos[None, :]
    mask = (kv[:, None, :] <= q_pos[:, :, None]) & (kv[:, None, :] < lengths[:, None, None])
    if sliding_window:
        mask &= (q_pos[:, :, None] - kv[:, None, :]) < sliding_window
    return mask


def gather_pages(pages: jax.Array, page_table: jax.Array, layer=None) -> jax.Array:
    """Each row's pages in position order: [B, R·P, KVH, D] (one gather from the flat pool)."""
    if pages.ndim == 5:
        _, n, p, kvh, d = pages.shape
        offset = jnp.asarray(layer, jnp.int32) * (n * p)
    else:
        n, p, kvh, d = pages.shape
        offset = 0
    slots = (page_table[:, :, None] * p + jnp.arange(p, dtype=jnp.int32)).reshape(page_table.shape[0], -1)
    return from_bits(pages.reshape(-1, kvh, d)[offset + slots], pages.dtype)  # a bits pool read as bf16


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                              lengths: jax.Array, *, layer=None, sliding_window: int = 0, softcap: float = 0.0,
                              scale: float | None = None) -> jax.Array:
    """Attention output [B, Q, H, D] in q's dtype; float32 softmax and accumulation."""
    k = jnp.swapaxes(gather_pages(k_pages, page_table, layer), 1, 2)  # [B, KVH, S, D]
    v = jnp.swapaxes(gather_pages(v_pages, page_table, layer), 1, 2)
    return contiguous_attention(q, k, v, lengths, sliding_window=sliding_window, softcap=softcap, scale=scale)


def contiguous_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, sliding_window: int = 0,
                         softcap: float = 0.0, scale: float | None = None, keys_last: bool = False) -> jax.Array:
    """The same attention over each row's keys laid out head-major in position order, k/v
    [B, KVH, S, D] (a gathered page view, or the rollout engine's per-slot decode window, which
    needs no gather at all). Head-major makes both products plain batched matmuls (CPU XLA runs
    the [B, S, KVH, D] einsum several times slower). `keys_last`: k is [B, KVH, D, S] (the engine's
    decode window), so q·k is a plain [G, D] x [D, S] product (XLA:CPU runs the transposed
    [S, D] operand ~2x slower)."""
    b, nq, h, d = q.shape
    kvh, s = k.shape[1], k.shape[3] if keys_last else k.shape[2]
    g = h // kvh
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = (q.astype(jnp.float32) * scale).reshape(b, nq, kvh, g, d).transpose(0, 2, 3, 1, 4)
    keys = k.astype(jnp.float32) if keys_last else jnp.swapaxes(k.astype(jnp.float32), 2, 3)
    logits = jnp.matmul(qg.reshape(b, kvh, g * nq, d), keys)
    logits = logits.reshape(b, kvh, g, nq, s)
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = visible(query_positions(lengths, nq), jnp.arange(s, dtype=lengths.dtype), lengths,
                   sliding_window)[:, None, None]
    logits = jnp.where(mask, logits, MASK_VALUE)
    weights = jnp.where(mask, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = (weights / jnp.where(total > 0, total, 1.0)).reshape(b, kvh, g * nq, s)
    out = jnp.matmul(probs, v.astype(jnp.float32)).reshape(b, kvh, g, nq, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, nq, h, d).astype(q.dtype)
