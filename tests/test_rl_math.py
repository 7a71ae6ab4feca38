"""RL maths (rlvr.rl): hand-computed examples (plain Python) and invariances for every function."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlvr.rl import advantages as adv_lib
from rlvr.rl import filters
from rlvr.rl import policy_loss as pl

R = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.5]]


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=tol, atol=tol)


def _mean(xs):
    return sum(xs) / len(xs)


def _pstd(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


# ---------------------------------------------------------------- advantages


def test_grpo_hand_computed():
    # row 0: mean 0.5, pop std 0.5 -> ±1; row 1: mean 0.375, computed with a loop.
    expected = [[(x - _mean(row)) / (_pstd(row) + 1e-6) for x in row] for row in R]
    close(expected[0], [1.0, -1.0, -1.0, 1.0], 1e-5)
    close(adv_lib.grpo(jnp.array(R)), expected)
    close(adv_lib.grpo(jnp.array(R), normalize_std=False), [[x - _mean(row) for x in row] for row in R])


def test_grpo_invariances():
    r = jax.random.uniform(jax.random.PRNGKey(0), (3, 6))
    a = adv_lib.grpo(r)
    close(jnp.sum(a, axis=1), jnp.zeros(3), 1e-5)
    shifted = r + jnp.array([[5.0], [-2.0], [0.3]])
    close(adv_lib.grpo(shifted), a, 1e-4)
    close(adv_lib.grpo(jnp.ones((2, 4))), jnp.zeros((2, 4)))  # zero-variance group: no signal


def test_grpo_group_ids_matches_2d_and_ragged():
    flat = jnp.array(R).reshape(-1)
    ids = jnp.array([0, 0, 0, 0, 1, 1, 1, 1])
    close(adv_lib.grpo(flat, group_ids=ids, num_groups=2), adv_lib.grpo(jnp.array(R)).reshape(-1))
    # ragged: group 0 = [2, 4], group 1 = [1, 1, 4]
    r = [2.0, 1.0, 4.0, 1.0, 4.0]
    g = [0, 1, 0, 1, 1]
    groups = {0: [2.0, 4.0], 1: [1.0, 1.0, 4.0]}
    expected = [(x - _mean(groups[i])) / (_pstd(groups[i]) + 1e-6) for x, i in zip(r, g, strict=True)]
    close(adv_lib.grpo(jnp.array(r), group_ids=jnp.array(g), num_groups=2), expected)
    exp_rloo = [x - (sum(groups[i]) - x) / (len(groups[i]) - 1) for x, i in zip(r, g, strict=True)]
    close(adv_lib.rloo(jnp.array(r), group_ids=jnp.array(g), num_groups=2), exp_rloo)


def test_dr_grpo_hand_computed():
    expected = [[x - _mean(row) for x in row] for row in R]
    close(expected[1], [-0.375, -0.375, 0.625, 0.125])
    close(adv_lib.dr_grpo(jnp.array(R)), expected)


def test_rloo_hand_computed_and_scaled_dr_grpo():
    expected = []
    for row in R:
        out = []
        for i, x in enumerate(row):
            others = [y for j, y in enumerate(row) if j != i]
            out.append(x - sum(others) / len(others))
        expected.append(out)
    close(expected[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    close(adv_lib.rloo(jnp.array(R)), expected)
    r = jax.random.normal(jax.random.PRNGKey(1), (4, 5))
    close(adv_lib.rloo(r), 5 / 4 * adv_lib.dr_grpo(r), 1e-5)
    close(adv_lib.rloo(jnp.array([[3.0]])), [[0.0]])  # a lone sample has no baseline


def test_reinforce_pp_hand_computed():
    flat = [x for row in R for x in row]
    m, s = _mean(flat), _pstd(flat)
    close(adv_lib.reinforce_pp(jnp.array(R)), [[(x - m) / (s + 1e-6) for x in row] for row in R])
    centred = [x - _mean(row) for row in R for x in row]
    m, s = _mean(centred), _pstd(centred)
    expected = [(x - m) / (s + 1e-6) for x in centred]
    close(adv_lib.reinforce_pp(jnp.array(R), group_baseline=True).reshape(-1), expected)
    close(adv_lib.ADVANTAGE_FNS["reinforce_pp_baseline"](jnp.array(R)).reshape(-1), expected)
    assert set(adv_lib.ADVANTAGE_FNS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}


def _gae_loop(rewards, values, mask, gamma, lam):
    """Reference GAE for one row; values has length T+1 (last = bootstrap)."""
    t_len = len(rewards)
    adv = [0.0] * t_len
    nxt = 0.0
    for t in reversed(range(t_len)):
        if not mask[t]:
            adv[t], nxt = 0.0, 0.0
            continue
        nm = 1.0 if t == t_len - 1 else float(mask[t + 1])
        delta = rewards[t] + gamma * nm * values[t + 1] - values[t]
        nxt = delta + gamma * lam * nm * nxt
        adv[t] = nxt
    ret = [(a + v) if m else 0.0 for a, v, m in zip(adv, values[:t_len], mask, strict=True)]
    return adv, ret


def test_gae_hand_computed():
    rewards = [[0.0, 0.0, 1.0, 0.5], [1.0, 0.0, 0.0, 0.0]]
    values = [[0.5, 0.4, 0.3, 0.2, 0.7], [0.1, 0.2, 9.0, 9.0, 9.0]]
    mask = [[1, 1, 1, 1], [1, 1, 0, 0]]
    gamma, lam = 0.9, 0.8
    # row 1 by hand: t=1: delta = 0 + 0 - 0.2 = -0.2 (next is padding); A1 = -0.2
    #                t=0: delta = 1 + 0.9*0.2 - 0.1 = 1.08; A0 = 1.08 + 0.72*(-0.2) = 0.936
    adv, ret = adv_lib.gae(jnp.array(rewards), jnp.array(values), jnp.array(mask), gamma, lam)
    close(adv[1], [0.936, -0.2, 0.0, 0.0])
    for b in range(2):
        e_adv, e_ret = _gae_loop(rewards[b], values[b], mask[b], gamma, lam)
        close(adv[b], e_adv)
        close(ret[b], e_ret)


def test_gae_lambda1_gamma1_is_reward_to_go_minus_value():
    rewards = [[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 2.0, 0.0]]
    values = [[0.3, 0.1, 0.7, 0.2], [1.0, 0.5, 0.25, 0.0]]
    adv, ret = adv_lib.gae(jnp.array(rewards), jnp.array(values), jnp.ones((2, 4)), 1.0, 1.0)  # bootstrap 0
    for b in range(2):
        rtg = [sum(rewards[b][t:]) for t in range(4)]
        close(adv[b], [g - v for g, v in zip(rtg, values[b], strict=True)])
        close(ret[b], rtg)


def test_gae_ignores_masked_padding():
    rewards = jnp.array([[1.0, 0.5, 0.0, 0.0]])
    values = jnp.array([[0.2, 0.3, 0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0, 0]])
    a1, r1 = adv_lib.gae(rewards, values, mask, 0.95, 0.9)
    junk_r = rewards.at[:, 2:].set(jnp.array([7.0, -3.0]))
    junk_v = values.at[:, 2:].set(jnp.array([5.0, 6.0, 8.0]))
    a2, r2 = adv_lib.gae(junk_r, junk_v, mask, 0.95, 0.9)
    close(a1, a2)
    close(r1, r2)
    short, _ = adv_lib.gae(rewards[:, :2], jnp.array([[0.2, 0.3, 0.0]]), jnp.ones((1, 2)), 0.95, 0.9)
    close(a1[:, :2], short)
    close(a1[:, 2:], jnp.zeros((1, 2)))


# ---------------------------------------------------------------- to_step_sums


LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]


def test_to_step_sums_hand_computed():
    loss, mask = jnp.array(LOSS), jnp.array(MASK)
    tok = sum(l_ * m for lr, mr in zip(LOSS, MASK, strict=True) for l_, m in zip(lr, mr, strict=True))
    n_tok = sum(sum(r) for r in MASK)
    assert (tok, n_tok) == (6.0 + 11.0 + 2.0, 9)
    s, aux = pl.to_step_sums(loss, mask, "token_mean")
    close([s, aux["weight"]], [19.0, 9.0])
    s, aux = pl.to_step_sums(loss, mask, "seq_mean_token_mean")
    close([s, aux["weight"]], [6 / 3 + 11 / 2 + 2 / 4, 3.0])
    s, aux = pl.to_step_sums(loss, mask, "seq_mean_token_sum")
    close([s, aux["weight"]], [19.0, 3.0])
    s, aux = pl.to_step_sums(loss, mask, "token_sum_norm")
    close([s, aux["weight"]], [19.0, 16.0])
    s, aux = pl.to_step_sums(loss, mask, "token_sum_norm", norm_len=10)
    close(aux["weight"], 40.0)
    with pytest.raises(ValueError):
        pl.to_step_sums(loss, mask, "nope")


@pytest.mark.parametrize("aggregation", pl.AGGREGATIONS)
def test_micro_batch_invariance(aggregation):
    key = jax.random.PRNGKey(3)
    logp = -jax.random.uniform(key, (4, 4)) - 0.1
    old = logp + 0.3 * jax.random.normal(jax.random.fold_in(key, 1), (4, 4))
    adv = jnp.array([1.0, -0.5, 2.0, -1.0])
    mask = jnp.array(MASK)
    full_s, full_aux = pl.to_step_sums(jnp.array(LOSS), mask, aggregation)
    halves = [pl.to_step_sums(jnp.array(LOSS)[i:i + 2], mask[i:i + 2], aggregation) for i in (0, 2)]
    close(halves[0][0] + halves[1][0], full_s)
    close(halves[0][1]["weight"] + halves[1][1]["weight"], full_aux["weight"])
    # the same for ppo_clip's loss and metric sums, and the gradients
    f = lambda lp, sl: pl.ppo_clip(lp, old[sl], adv[sl], mask[sl], aggregation=aggregation, return_sums=True)
    full = f(logp, slice(0, 4))
    parts = [f(logp[i:i + 2], slice(i, i + 2)) for i in (0, 2)]
    close(parts[0][0] + parts[1][0], full[0])
    for k in full[1]:
        close(parts[0][1][k] + parts[1][1][k], full[1][k])
    g_full = jax.grad(lambda lp: f(lp, slice(0, 4))[0])(logp)
    g_parts = [jax.grad(lambda lp, i=i: f(lp, slice(i, i + 2))[0])(logp[i:i + 2]) for i in (0, 2)]
    close(jnp.concatenate(g_parts), g_full)


# ---------------------------------------------------------------- policy losses


def _ppo_token(ratio, a, lo, hi, c=None):
    loss = max(-a * ratio, -a * min(max(ratio, 1 - lo), 1 + hi))
    if c is not None and a < 0:
        loss = min(loss, c * abs(a))
    return loss


def test_ppo_clip_hand_computed():
    ratios = [1.0, 1.5, 0.5, 1.1, 3.0]
    advs = [1.0, 1.0, -2.0, -1.0, -1.0]
    logp = jnp.array([[math.log(r) for r in ratios]])
    old = jnp.zeros((1, 5))
    a = jnp.array([advs])
    expected = [_ppo_token(r, x, 0.2, 0.2) for r, x in zip(ratios, advs, strict=True)]
    close(expected, [-1.0, -1.2, 1.6, 1.1, 3.0])
    loss, m = pl.ppo_clip(logp, old, a, jnp.ones((1, 5)))
    close(loss, sum(expected) / 5)
    close(m["clip_fraction"], 2 / 5)  # ratios 1.5 (A>0) and 0.5 (A<0)
    close(m["ratio_mean"], sum(ratios) / 5)
    close(m["approx_kl"], _mean([1 / r + math.log(r) - 1 for r in ratios]))
    # dual clip c=2: token 5 (A=-1, loss 3) is capped at 2
    loss, m = pl.ppo_clip(logp, old, a, jnp.ones((1, 5)), dual_clip_c=2.0)
    expected_dc = [_ppo_token(r, x, 0.2, 0.2, 2.0) for r, x in zip(ratios, advs, strict=True)]
    close(expected_dc[4], 2.0)
    close(loss, sum(expected_dc) / 5)
    close(m["dual_clip_fraction"], 1 / 5)


def test_ppo_clip_ratio_one_is_vanilla_pg():
    logp = jnp.array([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    adv = jnp.array([1.5, -0.5])
    mask = jnp.ones((2, 3))
    loss, m = pl.ppo_clip(logp, logp, adv, mask, return_sums=True)
    close(loss, -(1.5 * 3 - 0.5 * 3))
    close(m["clip_fraction"], 0.0)
    close(m["approx_kl"], 0.0)
    g = jax.grad(lambda lp: pl.ppo_clip(lp, logp, adv, mask, return_sums=True)[0])(logp)
    close(g, -jnp.broadcast_to(adv[:, None], (2, 3)))


def test_ppo_clip_higher_and_dual_clip():
    ratios = jnp.linspace(0.5, 2.0, 16)
    logp = jnp.log(ratios)[None]
    old = jnp.zeros_like(logp)
    mask = jnp.ones_like(logp)
    per_token = lambda a, **kw: jax.vmap(
        lambda lp: pl.ppo_clip(lp[None, None], jnp.zeros((1, 1)), jnp.array([a]), jnp.ones((1, 1)), **kw)[0]
    )(logp[0])
    # A>0: loss = -min(r, 1+eps_high): plateaus at 1.28 with clip-higher, at 1.2 without.
    close(per_token(1.0, eps_low=0.2, eps_high=0.28), -jnp.minimum(ratios, 1.28))
    close(per_token(1.0), -jnp.minimum(ratios, 1.2))
    # gradient is zero once the ratio exceeds 1+eps_high
    g = jax.grad(lambda lp: pl.ppo_clip(lp, old, jnp.ones(1), mask, eps_high=0.28, return_sums=True)[0])(logp)
    close(g[0], jnp.where(ratios > 1.28, 0.0, -ratios))
    # A<0 with dual clip: the loss never exceeds c·|A| however large the ratio
    dual = per_token(-2.0, dual_clip_c=3.0)
    assert float(jnp.max(dual)) <= 6.0 + 1e-6
    close(dual, jnp.minimum(2.0 * jnp.maximum(ratios, 0.8), 6.0), 1e-5)
    big = pl.ppo_clip(jnp.array([[5.0]]), jnp.zeros((1, 1)), jnp.array([-2.0]), jnp.ones((1, 1)), dual_clip_c=3.0)
    close(big[0], 6.0)


def test_ppo_clip_token_advantages_and_mask():
    logp = jnp.array([[math.log(1.5), 0.0, 9.0]])
    adv = jnp.array([[2.0, -1.0, 100.0]])
    mask = jnp.array([[1, 1, 0]])
    loss, _ = pl.ppo_clip(logp, jnp.zeros((1, 3)), adv, mask, aggregation="token_mean")
    close(loss, (-2.0 * 1.2 + 1.0) / 2)


def test_ppo_clip_sequence_aggregations():
    # ratio 1 everywhere: per-token loss is -A; row 0 has 3 tokens (A=1), row 1 has 1 token (A=-2).
    logp = jnp.zeros((2, 3))
    mask = jnp.array([[1, 1, 1], [1, 0, 0]])
    adv = jnp.array([1.0, -2.0])
    expected = {"token_mean": (-3.0 + 2.0) / 4, "seq_mean_token_mean": (-1.0 + 2.0) / 2,
                "seq_mean_token_sum": (-3.0 + 2.0) / 2, "token_sum_norm": (-3.0 + 2.0) / 6}
    for agg, value in expected.items():
        loss, m = pl.ppo_clip(logp, logp, adv, mask, aggregation=agg)
        close(loss, value)
        close(m["ratio_mean"], 1.0)  # metrics stay means under every aggregation


def test_gspo_hand_computed():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0], [-1.0, -1.0, -1.0]])
    old = jnp.array([[-1.1, -2.0, -3.3], [-0.5, -0.4, 0.0], [-1.0, -1.0, -1.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    adv = jnp.array([1.0, -1.0, 5.0])
    s0 = math.exp((0.1 + 0.0 + 0.3) / 3)
    s1 = math.exp((0.0 - 0.1) / 2)
    lo, hi = 0.1, 0.1
    l0 = max(-1.0 * s0, -1.0 * min(max(s0, 1 - lo), 1 + hi))
    l1 = max(1.0 * s1, 1.0 * min(max(s1, 1 - lo), 1 + hi))
    loss, m = pl.gspo(logp, old, adv, mask, eps_low=lo, eps_high=hi)
    close(loss, (l0 + l1) / 2)
    close(m["clip_fraction"], 0.5)  # s0 = 1.14 > 1.1 is clipped; s1 = 0.95 is inside
    close(m["ratio_mean"], (s0 + s1) / 2)
    s, aux = pl.gspo(logp, old, adv, mask, eps_low=lo, eps_high=hi, return_sums=True)
    close([s, aux["weight"]], [l0 + l1, 2.0])
    # at ratio 1, gradient wrt each token is -A_i / n_i (length-normalised sequence ratio)
    g = jax.grad(lambda lp: pl.gspo(lp, logp, adv, mask, return_sums=True)[0])(logp)
    close(g, [[-1 / 3] * 3, [0.5, 0.5, 0.0], [0.0] * 3])


def test_kl_estimators():
    logp = [-1.0, -0.5, -2.0, -0.1]
    ref = [-1.5, -0.5, -1.0, -0.3]
    lp, rf = jnp.array(logp), jnp.array(ref)
    close(pl.kl_k1(lp, rf), [a - b for a, b in zip(logp, ref, strict=True)])
    close(pl.kl_k2(lp, rf), [0.5 * (a - b) ** 2 for a, b in zip(logp, ref, strict=True)])
    close(pl.kl_k3(lp, rf), [math.exp(b - a) - (b - a) - 1 for a, b in zip(logp, ref, strict=True)])
    x = jax.random.normal(jax.random.PRNGKey(4), (64,)) * 3
    y = jax.random.normal(jax.random.PRNGKey(5), (64,)) * 3
    assert float(jnp.min(pl.kl_k3(x, y))) >= 0.0
    for name, fn in pl.KL_ESTIMATORS.items():
        assert float(jnp.max(jnp.abs(fn(x, x)))) == 0.0, name


def test_kl_k3_unbiased_for_kl():
    # Under samples from p, E[k1] = E[k3] = KL(p || q); checked exactly by weighting with p.
    p = [0.1, 0.2, 0.3, 0.4]
    q = [0.25, 0.25, 0.25, 0.25]
    kl = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    lp, lq = jnp.log(jnp.array(p)), jnp.log(jnp.array(q))
    close(jnp.sum(jnp.array(p) * pl.kl_k1(lp, lq)), kl)
    close(jnp.sum(jnp.array(p) * pl.kl_k3(lp, lq)), kl)


def test_entropy_from_logits():
    logits = [[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0], [100.0, 0.0, 0.0, 0.0]]]
    ents = []
    for row in logits[0]:
        z = sum(math.exp(v) for v in row)
        ps = [math.exp(v) / z for v in row]
        ents.append(-sum(p * math.log(p) for p in ps if p > 0))
    close(ents[0], math.log(4))
    close(pl.entropy_from_logits(jnp.array(logits), jnp.array([[1, 1, 0]])), (ents[0] + ents[1]) / 2)
    close(pl.entropy_from_logits(jnp.array(logits), jnp.array([[1, 1, 1]])), sum(ents) / 3, 1e-4)


def test_value_loss_hand_computed():
    v = [1.0, 0.0, 2.0, 0.5]
    old = [0.5, 0.0, 1.0, 0.5]
    ret = [2.0, 1.0, 0.0, 0.5]
    expected = []
    clipped_n = 0
    for a, o, r in zip(v, old, ret, strict=True):
        u = (a - r) ** 2
        c = (min(max(a, o - 0.2), o + 0.2) - r) ** 2
        clipped_n += c > u
        expected.append(0.5 * max(u, c))
    close(expected, [0.5 * 1.69, 0.5, 2.0, 0.0])
    loss, m = pl.value_loss(jnp.array([v]), jnp.array([old]), jnp.array([ret]), jnp.ones((1, 4)))
    close(loss, sum(expected) / 4)
    close(m["clip_fraction"], clipped_n / 4)
    loss, _ = pl.value_loss(jnp.array([v]), jnp.array([old]), jnp.array([ret]), jnp.array([[1, 1, 0, 0]]), clip=None)
    close(loss, (0.5 * 1.0 + 0.5 * 1.0) / 2)


def test_truncated_importance_weights():
    trainer = [[-1.0, -0.5, -2.0], [-0.2, -0.3, -9.0]]
    behaviour = [[-1.5, -0.5, -0.5], [-0.4, -0.1, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    w, m = pl.truncated_importance_weights(jnp.array(trainer), jnp.array(behaviour), jnp.array(mask), cap=1.5)
    exp_w, diffs, n_cap = [], [], 0
    for tr, be, ms in zip(trainer, behaviour, mask, strict=True):
        row = []
        for a, b, k in zip(tr, be, ms, strict=True):
            ratio = math.exp(a - b)
            row.append(min(ratio, 1.5) if k else 0.0)
            if k:
                diffs.append(abs(a - b))
                n_cap += ratio > 1.5
        exp_w.append(row)
    close(w, exp_w)
    close(m["mean_abs_logp_diff"], sum(diffs) / len(diffs))
    close(m["capped_fraction"], n_cap / 5)
    ws, ms_ = pl.truncated_importance_weights(jnp.array(trainer), jnp.array(behaviour), jnp.array(mask),
                                              cap=1.5, level="sequence")
    s0 = math.exp(0.5 + 0.0 - 1.5)
    s1 = math.exp(0.2 - 0.2)
    close(ws, [[s0] * 3, [s1, s1, 0.0]])
    close(ms_["capped_fraction"], 0.0)
    g = jax.grad(lambda t: jnp.sum(pl.truncated_importance_weights(t, jnp.array(behaviour), jnp.array(mask))[0]))(
        jnp.array(trainer))
    close(g, jnp.zeros((2, 3)))  # stop-gradient


# ---------------------------------------------------------------- filters


def test_zero_variance_groups():
    r = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.6]])
    assert filters.zero_variance_groups(r).tolist() == [True, False, True, False]


def test_overlong_penalty():
    lengths = [10, 12, 14, 16, 20]
    max_len, buffer, pen = 16, 4, 1.0
    expected = []
    for n in lengths:
        if n <= max_len - buffer:
            expected.append(0.0)
        elif n <= max_len:
            expected.append(-pen * (n - (max_len - buffer)) / buffer)
        else:
            expected.append(-pen)
    close(expected, [0.0, 0.0, -0.5, -1.0, -1.0])
    close(filters.overlong_penalty(jnp.array(lengths), max_len, buffer, pen), expected)


# ---------------------------------------------------------------- toy bandit


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_bandit_converges_to_best_arm(estimator):
    arm_rewards = jnp.array([0.0, 0.3, 1.0, 0.5])
    adv_fn = adv_lib.ADVANTAGE_FNS[estimator]
    k, lr = 8, 0.5

    def step(logits, key):
        # two groups of K=8 samples (so REINFORCE++'s global normalisation differs from GRPO's)
        arms = jax.random.categorical(key, logits, shape=(2 * k,))
        advantages = adv_fn(arm_rewards[arms].reshape(2, k)).reshape(2 * k)
        old = jax.lax.stop_gradient(jax.nn.log_softmax(logits)[arms])[:, None]

        def loss(lg):  # each sample is a one-token "sequence"
            logp = jax.nn.log_softmax(lg)[arms][:, None]
            return pl.ppo_clip(logp, old, advantages, jnp.ones((2 * k, 1)))[0]

        return logits - lr * jax.grad(loss)(logits), None

    keys = jax.random.split(jax.random.PRNGKey(0), 200)
    logits, _ = jax.jit(lambda lg: jax.lax.scan(step, lg, keys))(jnp.zeros(4))
    probs = jax.nn.softmax(logits)
    assert float(probs[2]) > 0.9, (estimator, probs)
