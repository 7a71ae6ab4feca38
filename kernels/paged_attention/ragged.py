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
exp-sum, exp-weighted values) written to the block's slot. A block that several rows hold (the
same pages at the same positions: a group's shared prompt, kept once by the prefix cache) is in a
second list, read once for up to SHARERS rows (a second loop); there the keys and values are copied
kv-head-major, and each kv head's product takes the SHARERS x G queries that read it side by side
(wide enough for XLA:CPU's matmul, so the block-diagonal doubling is not needed). After the loops
each row folds its blocks' partials (`RaggedPages.table`). Rows of length 0 (idle) output zeros.

The caller builds the list on the host (`ragged_pages`) once per decode call, covering every page a
row can write during the call; the per-step `lengths` mask what is not written yet.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from rlvr.kernels.bits import as_bits, from_bits, kv_float
from rlvr.kernels.paged_attention.reference import MASK_VALUE

BLOCK_TOKENS, BLOCKS_PER_CHUNK = 128, 16  # defaults: ~128 tokens a block, 16 blocks (2k tokens) a loop step
SHARERS, SHARED_PER_CHUNK = 8, 4  # rows a shared block serves at once (a group of 8 samples), shared blocks a step


class RaggedPages(NamedTuple):
    """The rows' pages as blocks, [C chunks, M blocks, K pages]; only the first `count` chunks hold
    blocks (the attention loops over those: the shape, hence the compiled program, is fixed while
    the work follows the pages held). A block that several rows hold (the same pages at the same
    positions: a prompt shared by a group of samples) is read once for up to SHARERS of them
    (`shared_*`); the others serve one row each."""
    pages: jax.Array  # [C, M, K] int32 page ids (past a row's pages, and in padding blocks: page 0)
    rows: jax.Array  # [C, M, 1] int32 row of each block (padding blocks: B, an idle row)
    starts: jax.Array  # [C, M] int32 position of the block's first token in its row (padding: 2**30)
    count: jax.Array  # [] int32 chunks in use
    shared_pages: jax.Array  # [C', M', K] as `pages`, for blocks held by several rows
    shared_rows: jax.Array  # [C', M', SHARERS] their rows (unused: B)
    shared_starts: jax.Array  # [C', M']
    shared_count: jax.Array  # [] int32
    table: jax.Array  # [B, blocks a row can have] int32 slot of each (row, block)'s partials (unused: the last, empty)


def ragged_pages(page_table: np.ndarray, tokens: np.ndarray, page_size: int, block_pages: int | None = None,
                 blocks_per_chunk: int = BLOCKS_PER_CHUNK) -> RaggedPages:
    """Host-side builder: the first ceil(tokens[b] / page_size) pages of each row b of
    `page_table` [B, R], in blocks of `block_pages` pages (default: BLOCK_TOKENS tokens' worth).
    The arrays' shapes depend only on B, R and the block sizes."""
    batch, width = page_table.shape
    block_pages = block_pages or max(1, BLOCK_TOKENS // page_size)
    per_row = -(-width // block_pages)
    held = np.minimum(-(-np.asarray(tokens, np.int64) // page_size), width)
    padded = np.zeros((batch, per_row * block_pages), np.int32)
    padded[:, :width] = np.where(np.arange(width) < held[:, None], page_table, 0)
    blocks = padded.reshape(batch, per_row, block_pages)
    holders: dict[tuple, list[int]] = {}  # (block index, its pages) -> the rows holding it
    for row in range(batch):
        for index in range(-(-int(held[row]) // block_pages)):
            holders.setdefault((index, *blocks[row, index].tolist()), []).append(row)
    shared_size = max(1, batch * per_row // SHARERS)  # shared entries beyond it go one row at a time
    single, shared = [], []
    for key, rows in holders.items():
        for at in range(0, len(rows), SHARERS):
            part = rows[at:at + SHARERS]
            if len(part) > 1 and len(shared) < shared_size:
                shared.append((key, part))
            else:
                single.extend((key, [row]) for row in part)
    table = np.full((batch, per_row), 0, np.int32)
    one = _entries(single, batch, per_row * batch, blocks_per_chunk, 1, block_pages, page_size, table, 0)
    offset = one[0].size // block_pages
    many = _entries(shared, batch, shared_size, SHARED_PER_CHUNK, SHARERS, block_pages, page_size, table, offset)
    empty = offset + many[1].size
    table[:] = np.where(table == 0, empty, table - 1)  # slots were stored + 1 (0: unused)
    return RaggedPages(*one, *many, table)


def _entries(entries, batch, capacity, per_chunk, sharers, block_pages, page_size, table, offset):
    """(pages [C, M, K], rows [C, M, sharers], starts [C, M], count) of `entries` ((block index,
    *pages), rows) padded to `capacity`, recording in `table` each (row, block)'s partials slot
    + 1: `offset` + entry · sharers + the row's place among the entry's rows."""
    chunks = -(-capacity // per_chunk)
    size = chunks * per_chunk
    pages, rows = np.zeros((size, block_pages), np.int32), np.full((size, sharers), batch, np.int32)
    starts = np.full(size, 2**30, np.int32)
    for e, (key, holders) in enumerate(entries):
        pages[e], starts[e] = key[1:], key[0] * block_pages * page_size
        rows[e, :len(holders)] = holders
        table[holders, key[0]] = offset + e * sharers + np.arange(len(holders)) + 1
    return (pages.reshape(chunks, per_chunk, block_pages), rows.reshape(chunks, per_chunk, sharers),
            starts.reshape(chunks, per_chunk), np.int32(-(-len(entries) // per_chunk)))


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
    qg = (q.astype(jnp.float32) * scale).reshape(b, kvh, h // kvh, d)
    qg = jnp.concatenate([qg, jnp.zeros((1, kvh, h // kvh, d), jnp.float32)])  # + row b: padding
    diagonal = jnp.einsum("bkgd,kj->bkdjg", qg, jnp.eye(kvh, dtype=jnp.float32)).reshape(b + 1, kvh * d, h)
    lengths = jnp.concatenate([lengths.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    options = dict(sliding_window=sliding_window, softcap=softcap)
    ragged = RaggedPages(*(jnp.asarray(x) for x in ragged))
    lists = ((ragged.pages, ragged.rows, ragged.starts, ragged.count),
             (ragged.shared_pages, ragged.shared_rows, ragged.shared_starts, ragged.shared_count))
    size = sum(rows.size for _, rows, _, _ in lists) + 1  # + the empty slot unused table entries point at
    parts = (jnp.full((size, h), MASK_VALUE, jnp.float32), jnp.zeros((size, h), jnp.float32),
             jnp.zeros((size, h, d), jnp.float32))
    offset = 0
    for pages, rows, starts, count in lists:  # each block's softmax partials into its rows' slots
        def chunk(c, parts, pages=pages, rows=rows, starts=starts, offset=offset):
            keys, values = _gather_blocks(k_pages, v_pages, layer, pages[c])
            if rows.shape[-1] == 1:
                new = _block_partials(diagonal[rows[c]], keys, values, starts[c], lengths[rows[c]], kvh, **options)
            else:
                new = _shared_block_partials(qg[rows[c]], keys, values, starts[c], lengths[rows[c]], **options)
            at = offset + c * rows[c].size
            return tuple(jax.lax.dynamic_update_slice(part, x, (at,) + (0,) * (x.ndim - 1))
                         for part, x in zip(parts, new, strict=True))

        parts = jax.lax.fori_loop(0, count, chunk, parts)
        offset += rows.size
    peak, total, out = (part[ragged.table] for part in parts)
    top = jnp.max(peak, axis=1, keepdims=True)  # [B, blocks, H]: fold each row's blocks
    weight = jnp.exp(peak - top)
    total = jnp.sum(total * weight, axis=1)
    out = jnp.sum(out * weight[..., None], axis=1)
    out = jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return out.astype(q.dtype)


def _compute_dtype(pool_dtype) -> jnp.dtype:
    """The score and value products' input dtype: bfloat16 for bf16 pages (the keys as stored,
    queries and softmax weights rounded to bf16, products accumulated in float32: ~2x the fp32
    FLOP/s on CPUs with bf16 dot units), float32 otherwise."""
    return jnp.dtype(jnp.bfloat16) if kv_float(pool_dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def _gather_blocks(k_pages, v_pages, layer, pages):
    """The keys and values of M blocks of K pages, [M, K·P, KVH·D] each in the compute dtype: rows of
    the whole pool's flat view [L·N, P·KVH·D] (whole pages: memcpy speed)."""
    layers, num_pages, page_size, kvh, d = k_pages.shape
    m, k = pages.shape
    flat = (layer * num_pages + pages).reshape(-1)
    compute = _compute_dtype(k_pages.dtype)
    return tuple(from_bits(jnp.take(as_bits(pool.reshape(layers * num_pages, -1)), flat, axis=0, mode="clip"),
                           pool.dtype).reshape(m, k * page_size, kvh * d).astype(compute)
                 for pool in (k_pages, v_pages))


def _softmax_partials(scores, starts, length, sliding_window, softcap):
    """scores [M, S, H, T] of S rows' queries over M blocks starting at `starts` [M], lengths [M, S]
    -> (max [M, S, H], exp(scores - max) masked [M, S, H, T])."""
    tokens = scores.shape[-1]
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    kv_pos = starts[:, None] + jnp.arange(tokens, dtype=jnp.int32)  # [M, T]
    visible = kv_pos[:, None, :] < length[:, :, None]  # [M, S, T]
    if sliding_window:
        visible &= (length[:, :, None] - 1 - kv_pos[:, None, :]) < sliding_window
    visible = visible[:, :, None, :]
    scores = jnp.where(visible, scores, MASK_VALUE)
    peak = jnp.max(scores, axis=-1)  # [M, S, H]
    return peak, jnp.where(visible, jnp.exp(scores - peak[..., None]), 0.0)


def _block_partials(diagonal, keys, values, starts, length, kvh, *, sliding_window, softcap):
    """Per block (M blocks of T tokens, one row each): the max score, the sum of exp(score - max)
    and the exp-weighted values, flat [M, H(, D)], for the rows' queries `diagonal` [M, 1, KVH·D, H]
    (scaled, block-diagonal: one [T, KVH·D] x [KVH·D, H] product a block; per kv head it would be
    KVH products G = H / KVH wide, slower on XLA:CPU) over keys and values [M, T, KVH·D]; lengths [M, 1]."""
    m, tokens, width = keys.shape
    h = diagonal.shape[-1]
    d = width // kvh
    compute = keys.dtype
    scores = jnp.matmul(keys, diagonal[:, 0].astype(compute), preferred_element_type=jnp.float32)  # [M, T, H]
    # Tokens minor ([M, H, T]) for the softmax: its exp then runs along contiguous tokens (~7x
    # faster on XLA:CPU than along the 8-wide head axis), and the value product is a plain
    # [H, T] x [T, KVH·D] matmul. The barriers keep XLA from folding the transposes into the dots
    # (a folded transposed-operand dot runs off YNNPACK, ~4x slower): the block costs ~25 % less.
    scores = jnp.swapaxes(jax.lax.optimization_barrier(scores), 1, 2).reshape(m, 1, h, tokens)
    peak, weights = _softmax_partials(scores, starts, length, sliding_window, softcap)
    product = jax.lax.optimization_barrier(weights.reshape(m, h, tokens).astype(compute))
    out = jnp.matmul(product, values, preferred_element_type=jnp.float32).reshape(m, kvh, h // kvh, kvh, d)
    out = jnp.stack([out[:, j, :, j] for j in range(kvh)], axis=1)  # each query head's own kv head
    return peak.reshape(m, h), jnp.sum(weights, axis=-1).reshape(m, h), out.reshape(m, h, d)


def _shared_block_partials(queries, keys, values, starts, length, *, sliding_window, softcap):
    """As `_block_partials` for blocks that S rows share (their queries [M, S, KVH, G, D], scaled;
    lengths [M, S]; results flat [M·S, ...]): the keys and values are copied kv-head-major once,
    [M, KVH, T, D], so each kv head's product is a [T, D] x [D, S·G] matmul with no block-diagonal
    doubling (S·G = 32 columns is wide enough for XLA:CPU's matmul: ~30 % faster than the
    block-diagonal form here, measured)."""
    m, sharers, kvh, g, d = queries.shape
    tokens, compute = keys.shape[1], keys.dtype
    key_heads, value_heads = (jax.lax.optimization_barrier(x.reshape(m, tokens, kvh, d).transpose(0, 2, 1, 3))
                              for x in (keys, values))
    q_heads = queries.transpose(0, 2, 4, 1, 3).reshape(m, kvh, d, sharers * g).astype(compute)
    scores = jnp.matmul(key_heads, q_heads, preferred_element_type=jnp.float32)  # [M, KVH, T, S·G]
    scores = jax.lax.optimization_barrier(scores).reshape(m, kvh, tokens, sharers, g)
    scores = scores.transpose(0, 3, 1, 4, 2).reshape(m, sharers, kvh * g, tokens)  # [M, S, H, T]
    peak, weights = _softmax_partials(scores, starts, length, sliding_window, softcap)
    product = weights.reshape(m, sharers, kvh, g, tokens).transpose(0, 2, 1, 3, 4).reshape(m, kvh, sharers * g, tokens)
    product = jax.lax.optimization_barrier(product.astype(compute))
    out = jnp.matmul(product, value_heads, preferred_element_type=jnp.float32)  # [M, KVH, S·G, D]
    out = out.reshape(m, kvh, sharers, g, d).transpose(0, 2, 1, 3, 4)
    rows = m * sharers
    return peak.reshape(rows, kvh * g), jnp.sum(weights, axis=-1).reshape(rows, kvh * g), out.reshape(rows, kvh * g, d)
