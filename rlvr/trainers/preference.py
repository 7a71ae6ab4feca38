"""Preference optimization (DPO, cDPO, IPO, SimPO, ORPO) and Bradley–Terry reward models.

Read top to bottom: tokenizer and model → pairs → reference log-probs (one pass with the
initial params, or the frozen params passed to every step) → the shared training loop →
held-out pairwise evaluation → summary.json. Jobs `dpo` and `rm` both land here; they
differ only in the loss function handed to the loop.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlvr import api, losses
from rlvr.data import shards
from rlvr.data.pairs import PairStream
from rlvr.data.sources import load_records
from rlvr.job import Job
from rlvr.losses import preference as pref
from rlvr.models import lora
from rlvr.models.transformer import forward, forward_with_values
from rlvr.trainers.loop import train_loop
from rlvr.trainers.sft import write_summary

SIDES = ("chosen", "rejected")


def _both_sides(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Chosen rows then rejected rows, as one [2P, T] batch (one forward pass)."""
    return {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
            for k in ("tokens", "positions", "segment_ids", "loss_mask")}


def sequence_logprobs(cfg, params, rows: dict[str, jax.Array], rng=None) -> tuple[jax.Array, jax.Array]:
    """Summed log-prob of each row's response tokens, and the response lengths (`rng`: adapter dropout)."""
    logits, _ = forward(cfg, params, rows["tokens"], rows["positions"], rows["segment_ids"], rng=rng)
    logp = losses.next_token_logprobs(logits, rows["tokens"])
    mask = losses.target_mask(rows["loss_mask"], rows["segment_ids"]).astype(jnp.float32)
    return jnp.sum(logp * mask, axis=1), jnp.sum(mask, axis=1)


def pair_logprobs(cfg, params, batch, rng=None) -> dict[str, jax.Array]:
    sums, lengths = sequence_logprobs(cfg, params, _both_sides(batch), rng)
    pairs = batch["chosen_tokens"].shape[0]
    return {"chosen": sums[:pairs], "rejected": sums[pairs:],
            "chosen_len": lengths[:pairs], "rejected_len": lengths[pairs:]}


def preference_loss(cfg, p: ml_collections.ConfigDict, params, batch, rng, frozen):
    """Sum over pairs of the configured preference loss; weight = number of pairs."""
    lp = pair_logprobs(cfg, params, batch, rng)
    if p.loss in ("dpo", "cdpo", "ipo"):
        if frozen is not None:  # online reference: the frozen initial params
            ref = jax.lax.stop_gradient(pair_logprobs(cfg, frozen, batch))
            ref_chosen, ref_rejected = ref["chosen"], ref["rejected"]
        else:
            ref_chosen, ref_rejected = batch["ref_chosen"], batch["ref_rejected"]
        args = (lp["chosen"], lp["rejected"], ref_chosen, ref_rejected, p.beta)
        if p.loss == "ipo":
            loss, metrics = pref.ipo(*args)
        else:
            loss, metrics = pref.dpo_sigmoid(*args, label_smoothing=p.label_smoothing if p.loss == "cdpo" else 0.0)
    elif p.loss == "simpo":
        loss, metrics = pref.simpo(lp["chosen"], lp["rejected"], lp["chosen_len"], lp["rejected_len"],
                                   p.beta, p.simpo_gamma)
    else:
        loss, metrics = pref.orpo(lp["chosen"], lp["rejected"], lp["chosen_len"], lp["rejected_len"],
                                  -lp["chosen"], p.orpo_lambda)
    return pref.to_step_sums(loss, metrics)


def pair_scores(cfg, params, batch, rng=None) -> tuple[jax.Array, jax.Array]:
    """Reward-model scores: the value head at each row's last response token."""
    rows = _both_sides(batch)
    _, values, _ = forward_with_values(cfg, params, rows["tokens"], rows["positions"], rows["segment_ids"],
                                       rng=rng)
    last = jnp.argmax(jnp.cumsum(rows["loss_mask"], axis=1), axis=1)  # first index of the max = last 1
    scores = jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]
    pairs = batch["chosen_tokens"].shape[0]
    return scores[:pairs], scores[pairs:]


def reward_model_loss(cfg, params, batch, rng, frozen):
    del frozen
    loss, metrics = pref.bradley_terry(*pair_scores(cfg, params, batch, rng))
    return pref.to_step_sums(loss, metrics)


def _pass(stream: PairStream, fn, params, start: int, mesh):
    """`fn(params, pairs order[start : start + P])`, each process reading only its rows' pairs."""
    return shards.apply_by_rows(fn, params, lambda rows: stream.batch_at(start, rows), stream.shapes(), mesh)


def reference_table(cfg, params, stream: PairStream, mesh) -> np.ndarray:
    """[num_records, 2] summed log-probs of (chosen, rejected) under `params`, one pass (on a
    multi-host job each process reads its rows' pairs of every batch; the table is gathered)."""
    compute = jax.jit(functools.partial(pair_logprobs, cfg))
    n, per = len(stream.records), stream.pairs_per_batch
    table = np.zeros((n, 2), np.float64)
    for start in range(0, n, per):
        out = _pass(stream, compute, params, start, mesh)
        rows = [stream.order[k] for k in range(start, start + per)]
        for j, row in enumerate(rows[: n - start]):
            table[row] = (out["chosen"][j], out["rejected"][j])
    return table


def _pair_stream(config, tokenizer, records, shuffle: bool) -> PairStream:
    return PairStream(records, tokenizer, config.data.batch_size, config.data.seq_len, config.seed, shuffle)


def evaluate_pairs(config, cfg, params, tokenizer, records, mesh, ref_params=None) -> dict[str, float]:
    """Held-out pairwise accuracy, margin (and calibration for reward models)."""
    stream = _pair_stream(config, tokenizer, records, shuffle=False)
    chosen, rejected = [], []
    if config.job == "rm":
        score = jax.jit(functools.partial(pair_scores, cfg))
    elif config.preference.loss in ("dpo", "cdpo", "ipo"):
        def score(p, batch):  # implicit reward β·log(π/π_ref); β > 0 does not change the order
            lp, ref = pair_logprobs(cfg, p, batch), pair_logprobs(cfg, ref_params, batch)
            return lp["chosen"] - ref["chosen"], lp["rejected"] - ref["rejected"]
        score = jax.jit(score)
    else:  # reference-free: length-averaged log-prob
        def score(p, batch):
            lp = pair_logprobs(cfg, p, batch)
            return lp["chosen"] / lp["chosen_len"], lp["rejected"] / lp["rejected_len"]
        score = jax.jit(score)
    for start in range(0, len(records), stream.pairs_per_batch):
        c, r = _pass(stream, score, params, start, mesh)
        take = min(stream.pairs_per_batch, len(records) - start)
        chosen.append(np.asarray(c[:take]))
        rejected.append(np.asarray(r[:take]))
    c, r = np.concatenate(chosen), np.concatenate(rejected)
    result = {"heldout_accuracy": float(pref.pairwise_accuracy(c, r)), "heldout_margin": float(np.mean(c - r))}
    if config.job == "rm":
        result["heldout_ece"] = float(pref.calibration(c, r)["ece"])
    return result


def reference_params(model: api.Model):
    """The frozen reference: a copy of the initial params, or a LoRA model's frozen base (the policy
    with its adapters at zero; no copy)."""
    if model.cfg.lora.enabled:
        return lora.frozen(model.params)
    return jax.tree.map(jnp.copy, model.params)


def train(job: Job) -> dict[str, Any]:
    """The DPO-family or reward-model job (`job`: resolved by `rlvr.job.resolve`)."""
    config, workdir, tokenizer = job.config, job.workdir, job.tokenizer
    if config.job == "rm" and not job.model_cfg.value_head:
        raise api.ConfigError("job='rm' needs model.value_head=True (the scalar score head).")
    model = job.build_model()
    cfg, p = model.cfg, config.preference
    stream = _pair_stream(config, tokenizer, load_records(config.data), shuffle=True)
    held_out = load_records(config.data, "eval") if config.data.eval_path else None
    uses_reference = config.job == "dpo" and pref.needs_reference(p.loss)
    ref_params = reference_params(model) if uses_reference or held_out else None
    frozen = None
    if config.job == "rm":
        loss_fn = functools.partial(reward_model_loss, cfg)
    else:
        loss_fn = functools.partial(preference_loss, cfg, p)
        if uses_reference and p.reference == "precompute":
            stream.reference = reference_table(cfg, ref_params, stream, model.mesh)
        elif uses_reference:
            frozen = ref_params
    frozen_sharding = jax.tree.map(lambda x: x.sharding, frozen) if frozen is not None else None
    tokens_per_batch = 2 * config.data.batch_size * config.data.seq_len
    result = train_loop(job, model, loss_fn, stream, tokens_per_batch, frozen, frozen_sharding)
    summary: dict[str, Any] = {"job": config.job, "loss_type": "bradley_terry" if config.job == "rm" else p.loss,
                               "final_step": config.train.num_steps, **result.last_metrics}
    if held_out:
        summary.update(evaluate_pairs(config, cfg, result.params, tokenizer, held_out, model.mesh, ref_params))
    write_summary(workdir, summary)
    return summary
