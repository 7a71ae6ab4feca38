"""The native CPU kernels' tests under AddressSanitizer and UndefinedBehaviorSanitizer, once.

    .venv/bin/python benchmarks/native_sanitizers.py [--tests "tests/... -k ..."] \\
        [--out benchmarks/results/native_sanitizers.json]

What: runs the kernels' tests (tests/test_native_kernels.py, tests/test_packed_matmul.py,
tests/test_paged_attention.py) in a child pytest whose kernels are built with
`-fsanitize=address,undefined` (`RLVR_NATIVE_SANITIZE=1`: rlvr.kernels.native_build adds the flags
and builds into the kernel cache's `sanitize/` folder, so the normal builds stay as they are), and
counts the sanitizers' reports in its output. Writes one JSON record: date (the start), command,
machine, load (the 1-minute average at the start and at the end), the child's exit status, its pytest
summary, and the reports (first lines of each).

How a Python host runs an ASan-built shared library: the ASan runtime must be the first library
loaded, before the interpreter's own allocations, so the child gets
`LD_PRELOAD="$($CXX -print-file-name=libasan.so) $($CXX -print-file-name=libstdc++.so.6)"`: libstdc++
too, because ASan resolves the real `__cxa_throw` when it starts, and python does not link libstdc++
(without it jaxlib's first C++ exception stops the process: "CHECK failed: asan_interceptors.cpp:
real___cxa_throw != 0"). The UBSan runtime is a dependency of the kernel library and loads with it.
`ASAN_OPTIONS=detect_leaks=0` (CPython and XLA keep memory until exit
by design: the leak report would be theirs, not the kernels'); ASan stops the process at its first
error (the exit status then says so), UBSan reports and goes on (`print_stacktrace=1`). By hand:

    RLVR_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \\
        LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so.6)" \\
        .venv/bin/python -m pytest -n 0 tests/test_native_kernels.py
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = "tests/test_native_kernels.py tests/test_packed_matmul.py tests/test_paged_attention.py"
REPORT = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer")


def sanitizer_env(compiler: str) -> dict[str, str]:
    """The child's environment: sanitized kernel builds, the ASan runtime (and libstdc++) preloaded."""
    preload = []
    for name in ("libasan.so", "libstdc++.so.6"):
        path = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True,
                              check=True).stdout.strip()
        if not os.path.isabs(path):
            raise SystemExit(f"{compiler} does not know {name} (got {path!r}): install gcc's libasan first")
        preload.append(path)
    return {**os.environ, "RLVR_NATIVE_SANITIZE": "1", "LD_PRELOAD": " ".join(preload), "JAX_PLATFORMS": "cpu",
            "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "print_stacktrace=1"}


def reports(output: str) -> list[str]:
    """Each sanitizer report's first line and the 5 after it (where, in which function)."""
    lines = output.splitlines()
    return ["\n".join(lines[i:i + 6]) for i, line in enumerate(lines) if REPORT.search(line)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", default=TESTS, help="pytest arguments (files, -k)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    compiler = os.environ.get("CXX", "g++")
    command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *shlex.split(args.tests)]
    start, load = time.time(), os.getloadavg()[0]
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    child = subprocess.run(command, cwd=ROOT, env=sanitizer_env(compiler), capture_output=True, text=True)
    output = child.stdout + child.stderr
    found = reports(output)
    summary = [line for line in child.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    emit({"benchmark": "native_sanitizers", "date": date,
          "command": "benchmarks/native_sanitizers.py" + (f" --out {args.out}" if args.out else ""),
          "child_command": shlex.join(["RLVR_NATIVE_SANITIZE=1", "LD_PRELOAD=<libasan.so> <libstdc++.so.6>",
                                       "ASAN_OPTIONS=detect_leaks=0", "UBSAN_OPTIONS=print_stacktrace=1", "python",
                                       *command[1:]]),
          "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "load_avg_1m": [load, os.getloadavg()[0]],
          "compiler": subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[0],
          "sanitizers": "address,undefined", "wall_s": round(time.time() - start, 1),
          "exit_status": child.returncode, "pytest_summary": summary[-1] if summary else None,
          "sanitizer_reports": len(found), "reports": found[:20],
          "output_tail": output[-3000:] if child.returncode or found else ""}, args.out)


if __name__ == "__main__":
    main()
