"""Context parallelism for attention over the `sequence` mesh axis: ring and Ulysses attention.

One package for both because they share everything but the communication pattern: the mesh
and shard_map specs, padding and layout (`layout`), the float32 reference and the per-device
block computation that calls the flash kernel (`reference`); `api.attention` picks one by name.
"""

from rlvr.kernels.context_parallel.api import IMPLEMENTATIONS, attention
from rlvr.kernels.context_parallel.layout import sequence_mesh, zigzag_order
from rlvr.kernels.context_parallel.reference import (
    NEG_INF,
    block_attention,
    local_attention,
    reference_attention,
    segment_mask,
)
from rlvr.kernels.context_parallel.ring import ring_attention
from rlvr.kernels.context_parallel.ulysses import kv_head_repeats, ulysses_attention

__all__ = ["IMPLEMENTATIONS", "NEG_INF", "attention", "block_attention", "kv_head_repeats", "local_attention",
           "reference_attention", "ring_attention", "segment_mask", "sequence_mesh", "ulysses_attention",
           "zigzag_order"]
