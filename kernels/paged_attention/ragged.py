"""Ragged paged decode attention in plain XLA (the "ragged" implementation).

What: one query per row (q [B, H, D]) over the rows' pages, where the pages are given as one flat
list of entries (`RaggedPages`: page id, row, position of the page's first token), sorted by row.
Why: the dense path (`reference.py`) gathers every row's whole page-table width and masks it, so a
batch with one long row pays the long row's cost for every row; here the work is the pages the rows
actually hold (plus the list's padding to a bucketed length). How: each entry's scores against its
row's query, a per-entry max and sum (softmax statistics), and a per-row combine with sorted segment
reductions (a flash-decoding split over pages). Entries of row >= B are padding and are dropped.

The caller builds the list on the host (`ragged_pages`) once per decode call, covering every page a
row can write during the call; the per-step `lengths` mask what is not written yet.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rlvr.kernels.paged_attention.reference import MASK_VALUE


class RaggedPages(NamedTuple):
    pages: jax.Array  # [T] int32 page ids (padding entries: 0, the engine's scratch page)
    rows: jax.Array  # [T] int32 row of each entry, ascending (padding entries: B)
    starts: jax.Array  # [T] int32 position of the page's first token in its row


def ragged_pages(page_table: np.ndarray, tokens: np.ndarray, page_size: int, bucket: int) -> RaggedPages:
    """Host-side builder: the first ceil(tokens[b] / page_size) pages of each row b of
    `page_table` [B, R], padded to `bucket` entries (which must fit them all)."""
    batch, width = page_table.shape
    count = np.minimum(-(-np.asarray(tokens) // page_size), width)
    total = int(count.sum())
    if total > bucket:
        raise ValueError(f"ragged_pages: {total} pages do not fit bucket={bucket}")
    rows = np.full(bucket, batch, np.int32)
    rows[:total] = np.repeat(np.arange(batch, dtype=np.int32), count)
    index = np.zeros(bucket, np.int32)
    index[:total] = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    pages = np.zeros(bucket, np.int32)
    pages[:total] = page_table[rows[:total], index[:total]]
    return RaggedPages(pages, rows, index * page_size)


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, ragged: RaggedPages,
                           lengths: jax.Array, *, layer=None, sliding_window: int = 0, softcap: float = 0.0,
                           scale: float | None = None) -> jax.Array:
    """q [B, H, D]; pool [N, P, KVH, D] or [L, N, P, KVH, D] (+ `layer`); lengths [B] = the query's
    position + 1 (0 = idle row, output zeros). Returns [B, H, D] in q's dtype (float32 softmax)."""
    b, h, d = q.shape
    if k_pages.ndim == 5:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    page_size, kvh = k_pages.shape[1], k_pages.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = jnp.minimum(ragged.rows, b)
    k = k_pages[ragged.pages].astype(jnp.float32)  # [T, P, KVH, D]
    v = v_pages[ragged.pages].astype(jnp.float32)
    qg = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)])[rows].astype(jnp.float32) * scale
    scores = jnp.einsum("tpkd,tkgd->tkpg", k, qg.reshape(-1, kvh, h // kvh, d))  # [T, KVH, P, G]
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    length = jnp.concatenate([lengths.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])[rows]
    kv_pos = ragged.starts[:, None] + jnp.arange(page_size, dtype=jnp.int32)
    visible = kv_pos < length[:, None]
    if sliding_window:
        visible &= (length[:, None] - 1 - kv_pos) < sliding_window
    scores = jnp.where(visible[:, None, :, None], scores, MASK_VALUE)
    peak = jnp.max(scores, axis=2)  # [T, KVH, G]
    weights = jnp.where(visible[:, None, :, None], jnp.exp(scores - peak[:, :, None]), 0.0)
    partial = jnp.einsum("tkpg,tpkd->tkgd", weights, v)
    segments = dict(segment_ids=rows, num_segments=b + 1, indices_are_sorted=True)
    row_peak = jax.ops.segment_max(peak, **segments)
    rescale = jnp.exp(peak - row_peak[rows])
    total = jax.ops.segment_sum(jnp.sum(weights, axis=2) * rescale, **segments)[:b]
    out = jax.ops.segment_sum(partial * rescale[..., None], **segments)[:b]
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return out.reshape(b, h, d).astype(q.dtype)
