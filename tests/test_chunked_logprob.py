"""Chunked log-probs (rlvr.kernels.chunked_logprob) against the full-logits reference: values and
gradients across drawn shapes and chunk sizes, the SFT and RL losses with `logprob_chunk_size` on
and off on a tiny model, and the compiled temporary memory of loss+grad at a long sequence."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvr.kernels.chunked_logprob import Sampling, token_logprobs, token_logprobs_reference

from rlvr import config_lib
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.transformer import forward
from rlvr.rl.objective import Objective, rl_loss
from rlvr.trainers.sft import sft_loss


def close(a, b, tol):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def tree_close(a, b, tol):
    jax.tree.map(lambda x, y: close(x, y, tol), a, b)


# ------------------------------------------------------------------ the kernel vs the reference


@functools.partial(jax.jit, static_argnames=("chunk_size", "softcap", "vocab_major", "sampling"))
def _values_and_grads(hidden, w, targets, g_logp, g_ent, *, chunk_size, softcap, vocab_major, sampling):
    """For the chunked and the reference function: (logp, entropy, (d hidden, d w)) of
    Σ g_logp·logp + Σ g_ent·entropy; one compile for both."""

    def run(call):
        def f(h, w):
            logp, ent = call(h, w, targets, softcap=softcap, return_entropy=True, vocab_major=vocab_major,
                             sampling=sampling)
            return jnp.sum(g_logp * logp) + jnp.sum(g_ent * ent), (logp, ent)

        (_, (logp, ent)), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, w)
        return logp, ent, grads

    logp_only = token_logprobs(hidden, w, targets, chunk_size=chunk_size, softcap=softcap, vocab_major=vocab_major,
                               sampling=sampling)
    return run(functools.partial(token_logprobs, chunk_size=chunk_size)), run(token_logprobs_reference), logp_only


@settings(max_examples=12, deadline=None, derandomize=True)
@given(batch=st.integers(1, 3), length=st.integers(1, 19), embed=st.sampled_from([8, 16]),
       vocab=st.integers(2, 70), chunk=st.integers(1, 24), softcap=st.sampled_from([0.0, 2.5]),
       vocab_major=st.booleans(), seed=st.integers(0, 2**16),
       sampling=st.sampled_from([Sampling(), Sampling(0.7, -1, 0.9, 0.0), Sampling(1.3, 5, 1.0, 0.05)]))
def test_matches_full_logits_reference(batch, length, embed, vocab, chunk, softcap, vocab_major, seed, sampling):
    """Also with the sampler's truncated, tempered distribution (`sampling`): the kept set is
    recomputed per chunk in the backward pass; the target always counts as kept."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((batch, length, embed)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((vocab, embed) if vocab_major else (embed, vocab)) * 0.7, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    g_logp = jnp.asarray(rng.standard_normal((batch, length)), jnp.float32)
    g_ent = jnp.asarray(rng.standard_normal((batch, length)), jnp.float32)
    got, want, logp_only = _values_and_grads(hidden, w, targets, g_logp, g_ent, chunk_size=chunk, softcap=softcap,
                                             vocab_major=vocab_major, sampling=sampling)
    tree_close(got, want, 2e-5)
    close(logp_only, want[0], 2e-5)  # log-probs alone (no entropy): the same values


def test_bfloat16_inputs_accumulate_in_float32():
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((2, 33, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 300)) * 0.3, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 300, (2, 33)), jnp.int32)
    f = lambda h, w: jnp.sum(token_logprobs(h, w, targets, chunk_size=8))
    g = lambda h, w: jnp.sum(token_logprobs_reference(h.astype(jnp.float32), w.astype(jnp.float32), targets))
    close(f(hidden, w), g(hidden, w), 1e-4)
    got, want = jax.grad(f, argnums=(0, 1))(hidden, w), jax.grad(g, argnums=(0, 1))(hidden, w)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.bfloat16
    tree_close(jax.tree.map(lambda x: x.astype(jnp.float32), got), want, 2e-2)


def test_shape_errors_name_the_argument():
    h, w, t = jnp.zeros((2, 5, 8)), jnp.zeros((8, 11)), jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="vocab_major=True"):
        token_logprobs(h, w.T, t, chunk_size=2)
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(h, w, t[:, :4], chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(h, w, t, chunk_size=0)
    with pytest.raises(ValueError, match="hidden"):
        token_logprobs(h[0], w, t, chunk_size=2)


# ------------------------------------------------------------------ the SFT and RL losses, flag on/off

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
            head_dim=8, dtype="float32", param_dtype="float32")
B, T = 3, 20


def _init(cfg, seed):
    """Random parameters (numpy, no init compile): weights ~ N(0, 0.2²), norm scales ~ 1."""
    rng = np.random.default_rng(seed)

    def draw(path, x):
        noise = rng.standard_normal(x.shape) * 0.2
        return jnp.asarray(1.0 + noise if path[-1].key == "scale" else noise, x.dtype)

    return jax.tree_util.tree_map_with_path(draw, params_lib.abstract_params(cfg))


def _batch(rng):
    """Packed rows: two segments in row 0, padding at the end of row 2."""
    tokens = rng.integers(1, TINY["vocab_size"], (B, T)).astype(np.int32)
    segments = np.ones((B, T), np.int32)
    segments[0, 11:] = 2
    segments[2, 15:] = 0
    positions = np.zeros((B, T), np.int32)
    for b in range(B):
        for s in np.unique(segments[b]):
            idx = np.nonzero(segments[b] == s)[0]
            positions[b, idx] = np.arange(len(idx))
    loss_mask = (rng.random((B, T)) < 0.7).astype(np.int32) * (segments != 0)
    return {"tokens": tokens, "positions": positions, "segment_ids": segments, "loss_mask": loss_mask}


def test_sft_loss_same_with_and_without_chunking():
    cfg = ModelConfig(**TINY)
    params = _init(cfg, 1)
    batch = jax.tree.map(jnp.asarray, _batch(np.random.default_rng(2)))

    @jax.jit
    def both(p):  # one compile for the flag off and on
        return [jax.value_and_grad(lambda p, n=n: sft_loss(cfg, p, batch, None, None, logprob_chunk_size=n),
                                   has_aux=True)(p) for n in (0, 7)]

    ((loss_full, aux_full), g_full), ((loss_chunk, aux_chunk), g_chunk) = both(params)
    close(loss_chunk, loss_full, 1e-5)
    assert float(aux_chunk["weight"]) == float(aux_full["weight"]) > 0
    tree_close(g_chunk, g_full, 1e-5)


def _rl_batch(rng, num_seqs):
    batch = _batch(rng)
    shape = (B, T)
    batch.update(advantages=rng.standard_normal(shape).astype(np.float32),
                 behaviour_logp=(-rng.random(shape) * 4).astype(np.float32),
                 token_weight=rng.random(shape).astype(np.float32),
                 row_weight=np.ones(B, np.float32),
                 seq_index=np.where(batch["segment_ids"] != 0,
                                    np.arange(B)[:, None] * 2 + batch["segment_ids"] - 1, num_seqs).astype(np.int32),
                 old_values=rng.standard_normal(shape).astype(np.float32),
                 returns=rng.standard_normal(shape).astype(np.float32))
    return batch


@pytest.mark.parametrize("case", ["kl_entropy_tis", "value_head_tied"])
def test_rl_loss_same_with_and_without_chunking(case):
    num_seqs = 2 * B
    value = case == "value_head_tied"
    cfg = ModelConfig(**TINY, value_head=value, tie_word_embeddings=value)
    params = _init(cfg, 3)
    batch = jax.tree.map(jnp.asarray, _rl_batch(np.random.default_rng(4), num_seqs))
    frozen = None
    if case == "kl_entropy_tis":
        obj = Objective("ppo_clip", 0.2, 0.28, dual_clip=3.0, kl_coef=0.3, entropy_coef=0.05, tis_cap=2.0,
                        num_seqs=num_seqs)
        frozen = {"ref": _init(cfg, 5)}
    else:
        obj = Objective("ppo_clip", num_seqs=num_seqs, value_coef=0.5, value_clip=0.2, entropy_coef=0.02)

    @jax.jit
    def both(p):  # one compile for the flag off and on
        objs = [dataclasses.replace(obj, logprob_chunk_size=chunk) for chunk in (0, 8)]
        return [jax.value_and_grad(lambda p, o=o: rl_loss(cfg, o, p, batch, None, frozen), has_aux=True)(p)
                for o in objs]

    ((loss_full, aux_full), g_full), ((loss_chunk, aux_chunk), g_chunk) = both(params)
    close(loss_chunk, loss_full, 1e-5)
    assert set(aux_chunk) == set(aux_full)
    tree_close(aux_chunk, aux_full, 1e-4)
    tree_close(g_chunk, g_full, 1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_bfloat16_model_logits_match_the_chunked_path(tied):
    """model.dtype="bfloat16": the model's logits (what the engine samples from and the full-logits
    loss scores) are float32 products of the bf16 hidden states and head, like the chunked
    log-probs' (before: rounded to bf16, a 3e-2 log-prob gap at logits of this size)."""
    from rlvr.losses import model_token_logprobs, next_token_logprobs

    cfg = ModelConfig(**{**TINY, "dtype": "bfloat16"}, tie_word_embeddings=tied)
    params = _init(cfg, 8)
    head = "embed_tokens" if tied else "lm_head"
    params[head] = jax.tree.map(lambda w: w * 30.0, params[head])  # logits of a trained model's size (~±20)
    tokens = jnp.asarray(np.random.default_rng(9).integers(1, TINY["vocab_size"], (B, T)), jnp.int32)
    logits = forward(cfg, params, tokens)[0]
    assert logits.dtype == jnp.float32 and float(jnp.max(jnp.abs(logits))) > 10
    full = next_token_logprobs(logits, tokens)
    chunked = model_token_logprobs(cfg, params, tokens, chunk_size=8)[0]
    close(full, chunked, 1e-5)


def _longest_vocab_rows(closed_jaxpr, vocab: int) -> int:
    """The most positions of any [..., L, V] array (V = vocab) anywhere in a jaxpr, sub-jaxprs
    (loops, custom VJPs, nested jits) included."""
    longest = 0

    def walk(jaxpr):
        nonlocal longest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                if len(shape) >= 3 and shape[-1] == vocab:
                    longest = max(longest, shape[-2])
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return longest


def test_rl_passes_never_build_full_vocabulary_logits():
    """The trainer's passes outside the loss (proximal and reference log-probs, GAE values) go
    through the chunked path: no [B, T, V] array, only [B, chunk, V] ones (or none)."""
    from rlvr.rl.update import gae_pass, logprobs_pass

    cfg = ModelConfig(**TINY, value_head=True)
    params = _init(cfg, 6)
    b = jax.tree.map(jnp.asarray, _batch(np.random.default_rng(7)))
    args = (params, b["tokens"], b["positions"], b["segment_ids"])
    for sampling in (Sampling(), Sampling(0.7, -1, 0.9, 0.0)):
        jaxpr = jax.make_jaxpr(functools.partial(logprobs_pass, cfg, sampling, 4))(*args)
        assert 0 < _longest_vocab_rows(jaxpr, TINY["vocab_size"]) <= 4
    jaxpr = jax.make_jaxpr(functools.partial(gae_pass, cfg, 1.0, 0.95))(*args, b["loss_mask"], jnp.zeros((B, T)))
    assert _longest_vocab_rows(jaxpr, TINY["vocab_size"]) == 0
    full = jax.make_jaxpr(lambda p, t: forward(cfg, p, t)[0])(params, b["tokens"])  # the check can fail
    assert _longest_vocab_rows(full, TINY["vocab_size"]) == T


def test_config_flag():
    config = config_lib.base_config()
    assert config.train.logprob_chunk_size == 0
    config.train.logprob_chunk_size = -1
    with pytest.raises(config_lib.ConfigError, match="train.logprob_chunk_size"):
        config_lib.validate(config, num_devices=1)


# ------------------------------------------------------------------ compiled memory


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_compiled_temp_memory_is_far_below_full_logits():
    """B=1, T=4096, E=64, V=32768: full logits are 512 MiB; loss+grad (with the entropy) holds
    ~2 GiB of temporaries with the full logits and ~64 MiB with 256-position chunks."""
    b, t, e, v = 1, 4096, 64, 32768
    shapes = (jax.ShapeDtypeStruct((b, t, e), jnp.float32), jax.ShapeDtypeStruct((e, v), jnp.float32),
              jax.ShapeDtypeStruct((b, t), jnp.int32))

    def loss_grad(fn):
        def loss(h, w, tg):
            logp, ent = fn(h, w, tg)
            return jnp.sum(logp) + 0.1 * jnp.sum(ent)
        return jax.value_and_grad(loss, argnums=(0, 1))

    full = _temp_bytes(loss_grad(functools.partial(token_logprobs_reference, return_entropy=True)), *shapes)
    chunked = _temp_bytes(loss_grad(functools.partial(token_logprobs, chunk_size=256, return_entropy=True)), *shapes)
    logits_bytes = b * t * v * 4
    assert full >= 2 * logits_bytes, full
    assert chunked <= logits_bytes // 4, chunked
    assert chunked * 10 < full


def test_sft_loss_compiled_temp_memory():
    """The SFT loss+grad of a 1-layer model at seq_len 4096, vocab 32768 (compile only)."""
    cfg = ModelConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32, max_position_embeddings=4096)
    params = params_lib.abstract_params(cfg)
    batch = {k: jax.ShapeDtypeStruct((1, 4096), jnp.int32)
             for k in ("tokens", "positions", "segment_ids", "loss_mask")}

    def grad(chunk):
        return jax.grad(lambda p, bt: sft_loss(cfg, p, bt, None, None, logprob_chunk_size=chunk)[0])

    full, chunked = _temp_bytes(grad(0), params, batch), _temp_bytes(grad(512), params, batch)
    assert chunked * 3 < full, (chunked, full)
