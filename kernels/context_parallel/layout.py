"""Where context-parallel attention runs: the mesh, the shard_map specs, and the zig-zag layout.

The mesh is the one passed in, else the one `rlvr.sharding.activation_sharding` holds while
the train step is traced, else the one `jax.set_mesh` installed. Attention is independent
across batch rows and heads, so those dimensions shard over the mesh's batch axes
(default `data`, `fsdp`) and head axes (default `tensor`) where they divide them; the length
dimension shards over the sequence axis. Axes that do not divide are left replicated.

Zig-zag layout (causal load balancing): the sequence is cut into 2n chunks and device r holds
chunks r and 2n-1-r, so under a causal mask every device has the same number of visible
(query, key) pairs — with a contiguous layout the last device would do n times the work of the
first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
HEAD_AXES = ("tensor",)


def sequence_mesh(mesh=None, axis_name: str = "sequence"):
    """The mesh to run on when its `axis_name` axis has size > 1, else None."""
    if mesh is None:
        from rlvr import sharding

        mesh = sharding.active_mesh()
    if mesh is None:
        abstract = jax.sharding.get_abstract_mesh()
        mesh = None if abstract.empty else abstract
    if mesh is None or axis_name not in mesh.axis_names or mesh.shape[axis_name] == 1:
        return None
    return mesh


def require_sequence_mesh(mesh, axis_name: str, what: str):
    found = sequence_mesh(mesh, axis_name)
    if found is None:
        shape = None if mesh is None else dict(mesh.shape)
        raise ValueError(
            f"{what} needs a mesh with a {axis_name!r} axis of size > 1 (pass mesh=, or call it inside "
            f"rlvr.sharding.activation_sharding(mesh) or jax.set_mesh(mesh)); got mesh {shape}.")
    return found


def dividing_axes(mesh, candidates: Sequence[str], *sizes: int) -> tuple[str, ...]:
    """The candidate mesh axes (size > 1) whose product divides every one of `sizes`."""
    chosen: list[str] = []
    for axis in candidates:
        if axis not in mesh.axis_names or mesh.shape[axis] == 1:
            continue
        product = math.prod(mesh.shape[a] for a in chosen) * mesh.shape[axis]
        if all(size % product == 0 for size in sizes):
            chosen.append(axis)
    return tuple(chosen)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def specs(mesh, axis_name: str, batch: int, heads: int, kv_heads: int,
          batch_axes: Sequence[str] | None = None, head_axes: Sequence[str] | None = None):
    """(spec of [B,T,H,D] arrays, spec of [B,T] arrays, local head-shard count)."""
    b_axes = dividing_axes(mesh, BATCH_AXES if batch_axes is None else batch_axes, batch)
    h_axes = dividing_axes(mesh, HEAD_AXES if head_axes is None else head_axes, heads, kv_heads)
    b_axes = tuple(a for a in b_axes if a != axis_name)
    h_axes = tuple(a for a in h_axes if a != axis_name and a not in b_axes)
    heads_split = math.prod(mesh.shape[a] for a in h_axes)
    return (P(_entry(b_axes), axis_name, _entry(h_axes), None), P(_entry(b_axes), axis_name), heads_split)


def zigzag_order(length: int, n: int) -> np.ndarray:
    """Indices taking a contiguous sequence of `length` (a multiple of 2n) to the zig-zag layout."""
    if length % (2 * n):
        raise ValueError(f"zig-zag layout needs a length divisible by 2×{n}, got {length}.")
    chunk = length // (2 * n)
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for r in range(n) for c in (r, 2 * n - 1 - r)])


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def pad_length(x: jax.Array, length: int, axis: int = 1) -> jax.Array:
    """Zero-pads `axis` of x to `length` (segment id 0 marks the pad as invisible)."""
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def defaults(q, k, q_segment_ids, kv_segment_ids, q_positions, kv_positions):
    """Fills unset segment ids (all 1) and positions (0..T-1) for self-attention inputs."""
    b, t = q.shape[:2]
    s = k.shape[1]
    if q_segment_ids is None:
        q_segment_ids = jnp.ones((b, t), jnp.int32)
    if kv_segment_ids is None:
        kv_segment_ids = jnp.ones((b, s), jnp.int32)
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    return q_segment_ids, kv_segment_ids, q_positions, kv_positions
