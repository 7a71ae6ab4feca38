"""Advantage estimators for GRPO/PPO-family training, as pure jnp functions.

Group-based estimators take rewards shaped [G, K] (G prompts, K completions each) or a flat
[N] vector with `group_ids` (ints in [0, num_groups)) for ragged groups; the result has the
shape of `rewards`. Token-level GAE takes per-token rewards and values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _group_stats(rewards: jax.Array, group_ids: jax.Array | None, num_groups: int | None):
    """Per-element (group mean, population group std, group size), each shaped like `rewards`."""
    if group_ids is None:
        if rewards.ndim != 2:
            raise ValueError(f"rewards must be [G, K] without group_ids, got shape {rewards.shape}")
        r = rewards.astype(jnp.float32)
        count = jnp.full_like(r, r.shape[1])
        mean = jnp.broadcast_to(jnp.mean(r, axis=1, keepdims=True), r.shape)
        std = jnp.broadcast_to(jnp.std(r, axis=1, keepdims=True), r.shape)
        return r, mean, std, count
    if num_groups is None:
        raise ValueError("num_groups is required with group_ids (a static size for jit)")
    r = rewards.astype(jnp.float32)
    seg = lambda x: jax.ops.segment_sum(x, group_ids, num_segments=num_groups)
    count_g = seg(jnp.ones_like(r))
    mean_g = seg(r) / jnp.maximum(count_g, 1.0)
    var_g = seg(jnp.square(r - mean_g[group_ids])) / jnp.maximum(count_g, 1.0)
    return r, mean_g[group_ids], jnp.sqrt(var_g)[group_ids], count_g[group_ids]


def grpo(rewards: jax.Array, normalize_std: bool = True, eps: float = 1e-6, *,
         group_ids: jax.Array | None = None, num_groups: int | None = None) -> jax.Array:
    """GRPO (DeepSeekMath): A_i = (r_i - mean_group) / (std_group + eps), population std (as TRL).

    Normalising by the group's std makes the update scale-free per prompt; a group whose rewards
    are all equal gets A = 0 (no signal). `normalize_std=False` is Dr.GRPO's mean-centring.
    """
    r, mean, std, _ = _group_stats(rewards, group_ids, num_groups)
    adv = r - mean
    return adv / (std + eps) if normalize_std else adv


def dr_grpo(rewards: jax.Array, *, group_ids: jax.Array | None = None, num_groups: int | None = None) -> jax.Array:
    """Dr.GRPO (Liu et al. 2025): A_i = r_i - mean_group, no std division, which removes GRPO's
    question-difficulty bias (low-variance groups are not up-weighted)."""
    return grpo(rewards, normalize_std=False, group_ids=group_ids, num_groups=num_groups)


def rloo(rewards: jax.Array, *, group_ids: jax.Array | None = None, num_groups: int | None = None) -> jax.Array:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j≠i} r_j, the leave-one-out baseline, which is
    independent of sample i so the estimator stays unbiased. Equals K/(K-1) · (r_i - mean_group);
    a group of one sample gets 0."""
    r, mean, _, count = _group_stats(rewards, group_ids, num_groups)
    safe = jnp.maximum(count - 1.0, 1.0)
    return jnp.where(count > 1, (r - mean) * count / safe, 0.0)


def reinforce_pp(rewards: jax.Array, group_baseline: bool = False, eps: float = 1e-6, *,
                 group_ids: jax.Array | None = None, num_groups: int | None = None) -> jax.Array:
    """REINFORCE++ (Hu 2025): normalise (r - group mean if `group_baseline` else r) by the mean and
    std of the WHOLE batch, not per group, which is more stable than per-prompt std division."""
    if group_baseline:
        x = dr_grpo(rewards, group_ids=group_ids, num_groups=num_groups)
    else:
        x = rewards.astype(jnp.float32)
    return (x - jnp.mean(x)) / (jnp.std(x) + eps)


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016) -> (advantages, returns), each [B, T].

    `values` is [B, T+1] (the last column bootstraps a sequence cut off at T; set it to 0 for one
    that terminated) or [B, T] (bootstrap 0). `mask` [B, T] marks real tokens; padding after a
    sequence's end is a terminal state: V there is not used, and the advantages and returns of
    padded positions are 0. delta_t = r_t + gamma·V_{t+1}·m_{t+1} - V_t and
    A_t = delta_t + gamma·lam·m_{t+1}·A_{t+1}, computed with a backwards `lax.scan`.
    """
    rewards = rewards.astype(jnp.float32)
    values = values.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    b, t = rewards.shape
    if values.shape == (b, t):
        values = jnp.concatenate([values, jnp.zeros((b, 1), jnp.float32)], axis=1)
    if values.shape != (b, t + 1):
        raise ValueError(f"values must be [B, T] or [B, T+1], got {values.shape} for rewards {rewards.shape}")
    next_mask = jnp.concatenate([mask[:, 1:], jnp.ones((b, 1), jnp.float32)], axis=1)
    deltas = (rewards + gamma * next_mask * values[:, 1:] - values[:, :-1]) * mask

    def body(next_adv, xs):
        delta, m, nm = xs
        adv = (delta + gamma * lam * nm * next_adv) * m
        return adv, adv

    _, adv_rev = jax.lax.scan(body, jnp.zeros((b,), jnp.float32), (deltas.T, mask.T, next_mask.T), reverse=True)
    advantages = adv_rev.T
    returns = (advantages + values[:, :-1]) * mask
    return advantages, returns


ADVANTAGE_FNS = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": lambda rewards, **kw: reinforce_pp(rewards, group_baseline=False, **kw),
    "reinforce_pp_baseline": lambda rewards, **kw: reinforce_pp(rewards, group_baseline=True, **kw),
}
