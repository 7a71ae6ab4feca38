"""Sandbox throughput: a warm gVisor pool vs bare subprocesses, in the same run, at concurrency 1, 2, 4, 8.

    .venv/bin/python benchmarks/sandbox.py [--tasks 48] [--cold 5]

The task (../shared/specs/sandbox-gvisor.md §3): `import math; print(sum(math.sqrt(i) for i in range(200000)))`,
about 10 ms of CPU natively. "bare" is `/usr/bin/python3 -I -B main.py` in a fresh temp directory (no
isolation at all); "pool" is `rlvr.sandbox.pool.Pool(8)`: each task is a fork inside a warm sandbox, with
the workspace reset, output capture and the leftover-process sweep. "cold" is `rlvr.sandbox.run` (a fresh
sandbox per call). Prints one JSON line: tasks/s, p50 and p99 latency (ms) per mode and concurrency, and
pool/bare ratios (per concurrency, and of the peaks). Goal: peak ratio >= 0.5.
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
    """tasks/s and latency percentiles of `tasks` calls of fn on `concurrency` threads."""
    latencies: list[float] = []

    def one() -> None:
        t0 = time.perf_counter()
        out = fn()
        latencies.append(time.perf_counter() - t0)
        if out != EXPECTED:
            raise RuntimeError(f"wrong task output {out[:200]!r}")

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one) for _ in range(tasks)]:
            f.result()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"tasks_per_s": round(tasks / wall, 2), "p50_ms": round(1e3 * latencies[len(latencies) // 2], 1),
            "p99_ms": round(1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=48, help="tasks per mode and concurrency level")
    parser.add_argument("--cold", type=int, default=5, help="cold run() calls for the reference latency")
    args = parser.parse_args(argv)
    record: dict = {"benchmark": "sandbox", "task": TASK.strip(), "cpus": os.cpu_count(), "tasks": args.tasks,
                    "platform": runsc.PLATFORM, "bare": {}, "pool": {}}
    t0 = time.perf_counter()
    with Pool(max(LEVELS), LIMITS, trace_path=False) as pool:
        record["pool_start_s"] = round(time.perf_counter() - t0, 2)
        measure(lambda: pool.run(python=TASK).stdout, 2, 8)  # warm-up
        for n in LEVELS:
            record["bare"][n] = measure(bare_task, n, args.tasks)
            record["pool"][n] = measure(lambda: pool.run(python=TASK).stdout, n, args.tasks)
        record["pool_retired"] = pool.retired
    cold = measure(lambda: run(python=TASK, limits=LIMITS, trace_path=False).stdout, 1, args.cold)
    record["cold_run_p50_ms"] = cold["p50_ms"]
    record["ratio"] = {n: round(record["pool"][n]["tasks_per_s"] / record["bare"][n]["tasks_per_s"], 2)
                       for n in LEVELS}
    peak = {mode: max(v["tasks_per_s"] for v in record[mode].values()) for mode in ("bare", "pool")}
    record["peak_tasks_per_s"] = peak
    record["peak_ratio"] = round(peak["pool"] / peak["bare"], 2)
    runsc.REAPER.drain()
    print(json.dumps(record))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
