"""Ulysses (all-to-all) attention: context parallelism by trading the sequence split for a head split.

Inside `jax.shard_map` over the `sequence` axis (n devices), each device holds T/n positions of
all its heads. One all-to-all per q, k, v gives every device the full sequence for H/n heads;
it attends locally (`reference.local_attention`: the flash kernel when installed), and one
all-to-all takes the output back to T/n positions of all heads. Segment ids and positions are
all-gathered (they are [B, T] integers). Communication is 4 all-to-alls of activations per layer
regardless of n, but the head count bounds n: heads must divide over the sequence axis.

GQA: when the KV heads do not divide over n (e.g. 2 KV heads, n = 4), each KV head is repeated r
times (the smallest r with KVH·r divisible by n), which keeps every query head with its own KV
head; only the query heads must divide over n (an error naming the sizes otherwise).
Backward: a custom VJP (see `ulysses_attention`).
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec as P
from rlvr.kernels.context_parallel import layout
from rlvr.kernels.context_parallel.reference import local_attention


def kv_head_repeats(heads: int, kv_heads: int, n: int, axis_name: str = "sequence") -> int:
    """How many times each KV head is repeated so that the KV heads split over n devices: the
    smallest r with n | KVH·r, i.e. n / gcd(KVH, n). It divides the group size H/KVH whenever n | H,
    so every device's query heads find their KV heads on the same device."""
    if heads % n:
        raise ValueError(f"ulysses attention splits query heads over the {axis_name!r} axis: {heads} heads (per "
                         f"head shard) are not divisible by its size {n}. Use a {axis_name!r} axis that divides the "
                         "heads, or ring attention.")
    return n // math.gcd(kv_heads, n)


def _ulysses_fns(axis_name: str, repeats: int, attend):
    """The per-device (forward, backward) functions run inside shard_map."""
    to_heads = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=2, concat_axis=1, tiled=True)
    to_sequence = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=1, concat_axis=2,
                                    tiled=True)
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)

    def forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        """(out, sequence-split; (q, k, v) head-split, the residuals of the backward pass)."""
        if repeats > 1:
            k, v = (x.repeat(repeats, axis=2) for x in (k, v))
        heads = to_heads(q), to_heads(k), to_heads(v)
        out, _ = attend(*heads, *(gather(x) for x in (q_seg, kv_seg, q_pos, kv_pos)))
        return to_sequence(out.astype(q.dtype)), heads

    def backward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, dout):
        """(dq, dk, dv) sequence-split, from the head-split q, k, v and the output cotangent."""
        ids = tuple(gather(x) for x in (q_seg, kv_seg, q_pos, kv_pos))
        out, vjp = jax.vjp(lambda a, b, c: attend(a, b, c, *ids)[0], q, k, v)
        dq, dk, dv = (to_sequence(g) for g in vjp(to_heads(dout).astype(out.dtype)))
        if repeats > 1:  # each KV head's gradient is the sum over its copies
            dk, dv = (x.reshape(*x.shape[:2], -1, repeats, x.shape[3]).sum(axis=3) for x in (dk, dv))
        return dq, dk, dv

    return forward, backward


def ulysses_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None, *,
                      causal: bool = True, sliding_window: int = 0, softcap: float = 0.0,
                      scale: float | None = None, mesh=None, axis_name: str = "sequence",
                      implementation: str = "auto", batch_axes=None, head_axes=None) -> jax.Array:
    """Self-attention with the sequence sharded over `axis_name`: out [B,T,H,D] in q's dtype.

    q [B,T,H,D], k/v [B,T,KVH,D], segment ids / positions [B,T] (default: one segment, 0..T-1),
    in sequence order (any order works: the mask comes from positions and segment ids). A length
    that does not divide over the axis is padded with segment id 0 and cut off again.

    Differentiable by a custom VJP outside the shard_maps: the backward pass keeps the head-split
    q, k, v, re-runs the local attention under `jax.vjp` (as a flash backward pass recomputes
    the probabilities) and sends the gradients back with all-to-alls."""
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"ulysses attention is self-attention: q has {q.shape[1]} positions, k/v {k.shape[1]}.")
    mesh = layout.require_sequence_mesh(mesh, axis_name, "ulysses_attention")
    n = mesh.shape[axis_name]
    qkv_spec, ids_spec, head_shards = layout.specs(mesh, axis_name, q.shape[0], q.shape[2], k.shape[2],
                                                   batch_axes, head_axes)
    repeats = kv_head_repeats(q.shape[2] // head_shards, k.shape[2] // head_shards, n, axis_name)
    length = q.shape[1]
    padded = layout.padded_length(length, n)
    ids = layout.defaults(q, k, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    arrays = [layout.pad_length(x, padded) for x in (q, k, v, *ids)]
    attend = functools.partial(local_attention, causal=causal, sliding_window=sliding_window, softcap=softcap,
                               scale=scale, implementation=implementation)
    head_axes_used = () if qkv_spec[2] is None else (qkv_spec[2],) if isinstance(qkv_spec[2], str) else qkv_spec[2]
    split = (*head_axes_used, axis_name)
    head_spec = P(qkv_spec[0], None, split[0] if len(split) == 1 else split, None)
    forward, backward = _ulysses_fns(axis_name, repeats, attend)
    smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    inputs = (qkv_spec,) * 3 + (ids_spec,) * 4
    # jax.checkpoint: see ring._sharded_ring (keeps an enclosing layer scan from hoisting the masks).
    forward = jax.checkpoint(smap(forward, in_specs=inputs, out_specs=(qkv_spec, (head_spec,) * 3)))
    backward = smap(backward, in_specs=(head_spec,) * 3 + (ids_spec,) * 4 + (qkv_spec,),
                    out_specs=(qkv_spec,) * 3)

    @jax.custom_vjp
    def ulysses(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        return forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos)[0]

    def ulysses_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos):
        out, heads = forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos)
        return out, (*heads, q_seg, kv_seg, q_pos, kv_pos)

    def ulysses_bwd(residuals, dout):
        return (*backward(*residuals, dout), None, None, None, None)

    ulysses.defvjp(ulysses_fwd, ulysses_bwd)
    return ulysses(*arrays)[:, :length]
