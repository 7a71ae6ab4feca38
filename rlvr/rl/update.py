"""One scored batch -> the policy update: the passes before it (GAE values, proximal and reference
log-probs) and `rl.updates_per_batch` jitted, sharded optimizer steps.

  PolicyUpdate(config, model, optimizer, shardings, frozen, learning_rate)(state, arrays, samples, step)
      -> (new state, mean metrics)

`reference_logprobs_fn` serves the producer's KL reward penalty (rl.kl_mode = "reward").
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlvr.kernels.chunked_logprob import Sampling
from rlvr.models import lora
from rlvr.models.vision import batch_images
from rlvr.rl.batching import build_batch
from rlvr.rl.objective import Objective, model_logprobs, rl_loss
from rlvr.train import step as step_lib

PASS_CHUNK = 512  # positions per chunk of the passes' log-probs when train.logprob_chunk_size is 0


def logprobs_pass(cfg, sampling: Sampling, chunk_size: int, params, tokens, positions, segment_ids, images=None):
    """The policy's log-prob of every token [B, T] (0 at position 0) under the sampled
    distribution, aligned like behaviour_logp: the proximal policy of PPO mini-batch updates, the
    reference policy of a KL penalty. Chunked: never the [B, T, V] logits. `images`: a VLM's."""
    from rlvr import losses

    lp, _, _ = losses.model_token_logprobs(cfg, params, tokens, positions, segment_ids,
                                           chunk_size=chunk_size or PASS_CHUNK, sampling=sampling, images=images)
    return jnp.pad(lp, ((0, 0), (1, 0)))


def shared_logprobs_pass(cfg, sampling: Sampling, chunk_size: int, params, batch):
    """`logprobs_pass` of a shared-prompt batch (rl.share_prompts): at its trained positions only, each
    read where the batch says (`rlvr.rl.objective.trained_logprobs`); 0 elsewhere."""
    obj = Objective(sampling=sampling, logprob_chunk_size=chunk_size)
    return jnp.pad(model_logprobs(cfg, obj, params, batch)[0], ((0, 0), (1, 0)))


def logprobs_fn(cfg, sampling: Sampling, chunk_size: int = 0):
    """(params, batch) -> `logprobs_pass` (or `shared_logprobs_pass`) on the host."""
    logprobs = jax.jit(functools.partial(logprobs_pass, cfg, sampling, chunk_size))
    shared = jax.jit(functools.partial(shared_logprobs_pass, cfg, sampling, chunk_size))
    shared_keys = ("tokens", "positions", "segment_ids", "branch_ids", "head_index", "head_valid", "head_source")

    def fn(params, b):
        if "branch_ids" in b:
            return np.asarray(shared(params, {k: b[k] for k in shared_keys}))
        return np.asarray(logprobs(params, b["tokens"], b["positions"], b["segment_ids"], batch_images(b)))
    return fn


def reference_logprobs_fn(cfg, ref_params, seq_len: int, pad_id: int, sampling: Sampling, chunk_size: int = 0):
    """samples -> per-token reference log-probs of their outputs (for rl.kl_mode="reward")."""
    logprobs = logprobs_fn(cfg, sampling, chunk_size)

    def fn(samples):
        lp = logprobs(ref_params, build_batch(samples, seq_len, pad_id, vision=cfg.vision, trim=True))
        return [lp[i, len(s.prompt_ids): len(s.prompt_ids) + len(s.output_ids)] for i, s in enumerate(samples)]
    return fn


def gae_pass(cfg, gamma: float, lam: float, params, tokens, positions, segment_ids, loss_mask, final_reward):
    """(advantages whitened over tokens, returns, old values), each [B, T] aligned like the batch:
    values from the value head (no logits), GAE over each sequence's sampled tokens (tool
    observations between turns are not episode ends; rlvr.rl.advantages.gae)."""
    from rlvr import losses
    from rlvr.rl.advantages import gae

    values = losses.model_values(cfg, params, tokens, positions, segment_ids)[:, :-1]
    mask = losses.target_mask(loss_mask, segment_ids).astype(jnp.float32)
    adv, returns = gae(final_reward[:, 1:], values, mask, gamma, lam, segments=segment_ids[:, 1:])
    mean = jnp.sum(adv * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    std = jnp.sqrt(jnp.sum(jnp.square(adv - mean) * mask) / jnp.maximum(jnp.sum(mask), 1.0))
    adv = (adv - mean) / (std + 1e-6) * mask
    pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
    return pad(adv), pad(returns), pad(values * mask)


def gae_fn(cfg, gamma: float, lam: float):
    """(params, batch, samples) -> batch with `gae_pass`'s advantages, returns and old values: the
    sequence's reward (task reward + KL penalty) sits on its last sampled token."""
    compute = jax.jit(functools.partial(gae_pass, cfg, gamma, lam))

    def fn(params, arrays, samples):
        final_reward = np.zeros_like(arrays["advantages"])
        rows, cols = np.nonzero(arrays["loss_mask"])  # row-major: a sequence's sampled tokens in order
        seqs = arrays["seq_index"][rows, cols]
        _, from_end = np.unique(seqs[::-1], return_index=True)
        last = len(seqs) - 1 - from_end  # each sequence's last sampled token (multi-turn: of its last turn)
        final_reward[rows[last], cols[last]] = [samples[i].rewards["reward"] + samples[i].rewards.get("kl_penalty", 0.0)
                                                for i in seqs[last]]
        adv, returns, old_values = compute(params, arrays["tokens"], arrays["positions"], arrays["segment_ids"],
                                           arrays["loss_mask"], final_reward)
        return {**arrays, "advantages": np.asarray(adv), "returns": np.asarray(returns),
                "old_values": np.asarray(old_values)}
    return fn


def mini_batches(arrays: dict[str, np.ndarray], count: int, rng: np.random.Generator):
    """`count` equal mini-batches of shuffled rows (one optimizer step each)."""
    if count == 1:
        yield arrays
        return
    order = rng.permutation(arrays["tokens"].shape[0])
    for part in np.split(order, count):
        yield {k: v[part] for k, v in arrays.items()}


class PolicyUpdate:
    """One scored batch -> `rl.updates_per_batch` optimizer steps: GAE advantages (PPO) and the
    proximal log-probs first when needed, then one jitted, sharded step per shuffled mini-batch
    (compiled once per mini-batch shape). Returns the new state and the mean metrics. `base`: a LoRA
    policy's frozen base (the state then holds its adapters), else None; `teacher_cfg`: the
    ModelConfig of `frozen["teacher"]` (full-vocabulary on-policy distillation), else None."""

    def __init__(self, config: ml_collections.ConfigDict, model, optimizer, shardings, frozen, learning_rate,
                 base=None, teacher_cfg=None):
        rl = config.rl
        self.config, self.model, self.optimizer, self.shardings = config, model, optimizer, shardings
        self.frozen, self.learning_rate, self.updates = frozen, learning_rate, rl.updates_per_batch
        self.base = base
        self.frozen_sharding = jax.tree.map(lambda x: x.sharding, frozen) if frozen is not None else None
        objective = Objective.from_config(config)
        self.loss_fn = functools.partial(rl_loss, model.cfg, objective, teacher_cfg=teacher_cfg)
        self.old_logprobs = None  # the proximal policy of several mini-batch updates: the weights before them
        if self.updates > 1 and objective.proximal == "current":
            self.old_logprobs = logprobs_fn(model.cfg, objective.sampling, objective.logprob_chunk_size)
        self.gae = gae_fn(model.cfg, rl.gae_gamma, rl.gae_lambda) if rl.advantage == "gae" else None
        self.rng = jax.random.key(config.seed)
        self._steps: dict[tuple[int, ...], Any] = {}

    def _step(self, mini: dict[str, np.ndarray]):
        shape = tuple(sorted((k, v.shape) for k, v in mini.items()))  # head_index's width varies too
        if shape not in self._steps:
            batch_sh = step_lib.batch_shardings(mini, self.model.mesh)
            self._steps[shape] = (step_lib.build_train_step(
                self.loss_fn, self.optimizer, self.model.mesh, self.shardings, batch_sh,
                micro_batches=self.config.train.micro_batches, learning_rate=self.learning_rate,
                frozen_sharding=self.frozen_sharding,
                base_sharding=step_lib.base_shardings(self.model.cfg, self.model.mesh)), batch_sh)
        return self._steps[shape]

    def __call__(self, state, arrays: dict[str, np.ndarray], samples, step: int):
        params = state["params"] if self.base is None else lora.combine(state["params"], self.base)
        if self.gae is not None:
            arrays = self.gae(params, arrays, samples)
        if self.old_logprobs is not None:  # the proximal policy of every mini-batch: the weights before them
            arrays["old_logp"] = self.old_logprobs(params, arrays)
        metrics = []
        for mini in mini_batches(arrays, self.updates, np.random.default_rng([self.config.seed, step])):
            train_step, batch_sh = self._step(mini)
            state, m = train_step(state, jax.device_put(mini, batch_sh), self.rng, self.frozen, self.base)
            metrics.append(m)
        metrics = jax.device_get(metrics)
        return state, {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
