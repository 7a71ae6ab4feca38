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


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, gamma: float = 1.0, lam: float = 1.0, *,
        segments: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016) -> (advantages, returns), each [B, T].

    `mask` [B, T] marks the policy's actions (sampled tokens). Positions off the mask (a prompt,
    tool observations between the turns of an episode, padding) are not actions: the recursion
    skips them, so the state after an action is the next action's state in the same sequence —
    a tool observation is the environment's transition, not the episode's end. A sequence ends
    where `segments` [B, T] changes (packed rows; None: one sequence per row) and at the row's end;
    the value after its last action is 0 (terminal), except that `values` [B, T+1]'s last column
    bootstraps a sequence whose last action is the row's last position (cut off at T).
    Over consecutive actions, delta_t = r_t + gamma·V_next - V_t and A_t = delta_t + gamma·lam·A_next
    (a backwards `lax.scan`); rewards sit on actions; advantages and returns are 0 off the mask.
    """
    rewards, values, mask = (x.astype(jnp.float32) for x in (rewards, values, mask))
    b, t = rewards.shape
    if values.shape not in ((b, t), (b, t + 1)):
        raise ValueError(f"values must be [B, T] or [B, T+1], got {values.shape} for rewards {rewards.shape}")
    bootstrap = jnp.zeros((b, t), jnp.float32)
    if values.shape == (b, t + 1):
        bootstrap = bootstrap.at[:, -1].set(values[:, t] * mask[:, -1])
        values = values[:, :t]
    segments = jnp.zeros((b, t), jnp.int32) if segments is None else segments
    ends = jnp.concatenate([segments[:, 1:] != segments[:, :-1], jnp.ones((b, 1), bool)], axis=1)

    def body(carry, xs):
        next_value, next_adv = carry
        r, v, m, end, boot = xs
        next_value, next_adv = jnp.where(end, boot, next_value), jnp.where(end, 0.0, next_adv)
        adv = r + gamma * next_value - v + gamma * lam * next_adv
        act = m > 0
        return (jnp.where(act, v, next_value), jnp.where(act, adv, next_adv)), jnp.where(act, adv, 0.0)

    zeros = jnp.zeros((b,), jnp.float32)
    _, adv_rev = jax.lax.scan(body, (zeros, zeros), (rewards.T, values.T, mask.T, ends.T, bootstrap.T), reverse=True)
    advantages = adv_rev.T
    return advantages, (advantages + values) * mask


ADVANTAGE_FNS = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": lambda rewards, **kw: reinforce_pp(rewards, group_baseline=False, **kw),
    "reinforce_pp_baseline": lambda rewards, **kw: reinforce_pp(rewards, group_baseline=True, **kw),
}
