"""Sandbox throughput: a warm gVisor pool vs bare subprocesses, interleaved in one run, at concurrency 1, 2, 4, 8.

    .venv/bin/python benchmarks/sandbox.py [--tasks 48] [--rounds 2] [--cold 5]

The task (../shared/specs/sandbox-gvisor.md §3): `import math; print(sum(math.sqrt(i) for i in range(200000)))`,
about 10 ms of CPU natively. "bare" is `/usr/bin/python3 -I -B main.py` in a fresh temp directory (no
isolation at all); "pool" is `rlvr.sandbox.pool.Pool(8)`: each task is a fork inside a warm sandbox, with
the workspace reset, output capture and the leftover-process sweep. "cold" is `rlvr.sandbox.run` (a fresh
sandbox per call). The machine is shared, so at each concurrency bare and pool alternate ABBA (`--rounds`
pairs: bare-pool, pool-bare, ...), each run with the 1-minute load average at its start. Prints one JSON
line: per concurrency the pairs (tasks/s of each, their ratio, the load), the means (tasks/s, p50 and p99
latency in ms over all of a mode's tasks) and pool/bare ratios of the means, and of the peaks. Goal (issue
50): peak ratio >= 0.8.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time

from rlvr.sandbox import Limits, run, runsc
from rlvr.sandbox.pool import Pool

TASK = "import math; print(sum(math.sqrt(i) for i in range(200000)))\n"
EXPECTED = b"59628255.58540428\n"
LEVELS = (1, 2, 4, 8)
LIMITS = Limits(wall_s=10.0, cpu_s=10)


def bare_task() -> bytes:
    with tempfile.TemporaryDirectory(prefix="bench-bare-") as d:
        with open(os.path.join(d, "main.py"), "w") as f:
            f.write(TASK)
        done = subprocess.run(["/usr/bin/python3", "-I", "-B", "main.py"], cwd=d, capture_output=True, timeout=60,
                              start_new_session=True)
        return done.stdout


def measure(fn, concurrency: int, tasks: int) -> dict:
    """tasks/s and the latencies (s) of `tasks` calls of fn on `concurrency` threads, with the load at the start."""
    latencies: list[float] = []

    def one() -> None:
        t0 = time.perf_counter()
        out = fn()
        latencies.append(time.perf_counter() - t0)
        if out != EXPECTED:
            raise RuntimeError(f"wrong task output {out[:200]!r}")

    load = os.getloadavg()[0]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one) for _ in range(tasks)]:
            f.result()
    return {"tasks_per_s": round(tasks / (time.perf_counter() - start), 2), "load": round(load, 2),
            "latencies": latencies}


def summary(runs: list[dict]) -> dict:
    """Mean tasks/s of a mode's runs at one concurrency; p50/p99 latency (ms) over all their tasks."""
    latencies = sorted(x for run in runs for x in run["latencies"])
    return {"tasks_per_s": round(sum(run["tasks_per_s"] for run in runs) / len(runs), 2),
            "p50_ms": round(1e3 * latencies[len(latencies) // 2], 1),
            "p99_ms": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1)}


def interleaved(modes: dict, concurrency: int, tasks: int, rounds: int) -> tuple[list[dict], dict]:
    """`rounds` ABBA pairs of the two modes ({"bare": fn, "pool": fn}) at one concurrency: (pairs, runs by mode)."""
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    pairs = []
    for r in range(rounds):
        order = list(modes) if r % 2 == 0 else list(modes)[::-1]
        got = {name: measure(modes[name], concurrency, tasks) for name in order}
        for name in modes:
            runs[name].append(got[name])
        pairs.append({"order": order, **{name: got[name]["tasks_per_s"] for name in modes},
                      "ratio": round(got["pool"]["tasks_per_s"] / got["bare"]["tasks_per_s"], 2),
                      "load": [got[name]["load"] for name in order]})
    return pairs, runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=48, help="tasks per run (one mode at one concurrency)")
    parser.add_argument("--rounds", type=int, default=2, help="bare/pool pairs per concurrency, in ABBA order")
    parser.add_argument("--cold", type=int, default=5, help="cold run() calls for the reference latency")
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.rounds < 1:
        parser.error(f"--tasks ({args.tasks}) and --rounds ({args.rounds}) must be >= 1")
    record: dict = {"benchmark": "sandbox", "task": TASK.strip(), "cpus": os.cpu_count(), "tasks": args.tasks,
                    "rounds": args.rounds, "platform": runsc.PLATFORM, "load_average_start": os.getloadavg(),
                    "pairs": {}, "bare": {}, "pool": {}}
    t0 = time.perf_counter()
    with Pool(max(LEVELS), LIMITS, trace_path=False) as pool:
        record["pool_start_s"] = round(time.perf_counter() - t0, 2)
        modes = {"bare": bare_task, "pool": lambda: pool.run(python=TASK).stdout}
        measure(modes["pool"], 2, 8)  # warm-up
        for n in LEVELS:
            record["pairs"][n], runs = interleaved(modes, n, args.tasks, args.rounds)
            for name in modes:
                record[name][n] = summary(runs[name])
        record["pool_retired"] = pool.retired
    cold = measure(lambda: run(python=TASK, limits=LIMITS, trace_path=False).stdout, 1, args.cold)
    record["cold_run_p50_ms"] = summary([cold])["p50_ms"]
    record["ratio"] = {n: round(record["pool"][n]["tasks_per_s"] / record["bare"][n]["tasks_per_s"], 2)
                       for n in LEVELS}
    peak = {mode: max(v["tasks_per_s"] for v in record[mode].values()) for mode in ("bare", "pool")}
    record["peak_tasks_per_s"] = peak
    record["peak_ratio"] = round(peak["pool"] / peak["bare"], 2)
    record["load_average_end"] = os.getloadavg()
    runsc.REAPER.drain()
    print(json.dumps(record))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
