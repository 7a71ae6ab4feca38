"""The in-loop scheduler on the real embedded engine: priority, preemption and degradation vs FIFO.

    .venv/bin/python benchmarks/scheduler.py [--repeats 2]

One batch of 24 groups x 4 samples on a tiny random model, 16 engine slots (capacity = 4 groups):
  bulk     16 groups, priority 1, arriving first; one sample per group is a straggler (224 tokens,
           the others 16), as long reasoning chains are
  urgent   8 groups, 16 tokens each, arriving right after
Policies, each on a fresh engine with the same requests and seeds:
  fifo      every group priority 1: arrival order
  priority  urgent = 4: urgent groups go first, and preempt bulk groups already running
  degrade   priority + deadline at 25% of fifo's batch time: bulk gets shorter budgets, then its
            groups are cut at 3 finished samples (the straggler dropped)
Figures: urgent groups' mean completion time and the batch time (ratios to fifo, same run),
inference slot utilisation, preemptions, cuts. One JSON line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import time

import jax

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rl.backends import EmbeddedBackend
from rlvr.rl.scheduler import GroupJob, SchedulePolicy, Scheduler
from rlvr.rollout.types import Request, SamplingParams

CFG = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=300, rope_theta=10_000.0)
ENGINE = dict(max_slots=16, max_len=256, page_size=16, decode_steps=4, prefill_rows=8, prefill_chunk=32)


def _group(name: str, index: int, lengths: list[int]) -> list[Request]:
    prompt = [1 + index, 2, 3, 4, 5, 6, 7, 8]
    return [Request(f"{name}{index}-k{k}", prompt, SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True,
                                                                  sampling_seed=1000 * index + k))
            for k, n in enumerate(lengths)]


def run_policy(params, policy: SchedulePolicy, urgent_priority: float) -> dict[str, float]:
    backend = EmbeddedBackend(CFG, params, byte_level_tokenizer(), **ENGINE)
    scorer = concurrent.futures.ThreadPoolExecutor(2)
    scheduler = Scheduler(policy, backend, scorer, 2, poll_s=0.002)
    finished: dict[str, float] = {}
    try:
        scheduler.begin_batch()
        start = time.monotonic()
        jobs = [GroupJob(i, "bulk", 1.0, _group("bulk", i, [16, 16, 16, 224]), score=lambda c: None)
                for i in range(16)]
        for job in jobs:
            scheduler.submit(job)
        time.sleep(0.05)  # urgent work arrives while bulk runs
        urgent = [GroupJob(8 + i, "urgent", urgent_priority, _group("urgent", i, [16] * 4), score=lambda c: None)
                  for i in range(8)]
        for job in urgent:
            scheduler.submit(job)
        for job in urgent:
            scheduler.wait(job)
            finished[f"u{job.key}"] = time.monotonic() - start
        for job in jobs:
            scheduler.wait(job)
        batch_s = time.monotonic() - start
        metrics = scheduler.end_batch()
    finally:
        scheduler.close()
        scorer.shutdown()
        backend.close()
    kept = sum(len(j.done) for j in jobs + urgent)
    return {"urgent_done_s": statistics.mean(finished.values()), "batch_s": batch_s, "samples_kept": kept,
            "util_inference_slots": metrics.get("util/inference_slots", 0.0),
            "preemptions": metrics["sched/preemptions"], "cut_groups": metrics["sched/degraded_cut"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    params = params_lib.init_params(CFG, jax.random.key(0), mesh)
    runs: dict[str, list[dict[str, float]]] = {"fifo": [], "priority": [], "degrade": []}
    for repeat in range(args.repeats + 1):  # the first round compiles every shape: not counted
        fifo = run_policy(params, SchedulePolicy(), 1.0)
        priority = run_policy(params, SchedulePolicy(), 4.0)
        deadline = 0.25 * (fifo["batch_s"] if repeat else 1.0)
        degrade = run_policy(params, SchedulePolicy(priorities={"urgent": 4.0}, deadline_s=deadline,
                                                    min_group_size=3), 4.0)
        if repeat:
            for name, row in (("fifo", fifo), ("priority", priority), ("degrade", degrade)):
                runs[name].append(row)
    out = {}
    for name, rows in runs.items():
        out[name] = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    for name in ("priority", "degrade"):
        out[name]["urgent_latency_vs_fifo"] = round(out[name]["urgent_done_s"] / out["fifo"]["urgent_done_s"], 3)
        out[name]["batch_time_vs_fifo"] = round(out[name]["batch_s"] / out["fifo"]["batch_s"], 3)
    print(json.dumps({"benchmark": "scheduler", "repeats": args.repeats, **out}))


if __name__ == "__main__":
    main()
