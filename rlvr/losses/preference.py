"""Preference-optimisation losses (DPO, cDPO, IPO, SimPO, ORPO) and reward-model losses.

Every preference loss takes per-pair arrays of shape [P]: the SUMMED log-probs of the chosen
and rejected responses under the policy (`policy_chosen`, `policy_rejected`), under the
frozen reference where the loss needs one (`ref_chosen`, `ref_rejected`), and the response
lengths in target tokens (`chosen_len`, `rejected_len`) where the loss normalises by length.
Each returns `(loss [P], metrics)` with `metrics` a dict of per-pair arrays [P]:

    reward_chosen, reward_rejected   the implicit rewards (see each loss)
    margin                           reward_chosen - reward_rejected
    accuracy                         1.0 where reward_chosen > reward_rejected (ties count 0)

The trainer sums both over pairs (`to_step_sums`) to follow the `rlvr.train.step` contract:
a sum over units plus `aux["weight"]` = number of pairs.

Conventions (h is the DPO "logit", the policy-vs-reference log-ratio difference):

    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    dpo / cdpo: -(1-ε)·logσ(βh) - ε·logσ(-βh)                      (TRL loss_type="sigmoid")
    ipo:        (h - 1/(2β))²   with SUMMED log-probs by default; TRL's "ipo" divides every
                log-prob by its length first, which `ipo(..., chosen_len=, rejected_len=)` does
    simpo:      -logσ(β(policy_chosen/|c| - policy_rejected/|r|) - γ), γ the absolute margin
                of the SimPO paper (TRL/SimPO-repo `gamma_beta_ratio` = γ/β)
    orpo:       chosen_nll_sum/|c| - λ·logσ(log_odds(c) - log_odds(r)),
                log_odds(y) = a - log(1 - exp(a)),  a = logp(y)/|y|
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

Metrics = dict[str, jax.Array]
LossOutput = tuple[jax.Array, Metrics]


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def _reward_metrics(reward_chosen: jax.Array, reward_rejected: jax.Array) -> Metrics:
    return {
        "reward_chosen": reward_chosen,
        "reward_rejected": reward_rejected,
        "margin": reward_chosen - reward_rejected,
        "accuracy": (reward_chosen > reward_rejected).astype(jnp.float32),
    }


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x <= 0, accurate everywhere (Mächler 2012): log(-expm1(x)) for
    x > -log 2, log1p(-exp(x)) below. x is clamped to <= -tiny, so x = 0 gives a large
    negative finite value instead of -inf; both branches get safe inputs so gradients stay
    finite under `jnp.where`."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    x = jnp.minimum(x, -jnp.finfo(x.dtype).tiny)
    near_zero = x > -math.log(2.0)
    x_near = jnp.where(near_zero, x, -1.0)
    x_far = jnp.where(near_zero, -1.0, x)
    return jnp.where(near_zero, jnp.log(-jnp.expm1(x_near)), jnp.log1p(-jnp.exp(x_far)))


def dpo_logits(policy_chosen, policy_rejected, ref_chosen, ref_rejected) -> jax.Array:
    """h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)."""
    return (_f32(policy_chosen) - _f32(policy_rejected)) - (_f32(ref_chosen) - _f32(ref_rejected))


def dpo_sigmoid(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    beta: float,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """DPO (Rafailov et al. 2023): -logσ(βh), the Bradley–Terry likelihood of the implicit
    reward β·log(π/π_ref). With label_smoothing ε > 0 it is conservative DPO (cDPO): the label
    is flipped with probability ε, loss = -(1-ε)logσ(βh) - ε·logσ(-βh), which stops the
    margin growing without bound on noisy labels. Rewards: β·(policy - ref) per response."""
    h = dpo_logits(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    reward_chosen = beta * (_f32(policy_chosen) - _f32(ref_chosen))
    reward_rejected = beta * (_f32(policy_rejected) - _f32(ref_rejected))
    return loss, _reward_metrics(reward_chosen, reward_rejected)


def cdpo(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    beta: float,
    label_smoothing: float = 0.1,
) -> LossOutput:
    """Conservative DPO (Mitchell 2023): DPO with labels flipped with probability
    `label_smoothing` (ε), for noisy preference data; ε = 0 is plain DPO."""
    return dpo_sigmoid(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, label_smoothing)


def ipo(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    beta: float,
    chosen_len: jax.Array | None = None,
    rejected_len: jax.Array | None = None,
) -> LossOutput:
    """IPO (Azar et al. 2023, eq. 17 with τ = β): (h - 1/(2β))². A squared loss regresses the
    log-ratio gap to a finite target instead of pushing it to infinity, so it does not
    overfit deterministic preferences the way DPO can.

    By default h uses SUMMED sequence log-probs (the paper's definition). Given `chosen_len`
    and `rejected_len`, every log-prob is first divided by its response length, which is
    what TRL's loss_type="ipo" does. Rewards: β·(policy - ref) on the same (summed or
    averaged) log-probs."""
    pc, pr, rc, rr = map(_f32, (policy_chosen, policy_rejected, ref_chosen, ref_rejected))
    if (chosen_len is None) != (rejected_len is None):
        raise ValueError("ipo: give both chosen_len and rejected_len, or neither")
    if chosen_len is not None:
        lc = jnp.maximum(_f32(chosen_len), 1.0)
        lr = jnp.maximum(_f32(rejected_len), 1.0)
        pc, rc, pr, rr = pc / lc, rc / lc, pr / lr, rr / lr
    h = dpo_logits(pc, pr, rc, rr)
    loss = (h - 1.0 / (2.0 * beta)) ** 2
    return loss, _reward_metrics(beta * (pc - rc), beta * (pr - rr))


def simpo(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    chosen_len: jax.Array,
    rejected_len: jax.Array,
    beta: float,
    gamma: float,
) -> LossOutput:
    """SimPO (Meng et al. 2024, eq. 6): -logσ(β·avg_c - β·avg_r - γ), avg = summed log-prob /
    length. Reference-free (no second model), and the length normalisation matches the
    reward to how generation is scored, removing DPO's bias toward long responses. γ is the
    ABSOLUTE target margin of the paper's equation; the SimPO repo and TRL's CPO trainer take
    `gamma_beta_ratio` = γ/β instead (pass gamma = beta * gamma_beta_ratio).
    Rewards: β·avg logp."""
    avg_chosen = _f32(policy_chosen) / jnp.maximum(_f32(chosen_len), 1.0)
    avg_rejected = _f32(policy_rejected) / jnp.maximum(_f32(rejected_len), 1.0)
    reward_chosen, reward_rejected = beta * avg_chosen, beta * avg_rejected
    loss = -jax.nn.log_sigmoid(reward_chosen - reward_rejected - gamma)
    return loss, _reward_metrics(reward_chosen, reward_rejected)


def orpo(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    chosen_len: jax.Array,
    rejected_len: jax.Array,
    chosen_nll_sum: jax.Array,
    lam: float,
) -> LossOutput:
    """ORPO (Hong et al. 2024): SFT on the chosen response plus λ times an odds-ratio
    penalty, so one reference-free stage both fits the chosen and pushes the rejected down:

        loss = chosen_nll_sum/|c| - λ·logσ(log_odds(c) - log_odds(r)),
        log_odds(y) = a - log1mexp(a),  a = logp(y)/|y| (length-averaged log-prob).

    The NLL term is the per-token mean over each pair's chosen tokens (the paper's L_SFT);
    TRL instead averages cross-entropy over all chosen tokens of the batch. Metrics: rewards
    are the length-averaged log-probs (unscaled, so accuracy is still meaningful at λ = 0;
    TRL logs λ·avg logp), plus `nll`, `log_odds_ratio` and `or_loss` = -logσ(log odds ratio)."""
    avg_chosen = _f32(policy_chosen) / jnp.maximum(_f32(chosen_len), 1.0)
    avg_rejected = _f32(policy_rejected) / jnp.maximum(_f32(rejected_len), 1.0)
    log_odds = (avg_chosen - log1mexp(avg_chosen)) - (avg_rejected - log1mexp(avg_rejected))
    or_loss = -jax.nn.log_sigmoid(log_odds)
    nll = _f32(chosen_nll_sum) / jnp.maximum(_f32(chosen_len), 1.0)
    loss = nll + lam * or_loss
    metrics = _reward_metrics(avg_chosen, avg_rejected)
    metrics.update(nll=nll, log_odds_ratio=log_odds, or_loss=or_loss)
    return loss, metrics


PREFERENCE_LOSSES: dict[str, Callable[..., LossOutput]] = {
    "dpo": dpo_sigmoid,
    "ipo": ipo,
    "cdpo": cdpo,
    "simpo": simpo,
    "orpo": orpo,
}

_NEEDS_REFERENCE = {"dpo": True, "ipo": True, "cdpo": True, "simpo": False, "orpo": False}


def needs_reference(name: str) -> bool:
    """Whether loss `name` needs the frozen reference policy's log-probs."""
    if name not in _NEEDS_REFERENCE:
        raise KeyError(f"unknown preference loss {name!r}; known: {sorted(PREFERENCE_LOSSES)}")
    return _NEEDS_REFERENCE[name]


def to_step_sums(loss: jax.Array, metrics: Metrics, pair_mask: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """Per-pair (loss, metrics) -> (loss_sum, aux) for `rlvr.train.step`: sums over the pairs
    in `pair_mask` (all when None) and aux["weight"] = number of pairs counted."""
    mask = jnp.ones_like(loss, jnp.float32) if pair_mask is None else _f32(pair_mask)
    aux = {k: jnp.sum(v * mask) for k, v in metrics.items()}
    aux["weight"] = jnp.sum(mask)
    return jnp.sum(loss * mask), aux


# ----------------------------------------------------------------------------- reward models


def bradley_terry(
    score_chosen: jax.Array, score_rejected: jax.Array, margin: jax.Array | None = None
) -> LossOutput:
    """Pairwise reward-model loss -logσ(s_c - s_r - m): the Bradley–Terry likelihood that the
    chosen response wins, with an optional per-pair margin m (Llama-2 style: demand a larger
    score gap on pairs rated as clearly better). Metrics: `margin` = s_c - s_r (without m)
    and `accuracy` = 1.0 where s_c > s_r."""
    diff = _f32(score_chosen) - _f32(score_rejected)
    logits = diff if margin is None else diff - _f32(margin)
    loss = -jax.nn.log_sigmoid(logits)
    return loss, {"margin": diff, "accuracy": (diff > 0).astype(jnp.float32)}


def pairwise_accuracy(score_chosen: jax.Array, score_rejected: jax.Array) -> jax.Array:
    """Fraction of pairs with s_c > s_r; ties count 1/2 (the expectation of a random
    tie-break), so a constant scorer gets 0.5 rather than 0."""
    sc, sr = _f32(score_chosen), _f32(score_rejected)
    return jnp.mean((sc > sr).astype(jnp.float32) + 0.5 * (sc == sr).astype(jnp.float32))


def calibration(score_chosen: jax.Array, score_rejected: jax.Array, num_bins: int = 10) -> dict:
    """Expected calibration error of p = σ(s_c - s_r) read as P(chosen is preferred).

    Evaluated symmetrically: each pair is seen in both orders, (p, label 1) and (1 - p,
    label 0), so the result does not depend on which response was listed first and a
    scorer is not rewarded for always predicting "first wins". Equal-width bins over
    [0, 1]; ECE = Σ_b (n_b / N) |mean label_b - mean p_b|.

    Returns {"ece": scalar, "bins": {"count", "confidence", "frequency"}} with [num_bins]
    arrays (confidence and frequency are 0 in empty bins)."""
    p = jax.nn.sigmoid(_f32(score_chosen) - _f32(score_rejected)).reshape(-1)
    probs = jnp.concatenate([p, 1.0 - p])
    labels = jnp.concatenate([jnp.ones_like(p), jnp.zeros_like(p)])
    index = jnp.clip(jnp.floor(probs * num_bins).astype(jnp.int32), 0, num_bins - 1)
    count = jnp.zeros(num_bins, jnp.float32).at[index].add(1.0)
    prob_sum = jnp.zeros(num_bins, jnp.float32).at[index].add(probs)
    label_sum = jnp.zeros(num_bins, jnp.float32).at[index].add(labels)
    safe = jnp.maximum(count, 1.0)
    confidence, frequency = prob_sum / safe, label_sum / safe
    ece = jnp.sum(count * jnp.abs(frequency - confidence)) / jnp.maximum(jnp.sum(count), 1.0)
    return {"ece": ece, "bins": {"count": count, "confidence": confidence, "frequency": frequency}}


def normalize_scores(scores: jax.Array, mean: jax.Array, std: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(scores - mean) / max(std, eps): reward-model scores standardised before they are
    used as RL rewards."""
    return (_f32(scores) - _f32(mean)) / jnp.maximum(_f32(std), eps)


class RunningMoments(NamedTuple):
    """Running count/mean/M2 of a stream of scores (Welford; batches merged with Chan et al.'s
    parallel update). Pure: `update_moments` returns a new value. `var`/`std` are the
    unbiased (n - 1) sample estimates, as in TRL's RunningMoments."""

    count: jax.Array
    mean: jax.Array
    m2: jax.Array

    @property
    def var(self) -> jax.Array:
        return self.m2 / jnp.maximum(self.count - 1.0, 1.0)

    @property
    def std(self) -> jax.Array:
        return jnp.sqrt(self.var)


def init_moments() -> RunningMoments:
    zero = jnp.zeros((), jnp.float32)
    return RunningMoments(count=zero, mean=zero, m2=zero)


def update_moments(state: RunningMoments, values: jax.Array, mask: jax.Array | None = None) -> RunningMoments:
    """Merges the (masked) `values` into `state`; an empty batch leaves it unchanged."""
    values = _f32(values).reshape(-1)
    mask = jnp.ones_like(values) if mask is None else _f32(mask).reshape(-1)
    n_b = jnp.sum(mask)
    mean_b = jnp.sum(values * mask) / jnp.maximum(n_b, 1.0)
    m2_b = jnp.sum(mask * (values - mean_b) ** 2)
    total = state.count + n_b
    delta = mean_b - state.mean
    safe_total = jnp.maximum(total, 1.0)
    mean = state.mean + delta * n_b / safe_total
    m2 = state.m2 + m2_b + delta**2 * state.count * n_b / safe_total
    return RunningMoments(count=total, mean=mean, m2=m2)
