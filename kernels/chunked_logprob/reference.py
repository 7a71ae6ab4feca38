"""The full-logits reference: materialises [B, T, V] float32 logits (what the chunked path avoids)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def project(hidden: jax.Array, lm_head: jax.Array, vocab_major: bool = False) -> jax.Array:
    """hidden [..., E] · W -> float32 logits [..., V]; W is [E, V], or [V, E] when `vocab_major`
    (a tied input embedding)."""
    spec = "...e,ve->...v" if vocab_major else "...e,ev->...v"
    return jnp.einsum(spec, hidden, lm_head, preferred_element_type=jnp.float32).astype(jnp.float32)


def softcap_logits(logits: jax.Array, softcap: float) -> jax.Array:
    """softcap · tanh(logits / softcap); the identity when softcap is 0."""
    return softcap * jnp.tanh(logits / softcap) if softcap else logits


def token_logprobs_reference(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, *, softcap: float = 0.0,
                             return_entropy: bool = False, vocab_major: bool = False):
    """log p(targets) [B, T] float32 (and the entropy [B, T] of each position's distribution)
    from the full logits."""
    logits = softcap_logits(project(hidden, lm_head, vocab_major), softcap)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if not return_entropy:
        return logp
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return logp, entropy
