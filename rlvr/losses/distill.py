"""Distillation losses between a student's and a teacher's next-token distributions, in chunks.

Logit distillation (SFT, `distill.*`): forward KL from the teacher's top-k distribution,

    KL_t = Σ_{v ∈ top-k_T(t)} p̂_T(v) · (log p̂_T(v) − log p_S(v))

p̂_T is the teacher's softmax restricted to its k most likely tokens at position t (renormalised over
them), p_S the student's full softmax. On-policy distillation (RL, `rl.distill_estimator="full"`):
the full-vocabulary reverse KL at every position of the student's own samples,

    KL_t = Σ_v p_S(v) · (log p_S(v) − log p_T(v))

whose gradient is exact at each position (no sampled-token estimate; the teacher is a constant).
Positions are taken `chunk_size` at a time: each chunk projects both models' final hidden states to
logits [B, chunk, V], reduces them, and drops them (recomputed in the backward pass), so neither
model's [tokens × vocab] logits exist at once. A teacher whose vocabulary is padded beyond the
student's (same tokenizer, another size) has its extra ids dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlvr.kernels.chunked_logprob.reference import project


def _chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, T, ...] -> [T/chunk, B, chunk, ...] (T padded with zeros to a multiple of chunk)."""
    b, t = x.shape[:2]
    pad = -t % chunk
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, (t + pad) // chunk, chunk, *x.shape[2:]), 1, 0)


def topk_forward_kl(student_hidden: jax.Array, student_head: jax.Array, teacher_hidden: jax.Array,
                    teacher_head: jax.Array, targets: jax.Array, *, top_k: int, chunk_size: int,
                    student_vocab_major: bool = False, teacher_vocab_major: bool = False):
    """(student log-prob of each target [B, T], forward KL from the teacher's top-k [B, T]): hidden
    states [B, T, E] predicting `targets` [B, T]; heads [E, V] (or [V, E] when vocab-major, tied)."""
    vocab = student_head.shape[0 if student_vocab_major else 1]
    teacher_hidden = jax.lax.stop_gradient(teacher_hidden)

    @jax.checkpoint
    def one(args):
        hs, ht, tgt = args
        logp_s = jax.nn.log_softmax(project(hs, student_head, student_vocab_major).astype(jnp.float32), axis=-1)
        logits_t = project(ht, teacher_head, teacher_vocab_major).astype(jnp.float32)[..., :vocab]
        top, index = jax.lax.top_k(jax.nn.log_softmax(logits_t, axis=-1), top_k)
        top = jax.lax.stop_gradient(top - jax.nn.logsumexp(top, axis=-1, keepdims=True))  # renormalised over top-k
        kl = jnp.sum(jnp.exp(top) * (top - jnp.take_along_axis(logp_s, index, axis=-1)), axis=-1)
        return jnp.take_along_axis(logp_s, tgt[..., None], axis=-1)[..., 0], kl

    return _map_chunks(one, chunk_size, student_hidden, teacher_hidden, targets)


def full_reverse_kl(student_hidden: jax.Array, student_head: jax.Array, teacher_hidden: jax.Array,
                    teacher_head: jax.Array, *, chunk_size: int, student_vocab_major: bool = False,
                    teacher_vocab_major: bool = False, teacher_temperature: float = 1.0) -> jax.Array:
    """KL(p_S ‖ p_T) over the whole vocabulary at each position [B, T] (float32; differentiable in the
    student, the teacher a constant): hidden states [B, T, E]; heads as in `topk_forward_kl`. p_T is
    softmax(teacher logits / `teacher_temperature`): below 1 a sharpened teacher, towards its greedy mode."""
    vocab = student_head.shape[0 if student_vocab_major else 1]
    teacher_hidden = jax.lax.stop_gradient(teacher_hidden)

    @jax.checkpoint
    def one(args):
        hs, ht = args
        logp_s = jax.nn.log_softmax(project(hs, student_head, student_vocab_major).astype(jnp.float32), axis=-1)
        logits_t = project(ht, teacher_head, teacher_vocab_major).astype(jnp.float32)[..., :vocab]
        logp_t = jax.lax.stop_gradient(jax.nn.log_softmax(logits_t / teacher_temperature, axis=-1))
        return (jnp.sum(jnp.exp(logp_s) * (logp_s - logp_t), axis=-1),)

    return _map_chunks(one, chunk_size, student_hidden, teacher_hidden)[0]


def _map_chunks(fn, chunk_size: int, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """`fn` over `chunk_size` positions at a time of arrays [B, T, ...] (jax.lax.map: one chunk live at
    once) -> its outputs, each [B, T]."""
    b, t = arrays[0].shape[:2]
    outs = jax.lax.map(fn, tuple(_chunks(x, min(chunk_size, t)) for x in arrays))
    return tuple(jnp.moveaxis(x, 0, 1).reshape(b, -1)[:, :t] for x in outs)


def model_hidden_and_head(cfg, params, tokens, positions, segment_ids, rng=None):
    """(final hidden states [B, T-1, E] predicting tokens[:, 1:], the output head, vocab-major?)
    as `rlvr.losses.model_token_logprobs` projects them."""
    from rlvr.losses import hidden_and_head

    x, head, tied, _ = hidden_and_head(cfg, params, tokens, positions, segment_ids, rng=rng)
    return x[:, :-1], head, tied
