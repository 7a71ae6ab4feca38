"""Float32 references and the per-device block computation shared by ring and Ulysses attention.

The mask is the one of `rlvr.models.transformer.attention_mask`, stated by segment ids and
positions instead of a dense matrix: query i sees key j iff they share a segment, the key is not
padding (segment 0), `kv_pos <= q_pos` when causal, and `q_pos - kv_pos < sliding_window` when
a window is set. Fully masked query rows (padding) give output 0 and log-sum-exp `NEG_INF`.

`local_attention` is the block a device computes on its own data: (out, lse) in float32, from
the flash kernel (`rlvr.kernels.flash_attention`) when it is installed, else from the plain-jnp
`block_attention` below (same mask, same outputs). Ring attention merges these blocks with an
online softmax; Ulysses attention calls it once on the full sequence.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp

# A finite stand-in for -inf as the log-sum-exp of a fully masked row: the online-softmax merge
# stays NaN-free (exp(NEG_INF - NEG_INF) is 1, and such rows carry output 0).
NEG_INF = -1e30

_log = logging.getLogger(__name__)
IMPLEMENTATIONS = ("auto", "flash", "reference")


def segment_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, *, causal: bool = True,
                 sliding_window: int = 0) -> jax.Array:
    """Boolean [B, T, S]: which keys each query sees."""
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    mask &= kv_segment_ids[:, None, :] != 0
    if causal:
        mask &= kv_positions[:, None, :] <= q_positions[:, :, None]
    if sliding_window:
        mask &= (q_positions[:, :, None] - kv_positions[:, None, :]) < sliding_window
    return mask


def block_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *,
                    causal: bool = True, sliding_window: int = 0, softcap: float = 0.0,
                    scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Dense GQA attention of one block in float32: (out [B,T,H,D] f32, lse [B,H,T] f32).

    q [B,T,H,D], k/v [B,S,KVH,D]; the H/KVH query heads of a group share a KV head."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.astype(jnp.float32).reshape(b, t, kvh, g, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = segment_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=causal,
                        sliding_window=sliding_window)[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(logits - jax.lax.stop_gradient(row_max))
    total = jnp.sum(p, axis=-1, keepdims=True)
    visible = total > 0
    safe = jnp.where(visible, total, 1.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p / safe, v.astype(jnp.float32)).reshape(b, t, h, d)
    lse = jnp.where(visible, jax.lax.stop_gradient(row_max) + jnp.log(safe), NEG_INF)
    return out, lse[..., 0].reshape(b, h, t)


def reference_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *,
                        causal: bool = True, sliding_window: int = 0, softcap: float = 0.0,
                        scale: float | None = None) -> jax.Array:
    """The float32 reference: plain softmax over the visible keys, out [B,T,H,D] float32."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = jnp.repeat(k.astype(jnp.float32), h // kvh, axis=2)
    v = jnp.repeat(v.astype(jnp.float32), h // kvh, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = segment_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal=causal,
                        sliding_window=sliding_window)[:, None]
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    probs = jnp.where(mask, probs, 0.0)  # fully masked rows: softmax of all -inf is NaN
    return jnp.einsum("bhts,bshd->bthd", probs, v)


def _flash_kernel():
    """`rlvr.kernels.flash_attention.flash_attention`, or None while it is not installed."""
    try:
        from rlvr.kernels.flash_attention import flash_attention
    except ImportError:
        return None
    return flash_attention


def flash_available() -> bool:
    return _flash_kernel() is not None


_WARNED: set[str] = set()


def log_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        _log.warning(message)


def local_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions, *,
                    causal: bool = True, sliding_window: int = 0, softcap: float = 0.0,
                    scale: float | None = None, implementation: str = "auto", return_lse: bool = True):
    """One device's block: (out [B,T,H,D] float32, lse [B,H,T] float32), differentiable in both;
    with `return_lse=False` only out, in q's dtype.

    implementation: "flash" (the flash kernel; an error if it is not installed), "reference"
    (`block_attention`), "auto" (flash when installed, else reference with a logged message)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: use one of {IMPLEMENTATIONS}.")
    flash = _flash_kernel() if implementation != "reference" else None
    if flash is None and implementation == "flash":
        raise ImportError("implementation='flash' needs rlvr.kernels.flash_attention, which is not installed.")
    if flash is None:
        if implementation == "auto":
            log_once("rlvr.kernels.flash_attention is not available: attention blocks use the plain-jnp "
                       "block_attention (same results, O(T·S) memory per block).")
        out, lse = block_attention(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                                   causal=causal, sliding_window=sliding_window, softcap=softcap, scale=scale)
        return (out, lse) if return_lse else out.astype(q.dtype)
    result = flash(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   q_positions=q_positions, kv_positions=kv_positions, causal=causal,
                   sliding_window=sliding_window, softcap=softcap, scale=scale, return_lse=return_lse)
    if not return_lse:
        return result
    out, lse = result
    return out.astype(jnp.float32), jnp.maximum(lse.astype(jnp.float32), NEG_INF)
