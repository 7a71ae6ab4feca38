"""Per-row token sampling on device: temperature, top-k, top-p, min-p, per-request seeds.

Every row carries its own parameters, so one jitted decode step serves a batch of requests
with different settings. A row's random key is `fold_in(key(seed), position)`: the same seed
and prompt give the same tokens whatever else is in the batch. Log-probs are the caller's
business (the engine reports the raw policy's, see `device_fns`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _filtered_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Logits with tokens outside top-k / top-p / min-p set to -inf (at least one survives)."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, top_k, vocab)[:, None]
    keep = rank < k
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass strictly before this token
    keep &= before < top_p[:, None]
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep = keep.at[:, 0].set(True)
    kept_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(kept_sorted, inverse, axis=-1)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Tokens [S] sampled from logits [S, V]; temperature 0 is greedy."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    scaled = jax.lax.cond(needs_filter, _filtered_logits, lambda s, *_: s, scaled, top_k, top_p, min_p)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    sampled = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(temperature <= 0.0, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
