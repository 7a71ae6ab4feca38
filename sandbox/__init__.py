"""Isolated code execution (installed as rlvr.sandbox): gVisor by default, with limits, traces and verdicts.

    from rlvr.sandbox import CallTest, CheckTest, Episode, Limits, Pool, run, verify_program

    result = run(python="print(6 * 7)", limits=Limits(wall_s=5))          # a fresh sandbox per call
    assert result.ok and result.stdout == b"42\\n"

    with Pool(4, Limits(wall_s=5)) as pool:                                # warm sandboxes, a fork per task
        result = pool.run(python="print(6 * 7)")
        verdict = verify_program("def add(a, b): return a + b", [CallTest((2, 3), 5)], entry_point="add",
                                 pool=pool)                                # judged on the host
        verdict = verify_program("def add(a, b): return a + b",               # test code, run on the host
                                 CheckTest("def check(f):\\n    assert abs(f(0.1, 0.2) - 0.3) < 1e-9\\n"),
                                 entry_point="add", pool=pool)

    with Episode(Limits(wall_s=5), template="repo/") as ep:                # several steps, one workspace
        ep.write({"calc.py": "def add(a, b): return a - b"})
        if not ep.run(["/usr/bin/python3", "-m", "unittest"]).ok:
            ep.snapshot("scene.tar.gz")       # python -m rlvr.sandbox.replay --episode scene.tar.gz

Modules: api (run, the backends table), workspace (private workspaces, templates over overlayfs), episode
(multi-step sessions, snapshots and their replay), executor (the `Executor` protocol the RL side depends on:
`Local`, `Pool`, and the JSON round trip a remote worker implements), runsc (the gVisor OCI bundle,
teardown), local (the weaker development backends), pool and zygote (the warm pool and the worker inside
each sandbox), verdict, wire, checks and harness (verdicts a program cannot forge: typed values out of the
sandbox, test code on the host), cleanup (sandboxes left by killed processes), trace and replay (JSONL records;
`python -m rlvr.sandbox.replay`).
Measured facts behind the design: ../shared/specs/sandbox-gvisor.md.
"""

from . import runsc
from .api import BACKENDS, PYTHON, run
from .episode import Episode, replay_episode
from .executor import Executor, JsonExecutor, Local
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
    SandboxStalled,
    SandboxUnavailable,
    Timings,
)
from .verdict import CallTest, CheckTest, StdioTest, Verdict
from .verify import verify_program


def _reap_orphans() -> None:
    """Sandboxes that killed processes left behind, removed in the background (cleanup.py) before this
    process's first sandbox. Imported here, not by runsc: cleanup drives runsc."""
    from .cleanup import start_reaping

    start_reaping()


runsc.BEFORE_FIRST_SANDBOX.append(_reap_orphans)

__all__ = ["BACKENDS", "CPU", "DISK", "FILE_SIZE", "MEMORY", "OUTPUT", "PYTHON", "WALL_TIME", "CallTest", "CheckTest",
           "Episode", "Executor", "JsonExecutor", "Limits", "Local", "Pool", "Result", "SandboxError",
           "SandboxStalled", "SandboxUnavailable", "StdioTest", "Timings", "Verdict", "replay_episode", "run",
           "verify_program"]
