"""Token log-probs (and entropies) from hidden states without materialising [B, T, V] logits.

The sequence axis is cut into chunks of `chunk_size` positions; a loop computes each chunk's
float32 logits [B, chunk, V], reduces them to log p(target), logsumexp and entropy, and drops
them. The custom VJP keeps only the per-token logsumexp and entropy [B, T] as residuals and
recomputes each chunk's logits in the backward loop, accumulating d lm_head in float32, so
neither pass ever holds more than one chunk of logits. Chunks run along T (every row of the
batch at once): a batch axis sharded over devices stays sharded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from rlvr.kernels.chunked_logprob.reference import (
    MIN_TEMPERATURE,
    RAW_POLICY,
    Sampling,
    project,
    target_sampling_logits,
)


def token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *, chunk_size: int,
                   softcap: float = 0.0, return_entropy: bool = False, vocab_major: bool = False,
                   sampling: Sampling = RAW_POLICY):
    """log p(targets[b, t] | hidden[b, t]) [B, T] float32, and with `return_entropy` also the
    entropy [B, T] of each position's distribution (both differentiable). p is the distribution
    a sampler with `sampling` draws from (`reference.sampling_logits`: temperature, top-k, top-p,
    min-p; the target always counts as kept); the default is the model's own softmax.

    hidden [B, T, E]; lm_head [E, V], or the input embedding [V, E] with `vocab_major=True`
    (tied weights); targets [B, T] int in [0, V). `softcap` > 0 applies
    `softcap·tanh(logits/softcap)` before the softmax. Logits are computed and reduced in
    float32 (`preferred_element_type`), whatever the input dtypes; gradients come back in the
    inputs' dtypes. Peak temporary memory is about a few × B·chunk_size·V·4 bytes plus an
    [E, V] float32 gradient accumulator, instead of several × B·T·V·4 bytes.
    """
    _check(hidden, lm_head, targets, chunk_size, vocab_major)
    t = hidden.shape[1]
    chunk = min(int(chunk_size), t)
    pad = -t % chunk
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    out = _chunked(hidden, lm_head, targets.astype(jnp.int32), chunk, float(softcap), bool(return_entropy),
                   bool(vocab_major), sampling)
    logp, entropy = (o[:, :t] for o in out)
    return (logp, entropy) if return_entropy else logp


def _check(hidden, lm_head, targets, chunk_size, vocab_major) -> None:
    if hidden.ndim != 3:
        raise ValueError(f"token_logprobs: hidden must be [batch, length, embed], got shape {hidden.shape}.")
    if lm_head.ndim != 2:
        raise ValueError(f"token_logprobs: lm_head must be 2-D ([embed, vocab], or [vocab, embed] with "
                         f"vocab_major=True), got shape {lm_head.shape}.")
    embed = lm_head.shape[1] if vocab_major else lm_head.shape[0]
    if embed != hidden.shape[-1]:
        layout = "[vocab, embed] (vocab_major=True)" if vocab_major else "[embed, vocab]"
        raise ValueError(f"token_logprobs: lm_head {lm_head.shape} read as {layout} has embed={embed}, but hidden "
                         f"{hidden.shape} has embed={hidden.shape[-1]}; for a tied embedding pass vocab_major=True.")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"token_logprobs: targets {targets.shape} must be hidden's [batch, length] = "
                         f"{hidden.shape[:2]}.")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"token_logprobs: targets must be integer token ids, got {targets.dtype}.")
    if int(chunk_size) <= 0:
        raise ValueError(f"token_logprobs: chunk_size must be positive, got {chunk_size}.")


def _slice(x, i, chunk):
    return jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)


def _put(buf, i, chunk, value):
    return jax.lax.dynamic_update_slice_in_dim(buf, value.astype(buf.dtype), i * chunk, axis=1)


def _chunk_logits(h, w, tgt, softcap, vocab_major, sampling):
    """(the sampled distribution's logits [B, chunk, V] (-inf outside the kept set), the soft cap's
    tanh or None): one chunk, recomputed in the backward pass."""
    raw = project(h, w, vocab_major)
    tanh = jnp.tanh(raw / softcap) if softcap else None
    z = softcap * tanh if softcap else raw
    return target_sampling_logits(z, tgt, sampling), tanh


def _chunk_stats(h, w, tgt, softcap, with_entropy, vocab_major, sampling):
    """One chunk: (log p(target), logsumexp, entropy or None), each [B, chunk] float32."""
    z, _ = _chunk_logits(h, w, tgt, softcap, vocab_major, sampling)
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    lse = m[..., 0] + jnp.log(jnp.sum(jnp.exp(z - m), axis=-1))
    logp = jnp.take_along_axis(z, tgt[..., None], axis=-1)[..., 0] - lse
    entropy = None
    if with_entropy:
        entropy = lse - jnp.sum(jnp.where(jnp.isfinite(z), jnp.exp(z - lse[..., None]) * z, 0.0), axis=-1)
    return logp, lse, entropy


def _forward(hidden, lm_head, targets, chunk, softcap, with_entropy, vocab_major, sampling):
    b, t = targets.shape
    zeros = jnp.zeros((b, t), jnp.float32)

    def body(i, bufs):
        logp_buf, lse_buf, ent_buf = bufs
        logp, lse, ent = _chunk_stats(_slice(hidden, i, chunk), lm_head, _slice(targets, i, chunk), softcap,
                                      with_entropy, vocab_major, sampling)
        ent_buf = _put(ent_buf, i, chunk, ent) if with_entropy else ent_buf
        return _put(logp_buf, i, chunk, logp), _put(lse_buf, i, chunk, lse), ent_buf

    return jax.lax.fori_loop(0, t // chunk, body, (zeros, zeros, zeros))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _chunked(hidden, lm_head, targets, chunk, softcap, with_entropy, vocab_major, sampling):
    logp, _, entropy = _forward(hidden, lm_head, targets, chunk, softcap, with_entropy, vocab_major, sampling)
    return logp, entropy


def _chunked_fwd(hidden, lm_head, targets, chunk, softcap, with_entropy, vocab_major, sampling):
    logp, lse, entropy = _forward(hidden, lm_head, targets, chunk, softcap, with_entropy, vocab_major, sampling)
    return (logp, entropy), (hidden, lm_head, targets, lse, entropy)


def _chunked_bwd(chunk, softcap, with_entropy, vocab_major, sampling, residuals, cotangents):
    """With z the sampled distribution's logits (-inf outside the kept set) and p = softmax(z):
    d/dz of log p(target) is onehot - p; of the entropy H = lse - Σ p·z it is -p·(z - E_p[z]),
    with E_p[z] = lse - H; z = logits / temperature on the kept set (the set itself is piecewise
    constant: no gradient); the soft cap multiplies by 1 - tanh²."""
    hidden, lm_head, targets, lse, entropy = residuals
    g_logp, g_entropy = cotangents
    vocab = lm_head.shape[0] if vocab_major else lm_head.shape[1]
    inv_temperature = 1.0 / max(sampling.temperature, MIN_TEMPERATURE)

    def body(i, carry):
        d_hidden, d_w = carry
        h, tgt = _slice(hidden, i, chunk), _slice(targets, i, chunk)
        z, tanh = _chunk_logits(h, lm_head, tgt, softcap, vocab_major, sampling)
        kept = jnp.isfinite(z)
        lse_c = _slice(lse, i, chunk)[..., None]
        p = jnp.exp(z - lse_c)
        onehot = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == tgt[..., None]
        dz = _slice(g_logp, i, chunk)[..., None] * (onehot.astype(jnp.float32) - p)
        if with_entropy:
            mean_z = lse_c - _slice(entropy, i, chunk)[..., None]
            dz = dz - _slice(g_entropy, i, chunk)[..., None] * p * jnp.where(kept, z - mean_z, 0.0)
        if sampling.temperature != 1.0:
            dz = dz * inv_temperature
        if softcap:
            dz = dz * (1.0 - tanh * tanh)
        w_spec = "ve" if vocab_major else "ev"
        d_h = jnp.einsum(f"bcv,{w_spec}->bce", dz, lm_head.astype(jnp.float32), preferred_element_type=jnp.float32)
        d_w = d_w + jnp.einsum(f"bce,bcv->{w_spec}", h.astype(jnp.float32), dz, preferred_element_type=jnp.float32)
        return _put(d_hidden, i, chunk, d_h), d_w

    w_shape = (vocab, hidden.shape[-1]) if vocab_major else (hidden.shape[-1], vocab)
    init = (jnp.zeros(hidden.shape, hidden.dtype), jnp.zeros(w_shape, jnp.float32))
    d_hidden, d_w = jax.lax.fori_loop(0, targets.shape[1] // chunk, body, init)
    return d_hidden, d_w.astype(lm_head.dtype), None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
