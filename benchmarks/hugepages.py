"""The SFT step, ours and Tunix's, with and without transparent huge pages for glibc's large allocations.

    .venv/bin/python benchmarks/hugepages.py [--rounds 4] [--tunix_python .venv-tunix/bin/python]
        [--out benchmarks/results/hugepages.json]

Why: XLA:CPU takes each call's temporary buffers from glibc malloc, which maps allocations over 32 MiB
fresh with mmap and unmaps them when freed, so every step touches ~100 MB of new 4 KiB pages: ~24,000
minor page faults and ~0.06 s of kernel time per SFT step here. `GLIBC_TUNABLES=glibc.malloc.hugetlb=1`
(glibc >= 2.35) makes malloc ask for transparent huge pages (with THP in `madvise` mode, as on this
VM), 2 MiB per fault. It is a property of the process's environment, not of a framework: both are
measured with and without it, each in a fresh process, in ABBA order.

Ours: `benchmarks/train_step.py`'s SFT step (per-layer weights, 4 micro-batches), the median of
`calls` calls, with the minor page faults and kernel seconds per step (getrusage). Tunix: the peer
script's SFT part (`bench_tunix.py --only sft`: 3 warm-up + 10 timed calls, its median).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_tunix_python, load_average, publish, tunix_part  # noqa: E402

HUGE = "glibc.malloc.hugetlb=1"
OURS = """
import functools, json, resource, statistics, sys, time
sys.path.insert(0, "benchmarks")
import numpy as np
from train_step import compiled_step, sft_batch
from rlvr.models.config import PRESETS, ModelConfig
from rlvr.trainers.sft import sft_loss
cfg = ModelConfig(**{**PRESETS["bench"], "scan_layers": False})
one = compiled_step(cfg, functools.partial(sft_loss, cfg), sft_batch(np.random.default_rng(0)), 4)[0]
for _ in range(3):
    one()
before, times = resource.getrusage(resource.RUSAGE_SELF), []
for _ in range(CALLS):
    t0 = time.perf_counter()
    one()
    times.append(time.perf_counter() - t0)
after = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"step_s": statistics.median(times),
                  "minor_faults_per_step": (after.ru_minflt - before.ru_minflt) / CALLS,
                  "kernel_s_per_step": (after.ru_stime - before.ru_stime) / CALLS}))
"""


def environment(huge: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return {**env, "GLIBC_TUNABLES": HUGE} if huge else env


def ours(huge: bool, calls: int) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", OURS.replace("CALLS", str(calls))], cwd=repo, capture_output=True,
                          text=True, env={**environment(huge), "PYTHONPATH": repo}, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"our SFT step failed, rc {proc.returncode}: {proc.stderr[-2000:]}")
    return {k: round(v, 4) for k, v in json.loads(lines[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4, help="ABBA rounds over the four runs")
    parser.add_argument("--calls", type=int, default=20, help="our timed calls per run")
    parser.add_argument("--tunix_python", default=default_tunix_python())
    parser.add_argument("--out", default="", help="also record the result here (earlier records kept)")
    args = parser.parse_args()
    load_before = load_average()
    runs = [(who, huge) for who in ("ours", "tunix") for huge in (False, True)]
    results: dict[str, list] = {f"{who}_{'huge' if huge else 'default'}": [] for who, huge in runs}
    for r in range(args.rounds):
        for who, huge in runs if r % 2 == 0 else runs[::-1]:
            key = f"{who}_{'huge' if huge else 'default'}"
            if who == "ours":
                results[key].append(ours(huge, args.calls))
            else:
                results[key].append({"step_s": tunix_part(args.tunix_python, "sft", env=environment(huge))
                                     ["median_step_s"]})
    step = {key: round(statistics.median(run["step_s"] for run in value), 4) for key, value in results.items()}
    record = {
        "benchmark": "hugepages", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%MZ"),
        "command": "benchmarks/hugepages.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (the load averages say how busy)",
        "transparent_hugepages": open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(),
        "glibc": platform.libc_ver()[1], "runs": results, "step_s": step,
        "speedup_with_huge_pages": {who: round(step[f"{who}_default"] / step[f"{who}_huge"], 3)
                                    for who in ("ours", "tunix")},
        "ours_vs_tunix": {env: round(step[f"tunix_{env}"] / step[f"ours_{env}"], 3) for env in ("default", "huge")},
        "load_average_before": load_before, "load_average_after": load_average(),
    }
    publish(record, args.out)


if __name__ == "__main__":
    main()
