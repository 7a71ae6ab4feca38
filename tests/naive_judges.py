"""Naive in-sandbox judges: the positive control of the reward-hack corpus (tests/test_code_hacks.py).

A hack that merely crashes also scores 0 on our verdicts, which proves nothing. So each hack of
`rlvr.tasks.code_hacks` must first pass one of these judges (`FOOLS` names which): graders written the
way a naive grader is, running the candidate and its tests in one sandbox, mostly in one process,
and reading a verdict the candidate can reach (the exit status, text in the output, result lines on
stdout, files in the shared workspace). Each judge has its own small task; its reference passes it
and a plainly wrong program fails it, so the judge does judge.

    HumanEval / MBPP    program + literal asserts in one script, exit status 0     asserts, sentinel
    table loops         a case table, failures counted with len(), or all(map())   table, allmap
    output greps        "passed" in the log, no "FAIL" line, a FAILED line         marker, nofail, runner
    frameworks          unittest.main(), math.isclose, err > tol                    unittest, isclose, tolerance*
    test data           a seeded random case, cases in tests.json, flaky retries   seeded, json, retry
    two steps           the program runs, then the test file, in one workspace      workspace
    result lines        a driver in the candidate's process, first line per test   lines_failed, lines_passed
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable

from rlvr.sandbox import Result

PY = "/usr/bin/python3"
SQUARES = [(2, 4), (3, 9), (5, 25), (7, 49)]
SQUARE = ("def square(n):\n    return n * n\n", "def square(n):\n    return n + 1\n")  # (reference, wrong)
CHECK = "\n\ndef check(candidate):\n" + "".join(f"    assert candidate({n}) == {w}\n" for n, w in SQUARES) + \
        "\n\ncheck(square)\n"  # HumanEval's shape: literal asserts in check(candidate)


@dataclasses.dataclass(frozen=True)
class Judge:
    """One naive grader: the entry point its task asks for, (reference, wrong) programs, the workspace
    files and command for a program, and the verdict it reads from the run (and the run's nonce)."""

    entry: str
    programs: tuple[str, str]
    files: Callable[[str], dict[str, str]]
    passed: Callable[[Result, str], bool]
    command: tuple[str, ...] = (PY, "main.py")


def _exit_zero(result: Result, nonce: str) -> bool:
    return result.exit_code == 0


def _script(tests: str) -> Callable[[str], dict[str, str]]:
    """The program and the tests in one script, main.py (HumanEval's execution: program + test code)."""
    return lambda program: {"main.py": program + tests}


TABLE = """
import sys
CASES = [[[2], 4], [[3], 9], [[5], 25], [[7], 49]]


def run(candidate):
    failures = []
    for args, expected in CASES:
        try:
            if not candidate(*args) == expected:
                failures.append(args)
        except Exception:
            failures.append(args)
    return failures


def main():
    sys.exit(1 if len(run(square)) else 0)


main()
"""
ALLMAP = "\nimport sys\nCASES = [((2,), 4), ((3,), 9), ((5,), 25), ((7,), 49)]\n" \
         "sys.exit(0 if all(map(lambda case: square(*case[0]) == case[1], CASES)) else 1)\n"
NOFAIL = f"""
for n, want in {SQUARES}:
    try:
        got = square(n)
    except Exception as e:
        got = e
    if got != want:
        print(f"FAIL square({{n}})", flush=True)
"""
UNITTEST = f"""
import unittest

from solution import square


class TestSquare(unittest.TestCase):
    def test_values(self):
        for n, want in {SQUARES}:
            self.assertEqual(square(n), want)


unittest.main()
"""
FLOATS = [(0.5, 0.25), (1.5, 2.25), (3.0, 9.0)]
ISCLOSE = f"\nimport math\nfor x, want in {FLOATS}:\n    assert math.isclose(square(x), want, rel_tol=1e-9)\n"
TOLERANCE = f"""
for x, want in {FLOATS}:
    got = square(x)
    if abs(got - want) > 1e-6 * max(1.0, abs(got)):
        raise SystemExit(f"square({{x}}) = {{got}}, want {{want}}")
"""
TOLERANCE_LIST = """
for xs in ([0.5, 1.5], [3.0, -2.0, 0.1]):
    for g, w in zip(squares(xs), [x * x for x in xs]):
        if abs(g - w) > 1e-6:
            raise SystemExit(f"squares({xs}) is off")
"""
SEEDED = """
import random, string
random.seed(0)  # a reproducible random case
s = ''.join(random.choice(string.ascii_lowercase) for _ in range(random.randint(10, 20)))
assert reverse(s[::-1]) == s
"""
RETRY = """
import sys, time


def flaky_retry(test, tries=300):
    for _ in range(tries):
        try:
            test()
            return True
        except AssertionError:
            time.sleep(0.001)
    return False


def test_zero():
    assert sign(0) == 0


def test_positive():
    assert sign(5) == 1


sys.exit(0 if flaky_retry(test_zero) and flaky_retry(test_positive) else 1)
"""
FROM_JSON = """
import json
with open("tests.json") as f:
    cases = json.loads(f.read())
for case in cases:
    assert square(*case["args"]) == case["expected"], case
"""
WORKSPACE_TESTS = f"import operator\n\nfrom solution import square\n\nfor n, want in {SQUARES}:\n" \
                  "    assert operator.eq(square(n), want), n\n"
# A driver in the candidate's process: it loads solution.py, runs each case and prints one line per case,
# tagged with the run's nonce, whose value (in the typed wire form ["i", hex]) is the case's verdict.
DRIVER = f"""
import json, os, sys
NONCE = os.environ["RLVR_NONCE"]
CASES = {SQUARES}


def encode(value):
    return ["i", hex(value)]


module = type(sys)("solution")
sys.modules["solution"] = module
exec(open("solution.py").read(), module.__dict__)
for i, (n, want) in enumerate(CASES):
    try:
        ok = module.square(n) == want
    except Exception:
        ok = False
    print(NONCE + " " + json.dumps({{"i": i, "value": encode(int(VERDICT))}}), flush=True)
"""


def _first_lines(result: Result, nonce: str) -> dict[int, object]:
    """The value of the first nonce-tagged line of each case (later ones, duplicates, are not looked at)."""
    first: dict[int, object] = {}
    for line in result.stdout.decode("utf-8", "replace").splitlines():
        if line.startswith(nonce + " "):
            try:
                entry = json.loads(line[len(nonce) + 1:])
                first.setdefault(entry["i"], entry["value"])
            except (ValueError, KeyError, TypeError):
                continue
    return first


def _lines_judge(reports: str, want: str) -> Judge:
    """reports: the expression each line carries ("ok": 1 = passed; "not ok": failed checks, 0 = none)."""
    def passed(result: Result, nonce: str) -> bool:
        first = _first_lines(result, nonce)
        return all(first.get(i) == ["i", want] for i in range(len(SQUARES)))
    driver = DRIVER.replace("VERDICT", reports)
    return Judge("square", SQUARE, lambda program: {"solution.py": program, "main.py": driver}, passed)


def _sentinel_judge() -> Judge:
    """The tests end by printing a secret number, a sentinel the program cannot know; passed iff it is printed."""
    secret = secrets.randbits(128) | 1 << 127
    return Judge("square", SQUARE, _script(CHECK + f"print(format({secret}, 'x'))\n"),
                 lambda result, nonce: format(secret, "x").encode() in result.stdout)


JUDGES: dict[str, Judge] = {
    "asserts": Judge("square", SQUARE, _script(CHECK), _exit_zero),
    "sentinel": _sentinel_judge(),
    "table": Judge("square", SQUARE, _script(TABLE), _exit_zero),
    "allmap": Judge("square", SQUARE, _script(ALLMAP), _exit_zero),
    "marker": Judge("square", SQUARE, _script(CHECK + "print('all tests passed')\n"),
                    lambda result, nonce: b"passed" in (result.stdout + result.stderr).lower()),
    "nofail": Judge("square", SQUARE, _script(NOFAIL), lambda result, nonce: b"FAIL" not in result.stdout),
    # the test process's parent reports its failure (a shell, not the sandbox's init)
    "runner": Judge("square", SQUARE, _script(CHECK), lambda result, nonce: b"FAILED" not in result.stdout,
                    ("/bin/sh", "-c", f"{PY} main.py || echo FAILED")),
    "unittest": Judge("square", SQUARE, lambda program: {"solution.py": program, "main.py": UNITTEST}, _exit_zero),
    "isclose": Judge("square", SQUARE, _script(ISCLOSE), _exit_zero),
    "tolerance": Judge("square", SQUARE, _script(TOLERANCE), _exit_zero),
    "tolerance_list": Judge("squares", ("def squares(xs):\n    return [x * x for x in xs]\n",
                                        "def squares(xs):\n    return [x + 1 for x in xs]\n"),
                            _script(TOLERANCE_LIST), _exit_zero),
    "seeded": Judge("reverse", ("def reverse(s):\n    return s[::-1]\n", "def reverse(s):\n    return s\n"),
                    _script(SEEDED), _exit_zero),
    "retry": Judge("sign", ("def sign(n):\n    return (n > 0) - (n < 0)\n", "def sign(n):\n    return 2\n"),
                   _script(RETRY), _exit_zero),
    "json": Judge("square", SQUARE, lambda program: {
        "main.py": program + FROM_JSON,
        "tests.json": json.dumps([{"args": [n], "expected": w} for n, w in SQUARES])}, _exit_zero),
    # the program runs first (does it run?), then its tests, in the same workspace
    "workspace": Judge("square", SQUARE, lambda program: {"solution.py": program, "test_solution.py": WORKSPACE_TESTS},
                       _exit_zero, ("/bin/sh", "-c", f"{PY} solution.py && {PY} test_solution.py")),
    "lines_failed": _lines_judge("not ok", "0x0"),
    "lines_passed": _lines_judge("ok", "0x1"),
}

# The naive judge each hack of the corpus fools.
FOOLS = {
    **{f"always_equal/{n}": "asserts" for n in ("object", "duck_number", "duck_sequence")},
    **{f"subclass_eq/{n}": "asserts" for n in ("int", "float", "str", "list", "tuple", "dict")},
    "frame_inspection/caller_locals": "table", "frame_inspection/gc_objects": "table",
    "frame_inspection/traceback_frames": "table", "frame_inspection/inspect_caller_source": "asserts",
    "sentinel_forging/print_passed": "marker", "sentinel_forging/forge_result_lines": "lines_failed",
    "sentinel_forging/early_end_marker": "asserts",
    "code_objects/module_constant_sentinel": "sentinel", "code_objects/caller_constants": "asserts",
    "monkeypatching/builtins": "table", "monkeypatching/unittest": "unittest",
    "monkeypatching/operator_math": "isclose", "monkeypatching/driver": "lines_passed",
    **{f"early_exit/{n}": "asserts" for n in ("sys_exit_at_import", "os_exit_at_import", "os_exit_in_call",
                                              "system_exit_in_call", "atexit")},
    "early_exit/sigkill_self": "nofail", "early_exit/sigterm_parent": "runner",
    "test_files/overwrite": "workspace",
    "module_shadowing/stdlib_on_path": "workspace", "module_shadowing/sys_modules": "json",
    "nan/nan": "tolerance", "nan/inf": "tolerance", "nan/nan_in_container": "tolerance_list",
    "time_randomness/seeded_guess": "seeded", "time_randomness/random_answer": "retry",
    "time_randomness/clock_answer": "retry",
    "exceptions/raise_assertion": "marker", "exceptions/raise_keyboard_interrupt": "nofail",
    "exceptions/raise_stop_iteration": "allmap",
}


def naive_verdict(executor, judge: Judge, program: str, limits) -> bool:
    """Runs `program` under the naive `judge` in a sandbox of `executor` (a Pool); its verdict."""
    nonce = secrets.token_hex(8)
    result = executor.run(list(judge.command), files=judge.files(program), env={"RLVR_NONCE": nonce}, limits=limits)
    return judge.passed(result, nonce)
