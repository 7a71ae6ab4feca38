"""Verdicts a candidate program cannot forge: `verify_program(program, tests, limits) -> Verdict`.

The rule (spec §8.6): the verdict is computed on the HOST, after the sandbox has finished, by comparing
the program's raw outputs with expected values that never enter the sandbox.

- The sandbox holds only the candidate (`/workspace/solution.py`, its own writable workspace) and a
  read-only harness (`/harness/driver.py` plus the test *inputs*). Expected outputs stay in the host
  process; no file, argument or environment variable inside carries them, so no amount of searching the
  filesystem, /proc or memory can find them ("peeking").
- For function tests the driver imports the candidate and calls `entry_point(*args)`; each returned
  value is converted to plain JSON by exact type (int, float, str, bool, None, list/tuple, dict with str
  keys; subclasses refused, so an object whose `__eq__` always returns True, or an int subclass lying
  about equality, never reaches the comparison). For stdio tests the driver runs the candidate as a fresh
  process per test, feeding stdin and keeping its stdout.
- The driver writes one result line per test to the sandbox's original stdout, tagged with a per-call
  nonce; the candidate's own prints go to stderr. The candidate shares the driver's process (or uid), so
  it *can* write to that channel, monkeypatch the driver, exit early or kill it. None of that helps: a
  forged line carries only an output value, which the host still compares with the hidden expected
  value, and anything irregular (a missing, duplicated or malformed line, no end marker, a timeout, an
  output over the cap) fails closed. Printing "PASSED", exit codes, sys.exit/os._exit/atexit tricks,
  patching unittest/pytest/assert, rewriting test files (the harness is read-only and is never read
  back), shadowing modules (`python -I`: the workspace is not on sys.path) all leave the verdict to
  the host's comparison. To pass, the program must produce the right outputs.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .api import PYTHON, run
from .types import Limits, Result

if TYPE_CHECKING:
    from .executor import Executor

SOLUTION = "solution.py"

DRIVER = r'''
import io, json, os, subprocess, sys
NONCE = sys.argv[1] if len(sys.argv) > 1 else os.environ["RLVR_NONCE"]
RESULT = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the result channel: the sandbox's original stdout
os.dup2(2, 1)  # the candidate's prints go to stderr
sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", 0), encoding="utf-8", write_through=True)
SPEC = json.load(open(os.environ.get("RLVR_HARNESS", "/harness") + "/tests.json", encoding="utf-8"))
SCALARS = (int, float, str, bool, type(None))


def emit(entry):
    RESULT.write(NONCE + " " + json.dumps(entry) + "\n")
    RESULT.flush()


def plain(value, depth=0):
    """JSON-ready copy by exact type: subclasses (always-equal objects, lying ints) are refused."""
    if depth > 50:
        raise TypeError("nested too deep")
    kind = type(value)
    if kind in SCALARS:
        return value
    if kind in (list, tuple):
        return [plain(v, depth + 1) for v in value]
    if kind is dict and all(type(k) is str for k in value):
        return {k: plain(v, depth + 1) for k, v in value.items()}
    raise TypeError(f"unsupported result type {kind.__name__}")


def calls():
    import importlib.util
    spec = importlib.util.spec_from_file_location("solution", "/workspace/solution.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["solution"] = module
    try:
        spec.loader.exec_module(module)
        fn = getattr(module, SPEC["entry_point"])
    except BaseException as e:
        emit({"load_error": type(e).__name__})
        return
    for i, test in enumerate(SPEC["tests"]):
        try:
            emit({"i": i, "value": plain(fn(*test["args"], **test["kwargs"]))})
        except BaseException as e:
            emit({"i": i, "error": type(e).__name__})


def stdio():
    for i, test in enumerate(SPEC["tests"]):
        try:
            done = subprocess.run([sys.executable, "-I", "-B", "/workspace/solution.py"], cwd="/workspace",
                                  input=test["stdin"].encode(), capture_output=True, timeout=SPEC["timeout_s"])
            out = done.stdout[: SPEC["output_bytes"]].decode("utf-8", "replace")
            emit({"i": i, "stdout": out, "rc": done.returncode})
        except subprocess.TimeoutExpired:
            emit({"i": i, "error": "timeout"})


calls() if SPEC["kind"] == "calls" else stdio()
emit({"end": True})
os._exit(0)
'''


@dataclasses.dataclass(frozen=True)
class CallTest:
    """`entry_point(*args, **kwargs)` must return `expected` (JSON values, compared by exact type on the host;
    arguments travel as JSON, so a tuple arrives as a list)."""

    args: tuple = ()
    expected: Any = None
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StdioTest:
    """The program, fed `stdin`, must print `expected_stdout` (trailing spaces and blank lines ignored)."""

    stdin: str
    expected_stdout: str


@dataclasses.dataclass
class Verdict:
    """passed iff every test's output matched; `reason` says why not (first failure), `outcomes` per test."""

    passed: bool
    n_passed: int
    n_tests: int
    reason: str
    outcomes: list[str]
    result: Result


def verify_program(program: str, tests: Sequence[CallTest] | Sequence[StdioTest], limits: Limits | None = None,
                   entry_point: str | None = None, backend: str = "runsc", float_tol: float = 1e-9,
                   trace_path: str | None | bool = None, pool: Executor | None = None) -> Verdict:
    """Run `program` against `tests` in one fresh sandbox (or one task of `pool`: a warm `Pool`, or any
    `executor.Executor`, remote ones included) and judge its outputs on the host (see the module doc). The
    expected values never travel to the executor: only the program, the test inputs and a nonce do."""
    kind = _kind(tests, entry_point)
    limits = limits or Limits()
    nonce = secrets.token_hex(16)
    if pool is not None:
        return judge(_on_pool(pool, program, kind, tests, entry_point, limits, nonce), nonce, tests, float_tol)
    harness = _harness(kind, tests, entry_point, limits)
    try:
        result = run([PYTHON, "-I", "-B", "/harness/driver.py", nonce], files={SOLUTION: program},
                     limits=limits, backend=backend, ro_binds={"/harness": harness}, trace_path=trace_path,
                     tag="verify_program")
    finally:
        shutil.rmtree(os.path.dirname(harness), ignore_errors=True)
    return judge(result, nonce, tests, float_tol)


def _on_pool(pool: Executor, program: str, kind: str, tests: Sequence[Any], entry_point: str | None, limits: Limits,
             nonce: str) -> Result:
    """The same driver as one pool task: it runs as the task's main program (a fork, no interpreter start)
    and the test inputs travel as a workspace file (inputs only: the expected values stay here)."""
    spec = json.dumps(_spec(kind, tests, entry_point, limits))
    return pool.run(python=DRIVER, files={SOLUTION: program, "harness/tests.json": spec}, limits=limits,
                    env={"RLVR_NONCE": nonce, "RLVR_HARNESS": "/workspace/harness"}, tag="verify_program")


def calls_from_asserts(tests_source: str, entry_point: str) -> list[CallTest] | None:
    """CallTests from HumanEval-style asserts (`assert candidate(1, [2]) == 3`, in `check(candidate)` or at
    top level, also calling `entry_point` by name); None when any assert has another shape (tolerances,
    computed arguments, several calls): then those tests cannot be judged on the host."""
    try:
        tree = ast.parse(tests_source)
    except SyntaxError:
        return None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            test = _literal_call_test(node.test, {"candidate", entry_point})
            if test is None:
                return None
            found.append(test)
    return found or None


def _literal_call_test(expr: ast.expr, names: set[str]) -> CallTest | None:
    """`name(<literals>) == <literal>` as a CallTest; None for any other expression."""
    if not (isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.ops[0], ast.Eq)):
        return None
    call = expr.left
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in names):
        return None
    try:
        args = tuple(ast.literal_eval(a) for a in call.args)
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
        expected = ast.literal_eval(expr.comparators[0])
        json.dumps([args, kwargs, expected], allow_nan=False)  # JSON values only (sets, bytes: not judged)
    except (ValueError, TypeError, SyntaxError):
        return None
    if len(kwargs) != len(call.keywords):
        return None
    return CallTest(args, expected, kwargs)


def _kind(tests: Sequence[CallTest] | Sequence[StdioTest], entry_point: str | None) -> str:
    if not tests:
        raise ValueError("verify_program needs at least one test")
    if all(isinstance(t, CallTest) for t in tests):
        if not entry_point:
            raise ValueError("CallTest tests need the entry_point (function name) to call")
        return "calls"
    if all(isinstance(t, StdioTest) for t in tests):
        return "stdio"
    raise ValueError("tests must be all CallTest or all StdioTest")


def _harness(kind: str, tests: Sequence[Any], entry_point: str | None, limits: Limits) -> str:
    """A host directory with the driver and the test inputs only (never the expected outputs)."""
    top = tempfile.mkdtemp(prefix="rlvr-harness-")
    os.chmod(top, 0o755)
    harness = os.path.join(top, "h")
    os.mkdir(harness, 0o755)
    for name, text in (("driver.py", DRIVER), ("tests.json", json.dumps(_spec(kind, tests, entry_point, limits)))):
        with open(os.path.join(harness, name), "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(os.path.join(harness, name), 0o644)
    return harness


def _spec(kind: str, tests: Sequence[Any], entry_point: str | None, limits: Limits) -> dict[str, Any]:
    """What the driver needs: the kind, the entry point and each test's *inputs* (no expected values)."""
    if kind == "calls":
        inputs = [{"args": list(t.args), "kwargs": dict(t.kwargs)} for t in tests]
    else:
        inputs = [{"stdin": t.stdin} for t in tests]
    return {"kind": kind, "entry_point": entry_point, "tests": inputs,
            "timeout_s": max(limits.wall_s / len(tests), 0.5), "output_bytes": limits.output_bytes}


def parse_results(stdout: bytes, nonce: str, n_tests: int) -> tuple[dict[int, dict], str | None]:
    """({test index: entry}, failure reason or None) from the nonce-tagged lines; fails closed."""
    entries, ended, prefix = {}, False, nonce + " "
    for line in stdout.decode("utf-8", "replace").split("\n"):
        if not line.startswith(prefix):
            continue
        try:
            entry = json.loads(line[len(prefix):])
        except ValueError:
            return {}, "malformed_result"
        if ended or not isinstance(entry, dict):
            return {}, "malformed_result"
        if entry.get("end") is True:
            ended = True
        elif "load_error" in entry:
            return {}, f"load_error:{entry['load_error']}"
        elif type(entry.get("i")) is not int or not 0 <= entry["i"] < n_tests or entry["i"] in entries:
            return {}, "duplicate_or_bad_result"
        else:
            entries[entry["i"]] = entry
    if not ended or len(entries) != n_tests:
        return {}, "missing_results"
    return entries, None


def judge(result: Result, nonce: str, tests: Sequence[CallTest] | Sequence[StdioTest],
          float_tol: float = 1e-9) -> Verdict:
    """The host-side verdict: run status first (any limit hit fails), then each output vs. its expected value."""
    fail = result.limit_hit or ("sandbox_exit" if result.exit_code != 0 else None)
    entries, reason = ({}, fail) if fail else parse_results(result.stdout, nonce, len(tests))
    if reason:
        return Verdict(False, 0, len(tests), reason, ["not_run"] * len(tests), result)
    outcomes = [_outcome(entries[i], t, float_tol) for i, t in enumerate(tests)]
    n_passed = outcomes.count("pass")
    first = next((o for o in outcomes if o != "pass"), "passed")
    return Verdict(n_passed == len(tests), n_passed, len(tests), first, outcomes, result)


def _outcome(entry: dict, test: CallTest | StdioTest, float_tol: float) -> str:
    if "error" in entry:
        return f"error:{entry['error']}"
    if isinstance(test, StdioTest):
        same = _lines(entry.get("stdout", "")) == _lines(test.expected_stdout) and entry.get("rc") == 0
        return "pass" if same else "wrong_output"
    expected = json.loads(json.dumps(test.expected))  # tuples -> lists, as the sandbox side sees them
    return "pass" if same_value(entry.get("value"), expected, float_tol) else "wrong_output"


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def same_value(got: Any, want: Any, float_tol: float = 1e-9) -> bool:
    """Equal by exact JSON type (True is not 1, 1.0 is not 1), floats within a relative tolerance."""
    if type(got) is not type(want):
        return False
    if isinstance(want, float):
        return math.isclose(got, want, rel_tol=float_tol, abs_tol=float_tol)
    if isinstance(want, list):
        return len(got) == len(want) and all(same_value(g, w, float_tol) for g, w in zip(got, want, strict=True))
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same_value(got[k], want[k], float_tol) for k in want)
    return got == want
