"""Where a warm pool task's time goes under gVisor: fork and copy-on-write costs measured inside a pool sandbox.

    .venv/bin/python benchmarks/sandbox_fork_probe.py [--repeats 15]

One task of a one-sandbox `rlvr.sandbox.pool.Pool` (uid 1000, the pool's limits) times, as medians in ms:
`fork_exit_wait` (os.fork, the child exits at once, the parent waits), `spawn_true` (posix_spawn of /bin/true
and its wait: a new process with a fresh address space, the least a task in its own process can cost),
`fork_then_write_<k>` (the same with
the child writing one byte into each of k distinct 2 MiB-aligned stretches of a 32 MiB anonymous mapping the
parent filled before the fork) and `syscall_us` (getppid). The slope of fork_then_write over k is the cost of
one copy-on-write break, which gVisor does per 2 MiB stretch (its private allocation unit); a Python child
writes into most of its parent's writable memory (`python_writable_mib`). Also prints the sandbox cgroup's
CPU per pool task of an empty program over `--repeats` tasks in a row (`pass_task_cpu_ms`: the pool's fixed
cost per task, the worker's next fork included), and `native`: the same probe run outside any sandbox.
One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from rlvr.sandbox import Limits, runsc
from rlvr.sandbox.pool import Pool

PROBE = r"""
import json, mmap, os, time
REPEATS = {repeats}
STRETCH = 2 << 20
area = mmap.mmap(-1, 16 * STRETCH, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, len(area), 4096):
    area[i] = 1

def median_ms(fn):
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1e3 * sorted(times)[REPEATS // 2], 2)

def fork_writing(k):
    def run():
        pid = os.fork()
        if pid == 0:
            for j in range(k):
                area[j * STRETCH] = 2
            os._exit(0)
        os.waitpid(pid, 0)
    return run

def spawn_true():
    pid = os.posix_spawn("/bin/true", ["/bin/true"], {{}})
    os.waitpid(pid, 0)

out = {{"fork_exit_wait": median_ms(fork_writing(0)), "spawn_true": median_ms(spawn_true)}}
for k in (1, 4, 8):
    out[f"fork_then_write_{{k}}"] = median_ms(fork_writing(k))
t0 = time.perf_counter()
for _ in range(2000):
    os.getppid()
out["syscall_us"] = round((time.perf_counter() - t0) / 2000 * 1e6, 1)
writable = 0
for line in open("/proc/self/maps"):
    span, perms = line.split()[:2]
    lo, hi = (int(x, 16) for x in span.split("-"))
    if perms.startswith("rw") and "[stack]" not in line and hi - lo < (16 * STRETCH):
        writable += hi - lo
out["python_writable_mib"] = round(writable / 2**20, 1)
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="forks per figure (the median is kept)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    record: dict = {"benchmark": "sandbox_fork_probe", "platform": runsc.PLATFORM, "cpus": os.cpu_count(),
                    "load_average_start": os.getloadavg()}
    with Pool(1, Limits(wall_s=120.0, cpu_s=120, memory_bytes=512 << 20), trace_path=False) as pool:
        result = pool.run(python=PROBE.format(repeats=args.repeats), timeout_s=120)
        if not result.ok:
            raise SystemExit(f"the probe failed: {result.text('stderr')[-2000:]}")
        record.update(json.loads(result.text()))
        cid = pool.run(python="pass\n").sandbox_id
        start = runsc.cpu_seconds(cid)
        sandboxes = {pool.run(python="pass\n").sandbox_id for _ in range(args.repeats)}
        if sandboxes != {cid}:
            raise SystemExit(f"the empty tasks ran on other sandboxes too: {sorted(sandboxes)}")
        record["pass_task_cpu_ms"] = round(1e3 * (runsc.cpu_seconds(cid) - start) / args.repeats, 1)
    native = subprocess.run([sys.executable, "-I", "-c", PROBE.format(repeats=args.repeats)], capture_output=True,
                            text=True, timeout=300, check=True)
    record["native"] = json.loads(native.stdout)  # the same probe outside any sandbox
    slope = (record["fork_then_write_8"] - record["fork_then_write_1"]) / 7
    record["ms_per_2mib_copy"] = round(slope, 2)
    record["load_average_end"] = os.getloadavg()
    runsc.REAPER.drain()
    print(json.dumps(record))


if __name__ == "__main__":
    main()
