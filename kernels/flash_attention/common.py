"""What the Pallas kernels and the blockwise XLA path share: the static attention settings, the mask
and soft-cap maths (written with broadcasting only, so it runs inside Mosaic and Triton kernels as
well as in plain XLA), and the GQA head folding.

GQA folding: the G = H / KVH query heads that share a KV head are folded into the query axis,
q [B, T, H, D] -> [B, KVH, G*T, D] (row g*T + t is head kvh*G + g at time t), so every kernel works
on one KV head and k/v are never repeated. This matches `rlvr.models.transformer` (head h reads KV
head h // G).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# A finite stand-in for -inf in running maxima (keeps inf - inf out of the kernels).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The log-sum-exp the backward pass uses for a query that sees no key: exp(s - BIG) == 0.
EMPTY_ROW_LSE = 1e30


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static (hashable) settings of one attention call."""

    causal: bool
    sliding_window: int
    softcap: float
    scale: float

    @property
    def may_skip_blocks(self) -> bool:
        return self.causal or self.sliding_window > 0


def visible(q_seg, q_pos, kv_seg, kv_pos, spec: AttentionSpec):
    """Elementwise (broadcasting) visibility: the mask of `rlvr.models.transformer.attention_mask`."""
    mask = (q_seg == kv_seg) & (kv_seg != 0)
    if spec.causal:
        mask &= kv_pos <= q_pos
    if spec.sliding_window:
        mask &= (q_pos - kv_pos) < spec.sliding_window
    return mask


def tile_may_be_visible(q_lo, q_hi, kv_lo, kv_hi, spec: AttentionSpec):
    """False only when no (query, key) pair of two tiles with these position ranges can be visible."""
    ok = True
    if spec.causal:
        ok = kv_lo <= q_hi
    if spec.sliding_window:
        ok = jnp.logical_and(ok, q_lo - kv_hi < spec.sliding_window)
    return ok


def cap(logits, spec: AttentionSpec):
    """softcap * tanh(logits / softcap) (or the logits unchanged)."""
    if spec.softcap:
        return spec.softcap * jnp.tanh(logits * (1.0 / spec.softcap))
    return logits


def cap_grad(ds, capped, spec: AttentionSpec):
    """Chain rule through `cap`, from its output: d/dx c*tanh(x/c) = 1 - (capped/c)^2."""
    if spec.softcap:
        t = capped * (1.0 / spec.softcap)
        return ds * (1.0 - t * t)
    return ds


def fold_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, T, H, D] -> [B, KVH, G*T, D]."""
    b, t, h, d = q.shape
    g = h // kv_heads
    return q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, d)


def unfold_heads(x: jax.Array, groups: int, t: int) -> jax.Array:
    """[B, KVH, G*Tp, D] -> [B, t, H, D], dropping padded rows (Tp >= t)."""
    b, kvh, gt, d = x.shape
    x = x.reshape(b, kvh, groups, gt // groups, d)[:, :, :, :t]
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, kvh * groups, d)


def unfold_lse(lse: jax.Array, groups: int, t: int) -> jax.Array:
    """[B, KVH, G*Tp] -> [B, H, t]."""
    b, kvh, gt = lse.shape
    return lse.reshape(b, kvh, groups, gt // groups)[:, :, :, :t].reshape(b, kvh * groups, t)


def heads_to_kv_major(x: jax.Array) -> jax.Array:
    """k/v [B, S, KVH, D] -> [B, KVH, S, D]."""
    return x.transpose(0, 2, 1, 3)
