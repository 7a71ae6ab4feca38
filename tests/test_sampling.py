"""The engine's sampler (rlvr.rollout.sampling.sample_tokens: bounded candidates, no vocabulary sort)
against the full-sort reference: the same tokens for the same seeds whether a row's kept set fits
the candidates or falls back; log-probs of the distribution sampled from; empirical frequencies
against the exact filtered distribution; greedy ties."""

import jax
import jax.numpy as jnp
import numpy as np
from rlvr.kernels.chunked_logprob import sampling_logits

from rlvr.rollout import sampling

V = 300
ROWS = dict(  # one row per case: (temperature, top_k, top_p, min_p)
    plain=(1.0, -1, 1.0, 0.0), top_k=(0.7, 5, 1.0, 0.0), nucleus=(1.0, -1, 0.9, 0.0), wide_nucleus=(1.0, -1, 0.95, 0.0),
    greedy=(0.0, -1, 1.0, 0.0), all_three=(1.3, 100, 0.8, 0.05), min_p=(1.0, -1, 1.0, 0.1), top_k_3=(1.0, 3, 1.0, 0.0),
    big_top_k=(1.0, 70, 1.0, 0.0), tight_nucleus=(0.5, -1, 0.5, 0.0), near_one=(1.0, -1, 0.99, 0.0),
    small_min_p=(1.0, -1, 1.0, 0.01))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (len(ROWS), V)).astype(np.float32)
    names = list(ROWS)
    logits[names.index("wide_nucleus")] *= 0.01  # nearly flat: the nucleus exceeds the candidates (fallback)
    logits[names.index("big_top_k")] *= 0.01  # top_k 70 > 64 candidates: fallback
    logits[names.index("plain"), 7] = -np.inf  # a masked token (a stop token before min_new_tokens)
    columns = [jnp.asarray(np.array(c, dtype)) for c, dtype in
               zip(zip(*ROWS.values(), strict=True), (np.float32, np.int32, np.float32, np.float32), strict=True)]
    return jnp.asarray(logits), columns


def _exact(logits, *settings):
    """The sampled-from log-probs [B, V]: the trainer's definition."""
    return jax.nn.log_softmax(sampling_logits(logits, *settings), axis=-1)


def test_candidates_and_fallback_give_the_reference_tokens_and_logprobs():
    logits, (temperature, top_k, top_p, min_p) = _batch()
    fast, reference = jax.jit(sampling.sample_tokens), jax.jit(sampling.sample_reference)
    exact = np.asarray(_exact(logits, temperature, top_k, top_p, min_p))
    rows = np.arange(len(ROWS))
    for position in range(40):
        seeds, positions = jnp.arange(len(ROWS), dtype=jnp.int32) * 7, jnp.full(len(ROWS), position, jnp.int32)
        token, logprob = fast(logits, temperature, top_k, top_p, min_p, seeds, positions)
        want_token, want_logprob = reference(logits, temperature, top_k, top_p, min_p, seeds, positions)
        np.testing.assert_array_equal(token, want_token)
        np.testing.assert_allclose(logprob, want_logprob, atol=1e-5)
        sampled = np.asarray(temperature) > 0
        assert np.isfinite(exact[rows, np.asarray(token)]).all()  # always inside the kept set
        np.testing.assert_allclose(np.asarray(logprob)[sampled], exact[rows, np.asarray(token)][sampled], atol=1e-5)
        assert np.asarray(token)[list(ROWS).index("plain")] != 7
    greedy = list(ROWS).index("greedy")
    assert int(token[greedy]) == int(np.argmax(np.asarray(logits)[greedy])) and float(logprob[greedy]) == 0.0


def test_frequencies_match_the_filtered_distribution():
    logits, columns = _batch(1)
    draws = 4000
    for name in ("plain", "nucleus", "all_three", "wide_nucleus"):
        row = list(ROWS).index(name)
        params = [c[row:row + 1] for c in columns]

        @jax.jit
        def draw(seeds, row=row, params=params):
            return jax.vmap(lambda s: sampling.sample_tokens(logits[row:row + 1], *params, s[None],
                                                      jnp.zeros(1, jnp.int32))[0][0])(seeds)

        counts = np.bincount(np.asarray(draw(jnp.arange(draws, dtype=jnp.int32))), minlength=V) / draws
        p = np.exp(np.asarray(_exact(logits[row:row + 1], *params))[0])
        assert counts[p == 0].sum() == 0
        # total variation within 4 standard deviations of the sampling noise
        noise = 0.5 * np.sum(np.sqrt(p * (1 - p) / draws)) * np.sqrt(2 / np.pi)
        assert 0.5 * np.abs(counts - p).sum() < 4 * noise + 1e-3, name


def test_inverse_cdf_never_picks_a_zero_weight_and_first_argmax_breaks_ties_low():
    weights = jnp.asarray([[0.0] * 127 + [1.0] + [0.0] * 200, [1.0, 0.0, 2.0] + [0.0] * 325])
    for u in (1e-9, 0.3, 0.5, 1.0):
        picks = np.asarray(sampling.inverse_cdf(weights, jnp.full(2, u, jnp.float32)))
        assert picks[0] == 127 and picks[1] in (0, 2)
    assert np.asarray(sampling.first_argmax(jnp.asarray([[1.0, 3.0, 3.0, 0.0]]))).tolist() == [1]
