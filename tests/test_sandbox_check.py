"""Check-style tests judged on the host (rlvr.sandbox.CheckTest): the test code runs in its own host process
against the candidate's answers as plain data (sandbox/harness.py), the values cross the boundary as typed
JSON (sandbox/wire.py). Reward-hack programs are in test_code_hacks.py; here: the semantics (tolerances,
computed arguments, random cases, typed exceptions, exact types, rounds) and the failure modes."""

import math

import pytest
from rlvr.sandbox import CheckTest, Limits, Pool, checks, verify_program
from rlvr.sandbox import harness as harness_module
from rlvr.sandbox.wire import WireError, decode, encode

pytestmark = pytest.mark.sandbox

LIMITS = Limits(wall_s=5.0, cpu_s=5)


@pytest.fixture(scope="module")
def pool():
    with Pool(2, LIMITS, trace_path=False) as p:
        yield p


def check(pool, program: str, tests: str, entry_point: str = "f", prelude: str = "", **kwargs):
    return verify_program(program, CheckTest(tests, prelude), LIMITS, entry_point=entry_point, pool=pool, **kwargs)


def test_wire_keeps_types_exactly():
    values = [None, True, 0, -(2 ** 200), 1.5, -0.0, math.inf, "é\udc80", b"\x00\xff", 1 + 2j, [1, (2, [3])],
              {1: "a", (1, 2): {3.0}}, {frozenset({1})}, ()]
    for value in values:
        back = decode(encode(value))
        assert back == value and type(back) is type(value) and repr(back) == repr(value)
    assert math.isnan(decode(encode(math.nan)))
    assert type(decode(encode(True))) is bool and type(decode(encode(1))) is int  # never confused

    class Liar(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    assert encode(Liar(7)) == encode(7)  # a subclass arrives as the plain value it holds
    with pytest.raises(WireError, match="unsupported"):
        encode(object())
    nested: list = []
    nested.append(nested)
    with pytest.raises(WireError, match="deep"):
        encode(nested)
    for bad in (5, 1.5, ["i", 5], ["x", []], ["s", [["l", []]]], ["d", [[["l", []], None]]], ["l"]):
        with pytest.raises(WireError):
            decode(bad)


def test_tolerance_computed_arguments_and_random_cases(pool):
    tests = ("import random\n"
             "def check(candidate):\n"
             "    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
             "    for _ in range(50):\n"
             "        x = random.randint(0, 1000) + 0.25\n"
             "        assert abs(candidate(x) - 0.25) < 1e-6\n")
    good = check(pool, "def f(x):\n    return x - int(x)\n", tests)
    assert good.passed and good.info == {"rounds": 1, "calls": 51, "mutated": 0}, good.reason
    assert not check(pool, "def f(x):\n    return round(x - int(x), 2) + 1e-3\n", tests).passed


def test_exceptions_cross_as_builtin_types(pool):
    tests = ("def check(candidate):\n"
             "    try:\n        candidate(-1)\n        assert False, 'no error'\n"
             "    except ValueError:\n        pass\n"
             "    assert candidate(4) == 2\n")
    subclass = ("class Negative(ValueError):\n    pass\n"
                "def f(x):\n    if x < 0:\n        raise Negative(x)\n    return 2\n")
    assert check(pool, subclass, tests).passed  # a ValueError subclass is caught as a ValueError
    wrong_type = check(pool, "def f(x):\n    if x < 0:\n        raise TypeError\n    return 2\n", tests)
    assert not wrong_type.passed and "TypeError" in wrong_type.reason
    assert not check(pool, "def f(x):\n    return 2\n", tests).passed


def test_exact_types_and_dependent_calls(pool):
    tests = "def check(candidate):\n    assert candidate(candidate(1)) == (1, 1, 1, 1)\n"
    good = check(pool, "def f(x):\n    return (x, x) if type(x) is int else x + x\n", tests)
    assert good.passed and good.info["rounds"] == 2  # the second call's argument is the first call's answer
    assert not check(pool, "def f(x):\n    return [x, x] if type(x) is int else x + x\n", tests).passed  # a list
    bool_test = "def check(candidate):\n    assert candidate(0) is False\n    assert candidate(1) == 1\n"
    assert check(pool, "def f(x):\n    return bool(x)\n", bool_test).passed  # dataset semantics: True == 1
    assert not check(pool, "def f(x):\n    return 0 * x\n", bool_test).passed  # 0 is not False


def test_prelude_helpers_and_in_place_mutation(pool):
    prelude = "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n\ndef f(xs):\n    '''a root'''\n"
    tests = ("def check(candidate):\n"
             "    for xs in ([-2, 1], [6, -5, 1], [-1, 0, 1]):\n"
             "        assert abs(poly(xs, candidate(list(xs)))) < 1e-9\n")
    solver = "def f(xs):\n    xs.reverse()\n    return next(x for x in range(-10, 10) if sum(c * x ** i for i, c in " \
             "enumerate(reversed(xs))) == 0)\n"
    v = check(pool, solver, tests, prelude=prelude)
    assert v.passed and v.info["mutated"] == 3  # the sandbox's copies changed; the test's objects did not


def test_failures_fail_closed(pool, monkeypatch):
    assert check(pool, "def f(x):\n    return x\n", "def check(candidate):\n    pass\n").reason.startswith("no_calls")
    broken = check(pool, "def f(x):\n    return x\n", "def check(candidate):\n    assert candidate(1) == missing\n")
    assert not broken.passed and "NameError" in broken.reason
    slow = check(pool, "def f(x):\n    while True:\n        pass\n", "def check(candidate):\n    candidate(1)\n",
                 call_timeout_s=0.5)
    assert not slow.passed and slow.reason == "error:timeout"
    load = check(pool, "raise RuntimeError\n", "def check(candidate):\n    assert candidate(1) == 1\n")
    assert load.reason == "load_error:RuntimeError"
    monkeypatch.setattr(checks, "HARNESS_STEP_S", 1.0)
    hung = check(pool, "def f(x):\n    return x\n", "def check(candidate):\n    while True:\n        pass\n")
    assert not hung.passed and hung.reason.startswith("harness_timeout")


def test_probing_never_decides():
    """In-process harness with a scripted sandbox: an attempt that probed is always followed by a round and a
    replay of that round's answers; a candidate whose answers drift from round to round never settles, and
    never passes (the coordinator's round limit ends it: here the script stops at round 6)."""
    rounds = []

    def run(calls, answer):
        rounds.append(len(calls))
        if len(rounds) > 5:
            raise RuntimeError("round 6")
        return {"results": [{"value": encode(answer(decode(c["args"])[0], len(rounds)))} for c in calls]}

    tests = "def check(candidate):\n    assert candidate(candidate(1)) == 4\n"
    setup = {"code": {"prelude": harness_module.probing_asserts("", "p"), "tests": harness_module.probing_asserts(
        tests, "t")}, "entry_point": "f", "seed": 3, "max_calls": 100, "probe_s": 1.0}
    sent = []
    found = harness_module.judge(setup, sent.append, lambda: run(sent[-1]["run"], lambda x, r: 2 * x))
    assert found["passed"] and rounds == [1, 2]
    rounds.clear()
    with pytest.raises(RuntimeError, match="round 6"):
        harness_module.judge(setup, sent.append, lambda: run(sent[-1]["run"], lambda x, r: 2 * x + r))


def test_every_ast_parse_goes_through_the_conversion_lock():
    """CPython 3.11 fails `ast.parse` run on two threads at once now and then ("AST constructor recursion depth
    mismatch": it broke the 164-problem HumanEval check in CI); graders parse from thread pools, so every
    conversion takes sandbox/pyast.py's lock: no `ast.parse` elsewhere, and a parse waits while it is held."""
    import ast
    import pathlib
    import threading

    from rlvr.sandbox import pyast

    root = pathlib.Path(__file__).resolve().parent.parent
    direct = []
    for path in [*root.glob("rlvr/**/*.py"), *root.glob("sandbox/*.py"), *root.glob("launch/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "parse"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ast"
                    and path.name != "pyast.py"):
                direct.append(f"{path.relative_to(root)}:{node.lineno}")
    assert direct == []

    parsed = threading.Event()
    with pyast._CONVERSION:
        worker = threading.Thread(target=lambda: (pyast.parse("x = 1"), parsed.set()))
        worker.start()
        assert not parsed.wait(0.2)  # blocked behind the held lock
    worker.join(5)
    assert parsed.is_set()
    code = pyast.compile_tree(ast.fix_missing_locations(pyast.parse("y = 6 * 7")), "<t>")
    namespace = {}
    exec(code, namespace)
    assert namespace["y"] == 42
