"""Policy-gradient losses, KL estimators and importance weights, per token.

Every function here works on token-aligned arrays [B, T] (padded or packed rows): the loss of
each token before aggregation, with per-token metrics. The RL objective (`rlvr.rl.objective`)
multiplies them by the batch's aggregation weights (`rlvr.rl.batching`), so one formula serves
every layout and every aggregation. Sequences in packed rows are identified by `seq_index`
[B, T] (ints in [0, num_seqs]; num_seqs marks padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ppo_clip(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, eps_low: float = 0.2,
             eps_high: float = 0.2, dual_clip_c: float | None = None):
    """PPO clipped surrogate (Schulman et al. 2017) per token: max(-A·r, -A·clip(r, 1-eps_low, 1+eps_high))
    with r = exp(logp - old_logp) and per-token advantages [B, T]. Returns (loss [B, T], metrics).

    eps_high > eps_low is DAPO's clip-higher: positive-advantage tokens may raise their ratio
    further, which keeps low-probability exploration tokens alive. `dual_clip_c` (> 1, Ye et al.
    2020) caps a negative-advantage token's loss at c·|A| so a huge ratio cannot blow it up.
    At r = 1 the loss is -A and its gradient -A·∇logp, the vanilla policy gradient.

    Metrics: clip_fraction (tokens where the clipped branch is active), approx_kl (k3 estimator of
    KL(old || new)), ratio_mean, and dual_clip_fraction when dual-clipping.
    """
    adv = advantages.astype(jnp.float32)
    ratio = jnp.exp(logp.astype(jnp.float32) - old_logp.astype(jnp.float32))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    # where, not maximum: at a tie the unclipped branch (and its full gradient) is taken
    loss = jnp.where(clipped > unclipped, clipped, unclipped)
    metrics = {"clip_fraction": (clipped > unclipped).astype(jnp.float32),
               "approx_kl": kl_k3(logp, old_logp), "ratio_mean": ratio}
    if dual_clip_c is not None:
        cap = dual_clip_c * jnp.abs(adv)
        dual = (adv < 0) & (loss > cap)
        loss = jnp.where(dual, cap, loss)
        metrics["dual_clip_fraction"] = dual.astype(jnp.float32)
    return loss, metrics


def per_sequence_sum(x: jax.Array, seq_index: jax.Array, num_seqs: int) -> jax.Array:
    """Broadcasts each sequence's sum of `x` [B, T] back to its tokens."""
    sums = jax.ops.segment_sum(x.reshape(-1), seq_index.reshape(-1), num_segments=num_seqs + 1)
    return sums[seq_index]


def gspo(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, seq_index: jax.Array,
         num_seqs: int, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO (Zheng et al. 2025): PPO-clip on the length-normalised SEQUENCE ratio
    s_i = exp(mean_t (logp - old_logp) over sequence i's tokens), every token of sequence i
    carrying sequence i's loss, so weighting each token by 1/len_i ("seq_mean_token_mean")
    gives the sequence-level loss. Its clip range is much narrower than PPO's (3e-4/4e-4).
    Returns (loss [B, T], metrics)."""
    mask = mask.astype(jnp.float32)
    lengths = per_sequence_sum(mask, seq_index, num_seqs)
    log_ratio = (logp.astype(jnp.float32) - old_logp.astype(jnp.float32)) * mask
    seq_ratio = jnp.exp(per_sequence_sum(log_ratio, seq_index, num_seqs) / jnp.maximum(lengths, 1.0))
    adv = advantages.astype(jnp.float32)
    unclipped = -adv * seq_ratio
    clipped = -adv * jnp.clip(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.where(clipped > unclipped, clipped, unclipped)
    metrics = {"clip_fraction": (clipped > unclipped).astype(jnp.float32), "approx_kl": kl_k3(logp, old_logp),
               "ratio_mean": seq_ratio}
    return loss, metrics


def truncated_importance_weights(proximal: jax.Array, behaviour: jax.Array, mask: jax.Array, seq_index: jax.Array,
                                 num_seqs: int, cap: float, level: str = "token"):
    """Truncated importance sampling (TIS): min(π_proximal/π_behaviour, cap), stop-gradient,
    per token or (level="sequence") the sequence ratio exp(Σ_t Δlogp) on every token of it.
    They correct the mismatch between the sampler (an inference engine's numerics, a stale
    policy) and the trainer; truncation bounds the variance. Returns (weights, capped [B, T])."""
    diff = (proximal.astype(jnp.float32) - behaviour.astype(jnp.float32)) * mask
    if level == "sequence":
        diff = per_sequence_sum(diff, seq_index, num_seqs)
    ratio = jnp.exp(diff)
    return jax.lax.stop_gradient(jnp.minimum(ratio, cap)), (ratio > cap).astype(jnp.float32)


def kl_k1(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k1 = logp - ref_logp: unbiased per-sample estimate of KL(pi || ref) under samples of pi, high variance."""
    return logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)


def kl_k2(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k2 = 0.5·(logp - ref_logp)²: biased but low variance, always >= 0 (Schulman, 'Approximating KL')."""
    return 0.5 * jnp.square(logp.astype(jnp.float32) - ref_logp.astype(jnp.float32))


def kl_k3(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """k3 = exp(ref - logp) - (ref - logp) - 1: unbiased and always >= 0 (x - 1 >= log x); GRPO's KL term."""
    d = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    return jnp.expm1(d) - d


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_loss(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k3") -> jax.Array:
    """The KL-to-reference loss term per token: its value is the estimator's (the reported `kl`),
    and its expected gradient under samples of π is exactly ∇ KL(π ‖ π_ref) = E_π[k1 · ∇log π].
    k2's own gradient is k1 · ∇log π already; k1's alone is ∇log π (expectation 0) and k3's is
    (1 - π_ref/π) · ∇log π (the gradient of the reverse KL(π_ref ‖ π)), so they are multiplied by
    the ratio π/sg(π) (value 1), which adds the score-function term k · ∇log π they lack:
    (k1 + 1)·∇log π and (k3 + 1 - π_ref/π)·∇log π = k1·∇log π, both of expectation ∇ KL."""
    k = KL_ESTIMATORS[estimator](logp, ref_logp)
    if estimator == "k2":
        return k
    return jnp.exp(logp - jax.lax.stop_gradient(logp)) * k


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, clip: float | None = 0.2):
    """PPO clipped value loss per token: 0.5·max((v - R)², (clip(v, v_old ± c) - R)²). The clip keeps
    the critic from moving far from the values the advantages were computed with. Returns
    (loss [B, T], clipped [B, T]: where the clipped branch is the larger)."""
    v, r = values.astype(jnp.float32), returns.astype(jnp.float32)
    unclipped = jnp.square(v - r)
    if clip is None:
        return 0.5 * unclipped, jnp.zeros_like(v)
    clipped = jnp.square(jnp.clip(v, old_values - clip, old_values + clip) - r)
    return 0.5 * jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(jnp.float32)
