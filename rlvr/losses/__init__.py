"""Losses: token-level log-probs and masks (here), preference losses (`preference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(tokens[t+1] | tokens[:t+1]) for t < T-1, shape [B, T-1], float32."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def target_mask(loss_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Mask [B, T-1] of targets to train on: the target is in `loss_mask` and in the same
    packed segment as the token predicting it."""
    same_segment = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return (loss_mask[:, 1:] != 0) & same_segment


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    mask = mask.astype(values.dtype)
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)
