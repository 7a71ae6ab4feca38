"""Losses: token-level log-probs and masks (here), preference losses (`preference`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlvr.kernels.chunked_logprob.reference import RAW_POLICY, Sampling, logprobs_and_entropy, target_sampling_logits


def next_token_logprobs(logits: jax.Array, tokens: jax.Array, sampling: Sampling = RAW_POLICY, *,
                        entropy: bool = False):
    """log p(tokens[t+1] | tokens[:t+1]) for t < T-1, shape [B, T-1], float32, p the distribution a
    sampler with `sampling` draws from (default: the model's softmax); with `entropy`, (logp,
    the entropy [B, T-1] of each position's p)."""
    targets = tokens[:, 1:]
    return logprobs_and_entropy(target_sampling_logits(logits[:, :-1], targets, sampling), targets, entropy)


def model_token_logprobs(cfg, params, tokens: jax.Array, positions=None, segment_ids=None, *, chunk_size: int,
                         entropy: bool = False, values: bool = False, sampling: Sampling = RAW_POLICY,
                         rng=None, images=None):
    """`next_token_logprobs(forward(...)[0], tokens, sampling)` without the [B, T, V] logits: the
    model's final hidden states go through `rlvr.kernels.chunked_logprob.token_logprobs` in chunks
    of `chunk_size` positions (forward and backward). Returns (logp [B, T-1], entropy [B, T-1] of
    each predicting position's distribution or None, value-head predictions [B, T] or None).
    `rng`: training randomness (adapter dropout; rlvr.models.transformer.forward); `images`: a VLM's
    batch images (rlvr.models.vision.ImageInputs)."""
    from rlvr.kernels.chunked_logprob import token_logprobs

    x, weight, tied, predicted = hidden_and_head(cfg, params, tokens, positions, segment_ids, values, rng, images)
    out = token_logprobs(x[:, :-1], weight, tokens[:, 1:], chunk_size=chunk_size, return_entropy=entropy,
                         vocab_major=tied, sampling=sampling)
    logp, ent = out if entropy else (out, None)
    return logp, ent, predicted


def hidden_and_head(cfg, params, tokens, positions=None, segment_ids=None, values: bool = False, rng=None,
                    images=None, branch_ids=None):
    """(final-norm hidden states [B, T, E], the output head [E, V] (or the tied embedding [V, E]),
    whether it is vocab-major (tied), value-head predictions [B, T] or None): the projection as
    `Transformer.logits` applies it (same dtype casts), for chunked log-prob and distillation passes.
    `branch_ids`: a shared-prompt batch's (`Transformer.hidden_states`)."""
    x, predicted = _hidden_and_values(cfg, params, tokens, positions, segment_ids, values, rng, images, branch_ids)
    tied = cfg.tie_word_embeddings
    weight = params["embed_tokens"].astype(x.dtype) if tied else params["lm_head"]["kernel"].astype(cfg.dtype)
    return x, weight, tied, predicted


def model_values(cfg, params, tokens: jax.Array, positions=None, segment_ids=None) -> jax.Array:
    """The value head's predictions [B, T] (no logits)."""
    return _hidden_and_values(cfg, params, tokens, positions, segment_ids, True)[1]


def _hidden_and_values(cfg, params, tokens, positions, segment_ids, values: bool, rng=None, images=None,
                       branch_ids=None):
    """(final-norm hidden states [B, T, E], value-head predictions [B, T] or None)."""
    from rlvr.models.transformer import Transformer, VisionLanguageModel, dropout_rngs

    if values and not cfg.value_head:
        raise ValueError("model.value_head is False; set it to True to use value predictions.")

    def apply(model, tokens, positions, segment_ids, images):
        if images is None:
            x, _ = model.hidden_states(tokens, positions, segment_ids, branch_ids=branch_ids)
        else:
            x, _ = model.image_hidden_states(tokens, positions, segment_ids, images)
        return x, (model.value_proj(x.astype(jnp.float32))[..., 0] if values else None)

    model = Transformer(cfg) if images is None else VisionLanguageModel(cfg)
    return model.apply({"params": params}, tokens, positions, segment_ids, images, method=apply,
                       rngs=dropout_rngs(cfg, rng))


def target_mask(loss_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Mask [B, T-1] of targets to train on: the target is in `loss_mask` and in the same
    packed segment as the token predicting it."""
    same_segment = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return (loss_mask[:, 1:] != 0) & same_segment
