"""Flash attention in Pallas: a forward kernel and two backward kernels (dq; dk and dv) under one
`jax.custom_vjp`. The backward pass recomputes the probabilities from the saved log-sum-exp.

Portable subset: `pl.pallas_call` with a grid and BlockSpecs, plain ref indexing with `pl.ds`, 2-D
`lax.dot_general` with float32 accumulation, `lax.fori_loop` / `lax.cond` inside the kernel. The
same kernels lower to Mosaic (TPU) and Triton (GPU; the Triton backend is asked for explicitly,
since JAX now defaults GPU Pallas to Mosaic GPU), and run on CPU with `interpret=True`.

Layout. Query heads are folded onto the query axis per KV head (`common.fold_heads`), so GQA/MQA
never repeats k/v: each program of the forward and dq kernels owns one tile of `block_q` query rows
of one KV head and walks that head's keys in steps of `block_kv`; each program of the dk/dv kernel
owns one tile of keys and walks all G*T query rows that read it (so dk/dv are summed over the query
group in-kernel). Segment ids and positions travel as [B, T, 1] columns or [B, 1, T] rows, the
shape the kernel needs to broadcast them against a [rows, cols] logits tile (2-D tiles, whose last
dim is either full or a whole tile, as Mosaic requires).

Limit: a program holds the whole key sequence of its head (forward, dq) or all G*T query rows
(dk/dv) as one block. Triton reads them from HBM through pointers, so this costs nothing there;
Mosaic copies whole blocks into VMEM, which bounds the sequence length on TPU: about 1 KiB per key
(D=128, bf16, k and v double-buffered), and likewise per folded query row (G*T) in dk/dv, against a
scoped VMEM limit of 16-32 MiB. Longer sequences want ring attention (which calls this per key
block), or a grid-over-keys TPU variant with scratch accumulators (not written).

Block skipping: when causal or windowed, a key tile is skipped (`lax.cond`) if the two tiles'
position ranges rule out every pair; the ranges are computed in-kernel from the positions, so the
skip stays right for packed sequences and for ring attention's global offsets.

Padding: T and S are padded to whole tiles; padded keys get segment 0 (never visible), padded
queries segment 0 (see nothing, output 0) and are sliced off; padded positions repeat the last real
one, so tile position ranges (and the skip) are unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import pallas_tpu, tiles
from .common import (
    EMPTY_ROW_LSE,
    AttentionSpec,
    fold_heads,
    heads_to_kv_major,
    tile_may_be_visible,
    unfold_heads,
    unfold_lse,
    visible,
)
from .config import BlockSizes, effective


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one call: the settings, the tiles, the padded lengths, the target."""

    spec: AttentionSpec
    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int
    t_pad: int
    s_pad: int
    groups: int
    platform: str
    interpret: bool
    skip: bool
    grid_over_keys: bool  # pallas_tpu's layout (TPU, and the interpreter on CPU); False: Triton's


def make_plan(spec: AttentionSpec, blocks: BlockSizes, t: int, s: int, groups: int, platform: str,
              interpret: bool) -> Plan:
    bq, bk = effective(blocks.block_q, t, platform), effective(blocks.block_kv, s, platform)
    bqb, bkb = effective(blocks.q_bwd, t, platform), effective(blocks.kv_bwd, s, platform)
    t_tile, s_tile = math.lcm(bq, bqb), math.lcm(bk, bkb)
    return Plan(spec, bq, bk, bqb, bkb, -(-t // t_tile) * t_tile, -(-s // s_tile) * s_tile, groups, platform,
                interpret, blocks.skip_masked_blocks and spec.may_skip_blocks, platform != "gpu")


def flash_attention_pallas(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, spec: AttentionSpec, blocks: BlockSizes,
                           platform: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """q [B,T,H,D], k/v [B,S,KVH,D], int32 segment ids / positions [B,T] and [B,S] (already
    defaulted and validated by `api.flash_attention`) -> (out [B,T,H,D] q.dtype, lse [B,H,T] f32)."""
    b, t, h, _ = q.shape
    s, kvh = k.shape[1], k.shape[2]
    plan = make_plan(spec, blocks, t, s, h // kvh, platform, interpret)
    q = fold_heads(_pad(q, 1, plan.t_pad, 0), kvh)
    k = heads_to_kv_major(_pad(k, 1, plan.s_pad, 0))
    v = heads_to_kv_major(_pad(v, 1, plan.s_pad, 0))
    q_seg, kv_seg = _pad(q_seg, 1, plan.t_pad, 0), _pad(kv_seg, 1, plan.s_pad, 0)
    q_pos, kv_pos = _pad(q_pos, 1, plan.t_pad, None), _pad(kv_pos, 1, plan.s_pad, None)
    out, lse = _flash(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan)
    return unfold_heads(out, plan.groups, t), unfold_lse(lse[..., 0], plan.groups, t)


def _pad(x, axis: int, size: int, value):
    """Pad `axis` to `size` with `value`, or by repeating the edge when `value` is None."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode="edge") if value is None else jnp.pad(x, widths, constant_values=value)


# ----------------------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan: Plan):
    return _forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan)


def _flash_fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan: Plan):
    out, lse = _forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan)
    return (out, lse), (q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse)


def _forward(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan: Plan):
    layout = pallas_tpu.forward if plan.grid_over_keys else _forward_whole_keys
    return layout(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan)


def _backward_dq(*args):
    return (pallas_tpu.backward_dq if args[-1].grid_over_keys else _backward_dq_whole_keys)(*args)


def _backward_dkv(*args):
    return (pallas_tpu.backward_dkv if args[-1].grid_over_keys else _backward_dkv_whole_keys)(*args)


def _flash_bwd(plan: Plan, residuals, cotangents):
    q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse = residuals
    d_out, d_lse = cotangents
    empty = lse == -jnp.inf
    # d lse / d logits = probs, so an lse cotangent folds into the usual delta = rowsum(dO * O).
    delta = (jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
             - jnp.where(empty, 0.0, d_lse))
    lse = jnp.where(empty, EMPTY_ROW_LSE, lse)
    dq = _backward_dq(q, k, v, d_out, lse, delta, q_seg, q_pos, kv_seg, kv_pos, plan)
    dk, dv = _backward_dkv(q, k, v, d_out, lse, delta, q_seg, q_pos, kv_seg, kv_pos, plan)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# -------------------------------------------------------------------------------------------- kernels


def _skip_or(plan: Plan, q_pos, kv_pos, update, carry):
    """update(carry), or carry unchanged when the tiles' position ranges rule out every pair."""
    if not plan.skip:
        return update(carry)
    may = tile_may_be_visible(jnp.min(q_pos), jnp.max(q_pos), jnp.min(kv_pos), jnp.max(kv_pos), plan.spec)
    return lax.cond(may, update, lambda c: c, carry)


def _forward_kernel(q_ref, k_ref, v_ref, qs_ref, qp_ref, ks_ref, kp_ref, o_ref, lse_ref, *, plan: Plan):
    spec, bk = plan.spec, plan.block_kv
    q = q_ref[...]  # [bq, D]
    q_seg, q_pos = qs_ref[...], qp_ref[...]  # [bq, 1]

    def step(j, carry):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        kv_pos = kp_ref[:, keys]  # [1, bk]

        def update(carry):
            mask = visible(q_seg, q_pos, ks_ref[:, keys], kv_pos, spec)
            return tiles.forward_update(spec, q, k_ref[keys, :], v_ref[keys, :], mask, carry)

        return _skip_or(plan, q_pos, kv_pos, update, carry)

    carry = lax.fori_loop(0, plan.s_pad // bk, step, tiles.forward_init(*q.shape))
    o_ref[...], lse_ref[...] = tiles.forward_result(*carry, o_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, qp_ref, ks_ref, kp_ref, dq_ref, *,
               plan: Plan):
    spec, bk = plan.spec, plan.block_kv_bwd
    q, d_out = q_ref[...], do_ref[...]  # [bq, D]
    lse, delta, q_seg, q_pos = lse_ref[...], delta_ref[...], qs_ref[...], qp_ref[...]  # [bq, 1]

    def step(j, dq):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        kv_pos = kp_ref[:, keys]

        def update(dq):
            mask = visible(q_seg, q_pos, ks_ref[:, keys], kv_pos, spec)
            return tiles.dq_update(spec, q, k_ref[keys, :], v_ref[keys, :], d_out, lse, delta, mask, dq)

        return _skip_or(plan, q_pos, kv_pos, update, dq)

    dq = lax.fori_loop(0, plan.s_pad // bk, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * spec.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qs_ref, qp_ref, ks_ref, kp_ref, dk_ref, dv_ref,
                *, plan: Plan):
    spec, bq = plan.spec, plan.block_q_bwd
    per_head = plan.t_pad // bq
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    kv_seg, kv_pos = ks_ref[...], kp_ref[...]  # [bk, 1]

    def step(i, carry):
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)  # rows of the folded G*T query axis
        times = pl.ds(pl.multiple_of(lax.rem(i, per_head) * bq, bq), bq)  # the same rows' time steps
        q_pos = qp_ref[:, times]  # [1, bq]

        def update(carry):
            mask = visible(qs_ref[:, times], q_pos, kv_seg, kv_pos, spec)
            return tiles.dkv_update(spec, q_ref[rows, :], k, v, do_ref[rows, :], lse_ref[:, rows], delta_ref[:, rows],
                               mask, carry)

        return _skip_or(plan, q_pos, kv_pos, update, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, plan.groups * per_head, step, (zeros, zeros))
    dk_ref[...] = (dk * spec.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ------------------------------------------------------------------------------------------ the calls


def _call(kernel, plan: Plan, grid, in_specs, out_specs, out_shape, name: str, head_dim: int):
    return pl.pallas_call(
        functools.partial(kernel, plan=plan), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=plan.interpret, name=name,
        compiler_params=None if plan.interpret else _compiler_params(plan.platform, len(grid), head_dim))


def _compiler_params(platform: str, grid_rank: int, head_dim: int):
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_rank)
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)
    raise ValueError(f"flash_attention: no compiled Pallas backend for platform {platform!r}")


def _forward_whole_keys(q, k, v, q_seg, q_pos, kv_seg, kv_pos, plan: Plan):
    b, kvh, gt, d = q.shape
    bq, per_head = plan.block_q, plan.t_pad // plan.block_q
    tile = pl.BlockSpec((None, None, bq, d), lambda i, h, j: (i, h, j, 0))
    whole_kv = pl.BlockSpec((None, None, plan.s_pad, d), lambda i, h, j: (i, h, 0, 0))
    q_col = pl.BlockSpec((None, bq, 1), lambda i, h, j: (i, lax.rem(j, per_head), 0))
    kv_row = pl.BlockSpec((None, 1, plan.s_pad), lambda i, h, j: (i, 0, 0))
    return _call(
        _forward_kernel, plan, (b, kvh, gt // bq), [tile, whole_kv, whole_kv, q_col, q_col, kv_row, kv_row],
        [tile, pl.BlockSpec((None, None, bq, 1), lambda i, h, j: (i, h, j, 0))],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, kvh, gt, 1), jnp.float32)],
        "flash_attention_fwd", d,
    )(q, k, v, tiles.col(q_seg), tiles.col(q_pos), tiles.row(kv_seg), tiles.row(kv_pos))


def _backward_dq_whole_keys(q, k, v, d_out, lse, delta, q_seg, q_pos, kv_seg, kv_pos, plan: Plan):
    b, kvh, gt, d = q.shape
    bq, per_head = plan.block_q_bwd, plan.t_pad // plan.block_q_bwd
    tile = pl.BlockSpec((None, None, bq, d), lambda i, h, j: (i, h, j, 0))
    tile_col = pl.BlockSpec((None, None, bq, 1), lambda i, h, j: (i, h, j, 0))
    whole_kv = pl.BlockSpec((None, None, plan.s_pad, d), lambda i, h, j: (i, h, 0, 0))
    q_col = pl.BlockSpec((None, bq, 1), lambda i, h, j: (i, lax.rem(j, per_head), 0))
    kv_row = pl.BlockSpec((None, 1, plan.s_pad), lambda i, h, j: (i, 0, 0))
    return _call(
        _dq_kernel, plan, (b, kvh, gt // bq),
        [tile, whole_kv, whole_kv, tile, tile_col, tile_col, q_col, q_col, kv_row, kv_row], tile,
        jax.ShapeDtypeStruct(q.shape, q.dtype), "flash_attention_dq", d,
    )(q, k, v, d_out, lse, delta, tiles.col(q_seg), tiles.col(q_pos), tiles.row(kv_seg), tiles.row(kv_pos))


def _backward_dkv_whole_keys(q, k, v, d_out, lse, delta, q_seg, q_pos, kv_seg, kv_pos, plan: Plan):
    b, kvh, gt, d = q.shape
    bk = plan.block_kv_bwd
    whole_q = pl.BlockSpec((None, None, gt, d), lambda i, h, j: (i, h, 0, 0))
    whole_q_row = pl.BlockSpec((None, None, 1, gt), lambda i, h, j: (i, h, 0, 0))
    q_row = pl.BlockSpec((None, 1, plan.t_pad), lambda i, h, j: (i, 0, 0))
    tile = pl.BlockSpec((None, None, bk, d), lambda i, h, j: (i, h, j, 0))
    kv_col = pl.BlockSpec((None, bk, 1), lambda i, h, j: (i, j, 0))
    as_row = lambda x: x.reshape(b, kvh, 1, gt)  # [B,KVH,GT,1] -> [B,KVH,1,GT]: same memory order
    return _call(
        _dkv_kernel, plan, (b, kvh, plan.s_pad // bk),
        [whole_q, tile, tile, whole_q, whole_q_row, whole_q_row, q_row, q_row, kv_col, kv_col], [tile, tile],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        "flash_attention_dkv", d,
    )(q, k, v, d_out, as_row(lse), as_row(delta), tiles.row(q_seg), tiles.row(q_pos), tiles.col(kv_seg),
      tiles.col(kv_pos))
