"""Per-row logit processing on device, only for the rows (and batches) that ask for it.

Applied in SGLang's order before sampling: penalties on the tokens generated so far (frequency
subtracts `f * count`, presence subtracts `p` once a token occurred, repetition divides positive
logits by `r` and multiplies negative ones; the prompt does not count, as in SGLang), then the
grammar mask (`grammar.Grammar.mask`: tokens outside it get -inf), then `logit_bias`. The
log-probs the engine reports stay those of the unprocessed logits (`sampling.policy_logprob`: the
trainer's).

Each piece is present only when a batch row uses it (its arrays exist in `sampling` / the decode
state / as a mask argument), so jit compiles the plain path without any of this work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PENALTY_KEYS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")


def unpack_mask(packed: jax.Array, vocab: int) -> jax.Array:
    """bool [S, V] from packed bits uint8 [S, ceil(V / 8)] (bit j of byte i is token 8i + j)."""
    ids = jnp.arange(vocab)
    return ((packed[:, ids >> 3] >> (ids & 7).astype(jnp.uint8)) & 1).astype(bool)


def process(logits: jax.Array, sampling: dict, counts: jax.Array | None, mask: jax.Array | None) -> jax.Array:
    """The logits sampling draws from: penalties (with `counts` [S, V] of generated tokens), the
    grammar mask (packed, see `unpack_mask`), then logit_bias; `logits` unchanged without them."""
    logits = logits.astype(jnp.float32)
    if counts is not None:
        seen = counts > 0
        logits = logits - sampling["frequency_penalty"][:, None] * counts
        logits = logits - sampling["presence_penalty"][:, None] * seen
        rep = sampling["repetition_penalty"][:, None]
        logits = jnp.where(seen, jnp.where(logits < 0, logits * rep, logits / rep), logits)
    if mask is not None:
        logits = jnp.where(unpack_mask(mask, logits.shape[-1]), logits, -jnp.inf)
    if counts is not None:
        logits = logits + sampling["logit_bias"]
    return logits


def count_tokens(counts: jax.Array | None, tokens: jax.Array, live: jax.Array) -> jax.Array | None:
    """`counts` with each live row's new token added."""
    if counts is None:
        return None
    return counts.at[jnp.arange(counts.shape[0]), tokens].add(live.astype(counts.dtype))


def reset_counts(counts: jax.Array | None, slots: jax.Array, tokens: jax.Array | None = None) -> jax.Array | None:
    """Rows `slots` (out-of-range entries ignored) start over: empty, or holding one first token."""
    if counts is None:
        return None
    rows = jnp.zeros((slots.shape[0], counts.shape[1]), counts.dtype)
    if tokens is not None:
        rows = rows.at[jnp.arange(slots.shape[0]), tokens].set(1)
    return counts.at[slots].set(rows, mode="drop")


def extra_logprobs(logits: jax.Array, temperature: jax.Array | None, top: int,
                   ids: jax.Array | None) -> dict[str, jax.Array]:
    """Log-probs beyond the sampled token's: the `top` most likely (values, ids) and those of the
    requested `ids` [S, M]; {} when neither is asked. As SGLang reports them: of the policy at the
    row's `temperature` [S] (1 for greedy rows and when None), before top-k/top-p/min-p."""
    if not top and ids is None:
        return {}
    logits = logits.astype(jnp.float32)
    if temperature is not None:
        logits = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    out = {}
    if top:
        out["top_values"], out["top_ids"] = jax.lax.top_k(logprobs, top)
    if ids is not None:
        out["ids_values"] = jnp.take_along_axis(logprobs, jnp.clip(ids, 0, logits.shape[-1] - 1), axis=-1)
    return out
