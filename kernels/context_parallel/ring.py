"""Ring attention: context parallelism by rotating key/value blocks around the sequence axis.

Inside `jax.shard_map` over the `sequence` mesh axis (n devices) each device keeps its queries
and passes its key/value block (with the block's segment ids and positions) to the next device
with `jax.lax.ppermute`, n-1 times. Every step attends the local queries to the visiting block
(`reference.local_attention`: the flash kernel when installed) and merges the result into a
running (output, log-sum-exp) with an online softmax in float32. The next block's transfer is
issued before the current block's compute, so the two can overlap.

Causal load balancing: the sequence is laid out zig-zag (device r holds chunks r and 2n-1-r of
2n). Then at every step after the first, a visiting block either precedes both local query
chunks in its first half and follows them in its second (block from a lower device: attend all
queries to its first half), or it is seen only by the second local query chunk (block from a
higher device: attend that chunk to all of it) — half a block's work on every device and step.
This skipping assumes what packed batches guarantee: a key visible to a query is not to its
right in the contiguous sequence (positions increase within a segment). The full mask from
segment ids and positions is still applied inside every block.

Backward: a custom VJP that runs the ring again. Each step recomputes its block's (out, lse)
under `jax.vjp` and feeds it the cotangents of the final softmax merge (dO_i = w_i dO,
dlse_i = w_i <dO, O_i - O>, w_i = exp(lse_i - LSE)); dq accumulates in place while dk/dv
accumulators travel around the ring with their key/value block and arrive home after n shifts.
Saved per device: q, k, v, the output and the log-sum-exp — O(T/n) memory, no per-step residuals.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from rlvr.kernels.context_parallel import layout
from rlvr.kernels.context_parallel.reference import NEG_INF, local_attention

LAYOUTS = ("contiguous", "zigzag")


def merge(out, lse, block_out, block_lse):
    """Online-softmax merge of two partial attentions: out [B,T,H,D] f32, lse [B,H,T] f32."""
    new = jnp.logaddexp(lse, block_lse)
    weight = lambda x: jnp.exp(x - new).transpose(0, 2, 1)[..., None]
    return out * weight(lse) + block_out * weight(block_lse), new


def _pad_rows(x, before: int, axis: int, value=0.0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (before, 0)
    return jnp.pad(x, widths, constant_values=value)


def _pad_rows_after(x, after: int, axis: int):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, after)
    return jnp.pad(x, widths)


def _ring_fns(axis_name: str, n: int, balanced: bool, attend):
    """The per-device ring: (forward, backward) functions run inside shard_map."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    shift = functools.partial(jax.lax.ppermute, axis_name=axis_name, perm=perm)

    def block_out(qs, kv, src, me, diagonal: bool):
        q, q_seg, q_pos = qs
        k, v, kv_seg, kv_pos = kv
        if diagonal or not balanced:
            return attend(q, k, v, q_seg, kv_seg, q_pos, kv_pos)
        half = q.shape[1] // 2

        def earlier():  # block from a lower device: its first chunk is visible to all local queries
            return attend(q, k[:, :half], v[:, :half], q_seg, kv_seg[:, :half], q_pos, kv_pos[:, :half])

        def later():  # block from a higher device: only the second local query chunk sees it
            o, lse = attend(q[:, half:], k, v, q_seg[:, half:], kv_seg, q_pos[:, half:], kv_pos)
            return _pad_rows(o, half, 1), _pad_rows(lse, half, 2, NEG_INF)

        return jax.lax.cond(src < me, earlier, later)

    def block_grads(qs, kv, res, src, me, diagonal: bool):
        q, q_seg, q_pos = qs
        k, v, kv_seg, kv_pos = kv
        out, lse, dout = res

        def grads(q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, dout):
            (o, lse_i), vjp = jax.vjp(lambda a, b, c: attend(a, b, c, q_seg, kv_seg, q_pos, kv_pos), q, k, v)
            w = jnp.exp(lse_i - lse)  # [B,H,T]: this block's share of each row's softmax
            d_out = w.transpose(0, 2, 1)[..., None] * dout
            d_lse = w * jnp.sum(dout * (o - out), axis=-1).transpose(0, 2, 1)
            return tuple(g.astype(jnp.float32) for g in vjp((d_out, d_lse)))

        if diagonal or not balanced:
            return grads(q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, dout)
        half = q.shape[1] // 2

        def earlier():
            dq, dk, dv = grads(q, k[:, :half], v[:, :half], q_seg, kv_seg[:, :half], q_pos, kv_pos[:, :half],
                               out, lse, dout)
            return dq, _pad_rows_after(dk, half, 1), _pad_rows_after(dv, half, 1)

        def later():
            h = slice(half, None)
            dq, dk, dv = grads(q[:, h], k, v, q_seg[:, h], kv_seg, q_pos[:, h], kv_pos, out[:, h], lse[:, :, h],
                               dout[:, h])
            return _pad_rows(dq, half, 1), dk, dv

        return jax.lax.cond(src < me, earlier, later)

    def forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        """(out [B,T,H,D] f32, lse [B,H,T] f32) of the local queries over the whole ring."""
        me = jax.lax.axis_index(axis_name)
        qs, kv = (q, q_seg, q_pos), (k, v, kv_seg, kv_pos)
        visiting = shift(kv)  # in flight while the diagonal block is computed
        out, lse = block_out(qs, kv, me, me, diagonal=True)

        def step(carry, s):
            out, lse, kv = carry
            following = shift(kv)
            out, lse = merge(out, lse, *block_out(qs, kv, (me - s) % n, me, diagonal=False))
            return (out, lse, following), None

        if n > 2:
            (out, lse, visiting), _ = jax.lax.scan(step, (out, lse, visiting), jnp.arange(1, n - 1))
        return merge(out, lse, *block_out(qs, visiting, (me - (n - 1)) % n, me, diagonal=False))

    def backward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse, dout):
        """(dq, dk, dv) of the local blocks, given the forward's out and lse and the output cotangent."""
        me = jax.lax.axis_index(axis_name)
        qs, kv, res = (q, q_seg, q_pos), (k, v, kv_seg, kv_pos), (out, lse, dout.astype(jnp.float32))
        visiting = shift(kv)
        dq, dk, dv = block_grads(qs, kv, res, me, me, diagonal=True)

        def step(carry, s):
            dq, kv, dkv = carry
            following = shift(kv)
            dkv = shift(dkv)  # the accumulator of the block this device now holds
            gq, gk, gv = block_grads(qs, kv, res, (me - s) % n, me, diagonal=False)
            return (dq + gq, following, (dkv[0] + gk, dkv[1] + gv)), None

        dkv = (dk, dv)
        if n > 2:
            (dq, visiting, dkv), _ = jax.lax.scan(step, (dq, visiting, dkv), jnp.arange(1, n - 1))
        dk, dv = shift(dkv)
        gq, gk, gv = block_grads(qs, visiting, res, (me - (n - 1)) % n, me, diagonal=False)
        dk, dv = shift((dk + gk, dv + gv))  # home: n shifts in all
        return (dq + gq).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    return forward, backward


def _sharded_ring(mesh, axis_name: str, n: int, balanced: bool, attend, qkv_spec, ids_spec, lse_spec):
    """The ring as a custom-VJP function of global arrays. The custom VJP sits outside the two
    shard_maps (forward, backward), so autodiff never traces into the ring loop."""
    forward, backward = _ring_fns(axis_name, n, balanced, attend)
    smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    inputs = (qkv_spec,) * 3 + (ids_spec,) * 4
    # Under jax.checkpoint: differentiating an enclosing layer scan would otherwise hoist the parts of
    # the ring that do not depend on the scan carry (masks from the ids, constants of every ring step)
    # out of the scan, materialised for all steps at once.
    forward = jax.checkpoint(smap(forward, in_specs=inputs, out_specs=(qkv_spec, lse_spec)))
    backward = smap(backward, in_specs=inputs + (qkv_spec, lse_spec, qkv_spec), out_specs=(qkv_spec,) * 3)

    @jax.custom_vjp
    def ring(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        return forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos)[0].astype(q.dtype)

    def ring_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        out, lse = forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos)
        return out.astype(q.dtype), (q, k, v, q_seg, kv_seg, q_pos, kv_pos, out, lse)

    def ring_bwd(residuals, dout):
        return (*backward(*residuals, dout), None, None, None, None)

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


def ring_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None, *,
                   causal: bool = True, sliding_window: int = 0, softcap: float = 0.0, scale: float | None = None,
                   mesh=None, axis_name: str = "sequence", layout_of_inputs: str = "contiguous",
                   implementation: str = "auto", batch_axes=None, head_axes=None) -> jax.Array:
    """Self-attention with the sequence sharded over `axis_name`: out [B,T,H,D] in q's dtype.

    q [B,T,H,D], k/v [B,T,KVH,D], segment ids / positions [B,T] (default: one segment, 0..T-1).
    `layout_of_inputs="contiguous"`: the arrays are in sequence order; they are padded (segment 0)
    to a multiple of 2n, permuted to the zig-zag layout and back here. `"zigzag"`: the caller has
    laid the sequence out zig-zag already (`layout.zigzag_order`, length a multiple of 2n) — the
    transformer does this once per forward pass instead of per layer. Differentiable (custom VJP).
    """
    if layout_of_inputs not in LAYOUTS:
        raise ValueError(f"layout_of_inputs={layout_of_inputs!r}: use one of {LAYOUTS}.")
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ring attention is self-attention: q has {q.shape[1]} positions, k/v {k.shape[1]}.")
    mesh = layout.require_sequence_mesh(mesh, axis_name, "ring_attention")
    n = mesh.shape[axis_name]
    ids = layout.defaults(q, k, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    length = q.shape[1]
    multiple = 2 * n if causal else n
    if layout_of_inputs == "zigzag":
        if length % (2 * n):
            raise ValueError(f"layout_of_inputs='zigzag' needs a length divisible by 2×{n}, got {length}.")
        padded, order = length, None
    else:
        padded = layout.padded_length(length, multiple)
        order = layout.zigzag_order(padded, n) if causal else None
    arrays = [layout.pad_length(x, padded) for x in (q, k, v, *ids)]
    if order is not None:
        arrays = [jnp.take(x, order, axis=1) for x in arrays]
    attend = functools.partial(local_attention, causal=causal, sliding_window=sliding_window, softcap=softcap,
                               scale=scale, implementation=implementation)
    qkv_spec, ids_spec, _ = layout.specs(mesh, axis_name, q.shape[0], q.shape[2], k.shape[2], batch_axes, head_axes)
    lse_spec = P(qkv_spec[0], qkv_spec[2], axis_name)
    ring = _sharded_ring(mesh, axis_name, n, causal, attend, qkv_spec, ids_spec, lse_spec)
    out = ring(*arrays)
    if order is not None:
        out = jnp.take(out, np.argsort(order), axis=1)
    return out[:, :length]
