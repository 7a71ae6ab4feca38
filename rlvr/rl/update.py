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

from rlvr.rl.batching import build_batch
from rlvr.rl.objective import Objective, rl_loss
from rlvr.train import step as step_lib


def logprobs_fn(cfg):
    """(params, batch) -> the policy's log-prob of every token [B, T] (0 at position 0), aligned
    like behaviour_logp: the proximal policy of PPO mini-batch updates."""
    from rlvr import losses
    from rlvr.models.transformer import forward

    @jax.jit
    def logprobs(params, tokens, positions, segment_ids):
        logits, _ = forward(cfg, params, tokens, positions, segment_ids)
        lp = losses.next_token_logprobs(logits, tokens)
        return jnp.pad(lp, ((0, 0), (1, 0)))

    return lambda params, b: np.asarray(logprobs(params, b["tokens"], b["positions"], b["segment_ids"]))


def reference_logprobs_fn(cfg, ref_params, seq_len: int, pad_id: int):
    """samples -> per-token reference log-probs of their outputs (for rl.kl_mode="reward")."""
    logprobs = logprobs_fn(cfg)

    def fn(samples):
        lp = logprobs(ref_params, build_batch(samples, seq_len, pad_id))
        return [lp[i, len(s.prompt_ids): len(s.prompt_ids) + len(s.output_ids)] for i, s in enumerate(samples)]
    return fn


def gae_fn(cfg, gamma: float, lam: float):
    """(params, batch, samples) -> batch with per-token GAE advantages (whitened over tokens),
    returns and old values: the reward sits on each sequence's last sampled token, values come
    from the value head before the update."""
    from rlvr import losses
    from rlvr.models.transformer import forward_with_values
    from rlvr.rl.advantages import gae

    @jax.jit
    def compute(params, tokens, positions, segment_ids, loss_mask, final_reward):
        _, values, _ = forward_with_values(cfg, params, tokens, positions, segment_ids)
        mask = losses.target_mask(loss_mask, segment_ids).astype(jnp.float32)
        values = values[:, :-1]
        adv, returns = gae(final_reward[:, 1:], values, mask, gamma, lam)
        mean = jnp.sum(adv * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        std = jnp.sqrt(jnp.sum(jnp.square(adv - mean) * mask) / jnp.maximum(jnp.sum(mask), 1.0))
        adv = (adv - mean) / (std + 1e-6) * mask
        pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))
        return pad(adv), pad(returns), pad(values * mask)

    def fn(params, arrays, samples):
        final_reward = np.zeros_like(arrays["advantages"])
        rows, cols = np.nonzero(arrays["loss_mask"])  # row-major: a sequence's sampled tokens in order
        seqs = arrays["seq_index"][rows, cols]
        _, from_end = np.unique(seqs[::-1], return_index=True)
        last = len(seqs) - 1 - from_end  # each sequence's last sampled token (multi-turn: of its last turn)
        final_reward[rows[last], cols[last]] = [samples[i].rewards["reward"] for i in seqs[last]]
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
    (compiled once per mini-batch shape). Returns the new state and the mean metrics."""

    def __init__(self, config: ml_collections.ConfigDict, model, optimizer, shardings, frozen, learning_rate):
        rl = config.rl
        self.config, self.model, self.optimizer, self.shardings = config, model, optimizer, shardings
        self.frozen, self.learning_rate, self.updates = frozen, learning_rate, rl.updates_per_batch
        self.frozen_sharding = {"ref": shardings["params"]} if frozen is not None else None
        self.loss_fn = functools.partial(rl_loss, model.cfg, Objective.from_config(config))
        self.old_logprobs = logprobs_fn(model.cfg) if self.updates > 1 else None
        self.gae = gae_fn(model.cfg, rl.gae_gamma, rl.gae_lambda) if rl.advantage == "gae" else None
        self.rng = jax.random.key(config.seed)
        self._steps: dict[tuple[int, ...], Any] = {}

    def _step(self, mini: dict[str, np.ndarray]):
        shape = mini["tokens"].shape
        if shape not in self._steps:
            batch_sh = step_lib.batch_shardings(mini, self.model.mesh)
            self._steps[shape] = (step_lib.build_train_step(
                self.loss_fn, self.optimizer, self.model.mesh, self.shardings, batch_sh,
                micro_batches=self.config.train.micro_batches, learning_rate=self.learning_rate,
                frozen_sharding=self.frozen_sharding), batch_sh)
        return self._steps[shape]

    def __call__(self, state, arrays: dict[str, np.ndarray], samples, step: int):
        if self.gae is not None:
            arrays = self.gae(state["params"], arrays, samples)
        if self.old_logprobs is not None:  # the proximal policy of every mini-batch: the weights before them
            arrays["old_logp"] = self.old_logprobs(state["params"], arrays)
        metrics = []
        for mini in mini_batches(arrays, self.updates, np.random.default_rng([self.config.seed, step])):
            train_step, batch_sh = self._step(mini)
            state, m = train_step(state, jax.device_put(mini, batch_sh), self.rng, self.frozen)
            metrics.append(m)
        metrics = jax.device_get(metrics)
        return state, {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
