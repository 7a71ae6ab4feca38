"""Does any XLA:CPU switch lift the rollout's ceiling? The decode's own weight products and the
fixed-config sampler under each set of XLA_FLAGS, side by side in one window.

    .venv/bin/python benchmarks/xla_cpu_flags.py [--rounds 2] [--flag_sets "|--xla_cpu_use_xnnpack=true|..."]

Per flag set (one subprocess each, since XLA reads its flags once per process), alternating the
order every round: `common.decode_matmul_gflops` at the fixed config's shapes (bench preset, 32
rows) and the realistic one's (bench_32k, 64 rows), and `rollout.py --only sampler`'s tokens/s
(the fixed config, 32 x 64 -> 64). Prints one JSON line: each set's medians and their ratio to the
default set's ("" = no flags) in the same rounds. Only same-window ratios mean anything on a
machine whose speed drifts by 2x over minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SETS = ("", "--xla_cpu_use_xnnpack=true", "--xla_cpu_use_onednn=true", "--xla_cpu_multi_thread_eigen=false",
                "--xla_cpu_prefer_vector_width=512", "--xla_cpu_enable_fast_math=true")
PRODUCTS = """
import json, sys
sys.path.insert(0, {here!r})
from common import decode_matmul_gflops
from rlvr.models.config import PRESETS, ModelConfig
print(json.dumps({{"bench_32_rows": decode_matmul_gflops(ModelConfig(**PRESETS["bench"]), 32),
                  "bench_32k_64_rows": decode_matmul_gflops(ModelConfig(**PRESETS["bench_32k"]), 64)}}))
"""


def _run(cmd: list[str], flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": flags}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(flags: str) -> dict:
    """One round's figures under `flags`."""
    products = _run([sys.executable, "-c", PRODUCTS.format(here=HERE)], flags)
    sampler = _run([sys.executable, os.path.join(HERE, "rollout.py"), "--only", "sampler"], flags)["sampler"]
    return {**{f"decode_gflops_{k}": round(v, 1) for k, v in products.items()},
            "sampler_tokens_per_s": sampler["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flag_sets", default="|".join(DEFAULT_SETS), help="XLA_FLAGS values separated by |")
    args = parser.parse_args()
    sets = args.flag_sets.split("|")
    runs: dict[str, list[dict]] = {s: [] for s in sets}
    for r in range(args.rounds):
        for flags in sets if r % 2 == 0 else sets[::-1]:
            runs[flags].append(measure(flags))
    medians = {s: {k: round(statistics.median(run[k] for run in rs), 1) for k in rs[0]} for s, rs in runs.items()}
    base = medians[sets[0]]
    print(json.dumps({"benchmark": "xla_cpu_flags", "rounds": args.rounds, "default": sets[0] or "(no flags)",
                      "medians": {s or "(no flags)": m for s, m in medians.items()},
                      "vs_default": {s or "(no flags)": {k: round(v / base[k], 3) for k, v in m.items()}
                                     for s, m in medians.items()},
                      "runs": {s or "(no flags)": rs for s, rs in runs.items()}}))


if __name__ == "__main__":
    main()
