"""Next-token training on a text corpus: the smallest complete training job.

Read top to bottom: build mesh, tokenizer, model and optimizer → restore the latest
checkpoint if any → loop (batch → sharded step → metrics → checkpoint) → evaluate.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rlvr import api, losses, observe
from rlvr.data.arithmetic import ArithmeticData
from rlvr.data.jsonl import JsonlTextData
from rlvr.models.generate import greedy_generate
from rlvr.models.transformer import forward
from rlvr.train import step as step_lib
from rlvr.train.checkpoint import Checkpointer
from rlvr.train.optimizer import build_optimizer


def make_loss(cfg):
    def loss_fn(params, batch, rng, frozen):
        del rng, frozen
        logits, _ = forward(cfg, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        logp = losses.next_token_logprobs(logits, batch["tokens"])
        mask = losses.target_mask(batch["loss_mask"], batch["segment_ids"])
        return -jnp.sum(logp * mask), {"weight": mask.sum()}
    return loss_fn


def build_data(config: ml_collections.ConfigDict, tokenizer):
    d = config.data
    if d.source == "jsonl":
        return JsonlTextData(d.path, tokenizer, d.batch_size, d.seq_len, config.seed)
    return ArithmeticData(tokenizer, d.batch_size, d.seq_len, config.seed, d.max_operand)


def evaluate_arithmetic(model: api.Model, tokenizer, data: ArithmeticData, count: int) -> float:
    """Greedy exact-match accuracy on held-out problems."""
    problems = data.problems(count, stream=1)
    prompts = [tokenizer.encode(p) for p, _ in problems]
    outputs = greedy_generate(model.cfg, model.params, prompts, 8, tokenizer.eos_id, tokenizer.pad_id)
    answers = [tokenizer.decode([t for t in out if t != tokenizer.eos_id]) for out in outputs]
    return float(np.mean([a == ref for a, (_, ref) in zip(answers, problems, strict=True)]))


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    mesh = api.build_mesh(config)
    tokenizer = api.build_tokenizer(config)
    model = api.build_model(config, mesh)
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise api.ConfigError(f"model.vocab_size={model.cfg.vocab_size} is smaller than the "
                              f"tokenizer's {tokenizer.vocab_size}; raise model.vocab_size.")
    num_steps = config.train.num_steps
    optimizer = build_optimizer(config.optimizer, num_steps)
    shardings = step_lib.state_shardings(model.cfg, optimizer, mesh)
    data = build_data(config, tokenizer)
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep,
                               config.checkpoint.async_save)
    if config.checkpoint.resume and checkpoints.latest_step() is not None:
        state, extra = checkpoints.restore(step_lib.abstract_state(model.cfg, optimizer, shardings))
        data.set_state(extra["data"])
        print(f"resumed from step {int(state['step'])} ({checkpoints.directory})")
    else:
        state = step_lib.init_state(model.params, optimizer, shardings)
    cfg = model.cfg
    del model  # its params now live (and are donated) in `state`

    batch_sh = step_lib.batch_shardings(data.batch(0), mesh)
    train_step = step_lib.build_train_step(make_loss(cfg), optimizer, mesh, shardings, batch_sh)
    rng = jax.random.key(config.seed)
    metrics_out = observe.MetricsWriter(workdir)
    start = int(state["step"])
    progress = observe.Progress(num_steps, start)
    t_last = time.perf_counter()
    for step in range(start, num_steps):
        batch = jax.device_put(next(data), batch_sh)
        state, metrics = train_step(state, batch, rng, None)
        done = step + 1
        if done % config.train.log_every == 0 or done == num_steps:
            metrics = jax.device_get(metrics)
            elapsed, t_last = time.perf_counter() - t_last, time.perf_counter()
            metrics["tokens_per_s"] = float(metrics["weight"]) * config.train.log_every / elapsed
            metrics_out.write(done, metrics)
            progress.update(done, {"loss": metrics["loss"]})
        if done % config.checkpoint.every_steps == 0 or done == num_steps:
            checkpoints.save(done, state, {"data": data.get_state()}, force=True)
    progress.close()
    checkpoints.close()
    metrics_out.close()
    summary = {"final_step": num_steps, "final_loss": _last_loss(metrics_out.path)}
    if isinstance(data, ArithmeticData):
        final = api.Model(cfg, state["params"], mesh)
        summary["heldout_accuracy"] = evaluate_arithmetic(final, tokenizer, data,
                                                          config.train.eval_examples)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print("summary: " + json.dumps(summary))
    return summary


def _last_loss(metrics_path: str) -> float | None:
    with open(metrics_path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return lines[-1]["loss"] if lines else None
