"""Verifiers: hand-checked true and false cases for every kind, the math verifier's timeouts (per pair
and the pool backstop, after which the pool keeps working), the code verifier on both executor
backends (gVisor runsc and the plain process), and tool-state replay."""

import json
import shutil
import time
import warnings

import pytest

from rlvr.tasks import verifiers
from rlvr.tasks.verifiers import VerifierTimeout, run_verifier


def test_unknown_kind_names_the_known_ones():
    with pytest.raises(ValueError, match=r"'nope'.*'choice'.*'tool_state'"):
        run_verifier({"kind": "nope"}, "x")


# ----------------------------------------------------------------------------------------- exact, regex, choice


@pytest.mark.parametrize("spec, answer, score", [
    ({"answer": "hello world"}, "hello world", 1.0),
    ({"answer": "hello world"}, "  hello \n  world ", 1.0),
    ({"answer": "hello world"}, "helloworld", 0.0),
    ({"answer": "Hello"}, "hello", 0.0),
    ({"answer": "Hello", "case_sensitive": False}, "hELLO", 1.0),
    ({"answer": "42"}, "42, 0", 0.0),
    ({"answer": "42"}, "", 0.0),
])
def test_exact(spec, answer, score):
    assert run_verifier({"kind": "exact", **spec}, answer) == score


@pytest.mark.parametrize("answer, score", [("1, 2, 3", 1.0), ("[1,2,3]", 1.0), ("1, 2, 3, 0", 0.0),
                                           ("1, 2, 30", 0.0), ("x 1, 2, 3", 0.0)])
def test_regex_fullmatch(answer, score):
    pattern = r"\[?\s*1\s*,\s*2\s*,\s*3\s*\]?"
    assert run_verifier({"kind": "regex", "pattern": pattern}, answer) == score


@pytest.mark.parametrize("answer, score", [("B", 1.0), ("(B)", 1.0), ("B.", 1.0), (" b ", 1.0), ("C", 0.0),
                                           ("E", 0.0), ("A or B", 0.0), ("B, C", 0.0), ("", 0.0), ("zzz", 0.0)])
def test_choice(answer, score):
    spec = {"kind": "choice", "answer": "B", "options": ["A", "B", "C", "D"]}
    assert run_verifier(spec, answer) == score


# ----------------------------------------------------------------------------------------- numeric


@pytest.mark.parametrize("want, answer, score", [
    ("1234", "1,234", 1.0), ("1234", "1234.0", 1.0), (0.75, "3/4", 1.0), ("3/4", "0.75", 1.0),
    ("-2", "-2", 1.0), ("1000", "1e3", 1.0), ("0.1", "0.1000000001", 1.0),
    (12345678901234567890, "12345678901234567890", 1.0),
    ("12345678901234567890", "12345678901234567891", 0.0),  # an integer reference compares exactly
    ("12345.5", "12345.51", 1.0),  # a non-integer reference: rel_tol 1e-6 by default
    ("5", "6", 0.0), ("5", "5, 0", 0.0), ("5", "five", 0.0), ("5", "", 0.0), ("5", "1/0", 0.0),
    ("1234", "1,23,4", 0.0), ("0.5", "0.51", 0.0),
])
def test_numeric(want, answer, score):
    assert run_verifier({"kind": "numeric", "answer": want}, answer) == score


def test_numeric_integer_references_compare_exactly():
    """rel_tol 1e-6 is for non-integer references: on an integer of 1e6 or more (ArithExpr level 3,
    ASDiv) it accepted off-by-one answers, up to ±27 at 2.7e7. An explicit tolerance still applies."""
    for want in ("1000000", "27000000", 27000000, "-27000000"):
        wrong = [str(int(want) + d) for d in (1, -1, 27)]
        assert [run_verifier({"kind": "numeric", "answer": want}, w) for w in wrong] == [0.0, 0.0, 0.0]
        assert run_verifier({"kind": "numeric", "answer": want}, f"{int(want):,}") == 1.0
    assert run_verifier({"kind": "numeric", "answer": "27000000", "rel_tol": 1e-6}, "27000027") == 1.0


def test_numeric_tolerances_and_bad_reference():
    assert run_verifier({"kind": "numeric", "answer": "100", "rel_tol": 0.01}, "100.9") == 1.0
    assert run_verifier({"kind": "numeric", "answer": "100", "rel_tol": 0, "abs_tol": 0}, "100.0001") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        run_verifier({"kind": "numeric", "answer": "n/a"}, "1")


# ----------------------------------------------------------------------------------------- math


@pytest.mark.parametrize("gold, answer, score", [
    ("1/2", "0.5", 1.0), ("1/2", "\\frac{1}{2}", 1.0), ("\\frac{1}{2}", "1/2", 1.0), ("$\\frac{1}{2}$", "0.5", 1.0),
    ("5", "x=5", 1.0), ("5", "x = 5", 1.0), ("x^2+2x+1", "(x+1)^2", 1.0), ("2", "\\boxed{2}", 1.0),
    ("1234", "1,234", 1.0), ("7/12", "14/24", 1.0),
    ("1/2", "0.6", 0.0), ("5", "6", 0.0), ("5", "5, 0", 0.0), ("5", "zzz", 0.0), ("5", "", 0.0),
    ("x^2+2x+1", "(x-1)^2", 0.0),
])
def test_math(gold, answer, score):
    assert run_verifier({"kind": "math", "answer": gold}, answer) == score


def test_math_equal_many_one_round_trip():
    pairs = [("1/2", "0.5"), ("3", "4"), ("x+1", "1+x")]
    assert verifiers.math_equal_many(pairs) == [1.0, 0.0, 1.0]
    assert verifiers.math_equal_many([]) == []


SLOW = ("(x+y+z+1)^{30}", "(x+y+z)^{30}")  # sympy needs ~10 s to tell these apart


def test_math_timeout_raises_and_the_pool_keeps_working():
    start = time.perf_counter()
    with pytest.raises(VerifierTimeout, match="took over 0.3 s"):
        run_verifier({"kind": "math", "answer": SLOW[0], "timeout_s": 0.3}, SLOW[1])
    assert time.perf_counter() - start < 5
    assert run_verifier({"kind": "math", "answer": "1/2"}, "0.5") == 1.0
    # with timeout_score, a slow pair costs only itself
    assert verifiers.math_equal_many([("1", "1"), SLOW, ("2", "3")], 0.3, timeout_score=0.0) == [1.0, 0.0, 0.0]


def test_math_pool_backstop_replaces_a_stuck_worker():
    pool = verifiers._get_pool()
    start = time.perf_counter()
    with pytest.raises(VerifierTimeout, match="pool was replaced"):
        verifiers._pool_call(time.sleep, (60,), 0.5)  # a worker stuck beyond its own timer
    assert time.perf_counter() - start < 5
    assert verifiers._POOL is not pool
    assert run_verifier({"kind": "math", "answer": "x+1"}, "1+x") == 1.0
    assert isinstance(VerifierTimeout("x"), TimeoutError)


# ----------------------------------------------------------------------------------------- json_schema

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "admin": {"type": "boolean"}}}


@pytest.mark.parametrize("answer, score", [
    ('{"name": "Ada", "age": 36}', 1.0),
    ('```json\n{"name": "Ada", "age": 36, "admin": true}\n```', 1.0),
    ('{"name": "Ada", "age": 200}', 0.0),  # out of range
    ('{"name": "Ada"}', 0.0),  # required key missing
    ('{"name": "Ada", "age": 36, "x": 1}', 0.0),  # extra key
    ('{"name": "Bob", "age": 36}', 0.0),  # valid, but not the expected name
    ('{"name": "Ada", "age": 36.5}', 0.0),
    ("{'name': 'Ada', 'age': 36}", 0.0),  # not JSON
    ("", 0.0), ("zzz", 0.0),
])
def test_json_schema(answer, score):
    spec = {"kind": "json_schema", "schema": SCHEMA, "expected": {"name": "Ada"}}
    assert run_verifier(spec, answer) == score


def test_json_schema_expected_tells_booleans_from_numbers():
    spec = {"kind": "json_schema", "schema": {"type": "object"}, "expected": {"flag": True, "n": 1}}
    assert run_verifier(spec, '{"flag": true, "n": 1}') == 1.0
    assert run_verifier(spec, '{"flag": 1, "n": 1}') == 0.0
    assert run_verifier(spec, '{"flag": true, "n": true}') == 0.0
    assert run_verifier({"kind": "json_schema", "schema": {"type": "array"}}, "[1, 2]") == 1.0


# ----------------------------------------------------------------------------------------- code

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
CHECK_TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n"
GOOD = "def add(a, b):\n    return a + b\n"


@pytest.fixture(params=["process", "runsc"])
def backend(request, monkeypatch):
    """Run the test on each executor backend; runsc must be installed (it is in CI): no skip."""
    if request.param == "runsc" and shutil.which("runsc") is None:
        pytest.fail("runsc (gVisor) is not installed: apt-get install -y runsc (the code verifier's default sandbox)")
    monkeypatch.setenv("RLVR_CODE_EXECUTOR", request.param)
    warnings.filterwarnings("ignore", "sandbox backend 'process' is for development only", RuntimeWarning)
    return request.param


def code(answer, tests=ADD_TESTS, entry_point="add", timeout_s=10, **spec):
    return run_verifier({"kind": "code", "tests": tests, "entry_point": entry_point, "timeout_s": timeout_s,
                         **spec}, answer)


def test_code_correct_and_wrong(backend):
    assert code(GOOD) == 1.0
    assert code(f"```python\n{GOOD}```") == 1.0
    assert code(f"Here you go:\n```\n{GOOD}```\nDone.") == 1.0
    assert code("def add(a, b):\n    return a - b\n") == 0.0
    assert code("def add(a, b) return a + b") == 0.0  # syntax error
    assert code("") == 0.0


def test_code_check_entry_point_convention(backend):
    assert code(GOOD, CHECK_TESTS) == 1.0
    assert code("def add(a, b):\n    return a * b\n", CHECK_TESTS) == 0.0


def test_code_prelude_is_the_tests_trusted_context(backend):
    """Helpers the tests use come from the trusted prelude (HumanEval's prompt), never from the candidate:
    a program that redefines the helper to make a wrong answer pass still fails."""
    prelude = "def scale(x):\n    return 10 * x\n\ndef add(a, b):\n    \"\"\"a + b\"\"\"\n"
    tests = "def check(candidate):\n    assert scale(candidate(2, 3)) == 50\n"
    assert code(GOOD, tests, prelude=prelude) == 1.0
    assert code("def scale(x):\n    return 50\n\ndef add(a, b):\n    return 0\n", tests, prelude=prelude) == 0.0


def test_code_spec_errors_name_the_field():
    with pytest.raises(ValueError, match="entry_point"):
        run_verifier({"kind": "code", "tests": ADD_TESTS}, GOOD)
    with pytest.raises(ValueError, match="'calls'.*'tests'"):
        run_verifier({"kind": "code", "entry_point": "add"}, GOOD)


@pytest.mark.parametrize("cheat", [
    "import sys\nsys.exit(0)\n",
    "import os\nos._exit(0)\n",
    "raise SystemExit(0)\n",
    "print('OK')\nprint('PASSED')\nprint(1)\nimport os\nos._exit(0)\n",  # guessing a success marker
    "import atexit, os\natexit.register(lambda: os._exit(0))\n",  # exit 0 after the failing tests
])
def test_code_early_exit_does_not_pass(backend, cheat):
    assert code(cheat + "\ndef add(a, b):\n    return 0\n") == 0.0


def test_code_infinite_loop_scores_zero(backend):
    """A candidate that runs out of time is a wrong answer (0), not a verifier failure (no raise)."""
    start = time.perf_counter()
    assert code("while True:\n    pass\n", timeout_s=1) == 0.0
    assert code("def add(a, b):\n    while True:\n        pass\n", timeout_s=1) == 0.0
    assert time.perf_counter() - start < 10


def test_code_timeout_with_little_cpu_used_is_an_infrastructure_failure(backend):
    """A program stopped by its time limit having used almost no CPU (it sleeps, as a correct program on a
    loaded host waits for a core) is run once more, then raises SandboxStalled: the producer records it as
    a failure and does not train on it (it scored 0). A busy loop past the limit still scores 0."""
    from rlvr.sandbox import SandboxStalled

    start = time.perf_counter()
    with pytest.raises(SandboxStalled, match=r"time limit \(wall_time\) twice, having used 0\.\d\d s of CPU in"):
        code("import time\ntime.sleep(30)\n" + GOOD, timeout_s=4)  # stalled while loading: the run's wall clock
    assert time.perf_counter() - start >= 8  # two runs of 4 s
    with pytest.raises(SandboxStalled, match="twice"):  # in a call: runsc's per-call timer, else the wall clock
        code("def add(a, b):\n    import time\n    time.sleep(30)\n", CHECK_TESTS, timeout_s=4)
    for tests in (ADD_TESTS, CHECK_TESTS):
        assert code("def add(a, b):\n    while True:\n        pass\n", tests, timeout_s=2) == 0.0


class _TimedOut:
    """An Executor whose every run hits the wall clock after 2 s, having used `cpu_s` seconds of CPU."""

    def __init__(self, cpu_s):
        self.cpu_s, self.runs = cpu_s, 0

    def run(self, command=None, *, python=None, files=None, stdin=b"", env=None, limits=None, tag=None):
        from rlvr.sandbox import WALL_TIME, Result, Timings

        self.runs += 1
        return Result("fake", None, 9, b"", b"", limit_hit=WALL_TIME, timings=Timings(run_s=2.0), cpu_s=self.cpu_s)

    def close(self):
        pass


@pytest.mark.parametrize("cpu_s, stalls", [(0.05, True), (0.3, False), (None, False)])
def test_verdict_of_a_run_stopped_with_little_cpu_is_retried_once_then_raises(cpu_s, stalls):
    """Under 10% of a core over the 2 s run (0.05 s of CPU): run twice, then SandboxStalled; 0.3 s (busy
    enough) or CPU not measured (the bwrap backend): a wall_time verdict after one run, as before."""
    from rlvr.sandbox import CallTest, CheckTest, Limits, SandboxStalled, verify_program

    for tests in ([CallTest((2, 3), 5)], CheckTest(CHECK_TESTS)):
        executor = _TimedOut(cpu_s)
        judge = lambda tests=tests, executor=executor: verify_program(GOOD, tests, Limits(wall_s=2.0),
                                                                      entry_point="add", pool=executor)
        if stalls:
            with pytest.raises(SandboxStalled, match=r"\(wall_time\) twice, having used 0\.05 s of CPU in 2\.0 s"):
                judge()
            assert executor.runs == 2
        else:
            verdict = judge()
            assert not verdict.passed and verdict.reason == "wall_time" and executor.runs == 1

def test_executor_selection(monkeypatch):
    monkeypatch.setenv("RLVR_CODE_EXECUTOR", "process")
    assert verifiers.executor_backend() == "process"
    monkeypatch.setenv("RLVR_CODE_EXECUTOR", "docker")
    with pytest.raises(ValueError, match="choose one of"):
        verifiers.executor_backend()
    monkeypatch.delenv("RLVR_CODE_EXECUTOR")
    assert verifiers.executor_backend() == "runsc"  # the default; never a silent fall back to weaker ones


def test_process_backend_warns_once(monkeypatch):
    import rlvr.sandbox.api as sandbox_api

    monkeypatch.setenv("RLVR_CODE_EXECUTOR", "process")
    sandbox_api._warned.discard("process")
    with pytest.warns(RuntimeWarning, match="development only"):
        assert code(GOOD) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert code(GOOD) == 1.0


# ----------------------------------------------------------------------------------------- tool_state

BANK = {"alice": 50, "bob": 10}


def call(tool, **arguments):
    return f"<tool_call>{json.dumps({'name': tool, 'arguments': arguments})}</tool_call>"


def bank(answer, target):
    return run_verifier({"kind": "tool_state", "tools": "bank", "initial": BANK, "target": target}, answer)


def test_tool_state_bank():
    target = {"alice": 0, "bob": 20, "carol": 40}
    good = [call("open_account", name="carol"), call("transfer", source="alice", target="carol", amount=40),
            call("deposit", account="bob", amount=10), call("withdraw", account="alice", amount=10)]
    assert bank("\n".join(good), target) == 1.0
    as_list = json.dumps([{"name": "open_account", "arguments": {"name": "carol"}},
                          {"name": "transfer", "arguments": {"source": "alice", "target": "carol", "amount": 40}},
                          {"name": "deposit", "arguments": {"account": "bob", "amount": 10.0}},
                          {"name": "withdraw", "arguments": json.dumps({"account": "alice", "amount": 10})}])
    assert bank(as_list, target) == 1.0
    assert BANK == {"alice": 50, "bob": 10}  # the initial state is not mutated
    assert bank("\n".join(good[:3]), target) == 0.0  # stops short of the target
    assert bank("\n".join(good) + "\n" + call("deposit", account="bob", amount=1), target) == 0.0


def test_tool_state_wrong_order_overdraft():
    # bob has 10: withdrawing 20 before receiving 15 overdraws, though the end state would match
    target = {"alice": 35, "bob": 5}
    ordered = [call("transfer", source="alice", target="bob", amount=15), call("withdraw", account="bob", amount=20)]
    assert bank("".join(ordered), target) == 1.0
    assert bank("".join(reversed(ordered)), target) == 0.0


@pytest.mark.parametrize("answer", [
    "", "zzz", "<tool_call>{not json}</tool_call>", "<tool_call>[1, 2]</tool_call>",
    call("deposit", account="bob", amount=10) + " and done",  # text outside the calls
    call("steal", account="bob"),  # unknown tool
    call("deposit", account="bob"),  # missing argument
    call("deposit", account="bob", amount=10, memo="x"),  # unexpected argument
    call("deposit", account="zed", amount=10),  # unknown account
    call("deposit", account="bob", amount=-5), call("deposit", account="bob", amount="10"),
    call("deposit", account="bob", amount=True), call("deposit", account=["bob"], amount=10),
    call("open_account", name="bob"),  # exists
    call("transfer", source="bob", target="bob", amount=1),
    '<tool_call>{"name": "deposit", "arguments": {"account": "bob", "amount": 10}, "x": 1}</tool_call>',
    '{"name": "deposit"}', "[1]", "null",
])
def test_tool_state_malformed_scores_zero(answer):
    assert bank(answer, {"alice": 50, "bob": 20}) == 0.0


def test_tool_state_files():
    initial, target = {"a.txt": "hi"}, {"b.txt": "hi there", "c.md": "new"}
    answer = "".join([call("append", path="a.txt", content=" there"), call("rename", source="a.txt", target="b.txt"),
                      call("write", path="c.md", content="old"), call("write", path="c.md", content="new")])
    spec = {"kind": "tool_state", "tools": "files", "initial": initial, "target": target}
    assert run_verifier(spec, answer) == 1.0
    assert run_verifier(spec, call("append", path="c.md", content="x")) == 0.0  # append needs an existing file
    assert run_verifier(spec, call("delete", path="zzz")) == 0.0
    assert run_verifier({**spec, "target": {}}, call("delete", path="a.txt")) == 1.0
    with pytest.raises(ValueError, match="unknown tool set"):
        run_verifier({**spec, "tools": "nope"}, answer)
