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


def test_gae_multi_turn_observations_are_not_episode_ends():
    """A packed row: episode A (segment 1) = actions a1 a2, tool observations o1 o2, action a3 with
    reward 1; episode B (segment 2) = observation, actions b1 b2 with reward 2. The observations
    are skipped (a2's next state is a3's), not terminal: turn 1 sees the final reward; B does not
    leak into A."""
    rewards = jnp.array([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 2.0]])
    values = jnp.array([[0.1, 0.2, 9.0, 9.0, 0.5, 9.0, 0.3, 0.4]])
    mask = jnp.array([[1, 1, 0, 0, 1, 0, 1, 1]])
    segments = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2]])
    gamma, lam = 0.9, 0.8
    # by hand: a3: 1 - 0.5 = 0.5; a2: 0.9*0.5 - 0.2 + 0.72*0.5 = 0.61; a1: 0.9*0.2 - 0.1 + 0.72*0.61 = 0.5192
    #          b2: 2 - 0.4 = 1.6; b1: 0.9*0.4 - 0.3 + 0.72*1.6 = 1.212
    alone, _ = adv_lib.gae(rewards[:, :5], values[:, :5], mask[:, :5], gamma, lam)  # episode A in its own row
    close(alone[0], [0.5192, 0.61, 0.0, 0.0, 0.5])
    adv, ret = adv_lib.gae(rewards, values, mask, gamma, lam, segments=segments)
    close(adv[0], [0.5192, 0.61, 0.0, 0.0, 0.5, 0.0, 1.212, 1.6])
    close(ret[0], [0.6192, 0.81, 0.0, 0.0, 1.0, 0.0, 1.512, 2.0])
    # gamma = lam = 1: every action of an episode gets its final reward minus its value
    adv, _ = adv_lib.gae(rewards, values, mask, 1.0, 1.0, segments=segments)
    close(adv[0], [0.9, 0.8, 0.0, 0.0, 0.5, 0.0, 1.7, 1.6])


# ---------------------------------------------------------------- aggregation (rlvr.rl.batching)


LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [2.0, 0.0, 0.0, 0.0]]
LENGTHS = [3, 2, 4]  # sampled tokens of each sequence


def test_aggregation_weights_hand_computed():
    """Σ loss·token_weight / Σ row_weight of build_batch's weights is each aggregation's value."""
    from rlvr.rl.batching import AGGREGATIONS, Sample, build_batch

    samples = [Sample(0, i, [7], [1] * n, [0.0] * n, [0] * n, False, {"reward": 0.0}) for i, n in enumerate(LENGTHS)]
    tok = sum(sum(row[:n]) for row, n in zip(LOSS, LENGTHS, strict=True))
    assert tok == 6.0 + 11.0 + 2.0
    expected = {"token_mean": tok / 9, "seq_mean_token_mean": (6 / 3 + 11 / 2 + 2 / 4) / 3,
                "seq_mean_token_sum": tok / 3, "token_sum_norm": tok / (3 * 10)}
    for aggregation in AGGREGATIONS:
        b = build_batch(samples, 5, 0, aggregation, norm_len=10)
        loss = np.zeros((3, 5), np.float32)
        loss[:, 1:] = LOSS  # output token j of a row sits after its one prompt token
        close(np.sum(loss * b["token_weight"]) / np.sum(b["row_weight"]), expected[aggregation])
    with pytest.raises(ValueError, match="rl.aggregation"):
        build_batch(samples, 5, 0, "nope")


# ---------------------------------------------------------------- policy losses (per token)


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
    loss, m = pl.ppo_clip(logp, old, a)
    close(loss[0], expected)
    close(m["clip_fraction"][0], [0, 1, 1, 0, 0])  # ratios 1.5 (A>0) and 0.5 (A<0)
    close(m["ratio_mean"][0], ratios)
    close(m["approx_kl"][0], [1 / r + math.log(r) - 1 for r in ratios])
    # dual clip c=2: token 5 (A=-1, loss 3) is capped at 2
    loss, m = pl.ppo_clip(logp, old, a, dual_clip_c=2.0)
    expected_dc = [_ppo_token(r, x, 0.2, 0.2, 2.0) for r, x in zip(ratios, advs, strict=True)]
    close(expected_dc[4], 2.0)
    close(loss[0], expected_dc)
    close(m["dual_clip_fraction"][0], [0, 0, 0, 0, 1])


def test_ppo_clip_ratio_one_is_vanilla_pg():
    logp = jnp.array([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    adv = jnp.array([[1.5] * 3, [-0.5] * 3])
    loss, m = pl.ppo_clip(logp, logp, adv)
    close(loss, -adv)
    close(m["clip_fraction"], 0.0)
    close(m["approx_kl"], 0.0)
    g = jax.grad(lambda lp: jnp.sum(pl.ppo_clip(lp, logp, adv)[0]))(logp)
    close(g, -adv)


def test_ppo_clip_higher_and_dual_clip():
    ratios = jnp.linspace(0.5, 2.0, 16)
    logp = jnp.log(ratios)[None]
    old = jnp.zeros_like(logp)
    per_token = lambda a, **kw: pl.ppo_clip(logp, old, jnp.full_like(logp, a), **kw)[0][0]
    # A>0: loss = -min(r, 1+eps_high): plateaus at 1.28 with clip-higher, at 1.2 without.
    close(per_token(1.0, eps_low=0.2, eps_high=0.28), -jnp.minimum(ratios, 1.28))
    close(per_token(1.0), -jnp.minimum(ratios, 1.2))
    # gradient is zero once the ratio exceeds 1+eps_high
    g = jax.grad(lambda lp: jnp.sum(pl.ppo_clip(lp, old, jnp.ones_like(lp), eps_high=0.28)[0]))(logp)
    close(g[0], jnp.where(ratios > 1.28, 0.0, -ratios))
    # A<0 with dual clip: the loss never exceeds c·|A| however large the ratio
    dual = per_token(-2.0, dual_clip_c=3.0)
    assert float(jnp.max(dual)) <= 6.0 + 1e-6
    close(dual, jnp.minimum(2.0 * jnp.maximum(ratios, 0.8), 6.0), 1e-5)
    big = pl.ppo_clip(jnp.array([[5.0]]), jnp.zeros((1, 1)), jnp.array([[-2.0]]), dual_clip_c=3.0)
    close(big[0], 6.0)


def test_gspo_hand_computed():
    """Padded rows (sequence i = row i; row 2 is a prompt-only sequence, index 3 = padding)."""
    logp = jnp.array([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0], [-1.0, -1.0, -1.0]])
    old = jnp.array([[-1.1, -2.0, -3.3], [-0.5, -0.4, 0.0], [-1.0, -1.0, -1.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    seq = jnp.array([[0, 0, 0], [1, 1, 3], [2, 2, 2]])
    adv = jnp.array([[1.0] * 3, [-1.0] * 3, [5.0] * 3])
    s0 = math.exp((0.1 + 0.0 + 0.3) / 3)
    s1 = math.exp((0.0 - 0.1) / 2)
    lo, hi = 0.1, 0.1
    l0 = max(-1.0 * s0, -1.0 * min(max(s0, 1 - lo), 1 + hi))
    l1 = max(1.0 * s1, 1.0 * min(max(s1, 1 - lo), 1 + hi))
    loss, m = pl.gspo(logp, old, adv, mask, seq, 3, eps_low=lo, eps_high=hi)
    close(loss[:2, :2], [[l0, l0], [l1, l1]])
    close(m["clip_fraction"][:2, 0], [1.0, 0.0])  # s0 = 1.14 > 1.1 is clipped; s1 = 0.95 is inside
    close(m["ratio_mean"][:2, 0], [s0, s1])
    # at ratio 1, the gradient of the sequence mean wrt each token is -A_i / n_i
    weight = mask / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1)
    g = jax.grad(lambda lp: jnp.sum(pl.gspo(lp, logp, adv, mask, seq, 3)[0] * weight))(logp)
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
    d = np.asarray(y, np.float64) - np.asarray(x, np.float64)  # log(π_ref/π) on 64 random pairs
    np.testing.assert_allclose(np.asarray(pl.kl_k3(x, y)), np.exp(d) - d - 1, rtol=1e-5, atol=1e-5)
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


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_gradient_is_the_gradient_of_the_kl(estimator):
    """A categorical policy π = softmax(θ) over 5 tokens and a fixed reference: the expected
    gradient of the KL loss term over samples of π (enumerated: Σ_x π(x)·∇ kl_loss(x)) equals the
    exact gradient of KL(π ‖ π_ref), and its expected value is the KL for the unbiased k1 and k3."""
    theta = jnp.array([0.3, -1.2, 2.0, 0.1, -0.4])
    ref = jax.nn.log_softmax(jnp.array([1.0, 0.5, -0.3, 0.2, 0.0]))
    kl = lambda t: jnp.sum(jax.nn.softmax(t) * (jax.nn.log_softmax(t) - ref))
    p = jax.lax.stop_gradient(jax.nn.softmax(theta))
    term = lambda t: jnp.sum(p * pl.kl_loss(jax.nn.log_softmax(t), ref, estimator))
    close(jax.grad(term)(theta), jax.grad(kl)(theta))
    assert float(jnp.max(jnp.abs(jax.grad(kl)(theta)))) > 0.05
    if estimator != "k2":  # k2 is biased: its value is not the KL
        close(term(theta), kl(theta))


def test_value_loss_hand_computed():
    v = [1.0, 0.0, 2.0, 0.5]
    old = [0.5, 0.0, 1.0, 0.5]
    ret = [2.0, 1.0, 0.0, 0.5]
    expected, clipped = [], []
    for a, o, r in zip(v, old, ret, strict=True):
        u = (a - r) ** 2
        c = (min(max(a, o - 0.2), o + 0.2) - r) ** 2
        clipped.append(float(c > u))
        expected.append(0.5 * max(u, c))
    close(expected, [0.5 * 1.69, 0.5, 2.0, 0.0])
    loss, frac = pl.value_loss(jnp.array([v]), jnp.array([old]), jnp.array([ret]))
    close(loss[0], expected)
    close(frac[0], clipped)
    loss, _ = pl.value_loss(jnp.array([v]), jnp.array([old]), jnp.array([ret]), clip=None)
    close(loss[0], [0.5 * (a - r) ** 2 for a, r in zip(v, ret, strict=True)])


def test_truncated_importance_weights():
    trainer = [[-1.0, -0.5, -2.0], [-0.2, -0.3, -9.0]]
    behaviour = [[-1.5, -0.5, -0.5], [-0.4, -0.1, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0]]
    seq = jnp.array([[0, 0, 0], [1, 1, 2]])
    args = (jnp.array(trainer), jnp.array(behaviour), jnp.array(mask, jnp.float32), seq, 2)
    w, capped = pl.truncated_importance_weights(*args, cap=1.5)
    exp_w = [[min(math.exp(a - b), 1.5) if k else 1.0 for a, b, k in zip(tr, be, ms, strict=True)]
             for tr, be, ms in zip(trainer, behaviour, mask, strict=True)]
    close(w, exp_w)  # (masked tokens: ratio exp(0) = 1; the loss masks them)
    close(capped, [[1, 0, 0], [0, 0, 0]])  # exp(0.5) > 1.5
    close(pl.truncated_importance_weights(*args, cap=1.1)[1], [[1, 0, 0], [1, 0, 0]])
    ws, _ = pl.truncated_importance_weights(*args, cap=1.5, level="sequence")
    s0 = math.exp(0.5 + 0.0 - 1.5)
    s1 = math.exp(0.2 - 0.2)
    close(ws[:, :2], [[s0] * 2, [s1] * 2])
    g = jax.grad(lambda t: jnp.sum(pl.truncated_importance_weights(t, *args[1:], cap=1.5)[0]))(jnp.array(trainer))
    close(g, jnp.zeros((2, 3)))  # stop-gradient


# ---------------------------------------------------------------- filters


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
            return jnp.mean(pl.ppo_clip(logp, old, advantages[:, None])[0])

        return logits - lr * jax.grad(loss)(logits), None

    keys = jax.random.split(jax.random.PRNGKey(0), 200)
    logits, _ = jax.jit(lambda lg: jax.lax.scan(step, lg, keys))(jnp.zeros(4))
    probs = jax.nn.softmax(logits)
    assert float(probs[2]) > 0.9, (estimator, probs)
