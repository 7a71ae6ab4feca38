"""The float32 reference: whole-matrix attention in plain jnp, written independently of the kernels
(its own mask, K/V repeated over query heads, no folding, no blocks). Tests and the benchmark
compare every implementation to it. It materialises [B, H, T, S] logits: small inputs only.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def reference_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, causal: bool = True,
                   sliding_window: int = 0) -> jax.Array:
    """Boolean [B, T, S]: key j visible to query i (see `flash_attention` for the rule)."""
    qs, ks = q_segment_ids[:, :, None], kv_segment_ids[:, None, :]
    qp, kp = q_positions[:, :, None], kv_positions[:, None, :]
    mask = (qs == ks) & (ks != 0)
    if causal:
        mask = mask & (kp <= qp)
    if sliding_window:
        mask = mask & (qp - kp < sliding_window)
    return mask


def reference_attention(q, k, v, *, q_segment_ids=None, kv_segment_ids=None, q_positions=None,
                        kv_positions=None, causal: bool = True, sliding_window: int = 0, softcap: float = 0.0,
                        scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """(out [B,T,H,D] in q.dtype, lse [B,H,T] float32; -inf where a query sees no key), all maths in
    float32 at HIGHEST matmul precision. Differentiable; a query that sees no key gets 0 output and
    zero gradients."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    ones_q, ones_k = jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32)
    q_seg = ones_q if q_segment_ids is None else q_segment_ids
    kv_seg = ones_k if kv_segment_ids is None else kv_segment_ids
    q_pos = jnp.broadcast_to(jnp.arange(t), (b, t)) if q_positions is None else q_positions
    kv_pos = jnp.broadcast_to(jnp.arange(s), (b, s)) if kv_positions is None else kv_positions
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    qf = q.astype(jnp.float32)
    kf = jnp.repeat(k.astype(jnp.float32), h // kvh, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), h // kvh, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", qf, kf, precision=HIGHEST) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = reference_mask(q_seg, kv_seg, q_pos, kv_pos, causal=causal, sliding_window=sliding_window)[:, None]
    row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    # exp of -inf (not a where around exp) so masked entries carry no 0 * inf into the gradient.
    probs = jnp.exp(jnp.where(mask, logits - row_max, -jnp.inf))
    total = jnp.sum(probs, axis=-1, keepdims=True)
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    out = jnp.einsum("bhts,bshd->bthd", probs / safe_total, vf, precision=HIGHEST)
    lse = jnp.where(seen, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
    return out.astype(q.dtype), lse
