"""The RL objective, batching, producer, task and config (rlvr.rl.objective, batching, producer,
rlvr.tasks.arithmetic, rlvr.config_lib): each checked against hand-computed numbers or an
independent reference written here from the formulas on padded rows (one sequence per row)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlvr import config_lib, sharding
from rlvr.losses import next_token_logprobs
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.models.transformer import forward
from rlvr.rl import advantages as adv_lib
from rlvr.rl import policy_loss as pl
from rlvr.rl.batching import AGGREGATIONS, Sample, bucket_columns, build_batch, trained_positions
from rlvr.rl.objective import Objective, rl_loss, token_means
from rlvr.rl.producer import Producer, ProducerSettings, ScoredBatch, sample_seed
from rlvr.rollout.types import Completion
from rlvr.tasks.arithmetic import ArithmeticFamily, Task
from rlvr.train.step import accumulate_gradients

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, dtype="float32", param_dtype="float32")
SEQ_LEN = 24
PAD = 0
NORM_LEN = 8
N = 8  # samples in the shared batch (all model batches are [8, 24]: few compiles)
CAP = 2.0


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def tree_close(a, b, tol=1e-5):
    jax.tree.map(lambda x, y: close(x, y, tol), a, b)


def scaled(tree, weight):
    """tree / weight on the host (no per-shape eager compiles)."""
    return jax.tree.map(lambda g: np.asarray(g, np.float64) / float(weight), tree)


# ---------------------------------------------------------------- jitted helpers (few compiles)


@functools.partial(jax.jit, static_argnums=(0, 4))
def loss_and_grad(obj: Objective, params, batch, frozen, micro_batches: int):
    """(loss_sum, aux sums, grads) of rl_loss through the trainer's accumulate_gradients."""
    grads, sums = accumulate_gradients(functools.partial(rl_loss, CFG, obj), params, batch, jax.random.key(0),
                                       frozen, micro_batches)
    sums = dict(sums)
    return sums.pop("loss"), sums, grads


def _logp(params, tokens, positions, segment_ids):
    logits, _ = forward(CFG, params, tokens, positions, segment_ids)
    return next_token_logprobs(logits, tokens)


@jax.jit
def _logits(params, tokens, positions, segment_ids):
    return forward(CFG, params, tokens, positions, segment_ids)[0]


def trainer_logp(params, batch):
    return next_token_logprobs(_logits(params, batch["tokens"], batch["positions"], batch["segment_ids"]),
                               batch["tokens"])


@jax.jit
def _logp_vjp(params, tokens, positions, segment_ids, cotangent):
    _, vjp = jax.vjp(lambda p: _logp(p, tokens, positions, segment_ids), params)
    return vjp(cotangent)[0]


def logp_vjp(params, batch, cotangent):
    """d/dparams Σ cotangent·logp(params): the chain rule from a reference's d/dlogp."""
    return _logp_vjp(params, batch["tokens"], batch["positions"], batch["segment_ids"], cotangent)


def _unpacked_mask(samples, rows: int) -> np.ndarray:
    """Targets mask [rows, T-1] of one-sample-per-row batches, written from the sample lengths."""
    mask = np.zeros((rows, SEQ_LEN - 1), np.float32)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        mask[i, p - 1: p - 1 + len(s.output_ids)] = 1.0
    return mask


def _per_token(samples, values, rows: int) -> np.ndarray:
    """Per-sample output-token values (lists) -> shifted [rows, T-1] layout of padded rows."""
    out = np.zeros((rows, SEQ_LEN - 1), np.float32)
    for i, (s, v) in enumerate(zip(samples, values, strict=True)):
        p = len(s.prompt_ids)
        out[i, p - 1: p - 1 + len(s.output_ids)] = v
    return out


def _with_logps(samples, behaviour):
    """The samples with `behaviour` (per-sample lists) as their behaviour_logp."""
    return [dataclasses.replace(s, behaviour_logp=[float(x) for x in b]) for s, b in zip(samples, behaviour,
                                                                                        strict=True)]


def _batch(samples, aggregation="token_mean", pack=False, old=None, row_multiple=1):
    """build_batch as jnp arrays, plus `old_logp` (a proximal policy) laid out like behaviour_logp."""
    arrays = build_batch(samples, SEQ_LEN, PAD, aggregation, NORM_LEN, pack=pack, row_multiple=row_multiple)
    if old is not None:
        arrays["old_logp"] = build_batch(_with_logps(samples, old), SEQ_LEN, PAD, aggregation, NORM_LEN,
                                         pack=pack)["behaviour_logp"]
    return {k: jnp.asarray(v) for k, v in arrays.items()}


@pytest.fixture(scope="module")
def setup():
    """8 random samples (prompt 2-6, output 1-8 tokens) whose behaviour log-probs are the trainer's
    ± 0.6 nats (so TIS weights matter), and an old (proximal) policy ~ trainer ± 0.3."""
    rng = np.random.default_rng(0)
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    params = params_lib.init_params(CFG, jax.random.key(0), mesh)
    leaves, treedef = jax.tree.flatten(params)
    ref_params = jax.tree.unflatten(treedef, [x + 0.3 * jnp.asarray(rng.normal(size=x.shape), x.dtype)
                                              for x in leaves])
    samples = []
    for i in range(N):
        p, o = int(rng.integers(2, 7)), int(rng.integers(1, 9))
        samples.append(Sample(group=i // 4, task_index=i, prompt_ids=rng.integers(1, 32, p).tolist(),
                              output_ids=rng.integers(1, 32, o).tolist(), behaviour_logp=[0.0] * o,
                              versions=[0] * o, truncated=False, rewards={"reward": 0.0},
                              advantage=float(rng.normal())))
    logp = np.asarray(trainer_logp(params, _batch(samples)))
    trainer = [logp[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.output_ids)]
               for i, s in enumerate(samples)]
    samples = _with_logps(samples, [t + rng.normal(0, 0.6, t.shape) for t in trainer])
    old = [t + rng.normal(0, 0.3, t.shape) for t in trainer]
    return {"params": params, "ref": ref_params, "samples": samples, "old": old, "trainer": trainer}


# The objectives under test (num_seqs = N).
PPO_TIS_TOKEN = Objective("ppo_clip", 0.2, 0.28, dual_clip=3.0, tis_cap=CAP, tis_level="token", num_seqs=N)
GSPO_TIS_SEQ = Objective("gspo", 3e-4, 4e-4, tis_cap=CAP, tis_level="sequence", num_seqs=N)
PPO_PLAIN = Objective("ppo_clip", 0.2, 0.28, dual_clip=1.2, num_seqs=N)
KL_OBJ = Objective("ppo_clip", kl_coef=0.5, entropy_coef=0.05, tis_cap=CAP, num_seqs=N)


# ---------------------------------------------------------------- 1. packed == unpacked


@pytest.mark.parametrize("obj", [PPO_TIS_TOKEN, GSPO_TIS_SEQ], ids=["ppo_tis_token", "gspo_tis_seq"])
def test_packed_equals_unpacked(setup, obj):
    params, samples = setup["params"], setup["samples"]
    aggregations = ["seq_mean_token_mean"] if obj.policy_loss == "gspo" else list(AGGREGATIONS)
    for aggregation in aggregations:
        results = []
        for pack in (False, True):
            # packed rows are bucketed up to N (a multiple of 8 rows): the same shape, one compile
            batch = _batch(samples, aggregation, pack, row_multiple=N)
            loss_sum, aux, grads = loss_and_grad(obj, params, batch, None, 1)
            w = aux["weight"]
            used = int(np.sum(np.any(np.asarray(batch["segment_ids"]) > 0, axis=1)))
            results.append((used, loss_sum / w, scaled(grads, w), aux))
        (rows_u, loss_u, grads_u, aux_u), (rows_p, loss_p, grads_p, aux_p) = results
        assert rows_u == N and rows_p < N  # packing really put several sequences in a row
        assert abs(float(loss_u)) > 1e-2
        close(loss_p, loss_u)
        tree_close(grads_p, grads_u)
        for key in ("tokens", "tis_capped_fraction", "logprob_mismatch", "entropy", "ratio_mean"):
            close(aux_p[key], aux_u[key], 1e-4)
        # the TIS weights matter: some tokens are capped, and not all
        assert 0 < float(aux_u["tis_capped_fraction"]) < float(aux_u["tokens"])


def test_trimmed_columns_give_the_full_width_loss(setup):
    """rl.trim_columns: rows cut to the longest sample's power-of-two width (here 64 of 160 columns)
    give the full-width batch's loss, gradients and metrics (padding columns weigh nothing)."""
    params, samples = setup["params"], setup["samples"]
    assert [bucket_columns(n, 160) for n in (1, 64, 65, 129, 400)] == [64, 64, 128, 160, 160]
    results = []
    for trim in (False, True):
        arrays = build_batch(samples, 160, PAD, "token_mean", NORM_LEN, trim=trim)
        loss_sum, aux, grads = loss_and_grad(PPO_TIS_TOKEN, params, {k: jnp.asarray(v) for k, v in arrays.items()},
                                             None, 1)
        results.append((arrays["tokens"].shape, loss_sum / aux["weight"], scaled(grads, aux["weight"]), aux))
    (shape_full, loss_full, grads_full, aux_full), (shape_trim, loss_trim, grads_trim, aux_trim) = results
    assert shape_full == (N, 160) and shape_trim == (N, 64)
    assert abs(float(loss_full)) > 1e-2
    close(loss_trim, loss_full)
    tree_close(grads_trim, grads_full)
    for key in ("tokens", "tis_capped_fraction", "logprob_mismatch", "entropy", "ratio_mean"):
        close(aux_trim[key], aux_full[key], 1e-4)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_sampled_logits_only_gives_the_full_loss(setup, pack):
    """rl.sampled_logits_only: the output layer run only at the trained positions (prompts skipped)
    gives the full batch's loss, gradients and metrics: KL to a reference (its log-probs taken at the
    same positions), entropy bonus, TIS, with and without chunking, over 2 micro-batches."""
    params, samples, frozen = setup["params"], setup["samples"], {"ref": setup["ref"]}
    full = build_batch(samples, SEQ_LEN, PAD, "token_mean", NORM_LEN, pack=pack, row_multiple=N)
    head = trained_positions(full["loss_mask"], full["segment_ids"])
    target = (full["loss_mask"][:, 1:] != 0) & (full["segment_ids"][:, 1:] == full["segment_ids"][:, :-1])
    for row, index, valid in zip(target, head["head_index"], head["head_valid"], strict=True):
        assert sorted(index[valid > 0].tolist()) == np.flatnonzero(row).tolist()
    assert head["head_index"].shape[1] < SEQ_LEN - 1  # fewer positions than the rows hold
    skipped = {k: jnp.asarray(v) for k, v in {**full, **head}.items()}
    full = {k: jnp.asarray(v) for k, v in full.items()}
    for chunk in (0, 4):
        obj = dataclasses.replace(KL_OBJ, logprob_chunk_size=chunk)
        loss_f, aux_f, grads_f = loss_and_grad(obj, params, full, frozen, 2)
        loss_s, aux_s, grads_s = loss_and_grad(obj, params, skipped, frozen, 2)
        assert abs(float(loss_f)) > 1e-2
        close(loss_s, loss_f)
        tree_close(grads_s, grads_f)
        for key in ("tokens", "kl", "entropy", "tis_capped_fraction", "logprob_mismatch", "ratio_mean"):
            close(aux_s[key], aux_f[key], 1e-4)


def _shared_prompt_samples():
    """3 groups (4, 3 and 1 completions of one prompt each, outputs 1-8 tokens, one multi-turn output
    with observation tokens), behaviour log-probs around the trainer's scale."""
    rng = np.random.default_rng(1)
    samples = []
    for group, size in enumerate((4, 3, 1)):
        prompt = rng.integers(1, 32, int(rng.integers(3, 7))).tolist()
        for j in range(size):
            o = int(rng.integers(1, 9)) if (group, j) != (0, 1) else 6
            samples.append(Sample(group=group, task_index=len(samples), prompt_ids=prompt,
                                  output_ids=rng.integers(1, 32, o).tolist(),
                                  behaviour_logp=rng.normal(-3.5, 0.6, o).tolist(), versions=[0] * o,
                                  truncated=False, rewards={"reward": 0.0}, advantage=float(rng.normal()),
                                  loss_mask=[1, 1, 0, 0, 1, 1] if (group, j) == (0, 1) else None))
    return samples


@pytest.mark.parametrize("obj", [KL_OBJ, GSPO_TIS_SEQ], ids=["ppo_kl_entropy_tis", "gspo_tis_seq"])
def test_shared_prompts_give_the_unshared_loss(setup, obj):
    """rl.share_prompts: a group's completions after one copy of its prompt (branches) give the loss,
    gradients, metrics and proximal log-probs of the same samples one per segment, over 2 micro-batches,
    with fewer tokens in the rows, under the "xla" and the "flash" attention. The prompt's last token must
    predict each branch's first token (`head_source`) and branches must not see each other (`branch_ids`):
    either wrong changes the loss."""
    from rlvr.rl.update import logprobs_fn

    params, frozen = setup["params"], {"ref": setup["ref"]}
    samples = _shared_prompt_samples()
    obj = dataclasses.replace(obj, num_seqs=len(samples))
    common = dict(pack=True, row_multiple=2, sampled_logits_only=True)
    plain = build_batch(samples, SEQ_LEN, PAD, "seq_mean_token_mean", NORM_LEN, **common)
    shared = build_batch(samples, SEQ_LEN, PAD, "seq_mean_token_mean", NORM_LEN, **common, share_prompts=True,
                         row_len=40)
    assert shared["branch_ids"].max() == 4  # the first group's 4 completions share one prompt
    assert np.count_nonzero(shared["segment_ids"]) < 0.8 * np.count_nonzero(plain["segment_ids"])
    results = [loss_and_grad(obj, params, {k: jnp.asarray(v) for k, v in b.items()}, frozen, 2)
               for b in (plain, shared)]
    (loss_p, aux_p, grads_p), (loss_s, aux_s, grads_s) = results
    assert abs(float(loss_p)) > 1e-2
    close(loss_s, loss_p)
    tree_close(grads_s, grads_p)
    for key in ("tokens", "weight", "kl", "entropy", "logprob_mismatch", "tis_capped_fraction"):
        if key in aux_p:
            close(aux_s[key], aux_p[key], 1e-4)

    def per_token(batch, logp):  # (sample, position) -> the proximal log-prob of each trained token
        rows, cols = np.nonzero(batch["loss_mask"])
        return {(int(batch["seq_index"][r, c]), int(batch["positions"][r, c])): float(logp[r, c])
                for r, c in zip(rows, cols, strict=True)}

    old = logprobs_fn(CFG, obj.sampling)
    old_p, old_s = per_token(plain, old(params, plain)), per_token(shared, old(params, shared))
    assert old_p.keys() == old_s.keys()
    close([old_s[k] for k in old_p], list(old_p.values()), 1e-4)
    # model.attention="flash": the flash kernel's one-id-per-token mask, two calls merged (shared_prompt_attention)
    flash = jax.jit(functools.partial(accumulate_gradients, functools.partial(
        rl_loss, dataclasses.replace(CFG, attention="flash"), obj)), static_argnums=(4,))
    grads_f, sums_f = flash(params, {k: jnp.asarray(v) for k, v in shared.items()}, jax.random.key(0), frozen, 2)
    close(sums_f["loss"], loss_p, 1e-4)
    tree_close(grads_f, grads_p, 1e-4)
    for broken in ({**shared, "head_source": shared["head_index"]}, {**shared, "branch_ids": shared["segment_ids"]}):
        loss_b = loss_and_grad(obj, params, {k: jnp.asarray(v) for k, v in broken.items()}, frozen, 2)[0]
        assert abs(float(loss_b) - float(loss_p)) > 1e-3


# ---------------------------------------------------------------- 2. rl_loss == row-based reference


def _hand_ppo(logp, old, adv, eps_low, eps_high, dual):
    ratio = jnp.exp(logp - old)
    loss = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
    if dual is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, dual * jnp.abs(adv)), loss)
    return loss


def _hand_gspo(logp, old, adv, mask, eps_low, eps_high):
    """Per-sequence GSPO losses [B] of padded rows (row i = sequence i)."""
    n = jnp.sum(mask, axis=1)
    s = jnp.exp(jnp.sum((logp - old) * mask, axis=1) / jnp.maximum(n, 1.0))
    return jnp.maximum(-adv * s, -adv * jnp.clip(s, 1 - eps_low, 1 + eps_high))


def _hand_tis(old, behaviour, mask, cap, level):
    """min(ratio, cap) per token, or the sequence's ratio on each of its tokens; 0 off the mask."""
    diff = (old - behaviour) * mask
    ratio = jnp.exp(diff) if level == "token" else jnp.exp(jnp.sum(diff, axis=1, keepdims=True)) * mask
    return jax.lax.stop_gradient(jnp.minimum(ratio, cap)) * mask


def _hand_aggregate(per_token, mask, aggregation):
    """(sum, weight) of padded rows for each aggregation (see rlvr.rl.batching)."""
    n = jnp.sum(mask, axis=1)
    seqs = jnp.sum(n > 0).astype(jnp.float32)
    total = jnp.sum(per_token * mask)
    return {"token_mean": (total, jnp.sum(mask)),
            "seq_mean_token_mean": (jnp.sum(jnp.sum(per_token * mask, axis=1) / jnp.maximum(n, 1.0)), seqs),
            "seq_mean_token_sum": (total, seqs), "token_sum_norm": (total, seqs * NORM_LEN)}[aggregation]


@pytest.mark.parametrize("obj, with_old", [(PPO_PLAIN, False), (PPO_PLAIN, True), (PPO_TIS_TOKEN, False),
                                           (GSPO_TIS_SEQ, False)],
                         ids=["ppo", "ppo_old_logp", "ppo_tis_token", "gspo_tis_seq"])
def test_rl_loss_matches_row_based_reference(setup, obj, with_old):
    """Padded rows: rl_loss == policy_loss's row-based functions on the trainer's own log-probs
    (proximal = stop_gradient(logp), or the batch's old_logp when given: then clipping is active)."""
    params, samples = setup["params"], setup["samples"]
    mask = jnp.asarray(_unpacked_mask(samples, N))
    behaviour = jnp.asarray(_per_token(samples, [s.behaviour_logp for s in samples], N))
    adv = jnp.asarray([s.advantage for s in samples], jnp.float32)
    adv_tok = jnp.broadcast_to(adv[:, None], mask.shape)
    old_fixed = jnp.asarray(_per_token(samples, setup["old"], N))
    aggregations = ["seq_mean_token_mean"] if obj.policy_loss == "gspo" else list(AGGREGATIONS)
    for aggregation in aggregations:
        batch = _batch(samples, aggregation, old=setup["old"] if with_old else None)
        logp = trainer_logp(params, batch)
        close(jnp.where(mask > 0, logp, 0.0), _per_token(samples, setup["trainer"], N))  # layout check

        def reference(lp, aggregation=aggregation):
            old = old_fixed if with_old else jax.lax.stop_gradient(lp)
            if obj.policy_loss == "gspo":  # per-sequence GSPO losses x sequence-level TIS weights
                seq_loss = _hand_gspo(lp, old, adv, mask, obj.clip_low, obj.clip_high)
                w = _hand_tis(old, behaviour, mask, obj.tis_cap, "sequence")
                w_seq = jnp.sum(w, axis=1) / jnp.sum(mask, axis=1)
                weight = jnp.sum(jnp.sum(mask, axis=1) > 0).astype(jnp.float32)
                return jnp.sum(seq_loss * w_seq) / weight, {"weight": weight}
            per_token = _hand_ppo(lp, old, adv_tok, obj.clip_low, obj.clip_high, obj.dual_clip)
            if obj.tis_cap:
                per_token = per_token * _hand_tis(old, behaviour, mask, obj.tis_cap, obj.tis_level)
            s, weight = _hand_aggregate(per_token, mask, aggregation)
            ratio = jnp.exp(lp - old)
            clipped = _hand_ppo(lp, old, adv_tok, obj.clip_low, obj.clip_high, None) > -adv_tok * ratio
            dual = (adv_tok < 0) & (_hand_ppo(lp, old, adv_tok, obj.clip_low, obj.clip_high, None)
                                    > obj.dual_clip * jnp.abs(adv_tok)) if obj.dual_clip else jnp.zeros_like(mask)
            sums = lambda x: jnp.sum(x * mask)
            return s / weight, {"weight": weight, "clip_fraction": sums(clipped), "dual_clip_fraction": sums(dual),
                                "ratio_mean": sums(ratio), "approx_kl": sums(pl.kl_k3(lp, old))}

        (ref_loss, ref_aux), ref_dlogp = jax.jit(jax.value_and_grad(reference, has_aux=True))(logp)
        loss_sum, aux, grads = loss_and_grad(obj, params, batch, None, 1)
        close(aux["weight"], ref_aux["weight"])
        assert abs(float(ref_loss)) > 1e-2
        close(loss_sum / aux["weight"], ref_loss)
        tree_close(scaled(grads, aux["weight"]), logp_vjp(params, batch, ref_dlogp))
        if with_old and aggregation == "token_mean":  # token-mean metric sums agree too
            for key in ("clip_fraction", "dual_clip_fraction", "ratio_mean", "approx_kl"):
                close(aux[key], ref_aux[key], 1e-4)
            assert 0 < float(aux["clip_fraction"]) < float(aux["tokens"])
            assert float(aux["dual_clip_fraction"]) > 0


def test_proximal_behaviour_clips_against_the_sampler(setup):
    """rl.proximal="behaviour": with one update per batch the ratio is π_θ/π_behaviour (the
    sampler's recorded log-probs), so the clip acts and clip_fraction reports it; TIS is off.
    With "current" the ratio is 1 and nothing is clipped."""
    params, samples = setup["params"], setup["samples"]
    mask = jnp.asarray(_unpacked_mask(samples, N))
    behaviour = jnp.asarray(_per_token(samples, [s.behaviour_logp for s in samples], N))
    adv = jnp.broadcast_to(jnp.asarray([s.advantage for s in samples], jnp.float32)[:, None], mask.shape)
    batch = _batch(samples)
    obj = Objective("ppo_clip", 0.2, 0.28, tis_cap=CAP, num_seqs=N, proximal="behaviour")
    loss_sum, aux, grads = loss_and_grad(obj, params, batch, None, 1)

    def reference(lp):
        per_token = _hand_ppo(lp, behaviour, adv, 0.2, 0.28, None)
        clipped = per_token > -adv * jnp.exp(lp - behaviour)
        return jnp.sum(per_token * mask) / jnp.sum(mask), jnp.sum(clipped * mask)

    logp = trainer_logp(params, batch)
    (ref_loss, ref_clipped), ref_dlogp = jax.value_and_grad(reference, has_aux=True)(logp)
    close(loss_sum / aux["weight"], ref_loss)
    tree_close(scaled(grads, aux["weight"]), logp_vjp(params, batch, ref_dlogp))
    assert 0 < float(aux["clip_fraction"]) == float(ref_clipped) < float(aux["tokens"])
    assert "tis_capped_fraction" not in aux
    _, current, _ = loss_and_grad(dataclasses.replace(obj, proximal="current"), params, batch, None, 1)
    assert float(current["clip_fraction"]) == 0.0


# ---------------------------------------------------------------- 3. KL to the reference policy


@functools.partial(jax.jit, static_argnums=(4, 5))
def _kl_entropy_reference(params, ref_params, batch, mask, kl_coef, entropy_coef):
    """kl_coef · token-mean k3(π, π_ref) - entropy_coef · token-mean entropy, and its gradient, k3
    weighted by the ratio π/sg(π) = 1 (its gradient is then the KL's, see test_kl_loss_gradient...)."""
    def loss(p):
        logits = _logits(p, batch["tokens"], batch["positions"], batch["segment_ids"])
        logp = next_token_logprobs(logits, batch["tokens"])
        ref_logp = _logp(ref_params, batch["tokens"], batch["positions"], batch["segment_ids"])
        k3 = jnp.exp(ref_logp - logp) - (ref_logp - logp) - 1
        kl = jnp.sum(jnp.exp(logp - jax.lax.stop_gradient(logp)) * k3 * mask) / jnp.sum(mask)
        log_probs = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        entropy = jnp.sum(-jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1) * mask) / jnp.sum(mask)
        return kl_coef * kl - entropy_coef * entropy, (kl, entropy)
    return jax.value_and_grad(loss, has_aux=True)(params)


def test_kl_and_entropy_terms_and_metrics(setup):
    params, ref_params = setup["params"], setup["ref"]
    samples = [dataclasses.replace(s, advantage=0.0) for s in setup["samples"]]
    batch = _batch(samples)
    mask = jnp.asarray(_unpacked_mask(samples, N))
    (expected, (kl, entropy)), expected_grads = _kl_entropy_reference(params, ref_params, batch, mask,
                                                                       KL_OBJ.kl_coef, KL_OBJ.entropy_coef)
    assert float(kl) > 1e-2 and float(entropy) > 1.0
    loss_sum, aux, grads = loss_and_grad(KL_OBJ, params, batch, {"ref": ref_params}, 1)
    weight = aux["weight"]
    assert float(weight) == float(jnp.sum(mask)) == float(aux["tokens"])
    # zero advantages: no policy term, the loss is exactly kl_coef·mean k3 - entropy_coef·mean entropy
    close(loss_sum / weight, expected)
    tree_close(scaled(grads, weight), expected_grads)
    metrics = token_means({k: float(v) / float(weight) for k, v in aux.items()})
    close(metrics["kl"], kl)
    close(metrics["entropy"], entropy)
    logp = trainer_logp(params, batch)
    behaviour = jnp.asarray(_per_token(samples, [s.behaviour_logp for s in samples], N))
    close(metrics["logprob_mismatch"], jnp.sum(jnp.abs(logp - behaviour) * mask) / jnp.sum(mask))
    assert "tokens" not in metrics


# ---------------------------------------------------------------- 4. truncated importance sampling


@pytest.mark.parametrize("obj, weights, capped", [
    (PPO_TIS_TOKEN, [[2.0, 0.5, 1.5, 2.0], [1.0, 1.5]], 2 / 6),   # ratios 3.0 and 2.5 capped at 2
    (GSPO_TIS_SEQ, [[2.0] * 4, [1.5] * 2], 4 / 6),                # seq ratios 5.625 (capped), 1.5
], ids=["token", "sequence"])
def test_tis_hand_computed(setup, obj, weights, capped):
    """At ratio 1 (proximal = trainer) both PPO and GSPO give per-token loss -A and, summed over a
    sequence's tokens (token_mean), gradient -A·∇logp per token; TIS scales each by its weight."""
    params = setup["params"]
    ratios = [[3.0, 0.5, 1.5, 2.5], [1.0, 1.5]]
    adv = [1.0, -0.5]
    samples = [Sample(0, 0, [3, 4, 5], [6, 7, 8, 9], [0.0] * 4, [0] * 4, False, {"reward": 1.0}, adv[0]),
               Sample(0, 1, [10, 11], [12, 13], [0.0] * 2, [0] * 2, False, {"reward": 0.0}, adv[1])]
    # both packed into row 0 of 8 rows (the shared batch shape); targets at 2-5 and 8-9
    positions = [slice(2, 6), slice(8, 10)]
    logp = np.asarray(trainer_logp(params, _batch(samples, pack=True, row_multiple=N)))
    trainer = [logp[0, positions[0]], logp[0, positions[1]]]
    # behaviour = trainer - log(ratio), so π_trainer/π_behaviour is exactly `ratios`
    samples = _with_logps(samples, [t - np.log(r) for t, r in zip(trainer, ratios, strict=True)])
    batch = _batch(samples, pack=True, row_multiple=N)
    assert batch["tokens"].shape == (N, SEQ_LEN)
    loss_sum, aux, grads = loss_and_grad(obj, params, batch, None, 1)
    assert float(aux["weight"]) == 6.0 and float(aux["tokens"]) == 6.0
    expected = {"token": -4.75 / 6, "sequence": -6.5 / 6}[obj.tis_level]
    close(sum(-a * sum(w) for a, w in zip(adv, weights, strict=True)) / 6, expected)
    close(loss_sum / aux["weight"], expected)
    metrics = token_means({k: float(v) / float(aux["weight"]) for k, v in aux.items()})
    close(metrics["tis_capped_fraction"], capped)
    cot = np.zeros_like(logp)
    for pos, a, w in zip(positions, adv, weights, strict=True):
        cot[0, pos] = -a * np.asarray(w) / 6
    tree_close(scaled(grads, 6), logp_vjp(params, batch, jnp.asarray(cot)))


# ---------------------------------------------------------------- 5. micro-batches


def test_micro_batches_equal_full_batch(setup):
    params = setup["params"]
    batch = _batch(setup["samples"])
    frozen = {"ref": setup["ref"]}
    loss_1, sums_1, grads_1 = loss_and_grad(KL_OBJ, params, batch, frozen, 1)
    loss_2, sums_2, grads_2 = loss_and_grad(KL_OBJ, params, batch, frozen, 2)
    assert set(sums_1) == set(sums_2) and {"weight", "kl", "tokens", "tis_capped_fraction"} <= set(sums_1)
    assert abs(float(loss_1)) > 1e-2
    close(loss_2, loss_1)
    tree_close(grads_2, grads_1)
    tree_close(sums_2, sums_1, 1e-4)


# ---------------------------------------------------------------- 6. gspo: packed == padded == per-row reference


def _scatter(flat, index, fill):
    """[rows, cols] layout of the token values `flat`: index -1 marks prompt/padding (`fill` there)."""
    return jnp.where(index >= 0, flat[np.maximum(index, 0)], fill)


def test_gspo_padded_and_packed_equal_row_reference():
    rng = np.random.default_rng(1)
    lengths, eps = [6, 3, 0, 5], 0.05
    B, total = len(lengths), sum(lengths)
    starts = np.cumsum([0] + lengths[:-1])
    x = jnp.asarray(rng.normal(-2.0, 0.5, total), jnp.float32)  # every sampled token's logp
    old_flat = jnp.asarray(np.asarray(x) + rng.normal(0, 0.2, total), jnp.float32)
    adv = jnp.asarray([1.0, -1.5, 2.0, -0.5], jnp.float32)
    # layouts: (flat token index or -1, sequence index; B = padding). Every sequence starts with
    # a prompt token (-1, its own sequence index, not in the mask), as build_batch lays them out.
    padded_idx, padded_seq = np.full((B, 7), -1), np.full((B, 7), B)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        padded_idx[i, 1:1 + n], padded_seq[i, :1 + n] = np.arange(s, s + n), i
    # packed: row 0 = sequences 0 and 1, row 1 = sequence 3, sequence 2 (prompt only), padding
    packed_idx, packed_seq = np.full((2, 11), -1), np.full((2, 11), B)
    packed_idx[0, 1:7], packed_idx[0, 8:11], packed_idx[1, 1:6] = np.arange(0, 6), np.arange(6, 9), np.arange(9, 14)
    packed_seq[0, :7], packed_seq[0, 7:11], packed_seq[1, :6], packed_seq[1, 6] = 0, 1, 3, 2

    def reference(flat):
        mask = (padded_idx >= 0).astype(np.float32)
        seq_loss = _hand_gspo(_scatter(flat, padded_idx, -1.0), _scatter(old_flat, padded_idx, -3.0), adv, mask,
                              eps, eps)
        return jnp.sum(jnp.where(jnp.sum(mask, axis=1) > 0, seq_loss, 0.0)) / 3.0  # 3 sequences with tokens

    def per_token(index, seq):
        def fn(flat):
            mask = (index >= 0).astype(np.float32)
            adv_tok = jnp.where(seq < B, adv[np.minimum(seq, B - 1)], 0.0)
            weight = mask / np.maximum(np.asarray(lengths + [1]), 1)[seq]  # 1/len_i: "seq_mean_token_mean"
            loss, _ = pl.gspo(_scatter(flat, index, -1.0), _scatter(old_flat, index, -3.0), adv_tok, mask,
                                     jnp.asarray(seq, jnp.int32), B, eps, eps)
            return jnp.sum(loss * weight) / 3.0  # 3 sequences with tokens
        return fn

    ref_loss, ref_grad = jax.jit(jax.value_and_grad(reference))(x)
    seq_ratio = [math.exp(float(np.mean(np.asarray(x)[s:s + n] - np.asarray(old_flat)[s:s + n])))
                 for s, n in zip(starts, lengths, strict=True) if n]
    assert any(abs(r - 1) > eps for r in seq_ratio) and any(abs(r - 1) < eps for r in seq_ratio)  # some clip
    assert float(jnp.max(jnp.abs(ref_grad))) > 1e-3
    for index, seq in ((padded_idx, padded_seq), (packed_idx, packed_seq)):
        loss, grad = jax.jit(jax.value_and_grad(per_token(index, seq)))(x)
        close(loss, ref_loss)
        close(grad, ref_grad)


# ---------------------------------------------------------------- 7. arithmetic tasks


def _score(family, task, text, truncated=False):
    out = family.score(task, text, truncated)
    return out["reward"], out["correct"], out["format"]


def test_arithmetic_scores_hand_checked():
    family = ArithmeticFamily()
    task = Task(0, "482+59=", "541")
    assert _score(family, task, "541") == (1.0, 1.0, 1.0)
    assert _score(family, task, "541 ") == (0.0, 0.0, 0.0)  # wrong format
    assert _score(family, task, "540") == (0.0, 0.0, 1.0)
    assert _score(family, task, "541", truncated=True) == (0.0, 0.0, 0.0)
    assert _score(family, task, "The answer is 541") == (0.0, 0.0, 0.0)
    shaped = ArithmeticFamily(format_weight=0.1)
    assert _score(shaped, task, "541") == pytest.approx((1.1, 1.0, 1.0))
    assert _score(shaped, task, "540") == pytest.approx((0.1, 0.0, 1.0))
    assert _score(shaped, task, "54x") == (0.0, 0.0, 0.0)
    assert _score(shaped, task, "541", truncated=True) == (0.0, 0.0, 0.0)
    assert _score(shaped, Task(0, "3-10=", "-7"), "-7") == pytest.approx((1.1, 1.0, 1.0))


def test_arithmetic_tasks_deterministic_and_correct():
    family = ArithmeticFamily(seed=3, min_digits=2, max_digits=3)
    first = family.tasks(0, 20)
    assert first == ArithmeticFamily(seed=3, min_digits=2, max_digits=3).tasks(0, 20)
    assert [t.index for t in first] == list(range(20))
    assert family.tasks(5, 3) == first[5:8]
    assert family.tasks(0, 20, stream=1) != first
    assert ArithmeticFamily(seed=4, min_digits=2, max_digits=3).tasks(0, 20) != first
    for op, symbol, fn in (("add", "+", lambda a, b: a + b), ("sub", "-", lambda a, b: a - b),
                           ("mul", "*", lambda a, b: a * b)):
        tasks = ArithmeticFamily(op=op, seed=3, min_digits=2, max_digits=3).tasks(0, 30)
        for t in tasks:
            m = re.fullmatch(r"(\d+)" + re.escape(symbol) + r"(\d+)=", t.prompt)
            assert m, t.prompt
            a, b = int(m.group(1)), int(m.group(2))
            assert 10 <= a <= 999 and 10 <= b <= 999
            assert t.answer == str(fn(a, b))
        if op == "sub":
            assert any(t.answer.startswith("-") for t in tasks)
    with pytest.raises(ValueError, match="rl.task"):
        ArithmeticFamily(op="div")


# ---------------------------------------------------------------- 8. config validation


def _config(**overrides):
    return config_lib.load_config("configs/quickstart.py", overrides)


def _validate(config):
    config_lib.validate(config, 8, {"rl": None, "sft": None})


def test_quickstart_config_is_valid():
    _validate(_config())
    _validate(_config(**{"rl.clip_high": 0.28, "rl.proximal": "behaviour"}))  # clip knobs that act
    _validate(_config(**{"rl.clip_high": 0.28, "rl.updates_per_batch": 2}))
    _validate(_config(**{"rl.policy_loss": "gspo", "rl.aggregation": "seq_mean_token_mean"}))
    _validate(_config(**{"rl.prompts_per_step": 3, "rl.group_size": 2, "rl.pack": True}))  # packed: rows bucketed
    _validate(_config(**{"rl.pack": True, "rl.share_prompts": True, "rl.row_len": 512}))
    _validate(_config(**{"rl.teacher": "/teacher", "rl.distill_estimator": "full",
                         "rl.distill_teacher_temperature": 0.5}))


@pytest.mark.parametrize("overrides, pattern", [
    ({"rl.advantage": "grpoo"}, r"rl\.advantage='grpoo'.*Did you mean \"grpo\""),
    ({"rl.policy_loss": "gspo", "rl.aggregation": "token_mean"}, r"rl\.aggregation='seq_mean_token_mean'"),
    ({"rl.seq_len": 40}, r"rl\.seq_len=40 exceeds rl\.engine\.max_len=32"),
    ({"rl.backend": "sglang"}, r"rl\.sglang_urls"),
    ({"rl.prompts_per_step": 3, "rl.group_size": 2}, r"rl\.prompts_per_step×rl\.group_size=6"),
    ({"rl.kl_coef": 0.1, "rl.kl_mode": "reward"}, r"rl\.kl_estimator='k3'.*only k1.*set rl\.kl_estimator='k1'"),
    ({"rl.clip_high": 0.28}, r"rl\.clip_high=0\.28 never acts.*rl\.proximal='behaviour'"),
    ({"rl.proximal": "old"}, r"rl\.proximal='old'"),
    ({"rl.top_p": 0.0}, r"0 < top_p <= 1"),
    ({"rl.share_prompts": True, "rl.advantage": "gae"},
     r"rl\.share_prompts=True .*needs: rl\.pack=False \(needs True\); rl\.advantage='gae'"),
    ({"rl.row_len": 8, "rl.pack": True}, r"rl\.row_len=8: must be 0 \(= rl\.seq_len\) or at least rl\.seq_len=16"),
    ({"rl.row_len": 64}, r"rl\.row_len=64 sets the width of packed rows: set rl\.pack=True"),
    ({"rl.teacher": "/teacher", "rl.distill_teacher_temperature": 0.5},  # was ignored by the sampled estimator
     r"rl\.distill_teacher_temperature=0\.5 acts only with rl\.distill_estimator='full'.*Set rl\.distill_estimator"),
])
def test_bad_rl_config_names_the_field(overrides, pattern):
    with pytest.raises(config_lib.ConfigError, match=pattern):
        _validate(_config(**overrides))


# ---------------------------------------------------------------- 9. the producer


class FakeBackend:
    """`generate` answers every request with `outcome(task, k) -> (text, finish_type)`."""

    def __init__(self, tokenizer, family, outcome):
        self.tokenizer, self.family, self.outcome = tokenizer, family, outcome
        self.requests = []

    def generate(self, requests):
        self.requests += requests
        out = []
        for r in requests:
            _, t, k = r.rid.split("-")
            task, k = self.family.task(int(t[1:])), int(k[1:])
            text, finish = self.outcome(task, k)
            ids = self.tokenizer.encode(text) + ([self.tokenizer.eos_id] if finish == "stop" else [])
            reason = {"stop": {"type": "stop", "matched": self.tokenizer.eos_id},
                      "length": {"type": "length", "length": len(ids)},
                      "abort": {"type": "abort", "message": "engine died"}}[finish]
            out.append(Completion(r.rid, list(r.input_ids), ids, [-0.1 * (j + 1) for j in range(len(ids))],
                                  [7] * len(ids), reason))
        return out


def _wrong(task):
    return str(int(task.answer) + 1)


_PRODUCERS: list[Producer] = []


@pytest.fixture(autouse=True)
def _stop_producers():
    """Stops every producer a test made (its scheduler and verifier threads)."""
    yield
    while _PRODUCERS:
        _PRODUCERS.pop().stop()


def _producer(outcome, family=None, **rl_overrides):
    rl = config_lib.load_config("configs/quickstart.py:smoke").rl
    for key, value in rl_overrides.items():
        setattr(rl, key, value)
    tokenizer = byte_level_tokenizer()
    family = family or ArithmeticFamily(seed=5)
    backend = FakeBackend(tokenizer, family, outcome)
    _PRODUCERS.append(Producer(backend, family, tokenizer, ProducerSettings.from_config(rl), seed=11))
    return _PRODUCERS[-1], backend, tokenizer, family


def _group_rewards(batch, k):
    return np.array([s.rewards["reward"] for s in batch.samples], np.float32).reshape(-1, k)


def test_producer_batch_order_and_advantages():
    # even k answers correctly; task 2's group is all correct (zero variance, kept without dynamic sampling)
    outcome = lambda task, k: (task.answer if k % 2 == 0 or task.index == 2 else _wrong(task), "stop")
    producer, backend, tokenizer, family = _producer(outcome)
    G, K = producer.settings.prompts_per_step, producer.settings.group_size
    assert (G, K) == (4, 4)
    batch = producer.make_batch(0)
    assert len(batch.samples) == G * K and batch.cursor_end == G and batch.failures == []
    assert batch.stats["generation_rounds"] == 1.0 and batch.stats["groups_filtered"] == 0.0
    for g in range(G):
        task = family.task(g)
        for k in range(K):
            s, req = batch.samples[g * K + k], backend.requests[g * K + k]
            assert (s.group, s.task_index) == (g, g)
            assert s.prompt_ids == tokenizer.encode(task.prompt) == req.input_ids
            assert req.sampling.sampling_seed == sample_seed(11, g, k)
            assert req.sampling.max_new_tokens == producer.settings.max_new_tokens
            assert tokenizer.decode(s.output_ids[:-1]) == outcome(task, k)[0]
            assert s.behaviour_logp == pytest.approx([-0.1 * (j + 1) for j in range(len(s.output_ids))])
            assert s.versions == [7] * len(s.output_ids) and not s.truncated
            assert s.rewards["reward"] == (1.0 if k % 2 == 0 or g == 2 else 0.0)
    rewards = _group_rewards(batch, K)
    close([s.advantage for s in batch.samples], np.asarray(adv_lib.grpo(jnp.asarray(rewards))).reshape(-1))
    close([s.advantage for s in batch.samples[:K]], [1, -1, 1, -1])  # hand: mean 0.5, std 0.5
    assert all(s.advantage == 0.0 for s in batch.samples[2 * K:3 * K])
    # the next batch continues the task stream
    nxt = producer.make_batch(1)
    assert nxt.cursor_end == 2 * G and [s.task_index for s in nxt.samples[::K]] == [4, 5, 6, 7]
    assert len({r.sampling.sampling_seed for r in backend.requests}) == 2 * G * K


def test_producer_dynamic_sampling_refills():
    # odd tasks: every sample correct (zero variance, dropped); even tasks: even k correct
    outcome = lambda task, k: (task.answer if task.index % 2 or k % 2 == 0 else _wrong(task), "stop")
    producer, backend, _, _ = _producer(outcome, dynamic_sampling=True, max_refill_rounds=2)
    batch = producer.make_batch(0)
    K = producer.settings.group_size
    # round 1: tasks 0-3 keep 0, 2; round 2: tasks 4, 5 keep 4; round 3: task 6
    assert len(backend.requests) == 7 * K
    assert [s.task_index for s in batch.samples[::K]] == [0, 2, 4, 6]
    assert [s.group for s in batch.samples] == [g for g in range(4) for _ in range(K)]
    assert batch.cursor_end == 7
    assert batch.stats["generation_rounds"] == 3.0 and batch.stats["groups_filtered"] == 3.0
    close([s.advantage for s in batch.samples], np.tile([1.0, -1.0], 8))


def test_producer_dynamic_sampling_gives_up_after_max_refill_rounds():
    producer, backend, _, _ = _producer(lambda task, k: (_wrong(task), "stop"), dynamic_sampling=True,
                                        max_refill_rounds=2)
    batch = producer.make_batch(0)
    K = producer.settings.group_size
    assert len(backend.requests) == 3 * 4 * K  # 1 round + 2 refills of 4 prompts each
    assert batch.cursor_end == 12 and batch.stats["generation_rounds"] == 3.0
    assert [s.task_index for s in batch.samples[::K]] == [0, 1, 2, 3]  # trains on flat groups
    assert all(s.advantage == 0.0 for s in batch.samples)


class ExplodingFamily(ArithmeticFamily):
    def score(self, task, completion, truncated):
        if completion == "boom":
            raise ValueError("bad verifier")
        return super().score(task, completion, truncated)


def test_producer_records_failures_and_round_trips():
    # k=0 correct, k=1 crashes the verifier, k=2 wrong and truncated, k=3 aborted
    def outcome(task, k):
        return [(task.answer, "stop"), ("boom", "stop"), (task.answer, "length"), (task.answer, "abort")][k]

    producer, _, _, _ = _producer(outcome, family=ExplodingFamily(seed=5))
    batch = producer.make_batch(3)
    assert len(batch.failures) == 2 * 4
    for g in range(4):
        group = batch.samples[2 * g:2 * (g + 1)]  # the failures are recorded, not trained on
        assert [s.rewards["reward"] for s in group] == [1.0, 0.0]
        assert [s.rewards["verifier_error"] for s in group] == [0.0, 0.0]
        assert [s.truncated for s in group] == [False, True]
        crash, abort = batch.failures[2 * g], batch.failures[2 * g + 1]
        assert crash == {"task_index": g, "family": "add", "rid": f"s3-t{g}-k1", "error": "ValueError: bad verifier"}
        assert abort == {"task_index": g, "family": "add", "rid": f"s3-t{g}-k3",
                         "error": "RuntimeError: rollout aborted: engine died"}
    close([s.advantage for s in batch.samples], np.tile([1.0, -1.0], 4))
    restored = ScoredBatch.from_json(json.loads(json.dumps(batch.to_json())))
    assert restored == batch
    assert restored.samples[0] is not batch.samples[0] and isinstance(restored.samples[0], Sample)


def test_failed_verifier_is_left_out_of_the_loss_and_the_group_statistics():
    """Infrastructure failures are not training signal: a batch where one sample's verifier
    crashed has the loss (and gradient) of the batch without that sample, its group's advantages
    computed over the other three."""
    outcome = lambda task, k: (("boom" if k == 1 else task.answer if k != 2 else _wrong(task)), "stop")
    producer, _, tokenizer, _ = _producer(outcome, family=ExplodingFamily(seed=5))
    batch = producer.make_batch(0)
    assert len(batch.failures) == 4 and len(batch.samples) == 12
    hand = [1 / math.sqrt(2.0), -math.sqrt(2.0), 1 / math.sqrt(2.0)]  # rewards 1, 0, 1: mean 2/3, std √2/3
    close([s.advantage for s in batch.samples], hand * 4, 1e-4)
    without = [dataclasses.replace(s, advantage=a) for s, a in zip(batch.samples, hand * 4, strict=True)]
    cfg = dataclasses.replace(CFG, vocab_size=tokenizer.vocab_size)
    params = params_lib.init_params(cfg, jax.random.key(1), sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    loss_fn = jax.jit(jax.value_and_grad(lambda p, b: rl_loss(cfg, Objective(num_seqs=16), p, b, None, None)[0]))
    (loss, grads), (loss_without, grads_without) = (
        loss_fn(params, {k: jnp.asarray(v) for k, v in build_batch(b, 24, 0, min_rows=16).items()})
        for b in (batch.samples, without))
    assert float(_global_norm(grads)) > 1e-3  # (the loss itself is ~0: advantages sum to 0 per group)
    close(loss, loss_without)
    tree_close(grads, grads_without)


def test_a_batch_of_failures_trains_on_nothing():
    """Every verifier call crashes: the producer refills up to rl.max_refill_rounds, then hands over
    an empty batch (all failures recorded); its metrics say so instead of crashing the step."""
    from rlvr.trainers.rl import rollout_metrics

    producer, backend, _, _ = _producer(lambda task, k: ("boom", "stop"), family=ExplodingFamily(seed=5))
    batch = producer.make_batch(0)
    assert batch.samples == [] and len(batch.failures) == len(backend.requests) == 3 * 4 * 4
    metrics = rollout_metrics(batch, 0)
    assert metrics["samples"] == 0.0 and metrics["failures"] == 48.0 and math.isnan(metrics["reward"])


def test_rollout_metrics_count_the_groups_without_signal():
    """zero_variance_groups: the share of groups whose rewards are all equal (all solved, all failed:
    zero GRPO advantage), here 2 of 3 (hand-counted); a mixed group is not one."""
    from rlvr.trainers.rl import rollout_metrics

    def group(g, rewards):
        return [Sample(g, g, [1], [2], [0.0], [0], False, {"reward": r, "correct": r}) for r in rewards]
    batch = ScoredBatch(0, group(0, [1.0, 1.0]) + group(1, [0.0, 1.0, 0.0]) + group(2, [0.0, 0.0]), 0, {}, [])
    metrics = rollout_metrics(batch, 0)
    assert metrics["zero_variance_groups"] == pytest.approx(2 / 3) and metrics["pass_at_group"] == pytest.approx(2 / 3)


def _global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def test_kl_penalty_is_added_after_the_group_normalisation():
    """rl.kl_mode="reward": a group whose samples all solved the task gets advantages -kl_coef·KL_i
    (small), not ±1 from dividing tiny KL differences by their own std."""
    from rlvr.rl.producer import group_advantages

    group = [Sample(0, 0, [1], [2, 3], [-0.1, -0.2], [0, 0], False, {"reward": 1.0, "kl_penalty": p})
             for p in (-0.01, -0.012, -0.008, -0.011)]
    close(group_advantages([group], "grpo"), [-0.01, -0.012, -0.008, -0.011])
    producer, _, _, _ = _producer(lambda task, k: (task.answer, "stop"), kl_coef=0.1, kl_mode="reward",
                                  kl_estimator="k1")
    producer.ref_logprobs = lambda samples: [np.asarray(s.behaviour_logp) + 0.01 * (i % 3)
                                             for i, s in enumerate(samples)]
    batch = producer.make_batch(0)
    for i, s in enumerate(batch.samples):  # k1 = behaviour - ref = -0.01·(i % 3) per token
        close(s.rewards["kl_penalty"], 0.1 * 0.01 * (i % 3) * len(s.output_ids))
        close(s.advantage, s.rewards["kl_penalty"])  # every sample solved its task: no task signal
        assert s.rewards["reward"] == 1.0


def test_kl_penalty_of_an_empty_completion_is_zero():
    """A zero-length output (a stop string at once) has no tokens, so no KL: its penalty is 0, and its
    neighbours' are their own sums. Hand: k1 = behaviour - ref; [-0.1, -0.2] vs [-0.3, -0.2]: 0.2 + 0,
    penalty -0.1 * 0.2 = -0.02; [-0.5] * 3 vs [-0.6, -0.7, -0.5]: 0.1 + 0.2 + 0, penalty -0.03."""
    producer, _, _, _ = _producer(lambda task, k: (task.answer, "stop"), kl_coef=0.1, kl_mode="reward",
                                  kl_estimator="k1")
    refs = {2: [-0.3, -0.2], 0: [], 3: [-0.6, -0.7, -0.5]}
    producer.ref_logprobs = lambda samples: [np.asarray(refs[len(s.output_ids)]) for s in samples]

    def sample(behaviour):
        return Sample(0, 0, [1], [5] * len(behaviour), behaviour, [0] * len(behaviour), False, {"reward": 1.0})

    for behaviours, expected in (([[-0.1, -0.2], [], [-0.5] * 3], [-0.02, 0.0, -0.03]),  # empty in the middle
                                 (([-0.1, -0.2], []), [-0.02, 0.0])):  # and last
        samples = [sample(list(b)) for b in behaviours]
        producer._kl_penalty(samples)
        close([s.rewards["kl_penalty"] for s in samples], expected)


def test_reinforce_pp_normalises_over_the_batch_when_groups_are_cut():
    """Groups of 4, 2 and 3 samples (the scheduler cut two): REINFORCE++'s advantages are the
    rewards normalised by the mean and std of all 9 samples, as with full groups."""
    from rlvr.rl.producer import group_advantages

    rewards = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0], [0.0, 0.5, 0.0]]
    groups = [[Sample(g, g, [1], [2], [0.0], [0], False, {"reward": r}) for r in rs] for g, rs in enumerate(rewards)]
    flat = np.concatenate(rewards)
    close(group_advantages(groups, "reinforce_pp"), (flat - flat.mean()) / (flat.std() + 1e-6))
    centred = np.concatenate([np.asarray(r) - np.mean(r) for r in rewards])  # the group-baseline variant
    close(group_advantages(groups, "reinforce_pp_baseline"), (centred - centred.mean()) / (centred.std() + 1e-6))
    grpo = np.concatenate([(np.asarray(r) - np.mean(r)) / (np.std(r) + 1e-6) for r in rewards])
    close(group_advantages(groups, "grpo"), grpo)


# ---------------------------------------------------------------- 10. GAE with the value head

def test_gae_batch_matches_brute_force_and_value_loss(setup):
    """The trainer's GAE pass (value head on the backbone, reward on the last sampled token,
    whitened advantages) against a per-sequence Python loop, in padded and packed layouts; then
    rl_loss adds value_coef · 0.5 (v - R)² exactly."""
    from rlvr import api
    from rlvr.models.transformer import forward_with_values
    from rlvr.rl import update as update_lib

    gamma, lam = 0.9, 0.8
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    model = api.with_value_head(api.Model(CFG, setup["params"], mesh))
    rng = np.random.default_rng(1)
    head = {"kernel": jnp.asarray(rng.normal(size=model.params["value_proj"]["kernel"].shape), jnp.float32),
            "bias": jnp.asarray([0.3], jnp.float32)}
    params = {**model.params, "value_proj": head}
    samples = [dataclasses.replace(s, rewards={"reward": float(r)})
               for s, r in zip(setup["samples"], rng.normal(size=N), strict=True)]
    gae_fn = update_lib.gae_fn(model.cfg, gamma, lam)

    padded = build_batch(samples, SEQ_LEN, PAD)
    _, values, _ = forward_with_values(model.cfg, params, jnp.asarray(padded["tokens"]),
                                       jnp.asarray(padded["positions"]), jnp.asarray(padded["segment_ids"]))
    values = np.asarray(values)
    advs, rets, olds = [], [], []
    for i, s in enumerate(samples):  # target j of sample i is output token j, valued at position p-1+j
        p, o = len(s.prompt_ids), len(s.output_ids)
        v = values[i, p - 1: p - 1 + o]
        r = np.zeros(o)
        r[-1] = s.rewards["reward"]
        a = np.zeros(o)
        for t in reversed(range(o)):
            nxt = v[t + 1] if t + 1 < o else 0.0
            a[t] = r[t] + gamma * nxt - v[t] + (gamma * lam * a[t + 1] if t + 1 < o else 0.0)
        advs.append(a)
        rets.append(a + v)
        olds.append(v)
    flat = np.concatenate(advs)
    whitened = [(a - flat.mean()) / (flat.std() + 1e-6) for a in advs]

    for pack in (False, True):
        arrays = build_batch(samples, SEQ_LEN, PAD, pack=pack)
        out = gae_fn(params, arrays, samples)
        for name, expected in (("advantages", whitened), ("returns", rets), ("old_values", olds)):
            got = out[name]
            for i in range(len(samples)):  # positions of sample i's output tokens in the layout
                rows, cols = np.nonzero((arrays["seq_index"] == i) & (arrays["loss_mask"] == 1))
                close(got[rows, cols], expected[i], tol=2e-4)

    obj = Objective("ppo_clip", num_seqs=N, value_coef=0.5, value_clip=0.2)
    base = dataclasses.replace(obj, value_coef=0.0)
    arrays = {k: jnp.asarray(v) for k, v in gae_fn(params, build_batch(samples, SEQ_LEN, PAD), samples).items()}
    arrays["advantages"] = jnp.zeros_like(arrays["advantages"])  # isolate the value term
    with_value, aux = rl_loss(model.cfg, obj, params, arrays, None, None)
    without, _ = rl_loss(model.cfg, base, params, arrays, None, None)
    # v = v_old (same params): the clip is inactive and the term is the token mean of 0.5 (v - R)^2
    expected = np.mean(np.concatenate([0.5 * (v - r) ** 2 for v, r in zip(olds, rets, strict=True)]))
    close((with_value - without) / aux["weight"], 0.5 * expected, tol=1e-4)
    assert expected > 0.01


def test_producer_passes_over_prompts_too_long_for_seq_len():
    """A prompt that leaves no room for max_new_tokens in seq_len is skipped (and counted), not
    sent to the engine; the cursor still moves past it, so the stream stays deterministic."""
    outcome = lambda task, k: (task.answer, "stop")
    producer, backend, tokenizer, family = _producer(outcome, seq_len=11)  # max_new_tokens 6: prompts <= 5
    batch = producer.make_batch(0)
    drawn = family.tasks(0, batch.cursor_end)
    fitting = [t.index for t in drawn if len(t.prompt) <= 5]
    assert [s.task_index for s in batch.samples[::producer.settings.group_size]] == fitting[:4]
    assert batch.stats["prompts_too_long"] == batch.cursor_end - len(fitting) > 0
    assert all(len(r.input_ids) <= 5 for r in backend.requests)


def test_constrained_decoding_switch_puts_the_task_grammar_on_the_requests():
    from rlvr.tasks.procedural import FAMILIES

    family = FAMILIES["json_person"](seed=3)
    roomy = dict(seq_len=2048, max_new_tokens=256)  # the JSON prompts are long in a byte-level vocabulary
    producer, backend, _, _ = _producer(lambda task, k: (f"<answer>{task.answer}</answer>", "stop"), family,
                                        constrained_decoding=True, **roomy)
    batch = producer.make_batch(0)
    assert all(s.rewards["reward"] == 1.0 for s in batch.samples)  # the reference answers fit the grammar
    for request in backend.requests:
        task = family.task(int(request.rid.split("-")[1][1:]))
        pattern = request.sampling.regex
        assert pattern.startswith("<answer>") and str(task.verifier["schema"]["required"][0]) in pattern
        assert re.fullmatch(pattern.replace("\\#", "#"), f"<answer>{task.answer}</answer>")
    plain, plain_backend, _, _ = _producer(lambda task, k: (f"<answer>{task.answer}</answer>", "stop"), family,
                                           **roomy)
    plain.make_batch(0)
    assert all(r.sampling.constraint is None for r in plain_backend.requests)  # off by default
