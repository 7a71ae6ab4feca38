"""The quickstart's learning result on several seeds: held-out accuracy before and after RL.

    .venv/bin/python benchmarks/quickstart_seeds.py [--seeds 0,1,2] [--out benchmarks/results/quickstart_seeds.json]
    .venv/bin/python benchmarks/quickstart_seeds.py --config=configs/finance_docs.py:tiny \
        --out=benchmarks/results/finance_learning.json      # the finance kit's easiest level, the same way

Runs `configs/quickstart.py` (SFT warm start, then 100 GRPO steps) once per seed, one after the
other, each in a fresh temporary workdir, exactly as `make quickstart` does apart from the seed
(`--config.seed=N`). Prints one JSON line and writes it (with the date, the machine and the
command) to `--out`: per seed the held-out greedy accuracy before and after RL, the improvement
in points, the any-format ("value") accuracy before and after, and the wall time; then the mean
and the minimum improvement. The README's quickstart figures come from this file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

from rlvr import config_lib  # noqa: E402
from rlvr.main import run  # noqa: E402


def one_seed(seed: int, spec: str = "configs/quickstart.py", overrides: dict | None = None) -> dict:
    config = config_lib.load_config(spec, {"seed": seed, **(overrides or {})})
    with tempfile.TemporaryDirectory(prefix=f"quickstart_s{seed}_") as workdir:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # the run's prints; stdout is the JSON line
            summary = run(config, workdir)
        wall = time.perf_counter() - t0
    return {"seed": seed, "heldout_accuracy_before": summary["heldout_accuracy_before"],
            "heldout_accuracy_after": summary["heldout_accuracy_after"],
            "improvement_points": summary["improvement_points"],
            "heldout_value_accuracy_before": summary["heldout_value_accuracy_before"],
            "heldout_value_accuracy_after": summary["heldout_value_accuracy_after"],
            "final_reward_mean_last10": summary["final_reward_mean_last10"], "wall_s": round(wall, 1)}


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
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "quickstart_seeds.json"))
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    overrides = dict(_override(item) for item in args.set)
    runs = [one_seed(s, args.config, overrides) for s in seeds]
    gains = [r["improvement_points"] for r in runs]
    flags = argv if argv is not None else sys.argv[1:]
    benchmark = "quickstart_seeds" if args.config == "configs/quickstart.py" else "learning_seeds"
    record = {"benchmark": benchmark, "date": datetime.date.today().isoformat(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
              "command": " ".join([".venv/bin/python benchmarks/quickstart_seeds.py", *flags]),
              "config": args.config, "overrides": overrides, "runs": runs,
              "improvement_points_mean": round(sum(gains) / len(gains), 2), "improvement_points_min": min(gains)}
    emit(record)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
