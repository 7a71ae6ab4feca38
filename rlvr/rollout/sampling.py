"""Per-row token sampling on device: temperature, top-k, top-p, min-p, per-request seeds.

Every row carries its own parameters, so one jitted decode step serves a batch of requests
with different settings. A row's random number is `uniform(fold_in(key(seed), position))`:
the same seed and prompt give the same tokens whatever else is in the batch (bit for bit within
the same compiled shapes; a different batch shape may round the logits differently on some CPUs).

The distribution sampled from is `rlvr.kernels.chunked_logprob.sampling_logits` (softmax of
logits / temperature over the kept set of top-k, top-p and min-p: a prefix of the tokens by
probability, ties by id, `kept_prefix`), the one definition the trainer scores with too; the
log-prob reported for each token (float32) is under that distribution, so the trainer's and the
sampler's log-probs agree (`logprob_mismatch`) at any sampling settings. The token is the inverse
CDF of that distribution at the row's uniform, in probability order for filtered rows and in id
order for unfiltered ones (top_k=-1, top_p=1, min_p=0). Temperature 0 is greedy (the lowest id
among the largest logits; log-prob 0).

Cost (`sample_tokens`, what the engine runs): nothing sorts the vocabulary. Unfiltered rows take
the inverse CDF over blocks of `BLOCK` ids (block masses, then one block), O(V): the
exponentials are summed inside the block-mass reduction, never written out as [B, V] weights
(`inverse_cdf_of_logs`), so a vocabulary is read twice after the output projection (its max,
then the masses) and written never. Filtered rows are resolved among the `CANDIDATES` most
likely tokens (`lax.top_k`): since a kept set is a prefix of the sorted order, it lies inside the
candidates exactly when the last candidate is dropped; when a row's kept set is larger (a wide
nucleus), the batch falls back to the sorted definition (`sample_reference`, through `lax.cond`),
so the semantics never change.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlvr.kernels.chunked_logprob.reference import MIN_TEMPERATURE, kept_prefix, kept_tokens, sampling_logits

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
    return _block_inverse_cdf(weights, 0.0, lambda w: w, u)[0]


def inverse_cdf_of_logs(log_weights: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(`inverse_cdf(exp(log_weights), u)`, the total weight [B]) without writing the weights: the
    exponential runs inside the block-mass reduction and again on the chosen block's entries only,
    so this reads [B, V] once and writes nothing of that size."""
    return _block_inverse_cdf(log_weights, -jnp.inf, jnp.exp, u)


def _block_inverse_cdf(values, pad, weight, u):
    """(index, total) of the inverse CDF of weight(values) [B, N] at u·total, by blocks of BLOCK."""
    rows, n = values.shape
    blocks = -(-n // BLOCK)
    v = jnp.pad(values, ((0, 0), (0, blocks * BLOCK - n)), constant_values=pad).reshape(rows, blocks, BLOCK)
    cdf = jnp.cumsum(jnp.sum(weight(v), axis=-1), axis=-1)
    x = u * cdf[:, -1]
    block = jnp.minimum(jnp.sum(cdf < x[:, None], axis=-1), blocks - 1)
    before = jnp.where(block > 0, jnp.take_along_axis(cdf, jnp.maximum(block - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner = weight(jnp.take_along_axis(v, block[:, None, None], axis=1)[:, 0])
    offset = jnp.sum(before[:, None] + jnp.cumsum(inner, axis=-1) < x[:, None], axis=-1)
    ids = jax.lax.broadcasted_iota(jnp.int32, inner.shape, 1)
    last_positive = jnp.max(jnp.where(inner > 0, ids, 0), axis=-1)  # rounding never picks a zero weight
    return (block * BLOCK + jnp.minimum(offset, last_positive)).astype(jnp.int32), cdf[:, -1]


def _scaled(logits, temperature):
    return logits.astype(jnp.float32) / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]


def _pick_sorted(sorted_kept, sorted_ids, u):
    """(token, log-prob under the kept distribution) by inverse CDF over logits sorted descending
    [B, N], -inf outside the kept set."""
    index, _ = inverse_cdf_of_logs(sorted_kept - sorted_kept[:, :1], u)
    token = jnp.take_along_axis(sorted_ids, index[:, None], -1)[:, 0]
    logprob = jnp.take_along_axis(sorted_kept, index[:, None], -1)[:, 0] - jax.nn.logsumexp(sorted_kept, axis=-1)
    return token.astype(jnp.int32), logprob


def _sorted_path(logp, top_k, top_p, min_p, u):
    """The definition, by a full sort: the kept set of `sampling_logits` (`kept_tokens` of the
    tempered log-probs [B, V]), drawn in probability order."""
    kept = jnp.where(kept_tokens(logp, top_k, top_p, min_p), logp, -jnp.inf)
    order = jnp.argsort(-kept, axis=-1, stable=True)
    return _pick_sorted(jnp.take_along_axis(kept, order, -1), order, u)


def _candidate_path(logp, top_k, top_p, min_p, u, filtered):
    values, ids = jax.lax.top_k(logp, min(CANDIDATES, logp.shape[-1]))  # ties: lower id first
    keep = kept_prefix(jnp.exp(values), top_k, top_p, min_p)
    covered = ~keep[:, -1] | ~filtered | (values.shape[-1] == logp.shape[-1])
    token, logprob = _pick_sorted(jnp.where(keep, values, -jnp.inf), ids, u)

    def with_fallback(_):
        slow_token, slow_logprob = _sorted_path(logp, top_k, top_p, min_p, u)
        return jnp.where(covered, token, slow_token), jnp.where(covered, logprob, slow_logprob)

    return jax.lax.cond(jnp.all(covered), lambda _: (token, logprob), with_fallback, None)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, seeds: jax.Array, positions: jax.Array,
                  filters: bool = True, u: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(tokens [B] int32, their log-probs [B] float32 under the distribution sampled from; 0 for
    greedy rows) from logits [B, V] (entries of -inf are never drawn). `filters=False` (static)
    compiles without the top-k/top-p/min-p paths: only for batches whose rows all have top_k=-1,
    top_p=1, min_p=0 (half the compile time of the decode step). `u`: the rows' uniforms
    `uniforms(seeds, positions)` when drawn already (a multi-step decode call draws all its steps'
    at once, before its loop)."""
    shifted = _scaled(logits, temperature)
    shifted = shifted - jnp.max(shifted, axis=-1, keepdims=True)
    u = uniforms(seeds, positions) if u is None else u
    token, total = inverse_cdf_of_logs(shifted, u)  # the exp sums are the normaliser too
    log_total = jnp.log(total)
    logprob = jnp.take_along_axis(shifted, token[:, None], -1)[:, 0] - log_total
    if filters:
        logp = shifted - log_total[:, None]  # = jax.nn.log_softmax's
        filtered = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
        token, logprob = jax.lax.cond(
            jnp.any(filtered),
            lambda: tuple(jnp.where(filtered, a, b) for a, b in zip(
                _candidate_path(logp, top_k, top_p, min_p, u, filtered), (token, logprob),
                strict=True)),
            lambda: (token, logprob))
    greedy = temperature <= 0.0
    token = jax.lax.cond(jnp.any(greedy), lambda: jnp.where(greedy, first_argmax(logits), token), lambda: token)
    return token, jnp.where(greedy, 0.0, logprob)


def policy_logprob(logits: jax.Array, tokens: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array, min_p: jax.Array, filters: bool = True) -> jax.Array:
    """log-probs [B] of `tokens` [B] under each row's distribution of `logits` [B, V] as the
    trainer scores a sampled token (`sampling_logits`, the token always kept): for rows that drew
    from other logits (penalties, a grammar mask). `filters`: as in `sample_tokens` (without it,
    top-k/top-p/min-p are taken to be off; the sort only runs with it)."""
    keep = None
    if filters:
        keep = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == tokens[:, None]
    settings = (top_k, top_p, min_p) if filters else ()
    logp = jax.nn.log_softmax(sampling_logits(logits, temperature, *settings, keep=keep), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, None], -1)[:, 0]


def sample_reference(logits: jax.Array, temperature, top_k, top_p, min_p, seeds, positions):
    """`sample_tokens` with every filtered row through the full sort: the definition tests compare to."""
    logp = jax.nn.log_softmax(_scaled(logits, temperature), axis=-1)
    u = uniforms(seeds, positions)
    token, logprob = _sorted_path(logp, top_k, top_p, min_p, u)
    plain = inverse_cdf(jnp.exp(logp), u)
    filtered = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
    token = jnp.where(filtered, token, plain)
    logprob = jnp.where(filtered, logprob, jnp.take_along_axis(logp, plain[:, None], -1)[:, 0])
    greedy = temperature <= 0.0
    return jnp.where(greedy, jnp.argmax(logits, axis=-1), token).astype(jnp.int32), jnp.where(greedy, 0.0, logprob)
