"""Validation of the RL-loop simulation (rlvr.launch.simulate) against measured runs, and a
planning example for a large run.

    .venv/bin/python benchmarks/simulation.py [--quick] [--workdir DIR]

1. Real RL jobs on this machine: configs/quickstart.py from random init (outputs of up to 24
   tokens, 8 steps; the first 2 are compiles and left out):
     cal      sync, 16 prompts x 8 samples, 64 engine slots       (the calibration run)
     slots32  the same on 32 slots (two waves of groups instead of one full load)
     g4       32 prompts x 4 samples (same rows, half the prefix sharing)
     p32      32 prompts x 8 samples (twice the rows: train and generation scale)
     async    rl.mode=async, max_staleness=1 (overlap on the same 2 CPU cores)
     cal_end  cal again, last: the drift of the machine's speed over the benchmark
   --quick runs cal, slots32 and async for 6 steps.
2. Microbenchmarks in one process on cal's setup: the engine's prefill and decode calls, the
   train step on half and all rows, and the contention of generation and training on two threads
   (SimulationConfig.colocated).
3. calibrate(cal) fits the simulation (engine scale, train, sync, lengths); every other run is
   PREDICTED from cal's timings and its own config.json (simulate_calibrate.transfer).
4. One JSON line: per run, measured vs predicted and the relative error of step_s (absolute,
   so sensitive to the machine's load), step_s / step_s(cal) (load drift partly cancels),
   util/trainer = sum(train_s + sync_s) / sum(step_s), util/producer = sum(generate_s) /
   sum(step_s), and rlvr.rl.scheduler's per-round util/inference_slots and queue/inference
   (time inside rounds). Noise: each run's step-time coefficient of variation, and the matmul
   yardstick (GFLOP/s) before each run: the machine is shared, so its speed drifts.
5. Planning: a 64-server math + agentic-code mix, swept over servers, sandbox workers and
   sync/async; the configuration with the lowest accelerator cost per step is recommended.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import calibrate_matmul_gflops, emit  # noqa: E402
from rlvr.launch import simulate as S  # noqa: E402
from rlvr.launch import simulate_calibrate as C  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--config.rl.sft_steps=0", "--config.rl.eval_examples=8", "--config.rl.eval_every=0",
          "--config.checkpoint.every_steps=1000", "--config.rl.max_new_tokens=24", "--config.rl.seq_len=32",
          "--config.rl.engine.max_len=64", "--config.rl.engine.max_slots=64", "--config.rl.prompts_per_step=16"]
RUNS = {
    "cal": [],
    "slots32": ["--config.rl.engine.max_slots=32"],
    "g4": ["--config.rl.prompts_per_step=32", "--config.rl.group_size=4"],
    "p32": ["--config.rl.prompts_per_step=32"],
    "async": ["--config.rl.mode=async", "--config.rl.max_staleness=1"],
    "cal_end": [],
}
QUICK = ("cal", "slots32", "async")
FIGURES = ("step_s", "step_ratio", "util/trainer", "util/producer", "round/util/inference_slots",
           "round/queue/inference")


def run_job(name: str, extra: list[str], workdir: str, steps: int) -> str:
    """Runs one real RL job (a subprocess, as a user would); returns its workdir."""
    path = os.path.join(workdir, name)
    command = [sys.executable, "-m", "rlvr.main", "--config=configs/quickstart.py", f"--workdir={path}",
               *COMMON, f"--config.train.num_steps={steps}", *extra]
    with open(path + ".log", "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    if done.returncode:
        with open(path + ".log") as log:
            tail = log.read()[-2000:]
        raise RuntimeError(f"run {name} failed (exit {done.returncode}):\n{tail}")
    return path


def predicted_figures(result: S.SimulationResult, cal_step_s: float, warmup: int) -> dict[str, float]:
    """The simulated run's figures, by the definitions of simulate_calibrate.measured."""
    u, steps = result.utilisation, result.steps[warmup:]
    producer = sum(s["generate_s"] for s in steps) / sum(s["step_s"] for s in steps)
    return {"step_s": result.step_s, "step_ratio": result.step_s / cal_step_s, "util/trainer": u["trainer"],
            "util/producer": producer, "round/util/inference_slots": result.round["util/inference_slots"],
            "round/queue/inference": result.round["queue/inference"], "staleness_mean": result.staleness["mean"]}


def compare(measured: dict[str, float], predicted: dict[str, float]) -> dict[str, dict[str, float]]:
    out = {}
    for key in (*FIGURES, "staleness_mean"):
        if key in measured and key in predicted:
            m, p = measured[key], predicted[key]
            out[key] = {"measured": round(m, 4), "predicted": round(p, 4),
                        "rel_error": round((p - m) / m, 3) if abs(m) > 1e-9 else None}
    return out


def validate(workdir: str, quick: bool) -> dict:
    names = QUICK if quick else tuple(RUNS)
    steps = 6 if quick else 8
    yardstick, dirs, started = {}, {}, time.perf_counter()
    for name in names:
        yardstick[name] = round(calibrate_matmul_gflops(reps=10), 1)
        dirs[name] = run_job(name, RUNS[name], workdir, steps)
        if name == "cal":  # microbenchmarks right after the calibration run, on its setup
            bench = C.Microbench(dirs["cal"])
            engine = bench.engine_timing()
            train = bench.train() if not quick else None
            colocated = bench.colocation()
    runs_s = time.perf_counter() - started
    config = C.calibrate(dirs["cal"], engine=engine, train=train, colocated=colocated)
    references = [C.measured(dirs[name])["step_s"] for name in ("cal", "cal_end") if name in dirs]
    reference = sum(references) / len(references)  # step_ratio: over the calibration setting's mean step
    cal_predicted = S.simulate(config)
    out = {}
    for name in names:
        m = C.measured(dirs[name])
        m["step_ratio"] = m["step_s"] / reference
        predicted = S.simulate(C.transfer(config, dirs[name], colocated=colocated))
        figures = predicted_figures(predicted, cal_predicted.step_s, config.warmup_steps)
        out[name] = {"compare": compare(m, figures),
                     "noise": {"step_s_cv": round(m["step_s_cv"], 3), "outlier_steps": m["outlier_steps"],
                               "yardstick_gflops": yardstick[name]}}
    errors = [abs(v["rel_error"]) for name in names if not name.startswith("cal")
              for k, v in out[name]["compare"].items()
              if k != "step_s" and v["rel_error"] is not None]
    drift = references[-1] / references[0] if len(references) > 1 else None
    return {"runs": out, "steps_per_run": steps, "skipped_steps": 2, "runs_wall_s": round(runs_s, 1),
            "drift_cal_end_over_cal_step_s": drift and round(drift, 3),
            "mean_abs_rel_error_dimensionless": round(sum(errors) / max(len(errors), 1), 3),
            "calibration": {"engine_microbench": dataclasses.asdict(engine),
                            "engine_scale_fitted": round(_decode_call(config) / _decode_call(config, engine), 3),
                            "train_shape_fixed_s_per_token_s": train, "colocated": round(colocated, 3),
                            "train_per_token_s": config.train_per_token_s, "train_fixed_s": config.train_fixed_s,
                            "weight_sync_s": round(config.weight_sync_s, 4)}}


def _decode_call(config: S.SimulationConfig, engine: S.EngineTiming | None = None) -> float:
    """Seconds of one decode call with every slot running."""
    e = engine or config.engine
    return e.decode_a + (e.decode_b + e.decode_slot_s) * config.max_slots


def planning_base() -> S.SimulationConfig:
    """A large run: 64 single-GPU SGLang servers (radix cache), a 64-chip trainer, math answers of
    ~1,200 tokens and multi-turn code-repair episodes whose test runs take ~3 s in a sandbox."""
    math = S.TaskClass("math", weight=0.5, priority=2, prompt_tokens=S.Dist.lognormal(300, 0.5),
                       output_tokens=S.Dist.lognormal(1200, 0.7), max_new_tokens=4096, verify_s=S.Dist.exp(0.05),
                       pass_rate=0.4)
    code = S.TaskClass("code_agent", weight=0.5, priority=1, prompt_tokens=S.Dist.lognormal(800, 0.3),
                       output_tokens=S.Dist.lognormal(250, 0.6), max_new_tokens=1024, episodic=True,
                       turns=S.Dist.uniform(2, 8),
                       tool_s=S.Dist.lognormal(3.0, 1.0), observation_tokens=S.Dist.lognormal(400, 0.8),
                       pass_rate=0.3)
    engine = S.EngineTiming(decode_a=0.015, decode_b=1e-4, prefill_a=0.02, prefill_b=2e-6, decode_steps=1,
                            prefill_rows=8, prefill_chunk=2048, cache_history=True)
    return S.SimulationConfig(prompts_per_step=256, group_size=8, dynamic_sampling=True, max_refill_rounds=2,
                              tasks=(math, code), servers=64, max_slots=64, engine=engine, verifier_workers=32,
                              sandbox_workers=256, episode_workers=1024, train_fixed_s=2.0, train_per_token_s=1.5e-6,
                              weight_sync_s=5.0, num_steps=5, warmup_steps=1)


def planning(quick: bool) -> dict:
    started = time.perf_counter()
    grid = {"servers": [16, 64] if quick else [8, 16, 32, 64], "sandbox_workers": [64, 256],
            "mode": ["sync", "async"]}
    base = planning_base()
    result = S.plan(base, grid, {"trainer": 64.0, "server": 1.0, "sandbox": 0.05})
    best = result["recommended"]
    chosen = dataclasses.replace(base, **{k: best[k] for k in grid})
    what_if = {}  # changes to the loop itself, on the recommended resources
    for name, change in {"serial_phases": {"overlap_phases": False}, "no_dynamic_sampling": {"dynamic_sampling": False},
                         "max_staleness_2": {"mode": "async", "max_staleness": 2}}.items():
        step_s = S.simulate(dataclasses.replace(chosen, **change)).step_s
        what_if[name] = {"step_s": round(step_s, 2), "vs_recommended": round(step_s / best["step_s"] - 1, 3)}
    return {**result, "what_if": what_if, "grid": grid,
            "costs": "per second: trainer 64, server 1, sandbox worker 0.05 (accelerators)",
            "sim_wall_s": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="3 runs of 6 steps, a smaller planning sweep")
    parser.add_argument("--workdir", default="", help="keep the runs here (default: a temporary directory)")
    parser.add_argument("--planning_only", action="store_true", help="no real runs: only the planning example")
    args = parser.parse_args()
    started = time.perf_counter()
    validation = None
    with tempfile.TemporaryDirectory(prefix="rlvr_sim_") as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        if not args.planning_only:
            validation = validate(workdir, args.quick)
    emit({"benchmark": "simulation", "quick": args.quick, "validation": validation,
          "planning": planning(args.quick), "wall_s": round(time.perf_counter() - started, 1)})


if __name__ == "__main__":
    main()
