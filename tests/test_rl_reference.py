"""The RL objective against an independent implementation: a plain NumPy re-implementation of the
formulas in docs/explanation/rl-objective.md ("What the trainer optimises") computes the advantages,
the per-token KL and the per-token and aggregated loss of one batch, for every rl.advantage × rl.policy_loss ×
rl.aggregation, and they equal the trainer's (`producer.group_advantages`, `update.gae_fn`,
`objective.token_terms`, `objective.rl_loss`).

The NumPy side takes only the batch's samples and the per-token log-probs and values the model
gives (the trainer's, behaviour, proximal and reference policies); every formula on top of them is
written here again, loop by loop, from that page.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlvr import losses, sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.rl.advantages import ADVANTAGE_FNS
from rlvr.rl.batching import AGGREGATIONS, Sample, build_batch
from rlvr.rl.objective import Objective, rl_loss, token_terms
from rlvr.rl.producer import group_advantages
from rlvr.rl.update import gae_fn

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=16, dtype="float32", param_dtype="float32", value_head=True)
SEQ_LEN, MAX_NEW, GROUPS, K = 16, 8, 3, 3
N = GROUPS * K
GAMMA, LAM, EPS_LOW, EPS_HIGH, DUAL, CAP, BETA, VALUE_COEF, VALUE_CLIP = 0.9, 0.8, 0.2, 0.28, 3.0, 1.5, 0.3, 0.5, 0.2


@pytest.fixture(scope="module")
def world():
    """Random params (policy with a value head, and a reference), 9 samples in 3 groups (rewards in
    {0, 0.5, 1}, outputs of 1-8 tokens), the trainer's per-token log-probs of their outputs, and
    behaviour / proximal log-probs around them (so ratios, clips and TIS weights all act)."""
    rng = np.random.default_rng(0)
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    params = params_lib.init_params(CFG, jax.random.key(0), mesh)
    params = jax.tree.map(lambda x: x * 3.0, params)  # larger logits: ratios far from 1
    ref = jax.tree.map(lambda x: x + 0.3 * jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    samples = []
    for i in range(N):
        p, o = int(rng.integers(2, 6)), int(rng.integers(1, MAX_NEW + 1))
        samples.append(Sample(i // K, i, rng.integers(1, 32, p).tolist(), rng.integers(1, 32, o).tolist(), [0.0] * o,
                              [0] * o, False, {"reward": float(rng.choice([0.0, 0.5, 1.0]))}))
    arrays = build_batch(samples, SEQ_LEN, 0)
    logp = _outputs(samples, _logprobs(params, arrays))
    ref_logp = _outputs(samples, _logprobs(ref, arrays))
    values = _outputs(samples, np.asarray(losses.model_values(CFG, params, *_model_inputs(arrays)))[:, :-1])
    behaviour = [lp + rng.normal(0, 0.3, lp.shape) for lp in logp]
    old = [lp + rng.normal(0, 0.3, lp.shape) for lp in logp]
    samples = [dataclasses.replace(s, behaviour_logp=b.tolist()) for s, b in zip(samples, behaviour, strict=True)]
    return dict(params=params, ref=ref, samples=samples, logp=logp, ref_logp=ref_logp, values=values,
                behaviour=behaviour, old=old)


def _model_inputs(arrays):
    return jnp.asarray(arrays["tokens"]), jnp.asarray(arrays["positions"]), jnp.asarray(arrays["segment_ids"])


@jax.jit
def _logprobs_jit(params, tokens, positions, segment_ids):
    return losses.model_token_logprobs(CFG, params, tokens, positions, segment_ids, chunk_size=4)[0]


def _logprobs(params, arrays):
    return np.asarray(_logprobs_jit(params, *_model_inputs(arrays)))


def _outputs(samples, per_target):
    """[B, T-1] target-aligned values -> per-sample arrays over its output tokens (padded rows)."""
    return [np.asarray(per_target[i, len(s.prompt_ids) - 1: len(s.prompt_ids) - 1 + len(s.output_ids)], np.float64)
            for i, s in enumerate(samples)]


# ---------------------------------------------------------------- the NumPy re-implementation


def np_advantages(samples, advantage, values=None):
    """Per sample, an array over its output tokens (the page's advantage table)."""
    r = np.array([s.rewards["reward"] for s in samples], np.float64)
    groups = [[i for i, s in enumerate(samples) if s.group == g] for g in sorted({s.group for s in samples})]
    out = np.zeros(len(samples))
    if advantage in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"):
        for members in groups:
            x = r[members]
            if advantage == "grpo":
                out[members] = (x - x.mean()) / (x.std() + 1e-6)
            elif advantage == "rloo":
                out[members] = len(x) / (len(x) - 1) * (x - x.mean()) if len(x) > 1 else 0.0
            else:
                out[members] = x - x.mean()
    if advantage == "reinforce_pp":
        out = (r - r.mean()) / (r.std() + 1e-6)
    if advantage == "reinforce_pp_baseline":
        out = (out - out.mean()) / (out.std() + 1e-6)
    if advantage != "gae":
        return [np.full(len(s.output_ids), a) for s, a in zip(samples, out, strict=True)], None
    adv = []
    for s, v in zip(samples, values, strict=True):  # reward on the last sampled token, terminal after it
        rewards, a, nxt_v, nxt_a = np.zeros(len(v)), np.zeros(len(v)), 0.0, 0.0
        rewards[-1] = s.rewards["reward"]
        for t in reversed(range(len(v))):
            a[t] = rewards[t] + GAMMA * nxt_v - v[t] + GAMMA * LAM * nxt_a
            nxt_v, nxt_a = v[t], a[t]
        adv.append(a)
    flat = np.concatenate(adv)
    returns = [a + v for a, v in zip(adv, values, strict=True)]
    return [(a - flat.mean()) / (flat.std() + 1e-6) for a in adv], returns


def np_token_loss(policy_loss, adv, logp, old, behaviour, ref, values=None, returns=None):
    """Per-token loss of one sequence and its KL (the page: policy loss x TIS + β·kl + value term)."""
    log_ratio = logp - old
    ratio = np.exp(log_ratio) if policy_loss == "ppo_clip" else np.full_like(logp, np.exp(log_ratio.mean()))
    lo, hi = (EPS_LOW, EPS_HIGH) if policy_loss == "ppo_clip" else (3e-4, 4e-4)
    loss = np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi))
    if policy_loss == "ppo_clip":
        loss = np.where(adv < 0, np.minimum(loss, DUAL * np.abs(adv)), loss)
    loss = loss * np.minimum(np.exp(old - behaviour), CAP)  # token-level TIS, proximal = old
    d = ref - logp
    kl = np.exp(d) - d - 1  # k3
    loss = loss + BETA * kl
    if values is not None:  # v = v_old (the same params): the value clip is inactive
        loss = loss + VALUE_COEF * 0.5 * np.maximum((values - returns) ** 2,
                                                     (np.clip(values, values - VALUE_CLIP, values + VALUE_CLIP)
                                                      - returns) ** 2)
    return loss, kl


def np_aggregate(per_seq_losses, aggregation):
    """Σ_t w_t·ℓ_t / W (the page's aggregation table)."""
    total = sum(x.sum() for x in per_seq_losses)
    seqs = len(per_seq_losses)
    if aggregation == "token_mean":
        return total / sum(len(x) for x in per_seq_losses)
    if aggregation == "seq_mean_token_mean":
        return sum(x.mean() for x in per_seq_losses) / seqs
    if aggregation == "seq_mean_token_sum":
        return total / seqs
    return total / (seqs * MAX_NEW)  # token_sum_norm


# ---------------------------------------------------------------- the check


_GAE = functools.cache(lambda: gae_fn(CFG, GAMMA, LAM))  # compiled once for the module


@functools.cache
def _trainer_fns(obj: Objective):
    terms = jax.jit(lambda p, b, f: token_terms(CFG, obj, p, b, f))
    loss = jax.jit(lambda p, b, f: rl_loss(CFG, obj, p, b, None, f))
    return terms, loss


CASES = [(a, "ppo_clip", g) for a in [*ADVANTAGE_FNS, "gae"] for g in AGGREGATIONS] + \
        [(a, "gspo", "seq_mean_token_mean") for a in [*ADVANTAGE_FNS, "gae"]]


@pytest.mark.parametrize("advantage, policy_loss, aggregation", CASES)
def test_objective_matches_numpy_reimplementation(world, advantage, policy_loss, aggregation):
    samples = world["samples"]
    gae = advantage == "gae"
    # trainer: advantages, then the per-token terms and the aggregated loss of the batch
    arrays = build_batch(samples, SEQ_LEN, 0, aggregation, MAX_NEW)
    if gae:
        arrays = _GAE()(world["params"], arrays, samples)
    else:
        adv = group_advantages([[s for s in samples if s.group == g] for g in range(GROUPS)], advantage)
        arrays = build_batch([dataclasses.replace(s, advantage=float(a)) for s, a in zip(samples, adv, strict=True)],
                             SEQ_LEN, 0, aggregation, MAX_NEW)
    old = build_batch([dataclasses.replace(s, behaviour_logp=o.tolist()) for s, o in zip(samples, world["old"],
                                                                                          strict=True)], SEQ_LEN, 0)
    arrays["old_logp"] = old["behaviour_logp"]
    obj = Objective(policy_loss, *((EPS_LOW, EPS_HIGH) if policy_loss == "ppo_clip" else (3e-4, 4e-4)),
                    dual_clip=DUAL if policy_loss == "ppo_clip" else None, kl_coef=BETA, kl_estimator="k3",
                    tis_cap=CAP, num_seqs=N, value_coef=VALUE_COEF if gae else 0.0, value_clip=VALUE_CLIP,
                    logprob_chunk_size=4)
    terms, loss_fn = _trainer_fns(obj)
    batch = {k: jnp.asarray(v) for k, v in arrays.items()}
    frozen = {"ref": world["ref"]}
    per_token, metrics, _ = terms(world["params"], batch, frozen)
    loss_sum, aux = loss_fn(world["params"], batch, frozen)

    # NumPy
    np_adv, returns = np_advantages(samples, advantage, world["values"])
    per_seq, kls = [], []
    for i in range(N):
        loss, kl = np_token_loss(policy_loss, np_adv[i], world["logp"][i], world["old"][i], world["behaviour"][i],
                                 world["ref_logp"][i], world["values"][i] if gae else None,
                                 returns[i] if gae else None)
        per_seq.append(loss)
        kls.append(kl)

    trainer_adv = _outputs(samples, arrays["advantages"][:, 1:])
    for i in range(N):
        np.testing.assert_allclose(trainer_adv[i], np_adv[i], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(_outputs(samples, np.asarray(metrics["kl"]))[i], kls[i], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(_outputs(samples, np.asarray(per_token))[i], per_seq[i], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(float(loss_sum / aux["weight"]), np_aggregate(per_seq, aggregation), rtol=1e-4,
                               atol=1e-6)
    if policy_loss == "ppo_clip":  # the batch exercises the clip, the dual clip and the TIS cap
        assert 0 < float(aux["clip_fraction"]) < float(aux["tokens"])
        assert 0 < float(aux["tis_capped_fraction"]) < float(aux["tokens"])
