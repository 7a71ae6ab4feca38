"""GRPO step time of the real RL loop on the fixed tiny config, sync and async.

    .venv/bin/python benchmarks/rl_step.py [--rounds 2 --warmup 2 --steps 4]
        [--tunix_python .venv-tunix/bin/python] [--out benchmarks/results/rl_step.json]

Runs `rlvr.trainers.rl.train` 2 x rounds times in one process, rl.mode="sync" and rl.mode="async"
(max_staleness=1) in ABBA order (sync, async, async, sync: a linear drift of the machine's speed
cancels out of the ratio), on the `bench` preset (4 layers, d256, 4.46M params, fp32, random
init), and reads the per-step records of metrics.jsonl. Workload, mirroring the GRPO part of
Tunix's bench_tunix.py: 8 prompts x group 4 = 32 completions of 64 new tokens (temperature 1, top_p 1) from
64-token prompts; a frozen reference model whose KL (k3, coefficient 0.04) is in the loss;
PPO clip 0.2, one AdamW update (lr 1e-6) per step. The prompts are arithmetic tasks with two
31-digit operands ("a+b=", exactly 64 byte tokens); the random model never answers them, so
rewards (and advantages) are 0, which changes no shape and no FLOP.

A step is the loop's step_s: rollout (generate + verify + advantages), batch assembly, the
jitted train step (policy forward/backward, reference forward, AdamW) and the weight sync to
the engine. Medians over the measured steps of a mode's runs pooled (2 x 4 by default; Tunix:
7), each run skipping `--warmup` steps (compiles, pipeline fill); held-out evaluation and the
final checkpoint run outside the timed steps. The sync/async ratio is measured in one
invocation and is the robust figure on a noisy machine.

Side by side (`--tunix_python`, default `.venv-tunix/bin/python`; '' = ours alone): every round
also runs the peer script's GRPO part (`benchmarks/peers/bench_tunix.py --only grpo`, its own
process, 2 warm-up + 7 timed steps, its median) first in even rounds and last in odd ones (ABBA:
tunix, sync, async | async, sync, tunix), and reports Tunix's median over ours and per round. The
roofline beside the step: the generation's (`common.decode_roofline`, 32 x 64 -> 64 tokens) plus
the train step's model FLOPs (policy forward and backward, the reference's forward) at the best
fp32 1024³ matmul rate measured between the runs, on the rows each trains: ours 8 x 320 tokens
(rl.share_prompts: each prompt once, then its group's 4 completions; the same loss), Tunix's
32 x 128 (`roofline_unshared_rows`); on one CPU generation and training share the same cores, so
the lower bound is their sum in async mode too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import (  # noqa: E402
    apply_overrides,
    calibrate_matmul_gflops,
    decode_roofline,
    default_tunix_python,
    emit,
    load_average,
    machine_peaks,
    record_with_history,
    tunix_part,
)

from rlvr import config_lib  # noqa: E402
from rlvr.job import resolve  # noqa: E402
from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402
from rlvr.train import flops  # noqa: E402
from rlvr.trainers import rl as rl_trainer  # noqa: E402

PROMPTS, GROUP, NEW_TOKENS, PROMPT_DIGITS = 8, 4, 64, 31  # "a+b=" with 31-digit operands: 64 tokens
SHARED_ROW = 2 * PROMPT_DIGITS + 2 + GROUP * NEW_TOKENS  # a prompt and its group's 4 completions: 320 tokens


def bench_config(mode: str, num_steps: int, overrides: tuple[str, ...] = ()):
    c = config_lib.base_config()
    c.job = "rl"
    c.model = config_lib.model_config_dict(preset="bench")
    rl = c.rl
    rl.task, rl.min_digits, rl.max_digits = "add", PROMPT_DIGITS, PROMPT_DIGITS
    rl.prompts_per_step, rl.group_size, rl.max_new_tokens = PROMPTS, GROUP, NEW_TOKENS
    rl.temperature, rl.top_p = 1.0, 1.0
    rl.seq_len = 2 * PROMPT_DIGITS + 2 + NEW_TOKENS  # 128, as Tunix's 64 + 64 train rows
    rl.engine.max_len, rl.engine.page_size, rl.engine.max_slots = 128, 16, 32
    rl.engine.decode_steps, rl.engine.prefill_rows, rl.engine.prefill_chunk = 16, 8, 64  # as benchmarks/rollout.py
    rl.mode, rl.max_staleness = mode, 1
    # Tunix's GRPOConfig(beta=0.04, epsilon=0.2, num_iterations=1): k3 KL in the loss, no IS correction.
    rl.reference_model, rl.kl_coef, rl.kl_estimator, rl.kl_mode = True, 0.04, "k3", "loss"
    rl.clip_low, rl.clip_high, rl.tis_cap = 0.2, 0.2, 0.0
    rl.advantage, rl.aggregation = "grpo", "seq_mean_token_mean"
    rl.eval_examples, rl.eval_every, rl.sft_steps = 1, 0, 0
    # Tunix passes optax.adamw(1e-6): b2 0.999, weight decay 1e-4, no clipping, constant lr.
    opt = c.optimizer
    opt.learning_rate, opt.warmup_steps, opt.schedule = 1e-6, 0, "constant"
    opt.b2, opt.weight_decay, opt.grad_clip = 0.999, 1e-4, 0.0
    c.train.num_steps, c.train.log_every, c.train.tensorboard = num_steps, 10**6, False
    c.checkpoint.every_steps, c.checkpoint.resume = 10**6, False
    # Our layout: each prompt once, its 4 completions after it (rl.share_prompts: the same loss; the train
    # passes run 8 x 320 tokens, not 32 x 128), in 2 micro-batches of 4 rows (1,280 tokens: this CPU's
    # fastest size). `--set rl.share_prompts=False --set rl.pack=False --set rl.row_len=0` trains Tunix's rows.
    rl.pack, rl.share_prompts, rl.row_len = True, True, SHARED_ROW
    c.train.micro_batches = 2
    apply_overrides(c, overrides)  # --set a.b=value, e.g. train.micro_batches=4
    config_lib.validate(c, jax.device_count())
    c.lock()
    return c


def run_mode(mode: str, warmup: int, steps: int, overrides: tuple[str, ...] = ()) -> dict:
    """One `train()` run; its per-step records (warm-up and measured) and wall time."""
    with tempfile.TemporaryDirectory(prefix=f"rl_step_{mode}_") as workdir:
        t0, cpu0 = time.perf_counter(), _cpu_seconds()
        with contextlib.redirect_stdout(sys.stderr):  # the loop's prints; stdout is the JSON line
            rl_trainer.train(resolve(bench_config(mode, warmup + steps, overrides), workdir))
        wall, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return {"warm": records[:warmup], "timed": records[warmup:], "wall_s": wall, "cpu_s": cpu}


def _cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) this process has used: over a run's wall time, the
    cores it kept busy (async can only gain where sync leaves cores idle)."""
    t = os.times()
    return t.user + t.system


def summarize(runs: list[dict]) -> dict:
    """Medians over the measured steps of all runs of one mode (pooled)."""
    timed = [r for run in runs for r in run["timed"]]
    med = lambda key: statistics.median(r[key] for r in timed)
    step_s = med("step_s")
    return {
        "step_s": round(step_s, 4),
        "steps_per_s": round(1 / step_s, 3),
        "breakdown_median_s": {
            "generate": round(statistics.median(r["generate_s"] - r["verify_s"] for r in timed), 4),
            "verify": round(med("verify_s"), 5),
            "train": round(med("train_s"), 4),
            "sync": round(med("sync_s"), 4),
            "idle_wait": round(med("wait_for_rollout_s"), 4),
        },
        "warmup_step_s_per_run": [[round(r["step_s"], 3) for r in run["warm"]] for run in runs],
        "step_s_per_run": [[round(r["step_s"], 4) for r in run["timed"]] for run in runs],
        "response_length_mean": round(statistics.mean(r["response_length"] for r in timed), 2),
        "truncated_fraction_mean": round(statistics.mean(r["truncated_fraction"] for r in timed), 3),
        "staleness_max": max(r["staleness_max"] for r in timed),
        "partial_rollout_fraction_mean": round(statistics.mean(r["partial_rollout_fraction"] for r in timed), 3),
        "kl_to_reference_last": timed[-1].get("kl"),
        "run_wall_s": [round(run["wall_s"], 1) for run in runs],
        "run_busy_cores": [round(run["cpu_s"] / run["wall_s"], 2) for run in runs],
    }


NOTES = (
    "Tunix: bench_tunix.py's GRPO part run in this invocation (its own process each round, ABBA with ours), the "
    "median over rounds of each run's median of 7 timed steps after 2 warm-up, where a step is "
    "the interval between batch pulls of GRPOLearner.train() (vanilla static-batch sampler, 32x64 tokens, kv cache "
    "128; a separate reference forward; reward/advantages; one AdamW update on 32x128 rows; colocated, weight sync "
    "0 s). Ours: the same shapes, sampling (temperature 1, top_p 1, EOS allowed), beta 0.04/k3, epsilon 0.2, AdamW "
    "lr 1e-6 b2 0.999 wd 1e-4, no clipping, 2 warm-up steps per run; one invocation, medians over the measured "
    "steps of 2 runs per mode (ABBA order). Differences: prompts are "
    "64-byte arithmetic tasks (two 31-digit operands) from the byte tokenizer, not BOS + 63 random ids; reward is "
    "the exact-match verifier (all 0 on a random model, so zero advantages; Tunix used a trivial per-token reward), "
    "same compute either way; the reference forward runs inside our jitted train step (in 'train'), Tunix times it "
    "separately; our engine is paged with continuous batching and shares each group's prompt pages; 'sync' copies "
    "the params into the engine (Tunix shares them); our loss also computes the entropy metric (one extra "
    "log-softmax); our step_s excludes the per-step metrics write (ms), Tunix's pull interval includes its logging. "
    "'generate' = generate_s - verify_s (engine time incl. tokenizing); 'idle_wait' = wait_for_rollout_s, the "
    "trainer's wait for a batch (in sync mode the whole rollout: generate + verify + advantages). Breakdown "
    "entries are separate medians, so they need not add up to step_s. Timings on a shared 2-core CPU are noisy: "
    "compare the sync/async ratio (same run) more than absolute figures. Our train rows (unless --set says "
    "otherwise): rl.share_prompts, each prompt once and its group's 4 completions after it as branches (8 x 320 "
    "tokens; the same loss and gradients as 32 x 128 rows, tests/test_rl_objective.py), in 2 micro-batches "
    "(train.micro_batches=2, the same gradient); Tunix trains 32 x 128 rows in one batch."
)


def roofline(peak_gflops: float, read_gbytes_per_s: float, shared: bool) -> dict:
    """The step's lower bound on this machine: generation (`decode_roofline` of 32 distinct 64-token
    prompts -> 64 tokens) plus the train step's model FLOPs at the matmul peak: on 32 rows of
    prompt + completion (128 tokens, as Tunix trains them), or (`shared`, rl.share_prompts) on 8 rows
    of one prompt + its 4 completions (320 tokens)."""
    cfg = ModelConfig(**PRESETS["bench"])
    completions = PROMPTS * GROUP
    gen = decode_roofline(cfg, [[i] * NEW_TOKENS for i in range(completions)], [NEW_TOKENS] * completions,
                          completions, {"matmul_gflops": peak_gflops, "read_gbytes_per_s": read_gbytes_per_s})
    rows, seq = (PROMPTS, SHARED_ROW) if shared else (completions, 2 * NEW_TOKENS)
    policy = flops.train_flops_per_token(cfg, seq) * rows * seq
    train_s = (policy + policy / 3) / (peak_gflops * 1e9)  # + the reference's forward: a third of fwd+bwd
    return {"step_s": round(gen["seconds"] + train_s, 4), "generate_s": gen["seconds"], "train_s": round(train_s, 4),
            "train_model_tflops": round((policy + policy / 3) / 1e12, 4), "peak_matmul_gflops": round(peak_gflops, 1),
            "train_rows": f"{rows} x {seq}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warmup", type=int, default=2, help="steps skipped at the start of every run")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="sync+async run pairs, in ABBA order")
    parser.add_argument("--tunix_python", default=default_tunix_python(),
                        help="python of a venv with google-tunix ('' = ours alone)")
    parser.add_argument("--out", default="", help="also record the result here (earlier records kept)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key of our runs (a Python literal), e.g. rl.share_prompts=False")
    args = parser.parse_args()
    t0 = time.perf_counter()
    load_before = load_average()
    cache = tempfile.TemporaryDirectory(prefix="rl_step_jax_cache_")
    # Later runs re-jit the same train step: a compilation cache for this invocation only (the
    # first run's compile times stay honest) keeps their warm-up short.
    jax.config.update("jax_compilation_cache_dir", cache.name)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    calibs, peaks = [calibrate_matmul_gflops()], [machine_peaks()]
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    tunix_runs, order, rounds = [], [], []
    who_all = (["tunix"] if args.tunix_python else []) + ["sync", "async"]
    for r in range(args.rounds):
        for who in who_all if r % 2 == 0 else who_all[::-1]:  # ABBA: cancels linear drift
            if who == "tunix":
                tunix_runs.append(tunix_part(args.tunix_python, "grpo"))
            else:
                runs[who].append(run_mode(who, args.warmup, args.steps, args.set))
            order.append(who)
            calibs.append(calibrate_matmul_gflops())
        peaks.append(machine_peaks())
        one = {m: round(statistics.median(x["step_s"] for x in runs[m][-1]["timed"]), 4) for m in ("sync", "async")}
        if args.tunix_python:
            one["tunix"] = tunix_runs[-1]["median_step_s"]
            one.update(speedup_sync=round(one["tunix"] / one["sync"], 3),
                       speedup_async=round(one["tunix"] / one["async"], 3))
        rounds.append(one)
    cache.cleanup()
    sync, async_ = summarize(runs["sync"]), summarize(runs["async"])
    calib = statistics.mean(calibs)
    peak = (max(p["matmul_gflops"] for p in peaks), max(p["read_gbytes_per_s"] for p in peaks))
    shared = bench_config("sync", 1, args.set).rl.share_prompts
    bound, tunix_bound = roofline(*peak, shared), roofline(*peak, False)  # the rows each trains
    for fig in (sync, async_):
        fig["roofline_step_s"] = bound["step_s"]
        fig["vs_roofline"] = round(bound["step_s"] / fig["step_s"], 3)
    record = {
        "benchmark": "rl_step", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%MZ"),
        "command": "benchmarks/rl_step.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (the load averages say how busy), "
                   f"{jax.devices()[0]}",
        "model": "bench preset (4 layers, d256, 4.46M params, fp32, random init)",
        "workload": f"{PROMPTS} prompts x group {GROUP} x {NEW_TOKENS} new tokens, 64-token prompts, reference "
                    "model (k3 KL, coef 0.04), 1 AdamW update/step",
        "devices": str(jax.devices()[0]), "cpu_count": os.cpu_count(), "order": order,
        # malloc's huge pages speed both frameworks' steps, Tunix's more (results/hugepages.json); the peer runs
        # in this environment too
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "runs_per_mode": args.rounds, "warmup_steps_per_run": args.warmup, "measured_steps_per_run": args.steps,
        "calib_matmul_gflops": round(calib, 1), "calib_matmul_gflops_between_runs": [round(c, 1) for c in calibs],
        "share_prompts": shared, "roofline": bound, "roofline_unshared_rows": tunix_bound,
        "sync": sync, "async_staleness1": async_,
        "grpo_step_s": sync["step_s"],
        "async_speedup": round(sync["step_s"] / async_["step_s"], 3),
        "async_speedup_per_pair": [round(x["sync"] / x["async"], 3) for x in rounds],
        "rounds": rounds,
    }
    if args.tunix_python:
        tunix_s = statistics.median(t["median_step_s"] for t in tunix_runs)
        record["tunix"] = {"step_s": round(tunix_s, 4), "roofline_step_s": tunix_bound["step_s"],
                           "vs_roofline": round(tunix_bound["step_s"] / tunix_s, 3),
                           "runs": [{k: t.get(k) for k in ("median_step_s", "all_step_s", "tunix_perf_breakdown",
                                                           "calib_matmul_gflops_before", "calib_matmul_gflops_after")}
                                    for t in tunix_runs]}
        record["speedup_vs_tunix_sync"] = round(tunix_s / sync["step_s"], 3)
        record["speedup_vs_tunix_async"] = round(tunix_s / async_["step_s"], 3)
        record["speedup_vs_tunix_per_round"] = [{k: x[k] for k in ("speedup_sync", "speedup_async")} for x in rounds]
    record.update(load_average_before=load_before, load_average_after=load_average(),
                  total_runtime_s=round(time.perf_counter() - t0, 1), notes=NOTES)
    emit(record)
    if args.out:
        record_with_history(args.out, record)


if __name__ == "__main__":
    main()
