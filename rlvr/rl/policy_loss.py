"""Policy-gradient losses, KL estimators and importance weights for GRPO/PPO-family training.

Contract with `rlvr.train.step`: a loss returns a SUM over its units and `aux["weight"]`, and the
step divides every sum by the total weight after accumulating micro-batches. `to_step_sums`
turns a per-token loss [B, T] into such a (sum, weight) pair for each aggregation:

  - "token_mean": sum over all tokens, weight = number of tokens (DAPO token-level loss).
  - "seq_mean_token_mean": sum over sequences of each sequence's token mean, weight = number of
    sequences with at least one token (original GRPO).
  - "seq_mean_token_sum": sum over all tokens, weight = number of sequences with a token.
  - "token_sum_norm": sum over all tokens, weight = B · norm_len (norm_len = T by default), a
    constant normaliser independent of lengths (Dr.GRPO).

All four are additive over rows, so micro-batches sum to exactly the full batch's (sum, weight).
The losses below return `(loss_sum, aux)` with `return_sums=True` (aux = {"weight", metric sums})
and `(loss, metrics)` as plain means otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")


def to_step_sums(per_token_loss: jax.Array, mask: jax.Array, aggregation: str = "token_mean",
                 norm_len: int | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss_sum, {"weight": w}) such that loss_sum / w is the chosen aggregation (see module doc)."""
    mask = mask.astype(jnp.float32)
    per_token = per_token_loss.astype(jnp.float32) * mask
    tokens_per_seq = jnp.sum(mask, axis=-1)
    num_seqs = jnp.sum((tokens_per_seq > 0).astype(jnp.float32))
    if aggregation == "token_mean":
        return jnp.sum(per_token), {"weight": jnp.sum(mask)}
    if aggregation == "seq_mean_token_mean":
        return jnp.sum(jnp.sum(per_token, axis=-1) / jnp.maximum(tokens_per_seq, 1.0)), {"weight": num_seqs}
    if aggregation == "seq_mean_token_sum":
        return jnp.sum(per_token), {"weight": num_seqs}
    if aggregation == "token_sum_norm":
        length = per_token.shape[-1] if norm_len is None else norm_len
        return jnp.sum(per_token), {"weight": jnp.asarray(per_token.shape[0] * length, jnp.float32)}
    raise ValueError(f"unknown aggregation {aggregation!r}; expected one of {AGGREGATIONS}")


def _metric_sums(metrics: dict[str, jax.Array], mask: jax.Array, aggregation: str,
                 weight: jax.Array) -> dict[str, jax.Array]:
    """Metric sums that divide by the loss's weight to a token mean ("token_mean") or else a mean
    over sequences of per-sequence token means (over all B rows for "token_sum_norm"); additive
    over micro-batches like the loss."""
    mask = mask.astype(jnp.float32)
    out = {}
    if aggregation == "token_mean":
        for k, v in metrics.items():
            out[k] = jnp.sum(v * mask)
        return out
    tokens_per_seq = jnp.sum(mask, axis=-1)
    # token_sum_norm's weight is B·norm_len, so scale by norm_len to get a mean over the B rows.
    per_seq_weight = weight / mask.shape[0] if aggregation == "token_sum_norm" else 1.0
    for k, v in metrics.items():
        seq_means = jnp.sum(v * mask, axis=-1) / jnp.maximum(tokens_per_seq, 1.0)
        out[k] = per_seq_weight * jnp.sum(seq_means)
    return out


def _finish(per_token_loss, mask, aggregation, metrics, return_sums, norm_len=None):
    loss_sum, aux = to_step_sums(per_token_loss, mask, aggregation, norm_len)
    metric_sums = _metric_sums(metrics, mask, aggregation, aux["weight"])
    if return_sums:
        return loss_sum, {**aux, **metric_sums}
    weight = jnp.maximum(aux["weight"], 1.0)
    return loss_sum / weight, {k: v / weight for k, v in metric_sums.items()}


def _token_advantages(advantages: jax.Array, shape) -> jax.Array:
    advantages = advantages.astype(jnp.float32)
    return jnp.broadcast_to(advantages[:, None], shape) if advantages.ndim == 1 else advantages


def ppo_clip(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
             eps_low: float = 0.2, eps_high: float = 0.2, dual_clip_c: float | None = None,
             aggregation: str = "token_mean", *, return_sums: bool = False, norm_len: int | None = None):
    """PPO clipped surrogate (Schulman et al. 2017) per token: max(-A·r, -A·clip(r, 1-eps_low, 1+eps_high))
    with r = exp(logp - old_logp) and advantages [B] (per sequence, GRPO) or [B, T] (per token, GAE).

    eps_high > eps_low is DAPO's clip-higher: positive-advantage tokens may raise their ratio
    further, which keeps low-probability exploration tokens alive. `dual_clip_c` (> 1, Ye et al.
    2020) caps a negative-advantage token's loss at c·|A| so a huge ratio cannot blow it up.
    At r = 1 the loss is -A and its gradient -A·∇logp, the vanilla policy gradient.

    Metrics: clip_fraction (tokens where the clipped branch is active), approx_kl (k3 estimator of
    KL(old || new)), ratio_mean, and dual_clip_fraction when dual-clipping.
    """
    loss, metrics = ppo_clip_tokens(logp, old_logp, _token_advantages(advantages, logp.shape), eps_low, eps_high,
                                    dual_clip_c)
    return _finish(loss, mask.astype(jnp.float32), aggregation, metrics, return_sums, norm_len)


def ppo_clip_tokens(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, eps_low: float = 0.2,
                    eps_high: float = 0.2, dual_clip_c: float | None = None):
    """`ppo_clip` before aggregation: (per-token loss [B, T], per-token metrics), with per-token
    advantages [B, T]. The RL trainer aggregates these itself so packed rows work."""
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


def gspo(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
         eps_low: float = 3e-4, eps_high: float = 4e-4, *, return_sums: bool = False):
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, s_i = exp(mean_t(logp - old_logp)),
    clipped at sequence level: loss_i = max(-A_i·s_i, -A_i·clip(s_i, 1-eps_low, 1+eps_high)).

    The length-normalised ratio has the same scale for short and long sequences, so the (much
    tighter) clip range acts uniformly and token-level ratio noise does not accumulate. Advantages
    are per sequence [B]; the loss is a mean over sequences with at least one token (weight =
    number of such sequences). Metrics: clip_fraction and ratio_mean over sequences, approx_kl.
    """
    mask = mask.astype(jnp.float32)
    tokens = jnp.sum(mask, axis=-1)
    valid = (tokens > 0).astype(jnp.float32)
    log_ratio = (logp.astype(jnp.float32) - old_logp.astype(jnp.float32)) * mask
    seq_ratio = jnp.exp(jnp.sum(log_ratio, axis=-1) / jnp.maximum(tokens, 1.0))
    adv = advantages.astype(jnp.float32)
    unclipped = -adv * seq_ratio
    clipped = -adv * jnp.clip(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.where(clipped > unclipped, clipped, unclipped) * valid
    kl_seq = jnp.sum(kl_k3(logp, old_logp) * mask, axis=-1) / jnp.maximum(tokens, 1.0)
    sums = {"weight": jnp.sum(valid), "clip_fraction": jnp.sum((clipped > unclipped) * valid),
            "approx_kl": jnp.sum(kl_seq * valid), "ratio_mean": jnp.sum(seq_ratio * valid)}
    if return_sums:
        return jnp.sum(loss), sums
    weight = jnp.maximum(sums["weight"], 1.0)
    return jnp.sum(loss) / weight, {k: v / weight for k, v in sums.items() if k != "weight"}


def gspo_tokens(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                seq_index: jax.Array, num_seqs: int, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """`gspo` before aggregation, for padded or packed rows: sequences are identified by
    `seq_index` [B, T] (ints in [0, num_seqs]; num_seqs marks padding) instead of rows. Returns
    (per-token loss, per-token metrics) where every token of sequence i carries sequence i's loss,
    so weighting each token by 1/len_i ("seq_mean_token_mean") gives exactly `gspo`'s loss."""
    mask = mask.astype(jnp.float32)
    flat = seq_index.reshape(-1)
    seg = lambda x: jax.ops.segment_sum(x.reshape(-1), flat, num_segments=num_seqs + 1)
    lengths = seg(mask)
    log_ratio = (logp.astype(jnp.float32) - old_logp.astype(jnp.float32)) * mask
    seq_ratio = jnp.exp(seg(log_ratio) / jnp.maximum(lengths, 1.0))[seq_index]
    adv = advantages.astype(jnp.float32)
    unclipped = -adv * seq_ratio
    clipped = -adv * jnp.clip(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = jnp.where(clipped > unclipped, clipped, unclipped)
    metrics = {"clip_fraction": (clipped > unclipped).astype(jnp.float32), "approx_kl": kl_k3(logp, old_logp),
               "ratio_mean": seq_ratio}
    return loss, metrics


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


def entropy_from_logits(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked token mean of the policy entropy -sum_v p·log p over logits [B, T, V]; a collapse
    monitor (entropy falling to 0 means the policy stopped exploring)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    mask = mask.astype(jnp.float32)
    return jnp.sum(ent * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def value_loss_tokens(values: jax.Array, old_values: jax.Array, returns: jax.Array, clip: float | None = 0.2):
    """`value_loss` before aggregation: (per-token loss, per-token clip indicator)."""
    v, r = values.astype(jnp.float32), returns.astype(jnp.float32)
    unclipped = jnp.square(v - r)
    if clip is None:
        return 0.5 * unclipped, jnp.zeros_like(v)
    clipped = jnp.square(jnp.clip(v, old_values - clip, old_values + clip) - r)
    return 0.5 * jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(jnp.float32)


def value_loss(values: jax.Array, old_values: jax.Array, returns: jax.Array, mask: jax.Array,
               clip: float | None = 0.2, aggregation: str = "token_mean", *, return_sums: bool = False):
    """PPO clipped value loss per token: 0.5·max((v - R)², (clip(v, v_old ± c) - R)²). The clip keeps
    the critic from moving far from the values the advantages were computed with. Metric:
    clip_fraction (tokens where the clipped branch is the larger)."""
    v = values.astype(jnp.float32)
    r = returns.astype(jnp.float32)
    unclipped = jnp.square(v - r)
    if clip is None:
        loss, frac = 0.5 * unclipped, jnp.zeros_like(v)
    else:
        old = old_values.astype(jnp.float32)
        clipped = jnp.square(jnp.clip(v, old - clip, old + clip) - r)
        loss, frac = 0.5 * jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(jnp.float32)
    return _finish(loss, mask, aggregation, {"clip_fraction": frac}, return_sums)


def truncated_importance_weights(trainer_logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array,
                                 cap: float = 2.0, level: str = "token"):
    """Truncated importance sampling (TIS) weights min(pi_trainer / pi_behaviour, cap), stop-gradient,
    [B, T] (0 at padding), for multiplying the per-token loss. They correct the mismatch between the
    sampler (e.g. an inference engine's numerics, or a stale policy) and the trainer; truncation bounds
    the variance. level="sequence" uses the sequence ratio exp(sum_t Δlogp) for every token of it.

    Metrics: mean_abs_logp_diff (token mean of |Δlogp|) and capped_fraction (over tokens, or over
    sequences at sequence level).
    """
    mask = mask.astype(jnp.float32)
    diff = (trainer_logp.astype(jnp.float32) - behaviour_logp.astype(jnp.float32)) * mask
    n_tokens = jnp.maximum(jnp.sum(mask), 1.0)
    if level == "token":
        ratio = jnp.exp(diff)
        capped = (ratio > cap).astype(jnp.float32) * mask
        frac = jnp.sum(capped) / n_tokens
        weights = jnp.minimum(ratio, cap) * mask
    elif level == "sequence":
        valid = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
        ratio = jnp.exp(jnp.sum(diff, axis=-1))
        frac = jnp.sum((ratio > cap) * valid) / jnp.maximum(jnp.sum(valid), 1.0)
        weights = jnp.minimum(ratio, cap)[:, None] * mask
    else:
        raise ValueError(f"unknown level {level!r}; expected 'token' or 'sequence'")
    metrics = {"mean_abs_logp_diff": jnp.sum(jnp.abs(diff)) / n_tokens, "capped_fraction": frac}
    return jax.lax.stop_gradient(weights), metrics
