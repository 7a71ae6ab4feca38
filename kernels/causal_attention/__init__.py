"""The training path's causal attention as native XLA:CPU custom calls (forward and backward).

What: `native_causal_attention(q, k, v, mask)`: softmax(q·kᵀ/√D) v over the keys each query may see,
q [B, T, H, D], k/v [B, T, KVH, D] (GQA), mask [B, 1, 1, T, T] in token order (no key after its
query: `rlvr.models.transformer.in_token_order`), float32; differentiable (a custom VJP whose backward
is the second kernel). `native_unavailable_reason()` says why it cannot run (None if it can).
Why: XLA:CPU runs the plain-jnp attention as small products, masks, softmaxes, transposes and pads
well below the machine's multiply-add rate; the train step's attention is one of the few parts of
the step that is not a large matmul (`benchmarks/attention.py`, `benchmarks/train_step.py`).
How: `native.cc`, built on first use with the host's C++ compiler (`rlvr.kernels.native_build`).
A query that sees no key (padding) gets a zero output and zero gradients; the plain-jnp path gives
it the mean of the values instead, which nothing downstream reads.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from rlvr.kernels import native_build

SOURCE = Path(__file__).with_name("native.cc")
FORWARD, BACKWARD = "rlvr_causal_attention_fwd", "rlvr_causal_attention_bwd"


def native_unavailable_reason() -> str | None:
    """Why the kernels cannot run on the default backend (None if they can); builds and registers
    both on the first call."""
    return (native_build.unavailable_reason(SOURCE, "RlvrCausalAttentionFwd", FORWARD, "the native causal attention")
            or native_build.unavailable_reason(SOURCE, "RlvrCausalAttentionBwd", BACKWARD,
                                               "the native causal attention's backward"))


def supports(q: jax.Array, k: jax.Array) -> bool:
    """Whether the kernels take these shapes and dtypes: float32, self-attention (as many keys as
    queries), a head dim that is a multiple of 8, whole GQA groups."""
    return (q.dtype == jnp.float32 and k.dtype == jnp.float32 and q.ndim == 4 and q.shape[:2] == k.shape[:2]
            and q.shape[3] == k.shape[3] and q.shape[3] % 8 == 0 and q.shape[2] % k.shape[2] == 0)


def _scale(q) -> np.float32:
    return np.float32(1.0 / math.sqrt(q.shape[-1]))


def _tables(q, cos, sin):
    """The RoPE tables as the kernels take them: [B, T, D] float32, or empty ones (no rotation)."""
    if cos is None:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32)
    shape = q.shape[:2] + q.shape[3:]
    return jnp.broadcast_to(cos, shape).astype(jnp.float32), jnp.broadcast_to(sin, shape).astype(jnp.float32)


def _forward_call(q, k, v, mask, cos, sin):
    b, t, h, _ = q.shape
    call = jax.ffi.ffi_call(FORWARD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                      jax.ShapeDtypeStruct((b, h, t), jnp.float32)), vmap_method="sequential")
    return call(q, k, v, mask, cos, sin, scale=_scale(q), rope=np.bool_(cos.size > 0))


@jax.custom_vjp
def _attention(q, k, v, mask, cos, sin):
    return _forward_call(q, k, v, mask, cos, sin)[0]


def _attention_fwd(q, k, v, mask, cos, sin):
    out, lse = _forward_call(q, k, v, mask, cos, sin)
    return out, (q, k, v, mask, cos, sin, out, lse)


def _attention_bwd(residuals, dout):
    q, k, v, mask, cos, sin, out, lse = residuals
    call = jax.ffi.ffi_call(BACKWARD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                       jax.ShapeDtypeStruct(k.shape, jnp.float32),
                                       jax.ShapeDtypeStruct(v.shape, jnp.float32)), vmap_method="sequential")
    dq, dk, dv = call(q, k, v, mask, cos, sin, out, lse, dout.astype(jnp.float32), scale=_scale(q),
                      rope=np.bool_(cos.size > 0))
    # The tables are position functions, not trained: no gradient flows to them.
    return dq, dk, dv, None, jnp.zeros_like(cos), jnp.zeros_like(sin)


_attention.defvjp(_attention_fwd, _attention_bwd)


def native_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, cos: jax.Array | None = None,
                            sin: jax.Array | None = None) -> jax.Array:
    """q [B, T, H, D], k/v [B, T, KVH, D] float32, mask bool [B, 1, 1, T, T] (or [B, T, T]) in token
    order -> [B, T, H, D] float32 (`supports`; raises where `native_unavailable_reason` says why not).
    With `cos`/`sin` ([B, T, D], `rlvr.models.transformer.rope_tables`), q and k come unrotated and the
    kernels apply HF's rotate-half RoPE (`rlvr.models.layers.apply_rope`) and its transpose themselves."""
    reason = native_unavailable_reason()
    if reason:
        raise RuntimeError(f"native causal attention cannot run: {reason}.")
    if not supports(q, k):
        raise ValueError(f"native causal attention takes float32 self-attention with D % 8 == 0 and whole GQA "
                         f"groups; got q {q.shape} {q.dtype}, k {k.shape} {k.dtype}")
    b, t = q.shape[:2]
    return _attention(q, k, v, mask.reshape(b, t, t).astype(jnp.uint8), *_tables(q, cos, sin))
