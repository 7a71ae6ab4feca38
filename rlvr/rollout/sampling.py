"""Per-row token sampling on device: temperature, top-k, top-p, min-p, per-request seeds.

Every row carries its own parameters, so one jitted decode step serves a batch of requests
with different settings. A row's random number is `uniform(fold_in(key(seed), position))`:
the same seed and prompt give the same tokens whatever else is in the batch.

Semantics (`filter_reference`, the definition): logits / temperature, sorted descending (ties:
lower id first); a token is kept while its rank < top_k, the probability mass strictly before
it < top_p, and its probability >= min_p x the largest; the first is always kept. The token is
the inverse CDF of the kept distribution at the row's uniform, in sorted order for filtered
rows and in id order for unfiltered ones (top_k=-1, top_p=1, min_p=0). Temperature 0 is greedy
(the lowest id among the largest logits).

Cost (`sample`, what the engine runs): nothing sorts the vocabulary. Unfiltered rows take the
inverse CDF over blocks of `BLOCK` ids (block masses, then one block), O(V). Filtered rows are
resolved among the `CANDIDATES` largest logits (`lax.top_k`): since a kept set is a prefix of the
sorted order, it lies inside the candidates exactly when the last candidate is dropped; when a
row's kept set is larger (a wide nucleus), the batch falls back to the sorted reference
(`lax.cond`), so the semantics never change. Log-probs are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CANDIDATES = 64
BLOCK = 128


def uniforms(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One float32 in (0, 1] per row from (seed, position)."""
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
    return 1.0 - jax.vmap(lambda k: jax.random.uniform(k, dtype=jnp.float32))(keys)


def first_argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, -1)` (lowest index among ties) as two plain reductions (faster on CPU)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(x == top, ids, x.shape[-1]), axis=-1).astype(jnp.int32)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Per row the index i with cdf[i-1] < u·total <= cdf[i] of non-negative `weights` [B, N]
    (unnormalised; zero-weight entries are never chosen), by blocks of BLOCK entries: block
    masses and their cumulative sum, then a scan inside the chosen block only."""
    rows, n = weights.shape
    blocks = -(-n // BLOCK)
    w = jnp.pad(weights, ((0, 0), (0, blocks * BLOCK - n))).reshape(rows, blocks, BLOCK)
    mass = jnp.sum(w, axis=-1)
    cdf = jnp.cumsum(mass, axis=-1)
    x = u * cdf[:, -1]
    block = jnp.minimum(jnp.sum(cdf < x[:, None], axis=-1), blocks - 1)
    before = jnp.where(block > 0, jnp.take_along_axis(cdf, jnp.maximum(block - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner = jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0]
    offset = jnp.sum(before[:, None] + jnp.cumsum(inner, axis=-1) < x[:, None], axis=-1)
    ids = jax.lax.broadcasted_iota(jnp.int32, inner.shape, 1)
    last_positive = jnp.max(jnp.where(inner > 0, ids, 0), axis=-1)  # rounding never picks a zero weight
    return (block * BLOCK + jnp.minimum(offset, last_positive)).astype(jnp.int32)


def keep_sorted(sorted_scaled: jax.Array, log_norm: jax.Array, top_k, top_p, min_p) -> jax.Array:
    """Kept mask over logits sorted descending [B, N] (N = V or a candidate prefix), with
    probabilities exp(x - log_norm) normalised over the whole vocabulary."""
    probs = jnp.exp(sorted_scaled - log_norm[:, None])
    rank = jax.lax.broadcasted_iota(jnp.int32, probs.shape, 1)
    keep = rank < jnp.where(top_k > 0, top_k, probs.shape[1] + 1)[:, None]
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    return keep | (rank == 0)


def _scaled(logits, temperature):
    return logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]


def _pick_sorted(sorted_scaled, sorted_ids, keep, u):
    """(token, log-prob under the kept distribution) by inverse CDF in sorted order."""
    kept = jnp.where(keep, sorted_scaled, -jnp.inf)
    top = kept[:, :1]
    index = inverse_cdf(jnp.exp(kept - top), u)
    token = jnp.take_along_axis(sorted_ids, index[:, None], -1)[:, 0]
    logprob = jnp.take_along_axis(kept, index[:, None], -1)[:, 0] - jax.nn.logsumexp(kept, axis=-1)
    return token.astype(jnp.int32), logprob


def _sorted_path(scaled, log_norm, top_k, top_p, min_p, u):
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_scaled = jnp.take_along_axis(scaled, order, -1)
    return _pick_sorted(sorted_scaled, order, keep_sorted(sorted_scaled, log_norm, top_k, top_p, min_p), u)


def _candidate_path(scaled, log_norm, top_k, top_p, min_p, u, filtered):
    values, ids = jax.lax.top_k(scaled, min(CANDIDATES, scaled.shape[-1]))
    keep = keep_sorted(values, log_norm, top_k, top_p, min_p)
    covered = ~keep[:, -1] | ~filtered | (values.shape[-1] == scaled.shape[-1])
    token, logprob = _pick_sorted(values, ids, keep, u)

    def with_fallback(_):
        slow_token, slow_logprob = _sorted_path(scaled, log_norm, top_k, top_p, min_p, u)
        return jnp.where(covered, token, slow_token), jnp.where(covered, logprob, slow_logprob)

    return jax.lax.cond(jnp.all(covered), lambda _: (token, logprob), with_fallback, None)


def sample(logits: jax.Array, temperature, top_k, top_p, min_p, seeds, positions, filters: bool = True):
    """(tokens [B] int32, log-prob of each token under the distribution it was sampled from
    [B] float32; 0 for greedy rows) from logits [B, V] (entries of -inf are never drawn).
    `filters=False` (static) compiles without the top-k/top-p/min-p paths: only for batches whose
    rows all have top_k=-1, top_p=1, min_p=0 (half the compile time of the decode step)."""
    scaled = _scaled(logits, temperature)
    log_norm = jax.nn.logsumexp(scaled, axis=-1)
    u = uniforms(seeds, positions)
    token = inverse_cdf(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), u)
    logprob = jnp.take_along_axis(scaled, token[:, None], -1)[:, 0] - log_norm
    if filters:
        filtered = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
        token, logprob = jax.lax.cond(
            jnp.any(filtered),
            lambda: tuple(jnp.where(filtered, a, b) for a, b in
                          zip(_candidate_path(scaled, log_norm, top_k, top_p, min_p, u, filtered), (token, logprob),
                              strict=True)),
            lambda: (token, logprob))
    greedy = temperature <= 0.0
    token = jax.lax.cond(jnp.any(greedy), lambda: jnp.where(greedy, first_argmax(logits), token), lambda: token)
    return token, jnp.where(greedy, 0.0, logprob)


def sample_reference(logits: jax.Array, temperature, top_k, top_p, min_p, seeds, positions):
    """`sample` with every filtered row through the full sort: the definition tests compare to."""
    scaled = _scaled(logits, temperature)
    log_norm = jax.nn.logsumexp(scaled, axis=-1)
    u = uniforms(seeds, positions)
    token, logprob = _sorted_path(scaled, log_norm, top_k, top_p, min_p, u)
    plain = inverse_cdf(jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), u)
    plain_logprob = jnp.take_along_axis(scaled, plain[:, None], -1)[:, 0] - log_norm
    filtered = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
    token, logprob = jnp.where(filtered, token, plain), jnp.where(filtered, logprob, plain_logprob)
    greedy = temperature <= 0.0
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), token).astype(jnp.int32), jnp.where(greedy, 0.0, logprob)


def filter_reference(logits: jax.Array, temperature, top_k, top_p, min_p) -> jax.Array:
    """The sampled-from log-probabilities [B, V] (-inf outside the kept set), by a full sort."""
    scaled = _scaled(logits, temperature)
    log_norm = jax.nn.logsumexp(scaled, axis=-1)
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_scaled = jnp.take_along_axis(scaled, order, -1)
    keep_in_order = keep_sorted(sorted_scaled, log_norm, top_k, top_p, min_p)
    keep = jnp.zeros_like(keep_in_order).at[jnp.arange(scaled.shape[0])[:, None], order].set(keep_in_order)
    return jax.nn.log_softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
