"""Per-row token sampling on device: temperature, top-k, top-p, min-p, per-request seeds.

Every row carries its own parameters, so one jitted decode step serves a batch of requests
with different settings. A row's random key is `fold_in(key(seed), position)`: the same seed
and prompt give the same tokens whatever else is in the batch.

The distribution sampled from is `rlvr.kernels.chunked_logprob.sampling_logits` (softmax of
logits / temperature over the kept set of top-k, top-p and min-p), the one definition the
trainer scores with too; the log-prob reported for each token is under that distribution, so
the trainer's and the sampler's log-probs agree (`logprob_mismatch`) at any sampling settings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlvr.kernels.chunked_logprob import sampling_logits
from rlvr.kernels.chunked_logprob.reference import MIN_TEMPERATURE


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, seeds: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [S], their log-probs [S] under the distribution sampled from), from logits [S, V];
    temperature 0 is greedy (log-prob 0: all mass on the argmax)."""
    logits = logits.astype(jnp.float32)
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))
    tempered = lambda *_: logits / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]
    scaled = jax.lax.cond(needs_filter, sampling_logits, tempered, logits, temperature, top_k, top_p, min_p)
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    sampled = jax.vmap(jax.random.categorical)(keys, scaled)
    tokens = jnp.where(temperature <= 0.0, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logp
