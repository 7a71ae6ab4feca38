"""Train-step throughput on the fixed tiny config beside Tunix's, measured in one window.

    .venv/bin/python benchmarks/train_step.py [--repeats 10] [--rounds 2] [--tunix_python .venv-tunix/bin/python]
        [--out benchmarks/results/train_step.json]

Model: 4 layers, d_model 256, 4 heads / 2 KV heads, head_dim 64, MLP 1024, vocab 1024, fp32
(the `bench` preset, 4,459,264 params; one module per layer unless `--scan_layers true`); batch
8 x 256 tokens; AdamW. SFT trains on every token; DPO on 8 pairs x 256 tokens per side with
precomputed reference log-probs (ours only).

Side by side: the peer script's SFT part (`benchmarks/peers/bench_tunix.py --only sft`, its own
process: Tunix's jitted PeftTrainer step called directly, 3 warm-up + 10 timed calls, its median)
and our SFT step (timed calls of the compiled step for as long as Tunix's timed calls took, at
least `repeats`) alternate in ABBA order for `rounds` pairs; the speed-up is Tunix's median over
ours and per adjacent pair. This machine's speed drifts up to ~2x over minutes and is shared: only
such same-window ratios mean anything. Beside every throughput figure: the roofline, the step's
model FLOPs at the best fp32 1024³ matmul rate measured between the rounds (the lower bound of the
step in seconds), and the MFU against it.
`--tunix_python ''` times ours alone; `--profile` adds our SFT step's per-op profile
(`op_profile.py`: milliseconds per group of ops, MLP / attention projections / attention core /
output head and cross-entropy / norms / optimizer).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np
import optax

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import (  # noqa: E402
    calibrate_matmul_gflops,
    default_tunix_python,
    emit,
    load_average,
    machine_peaks,
    record_with_history,
    time_calls,
)

from rlvr import sharding  # noqa: E402
from rlvr.models import params as params_lib  # noqa: E402
from rlvr.models.config import PRESETS, ModelConfig  # noqa: E402
from rlvr.train import flops  # noqa: E402
from rlvr.train import step as step_lib  # noqa: E402
from rlvr.trainers.preference import preference_loss  # noqa: E402
from rlvr.trainers.sft import sft_loss  # noqa: E402

BATCH, SEQ = 8, 256


def _rows(rng, n):
    return {"tokens": rng.integers(0, 1024, (n, SEQ)).astype(np.int32),
            "positions": np.tile(np.arange(SEQ, dtype=np.int32), (n, 1)),
            "segment_ids": np.ones((n, SEQ), np.int32), "loss_mask": np.ones((n, SEQ), np.int32)}


def sft_batch(rng):
    return _rows(rng, BATCH)


def dpo_batch(rng):
    batch = {f"chosen_{k}": v for k, v in _rows(rng, BATCH).items()}
    batch.update({f"rejected_{k}": v for k, v in _rows(rng, BATCH).items()})
    batch["ref_chosen"] = rng.normal(-1800, 10, BATCH).astype(np.float32)
    batch["ref_rejected"] = rng.normal(-1800, 10, BATCH).astype(np.float32)
    return batch


def compiled_step(cfg: ModelConfig, loss_fn, batch_np, micro_batches: int = 1):
    """(one blocking call of the jitted step on a fixed batch, seconds of its first call incl. compile,
    a function returning the per-op profile of 3 calls: `op_profile`)."""
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    optimizer = optax.adamw(1e-4)
    shardings = step_lib.state_shardings(cfg, optimizer, mesh)
    state = step_lib.init_state(params_lib.init_params(cfg, jax.random.key(0), mesh), optimizer, shardings)
    batch_sh = step_lib.batch_shardings(batch_np, mesh)
    step = step_lib.build_train_step(loss_fn, optimizer, mesh, shardings, batch_sh, micro_batches=micro_batches)
    batch, rng = jax.device_put(batch_np, batch_sh), jax.random.key(0)
    holder = {"state": state}

    def one():
        holder["state"], metrics = step(holder["state"], batch, rng, None, None)
        jax.block_until_ready(metrics)

    first, _ = time_calls(one, 0)

    def profile():
        from op_profile import op_profile

        hlo = step.lower(holder["state"], batch, rng, None, None).compile().as_text()
        return op_profile(one, hlo)

    return one, first, profile


def figures(cfg: ModelConfig, times: list[float], rows: int, peak: float) -> dict:
    """Median step, tokens/s and MFU, each beside its roofline at `peak` FLOP/s."""
    step_s = statistics.median(times)
    tokens = rows * SEQ
    model_flops = flops.train_flops_per_token(cfg, SEQ) * tokens
    roofline_s = model_flops / peak
    return {"step_s": round(step_s, 4), "roofline_step_s": round(roofline_s, 4),
            "tokens_per_s": round(tokens / step_s, 1), "roofline_tokens_per_s": round(tokens / roofline_s, 1),
            "model_tflops_per_step": round(model_flops / 1e12, 4), "mfu": round(roofline_s / step_s, 4),
            "all_step_s": [round(t, 4) for t in times]}


def calls_for(one, seconds: float, at_least: int) -> list[float]:
    """Per-call times of calls of `one` until they add up to `seconds` (and at least `at_least` calls)."""
    times = []
    while sum(times) < seconds or len(times) < at_least:
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return times


def side_by_side(cfg, one, python: str, rounds: int, repeats: int) -> dict:
    """Tunix's SFT step and ours alternately (ABBA), `rounds` pairs; the matmul peak between them.
    Each of our runs lasts as long as the previous Tunix run's timed calls (about 20 of ours to its
    10), at least `repeats` calls: both medians then span the same stretch of wall time, so a
    slowdown of the machine moves them alike (with our half 2.5x shorter, a slowdown of a few
    seconds could cover all of ours and only a minority of Tunix's calls)."""
    from common import tunix_part

    ours, theirs, pairs, order, peaks = [], [], [], [], [machine_peaks()["matmul_gflops"]]
    for r in range(rounds):
        pair = {}
        for who in ("tunix", "ours") if r % 2 == 0 else ("ours", "tunix"):
            if who == "tunix":
                part = tunix_part(python, "sft")
                theirs.append({"step_s": part["median_step_s"], "all_step_s": part["all_step_s"],
                               "calib_matmul_gflops": [part["calib_matmul_gflops_before"],
                                                       part["calib_matmul_gflops_after"]]})
                pair[who] = part["median_step_s"]
            else:
                times = calls_for(one, sum(theirs[-1]["all_step_s"]), repeats)
                ours.append([round(t, 4) for t in times])
                pair[who] = statistics.median(times)
            order.append(who)
        pairs.append({"tunix_s": pair["tunix"], "ours_s": round(pair["ours"], 4),
                      "speedup": round(pair["tunix"] / pair["ours"], 3)})
        peaks.append(machine_peaks()["matmul_gflops"])
    peak = max(peaks) * 1e9
    ours_fig = figures(cfg, [t for run in ours for t in run], BATCH, peak)
    theirs_fig = figures(cfg, [run["step_s"] for run in theirs], BATCH, peak)
    theirs_fig.pop("all_step_s")
    return {"order": order, "matmul_peak_gflops_between_rounds": [round(p, 1) for p in peaks],
            "roofline_peak_gflops": round(peak / 1e9, 1), "ours": {**ours_fig, "runs": ours},
            "tunix": {**theirs_fig, "runs": theirs},
            "speedup_vs_tunix": round(theirs_fig["step_s"] / ours_fig["step_s"], 3), "pairs": pairs,
            "speedup_per_pair": [p["speedup"] for p in pairs]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10,
                        help="our timed calls (per round: at least this many, as long as Tunix's timed calls)")
    parser.add_argument("--rounds", type=int, default=2, help="Tunix/ours pairs, in ABBA order")
    parser.add_argument("--tunix_python", default=default_tunix_python(),
                        help="python of a venv with google-tunix ('' = ours alone)")
    parser.add_argument("--out", default="", help="also record the result here (earlier records kept)")
    parser.add_argument("--micro_batches", type=int, default=1,
                        help="our steps accumulate over this many micro-batches (the same gradient)")
    parser.add_argument("--scan_layers", choices=("true", "false"), default="false",
                        help="model.scan_layers: false (one module per layer, as Tunix's model) is 2.5%% "
                             "faster here (results/layer_layout.json)")
    parser.add_argument("--profile", action="store_true", help="add our SFT step's per-op profile (op_profile.py)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    load_before = load_average()
    cfg = ModelConfig(**{**PRESETS["bench"], "scan_layers": args.scan_layers == "true"})
    rng = np.random.default_rng(0)
    sft_one, sft_first, sft_profile = compiled_step(cfg, functools.partial(sft_loss, cfg), sft_batch(rng),
                                                    args.micro_batches)
    pref_cfg = type("P", (), {"loss": "dpo", "beta": 0.1, "label_smoothing": 0.0})
    dpo_one, dpo_first, _ = compiled_step(cfg, functools.partial(preference_loss, cfg, pref_cfg), dpo_batch(rng),
                                          args.micro_batches)
    record = {
        "benchmark": "train_step", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%MZ"),
        "command": "benchmarks/train_step.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (the load averages say how busy), "
                   f"{jax.devices()[0]}",
        "model": "bench preset (4 layers, d256, 4.46M params, fp32)", "scan_layers": cfg.scan_layers,
        # malloc's huge pages speed both frameworks' steps, Tunix's more (results/hugepages.json); the peer runs
        # in this environment too
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "batch": f"{BATCH}x{SEQ}",
        "micro_batches": args.micro_batches,
    }
    if args.tunix_python:
        sft = side_by_side(cfg, sft_one, args.tunix_python, args.rounds, args.repeats)
        peak = sft["roofline_peak_gflops"] * 1e9
    else:
        peak = machine_peaks()["matmul_gflops"] * 1e9
        sft = {"ours": figures(cfg, time_calls(sft_one, args.repeats)[1], BATCH, peak)}
    sft["ours"]["first_step_incl_compile_s"] = round(sft_first, 2)
    if args.profile:
        sft["ours"]["op_profile"] = sft_profile()
    dpo = figures(cfg, time_calls(dpo_one, args.repeats)[1], 2 * BATCH, peak)
    dpo["first_step_incl_compile_s"] = round(dpo_first, 2)
    record.update(sft=sft, dpo_8_pairs=dpo, calib_matmul_gflops=round(calibrate_matmul_gflops(), 1),
                  load_average_before=load_before, load_average_after=load_average(),
                  total_runtime_s=round(time.perf_counter() - t0, 1))
    emit(record)
    if args.out:
        record_with_history(args.out, record)


if __name__ == "__main__":
    main()
