"""The per-tile maths of the flash-attention kernels, shared by both Pallas layouts (`pallas.py`: a
program walks the whole key sequence in a loop; `pallas_tpu.py`: the key sequence is a grid axis).
Plain jnp on 2-D tiles with float32 accumulation, so it lowers to Mosaic and Triton and interprets."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .common import MASK_VALUE, AttentionSpec, cap, cap_grad

NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b


def dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def col(x):  # [B, T] -> [B, T, 1]
    return x[:, :, None]


def row(x):  # [B, T] -> [B, 1, T]
    return x[:, None, :]


def forward_update(spec: AttentionSpec, q, k, v, mask, carry):
    """One key tile of the online softmax: (running max, denominator, float32 accumulator)."""
    m, denom, acc = carry
    logits = jnp.where(mask, cap(dot(q, k, NT) * spec.scale, spec), MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1, keepdims=True))
    p = jnp.where(mask, jnp.exp(logits - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    acc = alpha * acc + dot(p.astype(v.dtype), v, NN)
    return m_new, alpha * denom + jnp.sum(p, axis=1, keepdims=True), acc


def forward_result(m, denom, acc, out_dtype):
    """(out, lse) from the online softmax's state; acc is 0 for a query that sees no key."""
    seen = denom > 0.0
    denom = jnp.where(seen, denom, 1.0)
    return (acc / denom).astype(out_dtype), jnp.where(seen, m + jnp.log(denom), -jnp.inf)


def forward_init(rows: int, d: int):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))


def dq_update(spec: AttentionSpec, q, k, v, d_out, lse, delta, mask, dq):
    """dq += dS @ k for one key tile (probabilities recomputed from the saved lse)."""
    logits = cap(dot(q, k, NT) * spec.scale, spec)
    p = jnp.exp(jnp.where(mask, logits - lse, MASK_VALUE))
    ds = cap_grad(p * (dot(d_out, v, NT) - delta), logits, spec)
    return dq + dot(ds.astype(k.dtype), k, NN)


def dkv_update(spec: AttentionSpec, q, k, v, d_out, lse_row, delta_row, mask, carry):
    """(dk, dv) += one query tile's share, on transposed tiles: logits^T [bk, bq] = k @ q^T, so
    dv = p^T @ dO and dk = ds^T @ q are plain matmuls."""
    dk, dv = carry
    logits = cap(dot(k, q, NT) * spec.scale, spec)
    p = jnp.exp(jnp.where(mask, logits - lse_row, MASK_VALUE))
    dv = dv + dot(p.astype(d_out.dtype), d_out, NN)
    ds = cap_grad(p * (dot(v, d_out, NT) - delta_row), logits, spec)
    return dk + dot(ds.astype(q.dtype), q, NN), dv
