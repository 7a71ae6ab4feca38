"""Isolated code execution (installed as rlvr.sandbox): gVisor by default, with limits, traces and verdicts.

    from rlvr.sandbox import CallTest, Limits, Pool, run, verify_program

    result = run(python="print(6 * 7)", limits=Limits(wall_s=5))          # a fresh sandbox per call
    assert result.ok and result.stdout == b"42\\n"

    with Pool(4, Limits(wall_s=5)) as pool:                                # warm sandboxes, a fork per task
        result = pool.run(python="print(6 * 7)")
        verdict = verify_program("def add(a, b): return a + b", [CallTest((2, 3), 5)], entry_point="add",
                                 pool=pool)                                # judged on the host

Modules: api (run, the backends table), runsc (the gVisor OCI bundle, teardown), local (the weaker
development backends), pool and zygote (the warm pool and the worker inside each sandbox), verdict
(verdicts a program cannot forge), trace and replay (JSONL records; `python -m rlvr.sandbox.replay`).
Measured facts behind the design: ../shared/specs/sandbox-gvisor.md.
"""

from .api import BACKENDS, PYTHON, run
from .pool import Pool
from .types import (
    CPU,
    DISK,
    FILE_SIZE,
    MEMORY,
    OUTPUT,
    WALL_TIME,
    Limits,
    Result,
    SandboxError,
    SandboxUnavailable,
    Timings,
)
from .verdict import CallTest, StdioTest, Verdict, verify_program

__all__ = ["BACKENDS", "CPU", "DISK", "FILE_SIZE", "MEMORY", "OUTPUT", "PYTHON", "WALL_TIME", "CallTest", "Limits",
           "Pool", "Result", "SandboxError", "SandboxUnavailable", "StdioTest", "Timings", "Verdict", "run",
           "verify_program"]
