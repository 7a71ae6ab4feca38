"""verify_program: correct programs pass, wrong ones fail, and the host-side judging fails closed.

The reward-hack programs (print PASSED, early exit, monkeypatching, always-equal objects, …) are in
test_sandbox_adversarial.py; here: the protocol itself, with hand-made sandbox outputs where possible."""

import json

import pytest
from rlvr.sandbox import CallTest, Limits, Result, StdioTest, verify_program
from rlvr.sandbox.verdict import judge, parse_results, same_value
from rlvr.sandbox.wire import encode

pytestmark = pytest.mark.sandbox


LIMITS = Limits(wall_s=5.0, cpu_s=5)
ADD = [CallTest((2, 3), 5), CallTest((10, -4), 6), CallTest((0, 0), 0)]


def _result(stdout: bytes, exit_code: int = 0, limit_hit: str | None = None) -> Result:
    return Result("runsc", exit_code, None, stdout, b"", limit_hit=limit_hit)


def _value(v) -> dict:
    return {"value": encode(v)}


def _lines(nonce: str, *entries: dict) -> bytes:
    return "".join(f"{nonce} {json.dumps(e)}\n" for e in entries).encode()


def test_correct_function_passes_and_wrong_fails():
    good = verify_program("def add(a, b):\n    print('noise')\n    return a + b\n", ADD, LIMITS, entry_point="add")
    assert good.passed and good.n_passed == 3 and good.reason == "passed"
    wrong = verify_program("def add(a, b):\n    return a - b\n", ADD, LIMITS, entry_point="add")
    assert not wrong.passed and wrong.n_passed == 1 and wrong.outcomes[0] == "wrong_output"


def test_stdio_tests():
    tests = [StdioTest("3 4\n", "7\n"), StdioTest("1 1\n", "2")]
    assert verify_program("a, b = map(int, input().split())\nprint(a + b)", tests, LIMITS).passed
    assert not verify_program("print(7)", tests, LIMITS).passed


def test_exceptions_and_structured_values():
    tests = [CallTest(([3, 1, 2],), [1, 2, 3]), CallTest(([],), []), CallTest((None,), {"k": 1.5})]
    src = ("def f(x):\n"
           "    if x is None:\n        return {'k': 1.5 + 1e-12}\n"
           "    if not x:\n        raise ValueError('empty')\n"
           "    return sorted(x)\n")
    v = verify_program(src, tests, LIMITS, entry_point="f")
    assert v.outcomes == ["pass", "error:ValueError", "pass"]


def test_missing_entry_point_is_a_load_error():
    v = verify_program("def other(): pass", ADD, LIMITS, entry_point="add")
    assert not v.passed and v.reason == "load_error:AttributeError"


def test_same_value_is_type_strict():
    assert same_value(1, 1) and not same_value(True, 1) and not same_value(1.0, 1) and not same_value("1", 1)
    assert same_value([1, [2.0]], [1, [2.0 + 1e-15]]) and not same_value([1], [1, 2])
    assert not same_value({"a": 1}, {"a": 1, "b": 2}) and not same_value(None, 0)


def test_judge_fails_closed():
    n = "ab" * 16
    tests = [CallTest((1,), 1), CallTest((2,), 2)]
    ok = _lines(n, {"i": 0, **_value(1)}, {"i": 1, **_value(2)}, {"end": True})
    assert judge(_result(ok), n, tests).passed
    assert judge(_result(ok, exit_code=1), n, tests).passed  # exit codes play no part: the result lines do
    assert judge(_result(ok, limit_hit="wall_time"), n, tests).reason == "wall_time"
    assert judge(_result(ok), "cd" * 16, tests).reason == "missing_results"  # wrong nonce: no result lines
    no_end = _lines(n, {"i": 0, **_value(1)}, {"i": 1, **_value(2)})
    assert judge(_result(no_end), n, tests).reason == "missing_results"
    dup = _lines(n, {"i": 0, **_value(1)}, {"i": 0, **_value(1)}, {"i": 1, **_value(2)}, {"end": True})
    assert judge(_result(dup), n, tests).reason == "duplicate_or_bad_result"
    after_end = ok + _lines(n, {"i": 1, **_value(2)})
    assert judge(_result(after_end), n, tests).reason == "malformed_result"
    assert parse_results(f"{n} {{not json\n".encode(), n, 2)[1] == "malformed_result"
    assert judge(_result(b"PASSED\nOK\n"), n, tests).reason == "missing_results"
    raw = _lines(n, {"i": 0, "value": 1}, {"i": 1, **_value(2)}, {"end": True})  # an untyped JSON number
    assert judge(_result(raw), n, tests).outcomes == ["wrong_output", "pass"]
    typed = _lines(n, {"i": 0, **_value(True)}, {"i": 1, **_value((2,))}, {"end": True})
    assert judge(_result(typed), n, [CallTest((1,), 1), CallTest((2,), [2])]).outcomes == ["wrong_output", "pass"]


def test_expected_values_never_enter_the_sandbox():
    """The program dumps everything it can read under /harness, /workspace, its environment and argv."""
    secret = "EXPECTED-7f3a91"
    src = ("import os, sys\n"
           "seen = [repr(os.environ), repr(sys.argv), open('/proc/self/cmdline', 'rb').read().decode()]\n"
           "for top in ('/harness', '/workspace', '/tmp'):\n"
           "    for d, _, names in os.walk(top):\n"
           "        for name in names:\n"
           "            seen.append(open(os.path.join(d, name), errors='replace').read())\n"
           "BLOB = '\\n'.join(seen)\n"
           "def f(x):\n    return BLOB\n")
    v = verify_program(src, [CallTest((1,), secret)], LIMITS, entry_point="f")
    assert not v.passed
    blob = json.loads(v.result.stdout.decode().split(" ", 1)[1].splitlines()[0])["value"]
    assert "RESULT = os.fdopen" in blob  # it did read the driver and its input file ...
    assert "0x1" in blob and secret not in blob  # ... the inputs (the argument 1, in wire form), not the expected value


def test_calls_from_humaneval_asserts():
    from rlvr.sandbox.verdict import calls_from_asserts
    check = ("METADATA = {}\n\ndef check(candidate):\n"
             "    assert candidate([1, 2], t=3) == [3, 4]\n    assert candidate([]) == []\n"
             "    assert add([0], t=0) == [0]\n")
    assert calls_from_asserts(check, "add") == [CallTest(([1, 2],), [3, 4], {"t": 3}), CallTest(([],), []),
                                                CallTest(([0],), [0], {"t": 0})]
    assert calls_from_asserts("def check(c):\n    assert abs(c(1) - 2.0) < 1e-6\n", "f") is None
    assert calls_from_asserts("def check(candidate):\n    assert candidate(x) == 1\n", "f") is None
    assert calls_from_asserts("assert f({1, 2}) == 3\n", "f") is None  # a set is no JSON value
    assert calls_from_asserts("x = 1\n", "f") is None and calls_from_asserts("def (:", "f") is None
