"""Ragged paged decode attention in plain XLA (the "ragged" implementation).

What: one query per row (q [B, H, D]) over the rows' pages, where the pages are given as one flat
list of entries (`RaggedPages`: page id, row, position of the page's first token), sorted by row
and cut into fixed-size chunks. Why: the dense path (`reference.py`) gathers every row's whole
page-table width and masks it, so a batch with one long row pays the long row's cost for every
row; here the work is the pages the rows actually hold (rounded up to a chunk), and the compiled
program does not depend on how many there are. How: a loop over the chunks in use; per entry the
scores against its row's query, their max and exp-sum, folded into each row's running softmax
state with sorted segment reductions (a flash-decoding split over pages). Entries of row >= B are
padding and are dropped.

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
    """The rows' pages as [chunks, chunk] entries, row-major by row; only the first `count` chunks
    hold entries (the attention loops over those: the shape, hence the compiled program, is fixed
    while the work follows the pages held)."""
    pages: jax.Array  # [C, K] int32 page ids (padding entries: 0, the engine's scratch page)
    rows: jax.Array  # [C, K] int32 row of each entry, ascending (padding entries: B)
    starts: jax.Array  # [C, K] int32 position of the page's first token in its row
    count: jax.Array  # [] int32 chunks in use


def ragged_pages(page_table: np.ndarray, tokens: np.ndarray, page_size: int, chunk: int,
                 chunks: int) -> RaggedPages:
    """Host-side builder: the first ceil(tokens[b] / page_size) pages of each row b of
    `page_table` [B, R] in `chunks` chunks of `chunk` entries (which must fit them all)."""
    batch, width = page_table.shape
    count = np.minimum(-(-np.asarray(tokens) // page_size), width)
    total, size = int(count.sum()), chunks * chunk
    if total > size:
        raise ValueError(f"ragged_pages: {total} pages do not fit {chunks} chunks of {chunk}")
    rows = np.full(size, batch, np.int32)
    rows[:total] = np.repeat(np.arange(batch, dtype=np.int32), count)
    index = np.zeros(size, np.int32)
    index[:total] = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    pages = np.zeros(size, np.int32)
    pages[:total] = page_table[rows[:total], index[:total]]
    shape = (chunks, chunk)
    return RaggedPages(pages.reshape(shape), rows.reshape(shape), (index * page_size).reshape(shape),
                       np.int32(-(-total // chunk)))


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, ragged: RaggedPages,
                           lengths: jax.Array, *, layer=None, sliding_window: int = 0, softcap: float = 0.0,
                           scale: float | None = None) -> jax.Array:
    """q [B, H, D]; pool [N, P, KVH, D] or [L, N, P, KVH, D] (+ `layer`); lengths [B] = the query's
    position + 1 (0 = idle row, output zeros). Returns [B, H, D] in q's dtype (float32 softmax)."""
    b, h, d = q.shape
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    kvh = k_pages.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = jnp.concatenate([q, jnp.zeros((1, h, d), q.dtype)]).astype(jnp.float32).reshape(b + 1, kvh, h // kvh, d)
    length = jnp.concatenate([lengths.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    options = dict(sliding_window=sliding_window, softcap=softcap)

    def chunk(c, state):  # online softmax: fold chunk c's entries into the rows' running state
        peak, total, out = state
        rows = jnp.minimum(ragged.rows[c], b)
        c_peak, c_total, c_out = _chunk_attention(qg[rows] * scale, k_pages, v_pages, layer, ragged.pages[c],
                                                  ragged.starts[c], length[rows], **options)
        segments = dict(segment_ids=rows, num_segments=b + 1, indices_are_sorted=True)
        new_peak = jnp.maximum(peak, jax.ops.segment_max(c_peak, **segments))
        keep, rescale = jnp.exp(peak - new_peak), jnp.exp(c_peak - new_peak[rows])
        total = total * keep + jax.ops.segment_sum(c_total * rescale, **segments)
        out = out * keep[..., None] + jax.ops.segment_sum(c_out * rescale[..., None], **segments)
        return new_peak, total, out

    start = (jnp.full(qg.shape[:3], MASK_VALUE, jnp.float32), jnp.zeros(qg.shape[:3], jnp.float32),
             jnp.zeros(qg.shape, jnp.float32))
    _, total, out = jax.lax.fori_loop(0, ragged.count, chunk, start)
    total, out = total[:b], out[:b]
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return out.reshape(b, h, d).astype(q.dtype)


def _chunk_attention(q, k_pages, v_pages, layer, pages, starts, length, *, sliding_window, softcap):
    """Per entry (one page of one row): the max score, the sum of exp(score - max) and the
    exp-weighted values, for the row's query q [K, KVH, G, D] (scaled). Pages are read from the
    whole pool [L, N, ...] by flat index (slicing out a layer would copy it). Scores as a fused
    multiply-reduce in the pages' own [P, KVH] layout (tiny per-entry matmuls are slower on CPU)."""
    layers, num_pages, page_size = k_pages.shape[:3]
    flat = layer * num_pages + pages
    k = k_pages.reshape(layers * num_pages, *k_pages.shape[2:])[flat].astype(jnp.float32)  # [K, P, KVH, D]
    v = v_pages.reshape(layers * num_pages, *v_pages.shape[2:])[flat].astype(jnp.float32)
    scores = jnp.sum(k[:, :, :, None, :] * q[:, None], axis=-1)  # [K, P, KVH, G]
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    kv_pos = starts[:, None] + jnp.arange(page_size, dtype=jnp.int32)
    visible = kv_pos < length[:, None]
    if sliding_window:
        visible &= (length[:, None] - 1 - kv_pos) < sliding_window
    scores = jnp.where(visible[:, :, None, None], scores, MASK_VALUE)
    peak = jnp.max(scores, axis=1)  # [K, KVH, G]
    weights = jnp.where(visible[:, :, None, None], jnp.exp(scores - peak[:, None]), 0.0)
    return peak, jnp.sum(weights, axis=1), jnp.einsum("tpkg,tpkd->tkgd", weights, v)
