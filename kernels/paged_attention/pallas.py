"""Pallas paged decode attention (Mosaic TPU; any backend with `interpret=True`).

Grid (batch, page): step (b, j) attends row b's queries to the j-th page of its page table with an
online softmax (running max, denominator and float32 accumulator in scratch), and the last step
writes the normalised output. The page table, the lengths and the layer index are scalar-prefetched
(`PrefetchScalarGridSpec`), so the BlockSpec index map fetches page `page_table[b, j]` of the pool
directly (one [page_size, KVH, D] block, contiguous in the engine's layout) and a row never reads
pages past its length: the index of those steps is clamped to the row's last needed page (the
pipeline does not re-fetch an unchanged block) and their compute is skipped. With a sliding
window the pages before the window are skipped the same way. All KV heads of a page are processed
in one step (a static loop over KV heads, each a [Q·G, D] x [D, page_size] product).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from rlvr.kernels.paged_attention.reference import MASK_VALUE


def _needed_pages(length, num_queries: int, page_size: int, sliding_window: int):
    """(first, last) page index a row with `length` tokens reads (last >= first >= 0)."""
    last = jnp.maximum((length + page_size - 1) // page_size - 1, 0)
    if not sliding_window:
        return jnp.int32(0), last
    first = jnp.maximum(length - num_queries - sliding_window + 1, 0) // page_size
    return jnp.minimum(first, last), last


def _kernel(table_ref, lengths_ref, layer_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
            page_size: int, num_queries: int, kv_heads: int, group: int, scale: float, sliding_window: int,
            softcap: float):
    del table_ref, layer_ref  # used by the index maps only
    b, j = pl.program_id(0), pl.program_id(1)
    length = lengths_ref[b]

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    first, last = _needed_pages(length, num_queries, page_size, sliding_window)

    @pl.when((j >= first) & (j <= last) & (length > 0))
    def _page():
        rows = num_queries * group  # query row r is query r // group of head kv·group + r % group
        q_pos = length - num_queries + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // group
        kv_pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        mask = (kv_pos <= q_pos) & (kv_pos < length)
        if sliding_window:
            mask &= (q_pos - kv_pos) < sliding_window
        q = q_ref[...].astype(jnp.float32) * scale  # [Q, H, D]
        k = k_ref[...].astype(jnp.float32)  # [P, KVH, D]
        v = v_ref[...].astype(jnp.float32)
        for h in range(kv_heads):
            qh = q[:, h * group:(h + 1) * group, :].reshape(rows, q.shape[-1])
            s = jax.lax.dot_general(qh, k[:, h, :], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)  # [rows, P]
            if softcap:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[h]  # [rows, 1]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
            alpha = jnp.exp(m_prev - m_next)
            p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=-1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + jnp.dot(p, v[:, h, :], preferred_element_type=jnp.float32)
            m_ref[h] = m_next

    @pl.when(j == pl.num_programs(1) - 1)
    def _finish():
        denom = l_ref[...]
        out = jnp.where(denom > 0, acc_ref[...] / jnp.where(denom > 0, denom, 1.0), 0.0)  # [KVH, Q·G, D]
        d = out.shape[-1]
        out = out.reshape(kv_heads, num_queries, group, d).transpose(1, 0, 2, 3)
        o_ref[...] = out.reshape(num_queries, kv_heads * group, d).astype(o_ref.dtype)


def paged_attention_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, *, layer=None, sliding_window: int = 0, softcap: float = 0.0,
                           scale: float | None = None, interpret: bool = False) -> jax.Array:
    """q [B, Q, H, D]; pool [N, P, KVH, D] or [L, N, P, KVH, D] (+ `layer`); page_table [B, R];
    lengths [B]. Inputs are assumed validated (see `api.paged_attention`). Returns [B, Q, H, D]."""
    b, nq, h, d = q.shape
    page_size, kvh = k_pages.shape[-3], k_pages.shape[-2]
    rows_pages = page_table.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def page_index(bi, j, table, lens, layer_ref):
        first, last = _needed_pages(lens[bi], nq, page_size, sliding_window)
        return table[bi * rows_pages + jnp.clip(j, first, last)]

    if k_pages.ndim == 5:
        kv_block = (None, None, page_size, kvh, d)
        kv_map = lambda bi, j, table, lens, layer_ref: (layer_ref[0], page_index(bi, j, table, lens, layer_ref),
                                                        0, 0, 0)
    else:
        kv_block = (None, page_size, kvh, d)
        kv_map = lambda bi, j, table, lens, layer_ref: (page_index(bi, j, table, lens, layer_ref), 0, 0, 0)
    q_spec = pl.BlockSpec((None, nq, h, d), lambda bi, j, *_: (bi, 0, 0, 0))
    kernel = functools.partial(_kernel, page_size=page_size, num_queries=nq, kv_heads=kvh, group=h // kvh,
                               scale=scale, sliding_window=sliding_window, softcap=softcap)
    rows = nq * (h // kvh)
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,  # page table (flattened: 1-D scalar memory), lengths, layer
            grid=(b, rows_pages),
            in_specs=[q_spec, pl.BlockSpec(kv_block, kv_map), pl.BlockSpec(kv_block, kv_map)],
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((kvh, rows, 1), jnp.float32), pltpu.VMEM((kvh, rows, 1), jnp.float32),
                            pltpu.VMEM((kvh, rows, d), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="paged_attention",
    )
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    return call(page_table.reshape(-1).astype(jnp.int32), lengths.astype(jnp.int32), layer_arr, q, k_pages, v_pages)
