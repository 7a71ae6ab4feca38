"""Verdicts a candidate program cannot forge: the driver and the judging behind `verify_program` (verify.py).

The rule (spec §8.6): the verdict is decided OUTSIDE the candidate's process, from plain data. The
sandbox only ever answers calls: the candidate (`/workspace/solution.py`) is loaded by a driver that
calls its entry point with the arguments it is given and sends back, per call, the returned value as
typed JSON (`wire.py`: exact builtin types, subclasses reduced to their base value, anything else
"unsupported"), the builtin exception class it raised, or a timeout. What is done with those values
happens on the host, where the candidate cannot reach:

- `CallTest`s (literal calls, e.g. the procedural code tasks): the host compares each returned value
  with an expected value that never enters the sandbox, by exact JSON type (True is not 1) with a float
  tolerance.
- `CheckTest` (test code, e.g. HumanEval's `check(candidate)` with tolerances, computed arguments,
  loops over random cases): the test code runs in its own bounded host process (`harness.py`), where
  `candidate` is a stand-in that answers from the sandbox's transcript of calls; the test's `==`, `abs()`
  and `assert`s run there, on plain values. The calls go to the sandbox in batches (`run_calls`, one
  sandbox run each; `harness.py` explains how the batches are learned); usually one round.
- `StdioTest`s: the driver runs the program as a fresh process per test and sends back its stdout;
  the host compares it with the expected text.

The driver writes one line per call to the sandbox's original stdout, tagged with a per-run nonce; the
candidate's own prints go to stderr. The candidate shares the driver's process, so it can write to that
channel, patch the driver, exit early, or kill it; none of that helps. A forged line carries only a
value (the host still judges it), and anything irregular (a missing, duplicated or malformed line, no
end marker, a limit hit) fails closed. Exit codes, stdout text and sentinels play no part: printing
"PASSED", sys.exit/os._exit/atexit, patching unittest/operator/builtins, always-equal objects and
`__eq__` on subclasses (reduced to plain values), reading frames, `gc` or code objects (the test and its
expected values are in another process, on another machine boundary), rewriting test files (there are
none in the sandbox), shadowing modules (`python -I`: the workspace is not on sys.path) all leave the
verdict to the host. tests/test_code_hacks.py runs a corpus of such programs on every code family.

Not modelled: a test that relies on the candidate mutating its arguments in place sees its own,
unchanged objects (the sandbox has copies); `Verdict.info["mutated"]` counts calls that mutated theirs.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import marshal
import math
import os
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import pyast
from .types import Limits, Result
from .wire import WireError, decode, encode

if TYPE_CHECKING:
    from .executor import Executor

SOLUTION = "solution.py"
CALLS = "harness/calls.bin"

DRIVER_BODY = r'''
import io, marshal, os, signal, sys
NONCE = os.environ["RLVR_NONCE"]
RESULT = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the result channel: the sandbox's original stdout
os.dup2(2, 1)  # the candidate's prints go to stderr
sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", 0), encoding="utf-8", write_through=True)
WORKDIR = os.getcwd()  # /workspace (the development backends: the workspace's host path)
with open(os.path.join(WORKDIR, "harness", "calls.bin"), "rb") as f:
    SPEC = marshal.loads(f.read())  # written by the host, read before the candidate is loaded
ESCAPES = {'"': '\\"', "\\": "\\\\"}


def escape(c):
    n = ord(c)
    if n < 0x10000:
        return "\\u%04x" % n
    n -= 0x10000
    return "\\u%04x\\u%04x" % (0xD800 + (n >> 10), 0xDC00 + (n & 0x3FF))


def dumps(value):
    """JSON text of str, int, bool, None, list and dict with str keys (the json module costs an import)."""
    if value is None or value is True or value is False:
        return "null" if value is None else "true" if value else "false"
    if type(value) is int:
        return str(value)
    if type(value) is str:
        return '"' + "".join(ESCAPES.get(c) or (c if " " <= c < "\x7f" else escape(c)) for c in value) + '"'
    if type(value) is list:
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return "{" + ", ".join(dumps(k) + ": " + dumps(v) for k, v in value.items()) + "}"


def emit(entry):
    RESULT.write(NONCE + " " + dumps(entry) + "\n")
    RESULT.flush()


class CallTimeout(BaseException):
    pass


def on_alarm(signum, frame):
    raise CallTimeout


def builtin_name(error):
    """The nearest builtin class of the exception (a ValueError subclass is reported as ValueError)."""
    import builtins
    for cls in type(error).__mro__:
        if getattr(builtins, cls.__name__, None) is cls:
            return cls.__name__
    return "BaseException"


def one_call(fn, call):
    args, kwargs = decode(call["args"]), decode(call["kwargs"])
    try:
        value = fn(*args, **kwargs)
    except CallTimeout:
        raise
    except BaseException as e:
        return {"raised": builtin_name(e)}
    try:
        entry = {"value": encode(value)}
    except CallTimeout:
        raise
    except BaseException as e:
        return {"unsupported": (type(e).__name__ + ": " + str(e))[:200]}
    try:
        if encode(args) != call["args"] or encode(kwargs) != call["kwargs"]:
            entry["mutated"] = True
    except CallTimeout:
        raise
    except BaseException:
        entry["mutated"] = True
    return entry


def calls():
    path = os.path.join(WORKDIR, "solution.py")
    module = type(sys)("solution")
    module.__file__ = path
    sys.modules["solution"] = module
    try:
        with open(path, "rb") as f:
            exec(compile(f.read(), path, "exec"), module.__dict__)
        fn = getattr(module, SPEC["entry_point"])
    except BaseException as e:
        emit({"load_error": type(e).__name__})
        return
    signal.signal(signal.SIGALRM, on_alarm)
    for i, call in enumerate(SPEC["calls"]):
        signal.setitimer(signal.ITIMER_REAL, SPEC["call_s"])
        try:
            entry = one_call(fn, call)
        except CallTimeout:
            emit({"i": i, "error": "timeout"})
            for j in range(i + 1, len(SPEC["calls"])):
                emit({"i": j, "error": "not_run"})
            return
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        entry["i"] = i
        emit(entry)


def stdio():
    import subprocess
    for i, test in enumerate(SPEC["tests"]):
        try:
            done = subprocess.run([sys.executable, "-I", "-B", os.path.join(WORKDIR, "solution.py")], cwd=WORKDIR,
                                  input=test["stdin"].encode(), capture_output=True, timeout=SPEC["timeout_s"])
            out = done.stdout[: SPEC["output_bytes"]].decode("utf-8", "replace")
            emit({"i": i, "stdout": out, "rc": done.returncode})
        except subprocess.TimeoutExpired:
            emit({"i": i, "error": "timeout"})


calls() if SPEC["kind"] == "calls" else stdio()
emit({"end": True})
os._exit(0)
'''
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "wire.py"), encoding="utf-8") as _f:
    DRIVER = _f.read() + DRIVER_BODY  # one script: the typed-JSON codec, then the driver


@dataclasses.dataclass(frozen=True)
class CallTest:
    """`entry_point(*args, **kwargs)` must return `expected` (JSON values, compared by exact JSON type on the
    host: a returned tuple counts as a list, a set or bytes never match)."""

    args: tuple = ()
    expected: Any = None
    kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class StdioTest:
    """The program, fed `stdin`, must print `expected_stdout` (trailing spaces and blank lines ignored)."""

    stdin: str
    expected_stdout: str


@dataclasses.dataclass(frozen=True)
class CheckTest:
    """Test code judged on the host: `tests` defines `check(candidate)` and/or runs top-level asserts that
    call the entry point by name; `prelude` holds trusted definitions the tests use (HumanEval's prompt:
    helpers such as `poly`). Both run in a bounded host process (harness.py), never beside the candidate;
    the entry point's name and `candidate` there both stand for the sandboxed function."""

    tests: str
    prelude: str = ""


@dataclasses.dataclass
class Verdict:
    """passed iff every test passed; `reason` says why not (first failure), `outcomes` per test; `result` is
    the (last) sandbox run; `info`: rounds, calls and calls that mutated their arguments (CheckTest)."""

    passed: bool
    n_passed: int
    n_tests: int
    reason: str
    outcomes: list[str]
    result: Result
    info: dict = dataclasses.field(default_factory=dict)


def driver_spec(kind: str, tests, entry_point: str | None, limits: Limits, call_timeout_s: float | None) -> dict:
    """The driver's input for CallTests or StdioTests ({} for a CheckTest: the harness asks for its calls)."""
    if kind == "calls":
        return calls_spec(entry_point, [_call(t.args, t.kwargs) for t in tests], limits, call_timeout_s)
    if kind == "stdio":
        return {"kind": "stdio", "tests": [{"stdin": t.stdin} for t in tests],
                "timeout_s": max(limits.wall_s / len(tests), 0.5), "output_bytes": limits.output_bytes}
    return {}


def _call(args: Sequence[Any], kwargs: dict) -> dict[str, Any]:
    return {"args": encode(tuple(args)), "kwargs": encode(dict(kwargs))}


def calls_spec(entry_point: str, calls: list[dict], limits: Limits, call_timeout_s: float | None = None) -> dict:
    """The driver's input for one round of calls (arguments in wire form; never an expected value)."""
    return {"kind": "calls", "entry_point": entry_point, "calls": calls,
            "call_s": float(call_timeout_s or limits.wall_s)}


def run_calls(executor: Executor, program: str, spec: dict, limits: Limits) -> tuple[Result, str]:
    """One sandbox run of the driver (as the run's Python program: a pool task is a fork, no interpreter
    start) over the candidate and the round's inputs; (its Result, the nonce tagging its result lines)."""
    nonce = secrets.token_hex(16)
    result = executor.run(python=DRIVER, files={SOLUTION: program, CALLS: marshal.dumps(spec)}, limits=limits,
                          env={"RLVR_NONCE": nonce}, tag="verify_program")
    return result, nonce


def calls_from_asserts(tests_source: str, entry_point: str) -> list[CallTest] | None:
    """CallTests from HumanEval-style asserts (`assert candidate(1, [2]) == 3`, in `check(candidate)` or at
    top level, also calling `entry_point` by name); None when any assert has another shape (tolerances,
    computed arguments, several calls): then those tests cannot be judged on the host."""
    try:
        tree = pyast.parse(tests_source)
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


def tests_kind(tests: Sequence[CallTest] | Sequence[StdioTest] | CheckTest, entry_point: str | None) -> str:
    if isinstance(tests, CheckTest):
        if not entry_point:
            raise ValueError("a CheckTest needs the entry_point (the function the tests call)")
        return "check"
    if not tests:
        raise ValueError("verify_program needs at least one test")
    if all(isinstance(t, CallTest) for t in tests):
        if not entry_point:
            raise ValueError("CallTest tests need the entry_point (function name) to call")
        return "calls"
    if all(isinstance(t, StdioTest) for t in tests):
        return "stdio"
    raise ValueError("tests must be all CallTest, all StdioTest, or one CheckTest")


def parse_results(stdout: bytes, nonce: str, n_tests: int) -> tuple[dict[int, dict], str | None]:
    """({test index: entry}, failure reason or None) from the nonce-tagged lines; fails closed."""
    entries, ended, prefix = {}, False, nonce + " "
    for line in stdout.decode("utf-8", "replace").split("\n"):
        if not line.startswith(prefix):
            continue
        try:
            entry = json.loads(line[len(prefix):])
        except (ValueError, RecursionError):
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
    """The host-side verdict of CallTests / StdioTests: any limit hit fails, then each output vs. its expected
    value (the exit code plays no part: only the result lines count, and they must all be there)."""
    entries, reason = ({}, result.limit_hit) if result.limit_hit else parse_results(result.stdout, nonce, len(tests))
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
    if "raised" in entry:
        return f"error:{entry['raised']}"
    if "value" not in entry:
        return "error:unsupported"
    try:
        got = json_view(decode(entry["value"]))
    except WireError:
        return "wrong_output"  # malformed, or not a JSON value (a set, bytes, a dict with int keys)
    expected = json.loads(json.dumps(test.expected))  # tuples -> lists, as json_view sees returned values
    return "pass" if same_value(got, expected, float_tol) else "wrong_output"


def json_view(value: Any) -> Any:
    """A decoded value as JSON types (tuples as lists); WireError for anything JSON has no value for."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind in (list, tuple):
        return [json_view(v) for v in value]
    if kind is dict and all(type(k) is str for k in value):
        return {k: json_view(v) for k, v in value.items()}
    raise WireError(f"{kind.__name__} is not a JSON value")


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
