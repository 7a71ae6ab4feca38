"""`verify_program(program, tests, limits) -> Verdict`: a candidate program judged in a sandbox.

The verdict's parts live below this module: `verdict` (call and stdin tests: the driver that runs in
the sandbox, the host-side judging), `checks` (assert-style test code, judged in a host process of its
own). This module picks the one the tests need, runs it on a fresh sandbox or a warm pool, and runs a
stalled run once more (`stalled`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .checks import judge_check
from .executor import Executor, Local
from .types import WALL_TIME, Limits, SandboxStalled
from .verdict import CallTest, CheckTest, StdioTest, Verdict, driver_spec, judge, run_calls, tests_kind

STALL_CPU_FRACTION = 0.1  # a run stopped by a time limit having had under this share of a core stalled


def verify_program(program: str, tests: Sequence[CallTest] | Sequence[StdioTest] | CheckTest,
                   limits: Limits | None = None, entry_point: str | None = None, backend: str = "runsc",
                   float_tol: float = 1e-9, trace_path: str | None | bool = None, pool: Executor | None = None,
                   call_timeout_s: float | None = None) -> Verdict:
    """Judge `program` against `tests` (see the module doc). Each sandbox run is one task of `pool` (a warm
    `Pool`, or any `executor.Executor`, remote ones included) or, without one, a fresh sandbox of
    `backend`. `call_timeout_s` bounds each call (default: the run's whole `limits.wall_s`); a call that
    runs out fails the verdict. Expected values and test code never travel to the executor: only the
    program, the call arguments (or stdin texts) and a nonce do.

    A run stopped by a time limit having had little CPU (`stalled`: the program was mostly not running, so
    the host was loaded, or the program sleeps or blocks) is run once more; stalled again, it raises
    SandboxStalled, an infrastructure failure for the caller to record, never a verdict to train on."""
    kind = tests_kind(tests, entry_point)
    limits = limits or Limits()
    executor = pool if pool is not None else Local(backend, limits, trace_path)
    spec = driver_spec(kind, tests, entry_point, limits, call_timeout_s)

    def once() -> Verdict:
        if kind == "check":
            return judge_check(program, tests, entry_point, executor, limits, call_timeout_s)
        result, nonce = run_calls(executor, program, spec, limits)
        return judge(result, nonce, tests, float_tol)

    verdict = once()
    if stalled(verdict):
        verdict = once()
        if stalled(verdict):
            run = verdict.result
            raise SandboxStalled(f"the program was stopped by a time limit ({verdict.reason}) twice, having used "
                                 f"{run.cpu_s:.2f} s of CPU in {run.timings.run_s:.1f} s (under "
                                 f"{STALL_CPU_FRACTION:.0%} of a core): the host was too loaded to judge it (or it "
                                 "sleeps or blocks); an infrastructure failure, not a verdict")
    return verdict


def stalled(verdict: Verdict) -> bool:
    """Whether a time limit (the run's wall clock, or one call's or test's) stopped the verdict's run while the
    program had under STALL_CPU_FRACTION of a core over the run: it was mostly not running. False where the
    backend does not measure CPU (`Result.cpu_s` None)."""
    run = verdict.result
    return (verdict.reason in (WALL_TIME, "error:timeout") and run.cpu_s is not None
            and run.cpu_s < STALL_CPU_FRACTION * run.timings.run_s)
