"""Ragged paged decode attention in plain XLA (the "ragged" implementation).

What: one query per row (q [B, H, D]) over the pages each row holds, read where they lie in the
pool (no [B, S] copy of every row's whole table width). Why: the dense path (`reference.py`)
gathers every row's table width token by token and masks it, so a batch with one long row pays
the long row's cost for every row, at gather speed (~1 GB/s on XLA:CPU); here the work is the
pages the rows hold (rounded up to a block), and the compiled program does not depend on how
many there are.

How (flash-decoding over blocks): each row's pages are cut into blocks of `block_pages` pages;
the blocks of all rows form one list (`RaggedPages`, built on the host), looped over on device
in chunks of `blocks_per_chunk`. Per chunk: one gather of whole pages (rows of the pool's
[pages, P·KVH·D] view: memcpy speed, unlike a per-token gather), the scores as one batched matmul
of the keys in their stored [tokens, KVH·D] layout against the row's queries laid out
block-diagonally ([KVH·D, H]: each query head sees its own kv head's columns; this spends KVH x
the score and value FLOPs, small against the weights at decode, to avoid transposing the keys,
which costs more than the whole product on XLA:CPU), and per block the softmax partials (max,
exp-sum, exp-weighted values) written to the block's slot. After the loop each row folds its
blocks' partials (`RaggedPages.table`). Rows of length 0 (idle) output zeros.

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

BLOCK_TOKENS, BLOCKS_PER_CHUNK = 128, 16  # defaults: ~128 tokens a block, 16 blocks (2k tokens) a loop step


class RaggedPages(NamedTuple):
    """The rows' pages as blocks, [C chunks, M blocks, K pages]; only the first `count` chunks hold
    blocks (the attention loops over those: the shape, hence the compiled program, is fixed while
    the work follows the pages held)."""
    pages: jax.Array  # [C, M, K] int32 page ids (past a row's pages, and in padding blocks: page 0)
    rows: jax.Array  # [C, M] int32 row of each block (padding blocks: 0, fully masked by `starts`)
    starts: jax.Array  # [C, M] int32 position of the block's first token in its row (padding: 2**30)
    table: jax.Array  # [B, blocks a row can have] int32 flat block index (unused: C·M, an empty block)
    count: jax.Array  # [] int32 chunks in use


def ragged_pages(page_table: np.ndarray, tokens: np.ndarray, page_size: int, block_pages: int | None = None,
                 blocks_per_chunk: int = BLOCKS_PER_CHUNK) -> RaggedPages:
    """Host-side builder: the first ceil(tokens[b] / page_size) pages of each row b of
    `page_table` [B, R], in blocks of `block_pages` pages (default: BLOCK_TOKENS tokens' worth).
    The arrays' shapes depend only on B, R and the block sizes."""
    batch, width = page_table.shape
    block_pages = block_pages or max(1, BLOCK_TOKENS // page_size)
    per_row = -(-width // block_pages)
    chunks = -(-batch * per_row // blocks_per_chunk)
    size = chunks * blocks_per_chunk
    held = np.minimum(-(-np.asarray(tokens, np.int64) // page_size), width)
    blocks = -(-held // block_pages)
    total = int(blocks.sum())
    row = np.repeat(np.arange(batch), blocks)
    index = np.arange(total) - np.repeat(np.cumsum(blocks) - blocks, blocks)  # block index within its row
    rows, starts = np.zeros(size, np.int32), np.full(size, 2**30, np.int32)
    rows[:total], starts[:total] = row, index * block_pages * page_size
    padded = np.zeros((batch, per_row * block_pages), np.int32)
    padded[:, :width] = page_table
    columns = index[:, None] * block_pages + np.arange(block_pages)
    pages = np.zeros((size, block_pages), np.int32)
    pages[:total] = np.where(columns < held[row][:, None], padded[row[:, None], columns], 0)
    table = np.full((batch, per_row), size, np.int32)
    table[row, index] = np.arange(total)
    return RaggedPages(pages.reshape(chunks, blocks_per_chunk, block_pages),
                       rows.reshape(chunks, blocks_per_chunk), starts.reshape(chunks, blocks_per_chunk), table,
                       np.int32(-(-total // blocks_per_chunk)))


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
    eye = jnp.eye(kvh, dtype=jnp.float32)
    qg = (q.astype(jnp.float32) * scale).reshape(b, kvh, h // kvh, d)
    diagonal = jnp.einsum("bkgd,kj->bkdjg", qg, eye).reshape(b, kvh * d, h)  # row b's queries, block-diagonal
    lengths = lengths.astype(jnp.int32)
    chunks, per_chunk = ragged.rows.shape
    options = dict(sliding_window=sliding_window, softcap=softcap)

    def chunk(c, parts):  # the softmax partials of chunk c's blocks, into their slots
        rows = ragged.rows[c]
        peak, total, out = _block_partials(diagonal[rows], k_pages, v_pages, layer, ragged.pages[c],
                                           ragged.starts[c], lengths[rows], **options)
        at = c * per_chunk
        return tuple(jax.lax.dynamic_update_slice(part, new, (at,) + (0,) * (new.ndim - 1))
                     for part, new in zip(parts, (peak, total, out), strict=True))

    size = chunks * per_chunk + 1  # + the empty block that unused table entries point at
    parts = (jnp.full((size, h), MASK_VALUE, jnp.float32), jnp.zeros((size, h), jnp.float32),
             jnp.zeros((size, h, d), jnp.float32))
    peak, total, out = (part[ragged.table] for part in jax.lax.fori_loop(0, ragged.count, chunk, parts))
    top = jnp.max(peak, axis=1, keepdims=True)  # [B, blocks, H]: fold each row's blocks
    weight = jnp.exp(peak - top)
    total = jnp.sum(total * weight, axis=1)
    out = jnp.sum(out * weight[..., None], axis=1)
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return out.astype(q.dtype)


def _block_partials(diagonal, k_pages, v_pages, layer, pages, starts, length, *, sliding_window, softcap):
    """Per block (K pages of one row; M blocks): the max score, the sum of exp(score - max) and the
    exp-weighted values [M, H, D], for the block's row's queries `diagonal` [M, KVH·D, H] (scaled,
    block-diagonal). Pages are read from the whole pool [L, N, ...] as rows of its flat view."""
    layers, num_pages, page_size, kvh, d = k_pages.shape
    m, k = pages.shape
    tokens, h = k * page_size, diagonal.shape[-1]
    flat = (layer * num_pages + pages).reshape(-1)
    keys, values = (jnp.take(pool.reshape(layers * num_pages, -1), flat, axis=0, mode="clip")
                    .reshape(m, tokens, kvh * d).astype(jnp.float32) for pool in (k_pages, v_pages))
    scores = jnp.matmul(keys, diagonal)  # [M, T, H]
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    kv_pos = starts[:, None] + jnp.arange(tokens, dtype=jnp.int32)
    visible = kv_pos < length[:, None]
    if sliding_window:
        visible &= (length[:, None] - 1 - kv_pos) < sliding_window
    visible = visible[:, :, None]
    scores = jnp.where(visible, scores, MASK_VALUE)
    peak = jnp.max(scores, axis=1)  # [M, H]
    weights = jnp.where(visible, jnp.exp(scores - peak[:, None]), 0.0)
    out = jnp.einsum("mth,mtc->mhc", weights, values).reshape(m, kvh, h // kvh, kvh, d)
    out = jnp.einsum("mkgjd,kj->mkgd", out, jnp.eye(kvh, dtype=jnp.float32)).reshape(m, h, d)
    return peak, jnp.sum(weights, axis=1), out
