"""The RL training objective: one jitted loss over a batch of scored rollouts.

`rl_loss(cfg, objective, params, batch, rng, frozen)` follows the step contract of
`rlvr.train.step` (a SUM and `aux["weight"]`). The batch (built by `rlvr.rl.batching`) holds
token-aligned arrays, so padded rows and packed rows (several sequences per row) are the same
computation:

  tokens, positions, segment_ids, loss_mask   the sequences; loss_mask = 1 on sampled tokens
  advantages, behaviour_logp                  per token (the sampler's log-prob of each token)
  token_weight [B, T], row_weight [B]         the aggregation: loss = Σ l_t·w_t / Σ row_weight
  seq_index                                   which sequence a token belongs to (GSPO, TIS)

`token_terms` gives the per-token loss before aggregation: PPO-clip or GSPO against the proximal
policy, multiplied by truncated importance weights π_proximal/π_behaviour when `tis_cap > 0`
(which correct stale samples from async rollouts and sampler/trainer numerics), plus a KL term
to the frozen reference policy whose gradient is the KL's (`policy_loss.kl_loss`), the
full-vocabulary reverse KL to a distillation teacher at every sampled position (`distill_coef`,
rl.distill_estimator="full": `rlvr.losses.distill.full_reverse_kl`, an exact per-position gradient
where the sampled-token estimator puts a noisy advantage on one token), an entropy bonus, and for
PPO with GAE the clipped value loss of the value head (which shares the policy's backbone). The
proximal policy (`proximal`) is "current": the weights before this batch's updates (the batch's
`old_logp` from a pass before several updates, else the trainer's own log-probs, stop-gradient:
ratio 1, no clipping, TIS corrects the sampler), or "behaviour": the
policy that generated the batch (its recorded log-probs: the ratio and its clipping are against
the sampler; TIS then has nothing left to correct and is off).

Every log-prob is of the distribution the sampler draws from (`sampling`: temperature, top-k,
top-p, min-p; `rlvr.kernels.chunked_logprob.sampling_logits`, the engine's own definition), so
the trainer's and the sampler's log-probs agree (`logprob_mismatch`). With `logprob_chunk_size`
> 0 they come from `rlvr.losses.model_token_logprobs`, which never materialises the [B, T, V]
logits (same values up to float rounding). Metric sums are over tokens; `aux["tokens"]` lets the
trainer turn them into token means.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from rlvr import losses
from rlvr.kernels.chunked_logprob import Sampling
from rlvr.kernels.chunked_logprob.reference import RAW_POLICY
from rlvr.models.transformer import forward, forward_with_values
from rlvr.models.vision import batch_images
from rlvr.rl import policy_loss as pl

PROXIMAL = ("current", "behaviour")


@dataclasses.dataclass(frozen=True)
class Objective:
    """Static loss options (hashable: part of the jitted function's identity)."""

    policy_loss: str = "ppo_clip"  # ppo_clip | gspo
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0  # KL-to-reference loss term (0 = off)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float = 0.0  # 0 = no truncated importance sampling
    tis_level: str = "token"  # token | sequence
    num_seqs: int = 1  # sequences per batch (static size for segment sums)
    value_coef: float = 0.0  # > 0: PPO's clipped value loss on the value head (batch has returns, old_values)
    value_clip: float | None = 0.2
    # > 0 (`train.logprob_chunk_size`): log-probs and entropies in chunks of this many positions
    # (rlvr.kernels.chunked_logprob), never the [B, T, V] logits; 0 = from the full logits
    logprob_chunk_size: int = 0
    sampling: Sampling = RAW_POLICY  # the distribution the batch was sampled from (rl.temperature, ...)
    proximal: str = "current"  # current | behaviour (see the module docstring)
    # > 0: + distill_coef · KL(π ‖ teacher) over the whole vocabulary per sampled position (the raw
    # softmaxes; rl.teacher with rl.distill_estimator="full"; frozen["teacher"], rl_loss's teacher_cfg)
    distill_coef: float = 0.0
    distill_teacher_temperature: float = 1.0  # the teacher's softmax temperature in that KL (< 1: sharper)

    @classmethod
    def from_config(cls, config) -> Objective:
        """The RL job's objective (`rl.*`; `train.logprob_chunk_size`)."""
        rl = config.rl
        gspo = rl.policy_loss == "gspo"
        return cls(policy_loss=rl.policy_loss, clip_low=rl.gspo_clip_low if gspo else rl.clip_low,
                   clip_high=rl.gspo_clip_high if gspo else rl.clip_high, dual_clip=rl.dual_clip or None,
                   kl_coef=rl.kl_coef if rl.kl_mode == "loss" else 0.0, kl_estimator=rl.kl_estimator,
                   entropy_coef=rl.entropy_coef, tis_cap=rl.tis_cap, tis_level=rl.tis_level,
                   num_seqs=rl.prompts_per_step * rl.group_size,
                   value_coef=rl.value_coef if rl.advantage == "gae" else 0.0, value_clip=rl.value_clip or None,
                   logprob_chunk_size=config.train.logprob_chunk_size, sampling=sampling_of(rl),
                   proximal=rl.proximal,
                   distill_coef=rl.distill_coef if rl.teacher and rl.distill_estimator == "full" else 0.0,
                   distill_teacher_temperature=rl.distill_teacher_temperature)


def sampling_of(rl) -> Sampling:
    """The sampling settings RL rollouts are generated with (`rl.temperature`, `top_k`, `top_p`, `min_p`)."""
    return Sampling(rl.temperature, rl.top_k, rl.top_p, rl.min_p)


def model_logprobs(cfg, obj: Objective, params, batch, *, entropy: bool = False, values: bool = False, rng=None):
    """(log-probs [B, T-1] of the sampled distribution, its entropy or None, value-head
    predictions [B, T] or None): chunked when `obj.logprob_chunk_size`, else from the full logits.
    `rng`: adapter dropout (`lora.dropout`) in training, None otherwise."""
    if "head_index" in batch:
        return trained_logprobs(cfg, obj, params, batch, entropy=entropy, values=values, rng=rng)
    tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
    images = batch_images(batch)  # a VLM's rollouts with images (rlvr.rl.batching.image_arrays)
    if obj.logprob_chunk_size:
        return losses.model_token_logprobs(cfg, params, tokens, positions, segment_ids,
                                           chunk_size=obj.logprob_chunk_size, entropy=entropy, values=values,
                                           sampling=obj.sampling, rng=rng, images=images)
    predicted = None
    if values:
        if images is not None:
            raise ValueError("a value head on image rollouts needs train.logprob_chunk_size > 0 (the chunked path).")
        logits, predicted, _ = forward_with_values(cfg, params, tokens, positions, segment_ids, rng=rng)
    else:
        logits, _ = forward(cfg, params, tokens, positions, segment_ids, rng=rng, images=images)
    out = losses.next_token_logprobs(logits, tokens, obj.sampling, entropy=entropy)
    logp, ent = out if entropy else (out, None)
    return logp, ent, predicted


def trained_logprobs(cfg, obj: Objective, params, batch, *, entropy: bool = False, values: bool = False, rng=None):
    """`model_logprobs` with the output layer run only at the batch's trained positions
    (`batch["head_index"]`, `head_valid`: `rlvr.rl.batching.trained_positions`): the hidden states
    there are gathered, scored over the vocabulary (in chunks of `obj.logprob_chunk_size`, else all
    at once), and scattered back to [B, T-1], 0 elsewhere (positions the loss masks out). A shared-prompt
    batch (rl.share_prompts) also has `branch_ids` (the attention mask's branches) and `head_source`
    (the position whose hidden state predicts each target: not always the one before it there)."""
    from rlvr.kernels.chunked_logprob import token_logprobs

    tokens, index, valid = batch["tokens"], batch["head_index"], batch["head_valid"]
    x, head, tied, predicted = losses.hidden_and_head(cfg, params, tokens, batch["positions"],
                                                      batch["segment_ids"], values, rng, images=batch_images(batch),
                                                      branch_ids=batch.get("branch_ids"))
    # a shared-prompt batch's first token of a completion is predicted by its prompt's last token
    hidden = jnp.take_along_axis(x, batch.get("head_source", index)[..., None], axis=1)
    targets = jnp.take_along_axis(tokens[:, 1:], index, axis=1)
    out = token_logprobs(hidden, head, targets, chunk_size=obj.logprob_chunk_size or index.shape[1],
                         return_entropy=entropy, vocab_major=tied, sampling=obj.sampling)
    logp, ent = out if entropy else (out, None)
    rows = jnp.arange(index.shape[0])[:, None]

    def scatter(v):  # padding entries (valid 0) add nothing, whichever position they name
        return jnp.zeros(tokens[:, 1:].shape, v.dtype).at[rows, index].add(v * valid)
    return scatter(logp), (scatter(ent) if entropy else None), predicted


def distill_logprobs(cfg, teacher_cfg, obj: Objective, params, teacher_params, batch, *, values: bool = False,
                     rng=None):
    """`model_logprobs(..., entropy=True)` and the full-vocabulary reverse KL [B, T-1] to the teacher at
    each position, from one student forward, always chunked (`obj.logprob_chunk_size`, else 512
    positions): neither model's [B, T, V] logits exist. A VLM student sees the batch's images; so does
    the teacher when it is a VLM too (a text teacher reads the placeholders as text, as under the
    sampled estimator, whose teacher batch has images only for a VLM teacher)."""
    from rlvr.kernels.chunked_logprob import token_logprobs
    from rlvr.losses.distill import full_reverse_kl

    chunk = obj.logprob_chunk_size or 512
    tokens, positions, segment_ids = batch["tokens"], batch["positions"], batch["segment_ids"]
    images = batch_images(batch)
    teacher_images = images if teacher_cfg.vision is not None else None
    x, head, tied, predicted = losses.hidden_and_head(cfg, params, tokens, positions, segment_ids, values, rng,
                                                      images=images)
    xt, head_t, tied_t, _ = losses.hidden_and_head(teacher_cfg, teacher_params, tokens, positions, segment_ids,
                                                   images=teacher_images)
    logp, entropy = token_logprobs(x[:, :-1], head, tokens[:, 1:], chunk_size=chunk, return_entropy=True,
                                   vocab_major=tied, sampling=obj.sampling)
    kl = full_reverse_kl(x[:, :-1], head, xt[:, :-1], head_t, chunk_size=chunk, student_vocab_major=tied,
                         teacher_vocab_major=tied_t, teacher_temperature=obj.distill_teacher_temperature)
    return logp, entropy, predicted, kl


def token_terms(cfg, obj: Objective, params, batch: dict[str, jax.Array], frozen, rng=None, teacher_cfg=None):
    """(per-token loss [B, T-1], per-token metrics, target mask [B, T-1]) of the batch, before
    aggregation (see the module docstring)."""
    if obj.distill_coef:
        logp, entropy, values, teacher_kl = distill_logprobs(cfg, teacher_cfg, obj, params, frozen["teacher"], batch,
                                                             values=bool(obj.value_coef), rng=rng)
    else:
        logp, entropy, values = model_logprobs(cfg, obj, params, batch, entropy=True, values=bool(obj.value_coef),
                                               rng=rng)
    mask = losses.target_mask(batch["loss_mask"], batch["segment_ids"]).astype(jnp.float32)
    shift = lambda name: batch[name][:, 1:]
    advantages, behaviour, seq_index = shift("advantages"), shift("behaviour_logp"), shift("seq_index")
    if obj.proximal == "behaviour":
        proximal = behaviour
    else:
        proximal = shift("old_logp") if "old_logp" in batch else jax.lax.stop_gradient(logp)

    if obj.policy_loss == "gspo":
        loss, metrics = pl.gspo(logp, proximal, advantages, mask, seq_index, obj.num_seqs, obj.clip_low,
                                obj.clip_high)
    else:
        loss, metrics = pl.ppo_clip(logp, proximal, advantages, obj.clip_low, obj.clip_high, obj.dual_clip)
    metrics["logprob_mismatch"] = jnp.abs(jax.lax.stop_gradient(logp) - behaviour)
    if obj.tis_cap > 0 and obj.proximal != "behaviour":
        weights, capped = pl.truncated_importance_weights(proximal, behaviour, mask, seq_index, obj.num_seqs,
                                                          obj.tis_cap, obj.tis_level)
        loss = loss * weights
        metrics["tis_capped_fraction"] = capped
    if obj.distill_coef:
        loss = loss + obj.distill_coef * teacher_kl
        metrics["teacher_kl"] = jax.lax.stop_gradient(teacher_kl)
    if frozen is not None and "ref" in frozen:
        ref_logp, _, _ = model_logprobs(cfg, obj, frozen["ref"], batch)
        ref_logp = jax.lax.stop_gradient(ref_logp)
        metrics["kl"] = jax.lax.stop_gradient(pl.KL_ESTIMATORS[obj.kl_estimator](logp, ref_logp))
        if obj.kl_coef:
            loss = loss + obj.kl_coef * pl.kl_loss(logp, ref_logp, obj.kl_estimator)
    if obj.value_coef:  # the value of the state each target token is sampled from
        v_loss, v_clipped = pl.value_loss(values[:, :-1], shift("old_values"), shift("returns"), obj.value_clip)
        loss = loss + obj.value_coef * v_loss
        metrics.update(value_loss=jax.lax.stop_gradient(v_loss), value_clip_fraction=v_clipped)
    metrics["entropy"] = jax.lax.stop_gradient(entropy)
    if obj.entropy_coef:
        loss = loss - obj.entropy_coef * entropy
    return loss, metrics, mask


def rl_loss(cfg, obj: Objective, params, batch: dict[str, jax.Array], rng, frozen, teacher_cfg=None):
    """(Σ weighted per-token loss, aux sums); see the module docstring. `frozen` is None or holds
    "ref" (reference params) and/or "teacher" (a distillation teacher's, whose ModelConfig is
    `teacher_cfg`); `rng` drives adapter dropout (`lora.dropout`)."""
    loss, metrics, mask = token_terms(cfg, obj, params, batch, frozen, rng, teacher_cfg)
    loss_sum = jnp.sum(loss * batch["token_weight"][:, 1:] * mask)
    aux = {k: jnp.sum(v * mask) for k, v in metrics.items()}
    aux.update(weight=jnp.sum(batch["row_weight"]), tokens=jnp.sum(mask))
    return loss_sum, aux


def token_means(metrics: dict[str, float]) -> dict[str, float]:
    """Turns the step's metrics (aux sums / weight) into token means for the per-token metrics."""
    tokens = metrics.get("tokens", 0.0)
    per_token = ("clip_fraction", "approx_kl", "ratio_mean", "logprob_mismatch", "tis_capped_fraction",
                 "kl", "teacher_kl", "entropy", "dual_clip_fraction", "value_loss", "value_clip_fraction")
    out = dict(metrics)
    for key in per_token:
        if key in out:
            out[key] = out[key] / tokens if tokens else 0.0
    out.pop("tokens", None)
    return out
