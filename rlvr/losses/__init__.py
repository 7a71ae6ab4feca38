"""Losses: token-level log-probs and masks (here), preference losses (`preference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def next_token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log p(tokens[t+1] | tokens[:t+1]) for t < T-1, shape [B, T-1], float32."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def model_token_logprobs(cfg, params, tokens: jax.Array, positions=None, segment_ids=None, *, chunk_size: int,
                         entropy: bool = False, values: bool = False):
    """`next_token_logprobs(forward(...)[0], tokens)` without the [B, T, V] logits: the model's
    final hidden states go through `rlvr.kernels.chunked_logprob.token_logprobs` in chunks of
    `chunk_size` positions (forward and backward). Returns (logp [B, T-1], entropy [B, T-1] of
    each predicting position's distribution or None, value-head predictions [B, T] or None)."""
    from rlvr.kernels.chunked_logprob import token_logprobs
    from rlvr.models.transformer import Transformer

    if values and not cfg.value_head:
        raise ValueError("model.value_head is False; set it to True to use value predictions.")

    def hidden_and_values(model, tokens, positions, segment_ids):
        x, _ = model.hidden_states(tokens, positions, segment_ids)
        return x, (model.value_proj(x.astype(jnp.float32))[..., 0] if values else None)

    x, predicted = Transformer(cfg).apply({"params": params}, tokens, positions, segment_ids,
                                          method=hidden_and_values)
    tied = cfg.tie_word_embeddings  # the projection as `Transformer.logits` applies it (same dtype casts)
    weight = params["embed_tokens"].astype(x.dtype) if tied else params["lm_head"]["kernel"].astype(cfg.dtype)
    out = token_logprobs(x[:, :-1], weight, tokens[:, 1:], chunk_size=chunk_size, return_entropy=entropy,
                         vocab_major=tied)
    logp, ent = out if entropy else (out, None)
    return logp, ent, predicted


def target_mask(loss_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Mask [B, T-1] of targets to train on: the target is in `loss_mask` and in the same
    packed segment as the token predicting it."""
    same_segment = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return (loss_mask[:, 1:] != 0) & same_segment
