"""The training loop shared by every trainer: restore → step → metrics → checkpoint.

A trainer hands in what differs (a loss function, a data stream, optional frozen inputs such
as reference params); the loop owns the optimizer, shardings, checkpoints and metrics. For a LoRA
model the train state (and so the optimizer and the checkpoints) holds only the adapters; the
frozen base goes to every step beside it (rlvr.train.step).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax

from rlvr import observe
from rlvr.api import Model
from rlvr.data import shards
from rlvr.job import Job
from rlvr.models import lora
from rlvr.train import flops
from rlvr.train import step as step_lib
from rlvr.train.checkpoint import Checkpointer
from rlvr.train.optimizer import build_optimizer, learning_rate_schedule
from rlvr.train.preemption import Preempted, PreemptionGuard


@dataclasses.dataclass
class LoopResult:
    state: dict[str, Any]
    last_metrics: dict[str, float]
    resumed_from: int | None
    params: Any = None  # the trained policy: the state's params, with a LoRA model's frozen base


def split_trained(model: Model) -> tuple[Any, Any]:
    """(what trains, the frozen base or None): a LoRA model's adapters and base, else (params, None)."""
    return lora.split(model.params) if model.cfg.lora.enabled else (model.params, None)


def policy_params(trained: Any, base: Any) -> Any:
    """The whole policy from what trains and the frozen base (None: nothing frozen)."""
    return trained if base is None else lora.combine(trained, base)


def train_loop(job: Job, model: Model, loss_fn, data, tokens_per_batch: int, frozen: Any = None,
               frozen_sharding: Any = None) -> LoopResult:
    """Trains `model.params` with `loss_fn` on `data` for `config.train.num_steps` steps. A LoRA
    checkpoint records beside its adapters the frozen base it adapts (`job.policy_source`, rebuilt by
    `api.load_trained` from the workdir's config.json)."""
    config, workdir = job.config, job.workdir
    num_steps = config.train.num_steps
    optimizer = build_optimizer(config.optimizer, num_steps)
    shardings = step_lib.state_shardings(model.cfg, optimizer, model.mesh)
    checkpoints = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.keep,
                               config.checkpoint.async_save)
    resumed_from = None
    if config.checkpoint.resume and checkpoints.latest_step() is not None:
        state, extra = checkpoints.restore(step_lib.abstract_state(model.cfg, optimizer, shardings))
        data.set_state(extra["data"])
        resumed_from = int(state["step"])
        print(f"resumed from step {resumed_from} ({checkpoints.directory})")
        observe.drop_metrics_after(workdir, resumed_from)
    trained, base = split_trained(model)
    if resumed_from is None:
        state = step_lib.init_state(trained, optimizer, shardings)
    model.params = trained = None  # now owned (and donated) by `state`

    batch_sh = step_lib.batch_shardings(data.shapes(), model.mesh)
    reader = shards.RowReader(data, batch_sh)  # this process's rows of each batch
    train_step = step_lib.build_train_step(
        loss_fn, optimizer, model.mesh, shardings, batch_sh, micro_batches=config.train.micro_batches,
        learning_rate=learning_rate_schedule(config.optimizer, num_steps), frozen_sharding=frozen_sharding,
        base_sharding=step_lib.base_shardings(model.cfg, model.mesh))
    record = {"lora_base": job.policy_source.describe()} if model.cfg.lora.enabled else {}
    rng = jax.random.key(config.seed)
    step_flops = flops.train_flops_per_token(model.cfg, config.data.seq_len) * tokens_per_batch
    peak = flops.machine_peak(model.cfg.dtype)
    writer = observe.MetricsWriter.for_config(workdir, config.train)
    start = int(state["step"])
    progress = observe.Progress(num_steps, start)
    metrics: dict[str, Any] = {}
    window_start, window_steps = time.perf_counter(), 0
    preempted_at = None
    with PreemptionGuard() as guard:
        for step in range(start, num_steps):
            batch = reader.next()
            state, metrics = train_step(state, batch, rng, frozen, base)
            done, window_steps = step + 1, window_steps + 1
            if step == start:  # one host sync, to separate compile time from step time
                jax.block_until_ready(metrics)
                writer.write(done, {"compile_and_first_step_s": time.perf_counter() - window_start})
                window_start, window_steps = time.perf_counter(), 0
            if window_steps and (done % config.train.log_every == 0 or done == num_steps):
                metrics = jax.device_get(metrics)
                step_time = (time.perf_counter() - window_start) / window_steps
                metrics.update(step_time_s=step_time, tokens_per_s=tokens_per_batch / step_time,
                               model_flops_per_s=step_flops / step_time, mfu=step_flops / step_time / peak)
                writer.write(done, metrics)
                progress.update(done, {"loss": metrics["loss"]})
                window_start, window_steps = time.perf_counter(), 0
            if done % config.checkpoint.every_steps == 0 or done == num_steps:
                checkpoints.save(done, state, {"data": shards.merged_state(data), **record}, force=True)
            if done < num_steps and guard.should_stop():
                checkpoints.save_now(done, state, {"data": shards.merged_state(data), **record})
                preempted_at = done
                break
    progress.close()
    print(reader.describe())
    checkpoints.close()
    writer.close()
    if preempted_at is not None:
        raise Preempted(preempted_at, checkpoints.directory)
    return LoopResult(state, {k: float(v) for k, v in jax.device_get(metrics).items()}, resumed_from,
                      policy_params(state["params"], base))
