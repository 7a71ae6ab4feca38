"""The quickstart's learning result on several seeds: held-out accuracy before and after RL.

    .venv/bin/python benchmarks/quickstart_seeds.py [--seeds 0,1,2] [--out benchmarks/results/quickstart_seeds.json]
    .venv/bin/python benchmarks/quickstart_seeds.py --config=configs/finance_docs.py:tiny \
        --out=benchmarks/results/finance_learning.json      # the finance kit's easiest level, the same way

Runs `configs/quickstart.py` (SFT warm start, then 100 GRPO steps) once per seed, one after the
other, each in a fresh temporary workdir, exactly as `make quickstart` does apart from the seed
(`--config.seed=N`). Prints one JSON line and writes it (with the date, the machine and the
command) to `--out`: per seed the held-out greedy accuracy before and after RL, the improvement
in points, the any-format ("value") accuracy before and after, and the wall time; then the mean
and the minimum improvement. The quickstart figures of README.md and docs/tutorials/quickstart.md come from this file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

from rlvr import config_lib  # noqa: E402
from rlvr.main import run  # noqa: E402


def run_dir(root: str, seed: int, overrides: dict | None = None, spec: str = "configs/quickstart.py") -> str:
    """The kept workdir of one seed's run under `root`: named by its overrides (`full` for none) and
    any other config than the quickstart's, so a rerun resumes it (a finished run just returns its
    summary) and distill_quickstart.py finds the full run as its teacher."""
    name = "_".join(f"{k.rsplit('.', 1)[-1]}{os.path.basename(str(v))}" for k, v in sorted((overrides or {}).items()))
    name = name or "full"
    if spec != "configs/quickstart.py":
        name = os.path.basename(spec).replace(".py", "").replace(":", "_").replace(",", "_") + "_" + name
    return os.path.join(root, f"{name}_s{seed}")


def run_seed(seed: int, spec: str, overrides: dict | None, root: str = "", prefix: str = "quickstart") -> dict:
    """`rlvr.main.run` of `spec` with the seed and overrides, in a kept workdir under `root` (or a
    temporary one); its summary (a kept run that finished is read back, not rerun)."""
    config = config_lib.load_config(spec, {"seed": seed, **(overrides or {})})
    done = os.path.join(run_dir(root, seed, overrides, spec), "summary.json") if root else ""
    if done and os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    with contextlib.ExitStack() as stack:
        workdir = run_dir(root, seed, overrides, spec) if root else stack.enter_context(
            tempfile.TemporaryDirectory(prefix=f"{prefix}_s{seed}_"))
        _share_warm_start(root, seed, overrides, workdir, spec)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # the run's prints; stdout is the JSON line
            summary = run(config, workdir)
        summary["wall_s"] = round(time.perf_counter() - t0, 1)
        _share_warm_start(root, seed, overrides, workdir, spec)
    return summary


# overrides that change the SFT warm start (rlvr.trainers.rl.warm_start): its data, model, start and
# optimizer; of the optimizer only the peak learning rate is RL's alone (SFT's is rl.sft_learning_rate)
WARM_START_KEYS = ("rl.sft", "rl.task", "rl.prompt_format", "rl.env", "rl.min_digits", "rl.max_digits", "rl.seq_len",
                   "model.", "init.", "tokenizer.", "data.", "optimizer.", "mesh.", "train.micro_batches",
                   "train.logprob_chunk_size")


def changes_warm_start(key: str) -> bool:
    """Whether overriding `key` changes the SFT warm start (then a run makes its own)."""
    return key.startswith(WARM_START_KEYS) and key != "optimizer.learning_rate"


def _share_warm_start(root: str, seed: int, overrides: dict | None, workdir: str, spec: str) -> None:
    """One SFT warm start per seed under `root`: copied into a run's workdir before it starts, and
    from the first run that made it. The warm start depends on the seed and the settings
    `changes_warm_start` names (from a random init it trains every weight, a LoRA run's too), so runs
    whose overrides leave those alone share it bit for bit."""
    if not root or any(changes_warm_start(k) for k in overrides or {}):
        return
    shared = os.path.join(os.path.dirname(run_dir(root, seed, None, spec)), f"sft_s{seed}")
    if spec != "configs/quickstart.py":  # another config (or variant): its own warm start
        shared = run_dir(root, seed, None, spec).replace("_full_s", "_sft_s")
    own = os.path.join(workdir, "sft")
    source, target = (own, shared) if os.path.exists(os.path.join(own, "summary.json")) else (shared, own)
    if os.path.exists(os.path.join(source, "summary.json")) and not os.path.exists(target):
        shutil.copytree(source, target)


def one_seed(seed: int, spec: str = "configs/quickstart.py", overrides: dict | None = None, root: str = "") -> dict:
    summary = run_seed(seed, spec, overrides, root)
    wall = summary["wall_s"]
    return {"seed": seed, "heldout_accuracy_before": summary["heldout_accuracy_before"],
            "heldout_accuracy_after": summary["heldout_accuracy_after"],
            "improvement_points": summary["improvement_points"],
            "heldout_value_accuracy_before": summary["heldout_value_accuracy_before"],
            "heldout_value_accuracy_after": summary["heldout_value_accuracy_after"],
            "final_reward_mean_last10": summary["final_reward_mean_last10"], "wall_s": round(wall, 1),
            "heldout_curve": summary.get("evals", []),
            **step_figures(run_dir(root, seed, overrides, spec) if root else "")}


def step_figures(workdir: str) -> dict:
    """From a kept run's metrics.jsonl: the largest trainer/engine log-prob mismatch over its steps,
    and the first and last 10 steps' mean reward, token entropy and share of zero-variance groups
    (no GRPO signal); {} without a kept workdir."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not workdir or not os.path.exists(path):
        return {}
    with open(path) as f:
        steps = [r for r in map(json.loads, f) if "logprob_mismatch" in r]
    out = {"logprob_mismatch_max": max(r["logprob_mismatch"] for r in steps)}
    for key in ("reward", "entropy", "zero_variance_groups"):
        if all(key in r for r in steps):
            out[f"{key}_first10_last10"] = [round(sum(r[key] for r in part) / len(part), 4)
                                            for part in (steps[:10], steps[-10:])]
    return out


def _override(item: str) -> tuple[str, object]:
    import ast

    key, _, value = item.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config", default="configs/quickstart.py", help="a config with an SFT warm start, as "
                        "configs/quickstart.py (path[:arg])")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="A config override for every seed (e.g. lora.rank=16), a Python literal or a string.")
    parser.add_argument("--root", default="", help="keep each run's workdir under this directory (resumable; "
                        "distill_quickstart.py --root reuses the full runs as teachers); default: temporary")
    parser.add_argument("--baseline", action="append", default=[], metavar="KEY=VALUE",
                        help="also run the config with these overrides instead of --set (e.g. rl.eval_every=10 "
                        "for full fine-tuning) on the same seeds, in the same window, and report each seed's "
                        "gain over the baseline's")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quickstart_seeds.json"))
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    overrides = dict(_override(item) for item in args.set)
    baseline = dict(_override(item) for item in args.baseline)
    runs = []
    for s in seeds:  # baseline and variant of a seed back to back: the same window
        base = one_seed(s, args.config, baseline, args.root) if args.baseline else None
        runs.append(one_seed(s, args.config, overrides, args.root))
        if base:
            runs[-1].update(baseline_improvement_points=base["improvement_points"],
                            baseline_heldout_curve=base["heldout_curve"],
                            over_baseline=round(runs[-1]["improvement_points"] / base["improvement_points"], 3))
    gains = [r["improvement_points"] for r in runs]
    flags = argv if argv is not None else sys.argv[1:]
    benchmark = "quickstart_seeds" if args.config == "configs/quickstart.py" else "learning_seeds"
    record = {"benchmark": benchmark, "date": datetime.date.today().isoformat(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
              "command": " ".join([".venv/bin/python benchmarks/quickstart_seeds.py", *flags]),
              "config": args.config, "overrides": overrides, "runs": runs,
              "improvement_points_mean": round(sum(gains) / len(gains), 2), "improvement_points_min": min(gains)}
    if baseline:
        base_gains = [r["baseline_improvement_points"] for r in runs]
        record.update(baseline_overrides=baseline,
                      baseline_improvement_points_mean=round(sum(base_gains) / len(gains), 2),
                      over_baseline_mean_gain=round(sum(gains) / sum(base_gains), 3))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
