"""16-bit KV pages moved as integer bits (installed as `rlvr.kernels.bits`).

Used by the model's page scatters and reads (rlvr.models.transformer) and by the ragged decode
attention (kernels/paged_attention/ragged.py): XLA:CPU gathers and scatters bf16 arrays by
converting the whole operand to f32 and back, which for a KV pool is a full copy per layer and step.

A bf16 pool can also be *stored* as its bits (uint16, `bits_pool`): the rollout engine does so on
CPU, because even the bitcasts around a gather or scatter of a bf16 pool carried through the decode
loop are whole-pool copies on XLA:CPU (four of ~150 MB a step at the realistic shape: half the
bf16 decode time). A uint16 pool always means bf16 values (`kv_float`); `from_bits` reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from rlvr.kernels.target import target_platform


def as_bits(x: jax.Array) -> jax.Array:
    """16-bit floats as uint16 (a free bitcast on CPU), other dtypes (uint16 bits among them)
    unchanged: XLA:CPU gathers and scatters bf16 by converting the whole operand to f32 and back (a
    whole KV pool per layer and step, ~10x the decode time), integers it moves as they are. Only
    when compiling for CPU (`target_platform`): the TPU compiler keeps a bitcast-convert as a real
    op, so the bits view of the pool around each layer's KV write was a pool-sized copy per layer
    in the compiled TPU decode (benchmarks/results/engine_tpu_compile.json); there x is unchanged."""
    if (jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)
            and target_platform() == "cpu"):
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def kv_float(dtype) -> jnp.dtype:
    """The float dtype of a KV pool's values: bfloat16 for a pool stored as uint16 bits, else its own."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.uint16 else jnp.dtype(dtype)


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Inverse of `as_bits` for an array of `dtype` (uint16: a bits pool, read as bfloat16)."""
    dtype = kv_float(dtype)
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def bits_pool(pool: dict) -> dict:
    """A page pool's bf16 arrays stored as their uint16 bits (other arrays unchanged)."""
    return {name: as_bits(a) if a.dtype == jnp.bfloat16 else a for name, a in pool.items()}


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """`jnp.take(table, ids, axis=0)`; a 16-bit float table (a bf16 embedding) is gathered as its
    bits: XLA:CPU converts the whole table to f32 for a bf16 gather (the 32k x 512 embedding: ~7 %
    of a bf16 decode call). Differentiable in `table` (the gradient is the usual scatter-add)."""
    if jnp.dtype(table.dtype).itemsize != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
        return jnp.take(table, ids, axis=0)
    return _take_bits(table, ids)


@jax.custom_vjp
def _take_bits(table, ids):
    return from_bits(jnp.take(as_bits(table), ids, axis=0), table.dtype)


def _take_bits_fwd(table, ids):
    return _take_bits(table, ids), (ids, table)  # the table only for its shape and dtype (a parameter, alive anyway)


def _take_bits_bwd(saved, grad):
    ids, table = saved
    return jnp.zeros(table.shape, jnp.float32).at[ids].add(grad.astype(jnp.float32)).astype(table.dtype), None


_take_bits.defvjp(_take_bits_fwd, _take_bits_bwd)
