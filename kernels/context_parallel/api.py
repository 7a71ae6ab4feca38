"""Context-parallel attention, chosen at call time: `attention(..., implementation="ring"|"ulysses")`.

    from rlvr.kernels.context_parallel import attention
    out = attention(q, k, v, segment_ids, segment_ids, positions, positions, implementation="ring", mesh=mesh)

Both shard the sequence over the mesh's `sequence` axis inside `jax.shard_map`: ring rotates
key/value blocks (any head count, O(T/n) memory, n-1 neighbour transfers per layer), Ulysses
swaps the sequence split for a head split with all-to-alls (heads must divide over the axis).
"""

from __future__ import annotations

import jax
from rlvr.kernels.context_parallel.ring import ring_attention
from rlvr.kernels.context_parallel.ulysses import ulysses_attention

IMPLEMENTATIONS = {"ring": ring_attention, "ulysses": ulysses_attention}


def attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None, *,
              implementation: str = "ring", **kwargs) -> jax.Array:
    """Dispatches to `ring_attention` or `ulysses_attention` (their keyword arguments pass through)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: use one of {sorted(IMPLEMENTATIONS)}.")
    return IMPLEMENTATIONS[implementation](q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                                           **kwargs)
