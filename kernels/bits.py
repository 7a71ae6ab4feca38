"""16-bit KV pages moved as integer bits (installed as `rlvr.kernels.bits`).

Used by the model's page scatters and reads (rlvr.models.transformer) and by the ragged decode
attention (kernels/paged_attention/ragged.py): XLA:CPU gathers and scatters bf16 arrays by
converting the whole operand to f32 and back, which for a KV pool is a full copy per layer and step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_bits(x: jax.Array) -> jax.Array:
    """16-bit floats as uint16 (a free bitcast), other dtypes unchanged: XLA:CPU gathers and
    scatters bf16 by converting the whole operand to f32 and back (a whole KV pool per layer and
    step, ~10x the decode time), integers it moves as they are."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if jnp.dtype(x.dtype).itemsize == 2 else x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Inverse of `as_bits` for an array of `dtype`."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x
