"""The full-logits reference: materialises [B, T, V] float32 logits (what the chunked path avoids);
and the one definition of the distribution a sampler draws from (`sampling_logits`), which the
rollout engine samples with and the trainer scores with."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MIN_TEMPERATURE = 1e-6  # temperature 0 (greedy) scales the logits as this


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A sampler's settings (static: part of a jitted function's identity). Tokens are drawn from
    softmax(logits / temperature) restricted to the kept set and renormalised (`sampling_logits`);
    the defaults are the raw policy."""

    temperature: float = 1.0
    top_k: int = -1  # <= 0: no limit
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


RAW_POLICY = Sampling()  # the model's own softmax


def kept_prefix(sorted_probs: jax.Array, top_k, top_p, min_p) -> jax.Array:
    """bool [..., N]: which of the probabilities sorted descending [..., N] (the whole vocabulary
    or its N most likely tokens) a truncating sampler keeps: at most `top_k` (<= 0: no limit),
    only while the mass before one is < `top_p`, only p >= `min_p`·p_max; the first always.
    Settings are scalars or arrays broadcasting against [...]."""
    n = sorted_probs.shape[-1]
    top_k, top_p, min_p = (jnp.asarray(x)[..., None] for x in (top_k, top_p, min_p))
    keep = jnp.arange(n) < jnp.where(top_k > 0, top_k, n + 1)
    keep &= (jnp.cumsum(sorted_probs, axis=-1) - sorted_probs) < top_p
    keep &= sorted_probs >= min_p * sorted_probs[..., :1]
    return keep.at[..., 0].set(True)


def kept_tokens(logp: jax.Array, top_k, top_p, min_p) -> jax.Array:
    """bool [..., V]: the tokens a truncating sampler may draw, from the tempered log-probs
    [..., V]. The kept set is a prefix of the tokens ordered by probability (ties by token id),
    `kept_prefix` of that order. Decided by rank, never by comparing recomputed values, so a
    token at the boundary is in or out alike wherever this runs."""
    shape, vocab = logp.shape, logp.shape[-1]
    order = jnp.argsort(-logp, axis=-1, stable=True)
    keep = kept_prefix(jnp.exp(jnp.take_along_axis(logp, order, axis=-1)), top_k, top_p, min_p).reshape(-1, vocab)
    rows = jnp.arange(keep.shape[0])[:, None]
    return jnp.zeros_like(keep).at[rows, order.reshape(-1, vocab)].set(keep).reshape(shape)


def sampling_logits(logits: jax.Array, temperature, top_k=-1, top_p=1.0, min_p=0.0, keep=None) -> jax.Array:
    """The logits [..., V] of the distribution a sampler with these settings draws from: float32
    logits / temperature, -inf outside the kept set (`kept_tokens`). Their log_softmax is the
    sampled distribution's log-prob. `keep` (bool [..., V]) adds tokens to the kept set: the
    trainer adds the sampled token, so its log-prob stays finite when it falls outside another
    policy's kept set."""
    temperature = jnp.maximum(jnp.asarray(temperature, jnp.float32), MIN_TEMPERATURE)
    scaled = logits.astype(jnp.float32) / temperature[..., None]
    static = all(isinstance(x, int | float) for x in (top_k, top_p, min_p))
    if static and not Sampling(1.0, top_k, top_p, min_p).truncates:
        return scaled
    kept = kept_tokens(jax.nn.log_softmax(scaled, axis=-1), top_k, top_p, min_p)
    if keep is not None:
        kept |= keep
    return jnp.where(kept, scaled, -jnp.inf)


def target_sampling_logits(logits: jax.Array, targets: jax.Array, sampling: Sampling) -> jax.Array:
    """`sampling_logits` of a scored sequence: the target (sampled) token is always kept."""
    keep = None
    if sampling.truncates:
        keep = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    return sampling_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, keep)


def project(hidden: jax.Array, lm_head: jax.Array, vocab_major: bool = False) -> jax.Array:
    """hidden [..., E] · W -> float32 logits [..., V]; W is [E, V], or [V, E] when `vocab_major`
    (a tied input embedding)."""
    spec = "...e,ve->...v" if vocab_major else "...e,ev->...v"
    return jnp.einsum(spec, hidden, lm_head, preferred_element_type=jnp.float32).astype(jnp.float32)


def softcap_logits(logits: jax.Array, softcap: float) -> jax.Array:
    """softcap · tanh(logits / softcap); the identity when softcap is 0."""
    return softcap * jnp.tanh(logits / softcap) if softcap else logits


def token_logprobs_reference(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *, softcap: float = 0.0,
                             return_entropy: bool = False, vocab_major: bool = False,
                             sampling: Sampling = RAW_POLICY):
    """log p(targets) [B, T] float32 (and the entropy [B, T] of each position's distribution)
    from the full logits, p the distribution `sampling` draws from."""
    logits = softcap_logits(project(hidden, lm_head, vocab_major), softcap)
    return logprobs_and_entropy(target_sampling_logits(logits, targets.astype(jnp.int32), sampling), targets,
                                return_entropy)


def logprobs_and_entropy(logits: jax.Array, targets: jax.Array, return_entropy: bool = False):
    """log softmax(logits)[target] [...] and, with `return_entropy`, the entropy [...] (logits may
    be -inf outside a kept set)."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if not return_entropy:
        return logp
    kept = jnp.isfinite(logits)
    safe = jnp.where(kept, log_probs, 0.0)  # no inf·0 in either branch (nor in its gradient)
    entropy = -jnp.sum(jnp.where(kept, jnp.exp(safe) * safe, 0.0), axis=-1)
    return logp, entropy
