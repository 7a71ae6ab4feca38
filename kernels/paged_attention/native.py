"""Paged decode attention as a native XLA:CPU custom call (the "native" implementation).

What: `native_paged_attention(q, k_pages, v_pages, page_table, lengths, ...)`, the same contract as
`paged_attention_reference` (any number of queries per row, GQA, sliding window, softcap; pools of
float32, bfloat16 or bf16 bits), computed by `native.cc` through XLA's FFI.
Why: on XLA:CPU the plain-jnp decode attention ("ragged") ran at 4.4-5.7 ms per layer and step on
the realistic rollout shape against ~0.8 ms to stream its keys and values once (a third of the
decode time): small products, gathers and a short-axis softmax are what XLA:CPU emits slowest. The
C++ kernel reads each row's pages in place with an online softmax, on XLA's intra-op threads.
The engine's prefill chunks use it too where its decode does (`transformer._native_prefill_attention`:
the realistic shape's prefill calls 1.3x faster than with XLA's blocked loop, the fixed one's 1.05x).
How: the source is compiled on first use with the host's C++ compiler and registered as the FFI
target `rlvr_paged_attention` for the CPU platform (`rlvr.kernels.native_build`: `$CXX`, default
g++, `-O3 -march=native`, ~4 s, cached in `$RLVR_KERNEL_CACHE`, default ~/.cache/rlvr/kernels).
`native_unavailable_reason()` says why it cannot run (not a CPU backend, no compiler, a failed
build: the compiler's message), else None; `paged_attention` then falls back to plain XLA.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from rlvr.kernels import native_build

SOURCE = Path(__file__).with_name("native.cc")
TARGET = "rlvr_paged_attention"


class NativeDecode(NamedTuple):
    """Passed as `paged_attention(..., ragged=NativeDecode())` (and so through the model's decode
    cache): decode with the native kernel, which reads the page table itself (no host-built page
    list). A pytree without leaves: the choice is part of the traced program's structure."""


def native_unavailable_reason() -> str | None:
    """Why the native kernel cannot run on the default backend (None if it can); builds and
    registers it on the first call (`rlvr.kernels.native_build`)."""
    return native_build.unavailable_reason(SOURCE, "RlvrPagedAttention", TARGET, "the native paged-attention kernel")


def native_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, *, layer=None, sliding_window: int = 0, softcap: float = 0.0,
                           scale: float | None = None) -> jax.Array:
    """q [B, Q, H, D]; pools [N, P, KVH, D] or [L, N, P, KVH, D] (+ `layer`); page_table [B, R];
    lengths [B]: one past each row's last query (query i at lengths - Q + i); keys are read up to
    R·P, so lengths past it (`paged_attention` clips them; a prefill chunk's padded end does not)
    place the queries without reading past the table. Returns [B, Q, H, D] in q's dtype."""
    reason = native_unavailable_reason()
    if reason:
        raise RuntimeError(f"paged_attention: implementation='native' cannot run: {reason}.")
    if k_pages.ndim == 4:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    out = call(q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32), lengths.astype(jnp.int32),
               jnp.asarray(layer, jnp.int32).reshape(1), sliding_window=np.int64(sliding_window),
               softcap=np.float32(softcap), scale=np.float32(scale))
    return out.astype(q.dtype)
