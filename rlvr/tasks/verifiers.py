"""Verifiers: `run_verifier(spec, answer) -> score in [0, 1]`, dispatched on `spec["kind"]`.

A verifier judges the answer text a family extracted from a completion (see `base.Family.verify`).
The kinds, all in the explicit table `VERIFIERS`:

  exact        whitespace-normalised string equality (optionally case-insensitive)
  numeric      a number (int, decimal, fraction "3/4", thousands separators "1,234") within tolerance
  math         equivalence by math-verify (LaTeX or plain expressions), in a worker process pool
  regex        the whole answer matches a pattern
  choice       exactly one option letter ("B", "(B)", "B.")
  json_schema  JSON that validates against a schema (Draft 2020-12), plus optional expected field values
  code         a Python program that passes tests: it runs in rlvr.sandbox (gVisor runsc by default) only
               to answer calls; literal calls and test code (HumanEval's check) are judged on the host,
               from the returned values as plain data, so the program cannot forge the verdict
  tool_state   tool calls that, applied to an initial state, reach a target state

A verifier that crashes raises (the RL producer records the failure); one that runs out of time
raises `VerifierTimeout`. A candidate *program* that runs out of time is a wrong answer: the code
verifier scores it 0 (the verdict is the program's fault, not the verifier's), unless it used little
CPU on the way (a loaded host, or a program that sleeps): run once more and stalled again, that raises
rlvr.sandbox.SandboxStalled, an infrastructure failure recorded like a crash, never trained on.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import copy
import fractions
import json
import logging
import math
import multiprocessing
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


class VerifierTimeout(TimeoutError):
    """The verifier itself did not finish in time (not: the candidate program was slow)."""


# ----------------------------------------------------------------------------------------- helpers

_FENCE = re.compile(r"```[A-Za-z0-9_+-]*[ \t]*\n(.*?)```", re.DOTALL)


def strip_fences(text: str) -> str:
    """The content of the last ``` fenced block (```python, ```json, …), or the text itself without one."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _normalise(text: str) -> str:
    return " ".join(text.split())


# ----------------------------------------------------------------------------------------- exact, regex, choice


def verify_exact(spec: Mapping[str, Any], answer: str) -> float:
    """Equal after collapsing whitespace runs (and case, with `case_sensitive: false`)."""
    want, got = _normalise(str(spec["answer"])), _normalise(answer)
    if not spec.get("case_sensitive", True):
        want, got = want.casefold(), got.casefold()
    return float(want == got)


def verify_regex(spec: Mapping[str, Any], answer: str) -> float:
    """The whole answer matches `pattern` (re.fullmatch)."""
    return float(re.fullmatch(spec["pattern"], answer) is not None)


_CHOICE = re.compile(r"\(?\s*([A-Za-z])\s*[).:]?")


def verify_choice(spec: Mapping[str, Any], answer: str) -> float:
    """Exactly one option letter: "B", "(B)", "B.", "B)" or "B:"; any other text scores 0."""
    found = _CHOICE.fullmatch(answer.strip())
    if found is None:
        return 0.0
    letter = found.group(1).upper()
    options = [str(o).upper() for o in spec.get("options", [])]
    if options and letter not in options:
        return 0.0
    return float(letter == str(spec["answer"]).strip().upper())


# ----------------------------------------------------------------------------------------- numeric

_THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?")
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")
_FRACTION = re.compile(r"([+-]?\d+)\s*/\s*([+-]?\d+)")


def parse_number(text: str | float | int) -> fractions.Fraction | None:
    """An exact rational from "12", "-3.5", "1e3", "3/4", "1,234"; None for anything else."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int):
        return fractions.Fraction(text)
    if isinstance(text, float):
        return fractions.Fraction(repr(text)) if math.isfinite(text) else None
    text = text.strip()
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if _NUMBER.fullmatch(text):
        return fractions.Fraction(text)
    found = _FRACTION.fullmatch(text)
    if found and int(found.group(2)) != 0:
        return fractions.Fraction(int(found.group(1)), int(found.group(2)))
    return None


def verify_numeric(spec: Mapping[str, Any], answer: str) -> float:
    """|got - want| <= max(rel_tol·max(|got|, |want|), abs_tol), in exact rational arithmetic. The
    default tolerances (rel_tol 1e-6, abs_tol 1e-9) are for non-integer references; an integer
    reference compares exactly unless the spec sets them (1e-6 of 2.7e7 would accept ±27)."""
    want, got = parse_number(spec["answer"]), parse_number(answer)
    if want is None:
        raise ValueError(f"numeric verifier: reference answer {spec['answer']!r} is not a number")
    if got is None:
        return 0.0
    exact = want.denominator == 1
    rel, absolute = (fractions.Fraction(repr(float(spec.get(key, 0 if exact else default))))
                     for key, default in (("rel_tol", 1e-6), ("abs_tol", 1e-9)))
    tol = max(rel * max(abs(got), abs(want)), absolute)
    return float(abs(got - want) <= tol)


# ----------------------------------------------------------------------------------------- math (process pool)

# math-verify times itself out with signal.alarm, which only works in a main thread, and the parent runs
# JAX threads: so it runs in worker processes (forkserver: never fork a process with threads). Each pair
# gets its own timer in the worker (an interval timer raising a BaseException, which math-verify's
# `except Exception` cannot swallow); `future.result(timeout)` is the backstop for a worker stuck in C
# code, after which the pool's workers are killed and a fresh pool is made on the next call.

_POOL: concurrent.futures.ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_POOL_START_S = 120.0  # first start: forkserver + imports, on a busy machine
_BACKSTOP_GRACE_S = 10.0


class _PairTimeout(BaseException):
    """Raised by the worker's interval timer; a BaseException so math-verify cannot swallow it."""


def _math_worker_init() -> None:
    """Import and warm up math-verify once per worker; silence its 'timeout disabled' warning."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    from math_verify import parse, verify

    verify(parse("$1$", parsing_timeout=None), parse("$1$", parsing_timeout=None), timeout_seconds=None)


def _latex(text: str) -> str:
    """Wrap in $…$ unless already LaTeX-delimited, so a plain expression parses as one whole expression
    ("5, 0" is the set {0, 5}, not its last number)."""
    text = text.strip()
    return text if ("$" in text or "\\(" in text or "\\[" in text) else f"${text}$"


def _math_equal(gold: str, pred: str) -> bool:
    from math_verify import parse, verify

    if not pred.strip():
        return False
    parsed_gold = parse(_latex(gold), parsing_timeout=None)
    if not parsed_gold:
        raise ValueError(f"math verifier: reference answer {gold!r} does not parse")
    return bool(verify(parsed_gold, parse(_latex(pred), parsing_timeout=None), timeout_seconds=None))


def _on_alarm(signum: int, frame: Any) -> None:
    raise _PairTimeout


def _math_batch(pairs: Sequence[tuple[str, str]], timeout_s: float) -> list[bool | None]:
    """In a worker: each (gold, pred) judged under its own timer; None where the timer fired."""
    signal.signal(signal.SIGALRM, _on_alarm)
    out: list[bool | None] = []
    for gold, pred in pairs:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            out.append(_math_equal(gold, pred))
        except _PairTimeout:
            out.append(None)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    return out


def _noop() -> None:
    return None


def _pool_workers() -> int:
    return int(os.environ.get("RLVR_MATH_WORKERS", min(4, os.cpu_count() or 1)))


def _get_pool() -> concurrent.futures.ProcessPoolExecutor:
    """The module's worker pool, created (and warmed up) on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            context = multiprocessing.get_context("forkserver")
            pool = concurrent.futures.ProcessPoolExecutor(_pool_workers(), mp_context=context,
                                                          initializer=_math_worker_init)
            try:
                pool.submit(_noop).result(timeout=_POOL_START_S)
            except concurrent.futures.process.BrokenProcessPool as e:
                pool.shutdown(wait=False, cancel_futures=True)
                raise RuntimeError("math verifier: the worker processes failed to start. They import the main "
                                   "module (multiprocessing forkserver): a script that verifies at import time "
                                   "needs an `if __name__ == '__main__':` guard") from e
            _POOL = pool
            atexit.register(_shutdown_pool)
        return _POOL


def _shutdown_pool() -> None:
    """At exit, while the interpreter is still whole: stop the workers (otherwise the executor's
    weakref callback runs during teardown and prints a spurious traceback)."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def _discard_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Kill the pool's workers (one may be stuck) and forget it; the next call makes a fresh one."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is pool:
            _POOL = None
    for process in list(getattr(pool, "_processes", {}).values()):  # no public API to kill a stuck worker
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)


def _await(future: concurrent.futures.Future, timeout_s: float) -> Any:
    """The future's result; TimeoutError once it has been running for `timeout_s` (time spent queued
    behind other callers' work does not count, up to one extra `timeout_s` of slack)."""
    while True:
        queued = not future.running()
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            if not queued or future.done():
                raise


def _pool_call(fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
    """`fn(*args)` in the worker pool; VerifierTimeout (and a replaced pool) when it runs over `timeout_s`.

    A pool broken by another caller's timeout is replaced and the call retried once."""
    for attempt in range(2):
        pool = _get_pool()
        try:
            return _await(pool.submit(fn, *args), timeout_s)
        except concurrent.futures.TimeoutError:
            _discard_pool(pool)
            raise VerifierTimeout(f"verifier worker did not answer within {timeout_s:.1f} s "
                                  f"({getattr(fn, '__name__', fn)}); its pool was replaced") from None
        except concurrent.futures.process.BrokenProcessPool:
            _discard_pool(pool)
            if attempt:
                raise
    raise AssertionError("unreachable")


def math_equal_many(pairs: Sequence[tuple[str, str]], timeout_s: float = 5.0,
                    timeout_score: float | None = None) -> list[float]:
    """Judge (gold, prediction) pairs by math-verify in one pool round trip (e.g. a whole group).

    Each pair has `timeout_s`; a pair that runs out raises VerifierTimeout, or scores `timeout_score`
    when one is given (so one pathological answer need not cost the whole group)."""
    pairs = [(str(g), str(p)) for g, p in pairs]
    if not pairs:
        return []
    try:
        results = _pool_call(_math_batch, (pairs, timeout_s), timeout_s * len(pairs) + _BACKSTOP_GRACE_S)
    except _PairTimeout:  # the timer fired just as a pair finished (outside the worker's try)
        raise VerifierTimeout(f"math verifier: a pair took about {timeout_s} s") from None
    slow = [i for i, r in enumerate(results) if r is None]
    if slow and timeout_score is None:
        raise VerifierTimeout(f"math verifier: pair(s) {slow} took over {timeout_s} s "
                              f"(first: gold {pairs[slow[0]][0][:80]!r}, answer {pairs[slow[0]][1][:80]!r})")
    return [float(timeout_score) if r is None else float(r) for r in results]


def max_math_answer_chars(gold: str) -> int:
    """The longest answer text judged at all: math-verify extracts the LAST expression from free
    text, so an answer tag stuffed with prose or repeats ending in the right value would pass
    (the verifier audit's over-long probes); an answer is an expression, not an essay."""
    return max(64, 4 * len(gold))


def verify_math(spec: Mapping[str, Any], answer: str) -> float:
    """math-verify equivalence of the answer with `spec["answer"]` ("1/2" = "0.5" = "\\frac{1}{2}",
    "x=5" = "5", "(x+1)^2" = "x^2+2x+1"); VerifierTimeout after `timeout_s` (default 5). Answers
    longer than `max_math_answer_chars` score 0."""
    if len(answer.strip()) > max_math_answer_chars(str(spec["answer"])):
        return 0.0
    return math_equal_many([(spec["answer"], answer)], float(spec.get("timeout_s", 5.0)))[0]


# ----------------------------------------------------------------------------------------- json_schema


def _json_same(a: Any, b: Any) -> bool:
    """JSON equality that tells booleans from numbers (Python has True == 1)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def verify_json_schema(spec: Mapping[str, Any], answer: str) -> float:
    """The answer (``` fences stripped) is JSON valid under `schema` (Draft 2020-12), and every field
    in `expected` has exactly that value."""
    import jsonschema

    try:
        value = json.loads(strip_fences(answer))
    except ValueError:
        return 0.0
    if not jsonschema.Draft202012Validator(spec["schema"]).is_valid(value):
        return 0.0
    expected = spec.get("expected") or {}
    if expected and not isinstance(value, dict):
        return 0.0
    return float(all(k in value and _json_same(value[k], v) for k, v in expected.items()))


# ----------------------------------------------------------------------------------------- code execution


MEMORY_BYTES = 1 << 30  # address-space limit of a candidate program
FILE_BYTES = 16 << 20  # largest file it may write
NPROC = 64  # processes of the user (a fork bomb stops here; not enforced for root)
OUTPUT_BYTES = 64 << 10  # stdout/stderr kept; more output stops the program

EXECUTORS = ("runsc", "bwrap", "process")
_code_executor: list[Any] = []  # the executor of `code_executor`'s innermost block, if any
_default_code_executor: list[Callable[[], Any] | None] = [None]  # see set_default_code_executor


@contextlib.contextmanager
def code_executor(executor: Any) -> Iterator[Any]:
    """Inside the block, code verdicts (`verify_code`, the code-repair families' single-completion scoring)
    run on `executor` (a warm rlvr.sandbox.Pool, or any rlvr.sandbox Executor) instead of a fresh sandbox
    each: the same verdict, ~7x cheaper per call (docs/how-to/sandbox-pool.md). Process-wide (every
    thread); blocks nest."""
    _code_executor.append(executor)
    try:
        yield executor
    finally:
        _code_executor.remove(executor)


def set_default_code_executor(factory: Callable[[], Any] | None) -> None:
    """Outside any `code_executor` block, code verdicts run on `factory()` (called per verdict: it returns the
    executor, e.g. a process-wide warm pool started on first use, or None for a fresh sandbox); None = fresh
    sandboxes. The RL trainer installs its `rl.code_pool` here (rlvr.envs.sandboxes.use_code_pool)."""
    _default_code_executor[0] = factory


def active_code_executor() -> Any:
    """The executor of the innermost `code_executor` block, else the default's (`set_default_code_executor`),
    else None (fresh sandboxes)."""
    if _code_executor:
        return _code_executor[-1]
    factory = _default_code_executor[0]
    return factory() if factory is not None else None


def executor_backend() -> str:
    """The rlvr.sandbox backend for candidate code: RLVR_CODE_EXECUTOR if set, else "runsc" (gVisor).
    A missing runsc is an error (rlvr.sandbox.SandboxUnavailable says how to install it), never a
    silent fall back to the weaker backends, which must be chosen explicitly (and warn)."""
    choice = os.environ.get("RLVR_CODE_EXECUTOR", "").strip().lower() or "runsc"
    if choice not in EXECUTORS:
        raise ValueError(f"RLVR_CODE_EXECUTOR={choice!r}: choose one of {EXECUTORS}")
    return choice


def code_limits(timeout_s: float) -> Any:
    from rlvr.sandbox import Limits

    return Limits(wall_s=timeout_s, cpu_s=int(math.ceil(timeout_s)) + 1, memory_bytes=MEMORY_BYTES,
                  file_bytes=FILE_BYTES, nproc=NPROC, output_bytes=OUTPUT_BYTES)


def code_tests(spec: Mapping[str, Any]) -> Any:
    """The code task's tests in rlvr.sandbox form: `spec["calls"]` ([[args, expected], ...]) as CallTests,
    else `spec["tests"]` (HumanEval-style test code, with the trusted `spec["prelude"]` it may use, e.g.
    the problem's prompt) as one CheckTest. Both are judged outside the candidate's process."""
    from rlvr.sandbox import CallTest, CheckTest

    if not spec.get("entry_point"):
        raise ValueError("code verifier: the spec needs 'entry_point', the function the tests call")
    if spec.get("calls") is not None:
        return [CallTest(tuple(args), expected) for args, expected in spec["calls"]]
    if not spec.get("tests"):
        raise ValueError("code verifier: the spec needs 'calls' ([[args, expected], ...]) or 'tests' (test code)")
    return CheckTest(spec["tests"], spec.get("prelude", ""))


def verify_code(spec: Mapping[str, Any], answer: str) -> float:
    """1.0 iff the program (``` fences stripped) passes the task's tests; a timeout scores 0 (one with
    little CPU used, twice, raises rlvr.sandbox.SandboxStalled: see the module doc).

    rlvr.sandbox.verify_program runs the program in a fresh sandbox (or on `code_executor`'s pool) only
    to answer calls of its entry point; the verdict is decided on the host from the returned values as
    plain data: literal calls against expected values that never enter the sandbox, test code
    (HumanEval's `check`) in a bounded host process (see rlvr.sandbox.verdict). Exit codes and printed
    text count for nothing. The same holds on every backend, the development-only "process" and "bwrap"
    included."""
    from rlvr.sandbox import verify_program

    program = strip_fences(answer).strip()
    if not program:
        return 0.0
    timeout_s = float(spec.get("timeout_s", 10.0))
    verdict = verify_program(program, code_tests(spec), code_limits(timeout_s), entry_point=spec["entry_point"],
                             backend=executor_backend(), pool=active_code_executor())
    return float(verdict.passed)


# ----------------------------------------------------------------------------------------- tool_state


class ToolError(ValueError):
    """An invalid tool call (unknown account, overdraft, missing file, …)."""


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ToolError(f"{what} must be a non-empty string, got {value!r}")
    return value


def _amount(value: Any) -> int:
    """A positive whole amount (an integral float such as 30.0 is accepted as 30)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ToolError(f"amount must be a positive integer, got {value!r}")
    return value


def _account(state: dict, account: Any) -> str:
    if _name(account, "account") not in state:
        raise ToolError(f"no account {account!r}")
    return account


def bank_deposit(state: dict, account: str, amount: int) -> None:
    state[_account(state, account)] += _amount(amount)


def bank_withdraw(state: dict, account: str, amount: int) -> None:
    account, amount = _account(state, account), _amount(amount)
    if state[account] < amount:
        raise ToolError(f"overdraft: {account} has {state[account]}, cannot withdraw {amount}")
    state[account] -= amount


def bank_transfer(state: dict, source: str, target: str, amount: int) -> None:
    if _account(state, source) == _account(state, target):
        raise ToolError("transfer to the same account")
    bank_withdraw(state, source, amount)
    bank_deposit(state, target, amount)


def bank_open_account(state: dict, name: str) -> None:
    if _name(name, "name") in state:
        raise ToolError(f"account {name!r} already exists")
    state[name] = 0


def _file(state: dict, path: Any) -> str:
    if _name(path, "path") not in state:
        raise ToolError(f"no file {path!r}")
    return path


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ToolError(f"content must be a string, got {value!r}")
    return value


def files_write(state: dict, path: str, content: str) -> None:
    state[_name(path, "path")] = _text(content)


def files_append(state: dict, path: str, content: str) -> None:
    state[_file(state, path)] += _text(content)


def files_delete(state: dict, path: str) -> None:
    del state[_file(state, path)]


def files_rename(state: dict, source: str, target: str) -> None:
    if _name(target, "target") in state:
        raise ToolError(f"file {target!r} already exists")
    state[target] = state.pop(_file(state, source))


# Tool sets: state is a plain dict (bank: account -> balance; files: path -> content); each tool is a pure
# function (state, **arguments) -> None that mutates the state or raises on invalid use.
TOOL_SETS: dict[str, dict[str, Callable[..., None]]] = {
    "bank": {"deposit": bank_deposit, "withdraw": bank_withdraw, "transfer": bank_transfer,
             "open_account": bank_open_account},
    "files": {"write": files_write, "append": files_append, "delete": files_delete, "rename": files_rename},
}

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(answer: str) -> list[tuple[str, dict]] | None:
    """[(name, arguments)] from `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks (nothing else
    but whitespace around them) or from one JSON list of such objects; None if malformed."""
    text = answer.strip()
    try:
        if "<tool_call>" in text:
            if _TOOL_CALL.sub("", text).strip():
                return None
            raw = [json.loads(block) for block in _TOOL_CALL.findall(text)]
        else:
            raw = json.loads(strip_fences(text))
            raw = [raw] if isinstance(raw, dict) else raw
    except ValueError:
        return None
    if not isinstance(raw, list):
        return None
    calls = [_tool_call(item) for item in raw]
    return None if any(c is None for c in calls) else calls


def _tool_call(item: Any) -> tuple[str, dict] | None:
    if not isinstance(item, dict) or set(item) - {"name", "arguments"} or not isinstance(item.get("name"), str):
        return None
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI style: arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return (item["name"], arguments) if isinstance(arguments, dict) else None


def apply_tool_calls(tools: Mapping[str, Callable[..., None]], initial: Mapping[str, Any],
                     calls: Sequence[tuple[str, dict]]) -> dict | None:
    """The state after the calls, applied in order to a deep copy of `initial`; None at the first
    unknown tool, bad argument or invalid use."""
    state = copy.deepcopy(dict(initial))
    for name, arguments in calls:
        if name not in tools:
            return None
        try:
            tools[name](state, **arguments)
        except Exception:  # noqa: BLE001 - candidate input: any failure of a call is a wrong answer
            return None
    return state


def verify_tool_state(spec: Mapping[str, Any], answer: str) -> float:
    """1.0 iff the tool calls in the answer turn `initial` into exactly `target` (tool set `tools`)."""
    if spec["tools"] not in TOOL_SETS:
        raise ValueError(f"tool_state verifier: unknown tool set {spec['tools']!r}; known: {sorted(TOOL_SETS)}")
    calls = parse_tool_calls(answer)
    if calls is None:
        return 0.0
    state = apply_tool_calls(TOOL_SETS[spec["tools"]], spec["initial"], calls)
    return float(state is not None and _json_same(state, dict(spec["target"])))


# ----------------------------------------------------------------------------------------- dispatch

VERIFIERS: dict[str, Callable[[Mapping[str, Any], str], float]] = {
    "exact": verify_exact,
    "numeric": verify_numeric,
    "math": verify_math,
    "regex": verify_regex,
    "json_schema": verify_json_schema,
    "code": verify_code,
    "tool_state": verify_tool_state,
    "choice": verify_choice,
}


def run_verifier(spec: Mapping[str, Any], answer: str) -> float:
    """The score in [0, 1] of `answer` under the verifier `spec` (dispatched on spec["kind"])."""
    kind = spec.get("kind")
    if kind not in VERIFIERS:
        raise ValueError(f"unknown verifier kind {kind!r}; known kinds: {sorted(VERIFIERS)}")
    return VERIFIERS[kind](spec, answer)
