"""Flash attention kernels with the key (dq: key; dk/dv: query) sequence on the grid, for Mosaic (TPU)
and the interpreter: what makes long sequences compile on TPU.

Mosaic copies each BlockSpec block into VMEM, so `pallas.py`'s layout (a program holds its head's whole
key sequence, or all G*T query rows for dk/dv) runs out of the 16 MiB scoped VMEM of v5e/v5p at 16-32k
tokens. Here every block is one tile: the forward and dq kernels' grid is (batch, kv head, query tile,
key tile) and the dk/dv kernel's (batch, kv head, key tile, query tile); the last grid axis is
sequential ("arbitrary") and the running softmax state or gradient sums live in VMEM scratch across
its steps, initialised at step 0 and written out at the last (the layout of JAX's reference Pallas TPU
flash kernel). VMEM per program is a few tiles whatever the sequence length. The per-tile maths is
`pallas.py`'s (`_forward_update`, `_dq_update`, `_dkv_update`), so both layouts compute the same thing.

Block skipping: a tile pair whose position ranges rule out every (query, key) pair skips its compute
(`pl.when`); its blocks are still fetched (clamping the index maps to skip the copies too is not done).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import tiles
from .common import tile_may_be_visible, visible


def _when_visible(plan, q_pos, kv_pos, update) -> None:
    """Runs `update()` unless the tiles' position ranges rule out every pair (when skipping is on)."""
    if not plan.skip:
        update()
        return
    may = tile_may_be_visible(jnp.min(q_pos), jnp.max(q_pos), jnp.min(kv_pos), jnp.max(kv_pos), plan.spec)
    pl.when(may)(update)


def _forward_kernel(q_ref, k_ref, v_ref, qs_ref, qp_ref, ks_ref, kp_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref,
                    *, plan):
    step = pl.program_id(3)

    @pl.when(step == 0)
    def _init():
        m_ref[...], l_ref[...], acc_ref[...] = tiles.forward_init(*acc_ref.shape)

    q_pos, kv_pos = qp_ref[...], kp_ref[...]  # [bq, 1], [1, bk]

    def update():
        mask = visible(qs_ref[...], q_pos, ks_ref[...], kv_pos, plan.spec)
        carry = (m_ref[...], l_ref[...], acc_ref[...])
        m_ref[...], l_ref[...], acc_ref[...] = tiles.forward_update(plan.spec, q_ref[...], k_ref[...],
                                                                        v_ref[...], mask, carry)

    _when_visible(plan, q_pos, kv_pos, update)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...], lse_ref[...] = tiles.forward_result(m_ref[...], l_ref[...], acc_ref[...], o_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, qp_ref, ks_ref, kp_ref, dq_ref, dq_acc,
               *, plan):
    step = pl.program_id(3)

    @pl.when(step == 0)
    def _init():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    q_pos, kv_pos = qp_ref[...], kp_ref[...]

    def update():
        mask = visible(qs_ref[...], q_pos, ks_ref[...], kv_pos, plan.spec)
        dq_acc[...] = tiles.dq_update(plan.spec, q_ref[...], k_ref[...], v_ref[...], do_ref[...], lse_ref[...],
                                          delta_ref[...], mask, dq_acc[...])

    _when_visible(plan, q_pos, kv_pos, update)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_acc[...] * plan.spec.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, qp_ref, ks_ref, kp_ref, dk_ref, dv_ref,
                dk_acc, dv_acc, *, plan):
    step = pl.program_id(3)

    @pl.when(step == 0)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    q_pos, kv_pos = qp_ref[...], kp_ref[...]  # [1, bq], [bk, 1]

    def update():
        mask = visible(qs_ref[...], q_pos, ks_ref[...], kv_pos, plan.spec)
        dk_acc[...], dv_acc[...] = tiles.dkv_update(plan.spec, q_ref[...], k_ref[...], v_ref[...], do_ref[...],
                                                        lse_ref[...], delta_ref[...], mask,
                                                        (dk_acc[...], dv_acc[...]))

    _when_visible(plan, q_pos, kv_pos, update)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_acc[...] * plan.spec.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _call(kernel, plan, grid, in_specs, out_specs, out_shape, scratch, name: str):
    params = None if plan.interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    return pl.pallas_call(
        functools.partial(kernel, plan=plan), out_shape=out_shape, interpret=plan.interpret, name=name,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
                                               out_specs=out_specs, scratch_shapes=scratch),
        compiler_params=params)


def forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan):
    """As `pallas._forward` (folded q [B, KVH, G*Tp, D], k/v [B, KVH, Sp, D]) -> (out, lse [.., 1])."""
    b, kvh, gt, d = q.shape
    bq, bk, per_head = plan.block_q, plan.block_kv, plan.t_pad // plan.block_q
    q_tile = pl.BlockSpec((None, None, bq, d), lambda i, h, j, s: (i, h, j, 0))
    kv_tile = pl.BlockSpec((None, None, bk, d), lambda i, h, j, s: (i, h, s, 0))
    q_col = pl.BlockSpec((None, bq, 1), lambda i, h, j, s: (i, lax.rem(j, per_head), 0))
    kv_row = pl.BlockSpec((None, 1, bk), lambda i, h, j, s: (i, 0, s))
    lse_tile = pl.BlockSpec((None, None, bq, 1), lambda i, h, j, s: (i, h, j, 0))
    scratch = [pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, d), jnp.float32)]
    return _call(
        _forward_kernel, plan, (b, kvh, gt // bq, plan.s_pad // bk),
        [q_tile, kv_tile, kv_tile, q_col, q_col, kv_row, kv_row], [q_tile, lse_tile],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, kvh, gt, 1), jnp.float32)], scratch,
        "flash_attention_fwd",
    )(q, k, v, tiles.col(q_seg), tiles.col(q_pos), tiles.row(kv_seg), tiles.row(kv_pos))


def backward_dq(q, k, v, d_out, lse, delta, q_seg, q_pos, kv_seg, kv_pos, plan):
    b, kvh, gt, d = q.shape
    bq, bk, per_head = plan.block_q_bwd, plan.block_kv_bwd, plan.t_pad // plan.block_q_bwd
    q_tile = pl.BlockSpec((None, None, bq, d), lambda i, h, j, s: (i, h, j, 0))
    q_tile_col = pl.BlockSpec((None, None, bq, 1), lambda i, h, j, s: (i, h, j, 0))
    kv_tile = pl.BlockSpec((None, None, bk, d), lambda i, h, j, s: (i, h, s, 0))
    q_col = pl.BlockSpec((None, bq, 1), lambda i, h, j, s: (i, lax.rem(j, per_head), 0))
    kv_row = pl.BlockSpec((None, 1, bk), lambda i, h, j, s: (i, 0, s))
    return _call(
        _dq_kernel, plan, (b, kvh, gt // bq, plan.s_pad // bk),
        [q_tile, kv_tile, kv_tile, q_tile, q_tile_col, q_tile_col, q_col, q_col, kv_row, kv_row], q_tile,
        jax.ShapeDtypeStruct(q.shape, q.dtype), [pltpu.VMEM((bq, d), jnp.float32)], "flash_attention_dq",
    )(q, k, v, d_out, lse, delta, tiles.col(q_seg), tiles.col(q_pos), tiles.row(kv_seg),
      tiles.row(kv_pos))


def backward_dkv(q, k, v, d_out, lse, delta, q_seg, q_pos, kv_seg, kv_pos, plan):
    b, kvh, gt, d = q.shape
    bq, bk, per_head = plan.block_q_bwd, plan.block_kv_bwd, plan.t_pad // plan.block_q_bwd
    q_tile = pl.BlockSpec((None, None, bq, d), lambda i, h, j, r: (i, h, r, 0))
    q_tile_row = pl.BlockSpec((None, None, 1, bq), lambda i, h, j, r: (i, h, 0, r))
    q_row = pl.BlockSpec((None, 1, bq), lambda i, h, j, r: (i, 0, lax.rem(r, per_head)))
    kv_tile = pl.BlockSpec((None, None, bk, d), lambda i, h, j, r: (i, h, j, 0))
    kv_col = pl.BlockSpec((None, bk, 1), lambda i, h, j, r: (i, j, 0))
    as_row = lambda x: x.reshape(b, kvh, 1, gt)  # [B,KVH,GT,1] -> [B,KVH,1,GT]: same memory order
    scratch = [pltpu.VMEM((bk, d), jnp.float32), pltpu.VMEM((bk, d), jnp.float32)]
    return _call(
        _dkv_kernel, plan, (b, kvh, plan.s_pad // bk, gt // bq),
        [q_tile, kv_tile, kv_tile, q_tile, q_tile_row, q_tile_row, q_row, q_row, kv_col, kv_col], [kv_tile, kv_tile],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)], scratch,
        "flash_attention_dkv",
    )(q, k, v, d_out, as_row(lse), as_row(delta), tiles.row(q_seg), tiles.row(q_pos),
      tiles.col(kv_seg), tiles.col(kv_pos))
