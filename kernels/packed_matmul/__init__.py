"""A float32 matmul with weights packed once into column panels, as a native XLA:CPU custom call.

What: `pack_weight(w)` turns a [K, N] weight into panels [ceil(N/32), K, 32] (zero past N);
`packed_matmul(x, packed, n)` is `x @ w` from them ([..., K] -> [..., N], float32), computed by
`native.cc` through XLA's FFI; `packed_swiglu(x, packed, i)` is a SwiGLU MLP's hidden layer
silu(x @ w[:, :i]) * (x @ w[:, i:]) from one packed [K, 2i] weight (the engine's `gate_up_proj`),
combined before it leaves the kernel; `unpack_weight`, `packed_matmul_reference` and
`packed_swiglu_reference` are the plain-XLA inverse and references.
Why: in the rollout engine's decode loop XLA:CPU's matmul re-packs every weight at every step (a
pass over the weights with no arithmetic in it, which does not overlap the products), so the
decode's products ran at ~0.55-0.7 of the machine's FMA rate. The engine packs its decode weights
once per weight load (`rlvr.models.transformer.pack_projections`) and `Linear` multiplies through
this kernel when its params hold `kernel_packed`.
How: built on first use (`native_unavailable_reason`, `rlvr.kernels.native_build`: the host's C++
compiler, cached).
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from rlvr.kernels import native_build

SOURCE = Path(__file__).with_name("native.cc")
TARGET = "rlvr_packed_matmul"
SWIGLU_TARGET = "rlvr_packed_swiglu"
PANEL = 32  # output columns per panel (native.cc's kCols)


def native_unavailable_reason() -> str | None:
    """Why the packed matmul cannot run natively on the default backend (None if it can); builds
    and registers it on the first call (`rlvr.kernels.native_build`)."""
    return native_build.unavailable_reason(SOURCE, "RlvrPackedMatmul", TARGET, "the native packed matmul")


def pack_weight(w: jax.Array) -> jax.Array:
    """[K, N] -> float32 panels [ceil(N/32), K, 32]: packed[p, k, j] = w[k, 32 p + j], zero past N."""
    k, n = w.shape
    panels = -(-n // PANEL)
    w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, panels * PANEL - n)))
    return w.reshape(k, panels, PANEL).transpose(1, 0, 2)


def unpack_weight(packed: jax.Array, n: int) -> jax.Array:
    """`pack_weight`'s inverse: [K, n]."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 0, 2).reshape(k, panels * PANEL)[:, :n]


def packed_matmul_reference(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """x [..., K] @ the unpacked weight in plain XLA, float32."""
    return x.astype(jnp.float32) @ unpack_weight(packed, n)


def packed_matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
    """x [..., K] @ w, w given as `pack_weight(w)` with n columns; float32 [..., n]. Runs the native
    kernel where it builds (XLA:CPU), else `packed_matmul_reference`."""
    if packed.ndim != 3 or packed.shape[2] != PANEL or packed.shape[1] != x.shape[-1] or \
            not (packed.shape[0] - 1) * PANEL < n <= packed.shape[0] * PANEL:
        raise ValueError(f"packed_matmul: x {x.shape} and packed {packed.shape} for n={n}: expected packed "
                         f"[ceil(n/{PANEL}), x.shape[-1], {PANEL}] (pack_weight of a [K, n] weight)")
    if native_unavailable_reason() is not None:
        return packed_matmul_reference(x, packed, n)
    return _native_call(TARGET, x, packed, n)


def _native_call(target: str, x: jax.Array, packed: jax.Array, width: int) -> jax.Array:
    """The custom call `target` on x as rows [M, K] and the panels: float32 [..., width]."""
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x2.shape[0], width), jnp.float32), vmap_method="sequential")
    return call(x2, packed.astype(jnp.float32)).reshape(*x.shape[:-1], width)


def swiglu_unavailable_reason() -> str | None:
    """Why `packed_swiglu` cannot run natively here (None if it can); see `native_unavailable_reason`."""
    return native_build.unavailable_reason(SOURCE, "RlvrPackedSwiglu", SWIGLU_TARGET, "the native packed SwiGLU")


def packed_swiglu_reference(x: jax.Array, packed: jax.Array, i: int) -> jax.Array:
    """silu(gate) * up of x [..., K] @ the unpacked [K, 2i] weight in plain XLA, float32."""
    y = packed_matmul_reference(x, packed, 2 * i)
    return jax.nn.silu(y[..., :i]) * y[..., i:]


def packed_swiglu(x: jax.Array, packed: jax.Array, i: int) -> jax.Array:
    """silu(x @ w[:, :i]) * (x @ w[:, i:]) for w [K, 2i] given as `pack_weight(w)`, i a multiple of
    32 (gate and up columns in whole panels); float32 [..., i]. Runs the native kernel where it
    builds (XLA:CPU), else `packed_swiglu_reference`."""
    if packed.ndim != 3 or packed.shape[2] != PANEL or packed.shape[1] != x.shape[-1] or i % PANEL or \
            packed.shape[0] * PANEL != 2 * i:
        raise ValueError(f"packed_swiglu: x {x.shape} and packed {packed.shape} for i={i}: expected i a multiple "
                         f"of {PANEL} and packed [2i/{PANEL}, x.shape[-1], {PANEL}] (pack_weight of a [K, 2i] weight)")
    if swiglu_unavailable_reason() is not None:
        return packed_swiglu_reference(x, packed, i)
    return _native_call(SWIGLU_TARGET, x, packed, i)
