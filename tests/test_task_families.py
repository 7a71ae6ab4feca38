"""Every registered task family self-checks, and the verifier audit catches planted bugs.

For each family in `rlvr.tasks.registry.FAMILIES`, at its first and last level: tasks are
deterministic in (seed, stream, index, level) and JSON round-trip, the reference completion scores
correct with full reward, and junk ("", "zzz", "<answer>zzz</answer>") is not correct. The audit
(`rlvr.tasks.audit`) must flag a verifier that accepts anything, one that `eval`s the answer,
reasoning-gym's unfixed game_of_life_halting verifier, and a family that hangs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from rlvr.tasks import audit
from rlvr.tasks import reasoning_gym as rg
from rlvr.tasks.base import HELD_OUT, TRAIN, Family, Task, extract_answer
from rlvr.tasks.procedural import CodeFunction
from rlvr.tasks.registry import FAMILIES
from rlvr.tasks.verifiers import strip_fences

# Families whose reference_completion may be None, and why (any family returning None must be here).
NO_REFERENCE: dict[str, str] = {}
# Families that generate slowly (> ~100 ms a task at some level): one task per level instead of three.
SLOW = {f"rg/{name}" for name in ("zebra_puzzles", "polynomial_multiplication", "futoshiki", "game_of_life", "bf",
                                  "n_queens", "knight_swap", "acre", "arc_agi", "puzzle24", "rush_hour", "sokoban",
                                  "word_ladder", "countdown", "intermediate_integration", "jugs", "rubiks_cube")} | {
    "cad_openscad", "cad_openscad_tools",  # each score runs OpenSCAD in a fresh gVisor sandbox
    "chart_bars", "chart_bars_labelled"}  # each task renders a matplotlib chart
JUNK = ("", "zzz", "<answer>zzz</answer>")


@functools.cache
def family(name: str) -> Family:
    """One instance per family for the whole module (datasets and caches are built once)."""
    return FAMILIES[name](seed=0)


def end_levels(fam: Family) -> list[int]:
    levels = fam.levels()
    assert levels and levels == sorted(levels), f"levels() must be a non-empty sorted list, got {levels}"
    return sorted({levels[0], levels[-1]})


@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")  # code codeio generates
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_self_check(name):
    fam = family(name)
    assert fam.name == name
    for level in end_levels(fam):
        for index in range(1 if name in SLOW else 3):
            stream = HELD_OUT if index % 2 else TRAIN
            task = fam.task(index, stream, level)
            assert (task.family, task.index, task.stream, task.level) == (name, index, stream, level)
            assert Task.from_json(json.loads(json.dumps(task.to_json()))) == task
            if index == 0:  # the same task from a fresh instance (no shared state)
                assert FAMILIES[name](seed=0).task(index, stream, level) == task
            check_scores(name, fam, task)


def check_scores(name: str, fam: Family, task: Task) -> None:
    reference = fam.reference_completion(task)
    if reference is None:
        assert NO_REFERENCE.get(name), f"{name}: no reference completion; list it in NO_REFERENCE with a reason"
    else:
        scores = fam.score(task, reference, truncated=False)
        assert scores["correct"] == 1.0, f"{name} level {task.level}: reference {reference[:200]!r} -> {scores}"
        assert scores["reward"] == pytest.approx(audit.max_reward(fam))
    for junk in JUNK:
        assert fam.score(task, junk, truncated=False)["correct"] == 0.0, f"{name}: junk {junk!r} scored correct"


def test_reasoning_gym_table():
    assert rg.AVAILABLE, rg.IMPORT_ERROR
    assert len(rg.FAMILIES) >= 100
    for name, reason in rg.EXCLUDED.items():
        assert f"rg/{name}" not in FAMILIES and reason
    assert set(rg.FIXES) <= set(rg.DATASETS)
    gsm = family("rg/gsm_symbolic")
    assert gsm.domain == "rg/arithmetic" and gsm.levels() == [0]
    assert family("rg/basic_arithmetic").levels() == [0, 1, 2, 3, 4]


def test_reasoning_gym_missing_gives_empty_table():
    code = ("import sys; sys.modules['reasoning_gym'] = None\n"
            "import rlvr.tasks.reasoning_gym as r\n"
            "assert r.FAMILIES == {} and not r.AVAILABLE\n"
            "try:\n    r.require()\nexcept ImportError as e:\n    assert 'pip install -e .[data]' in str(e)\n"
            "else:\n    raise AssertionError('require() passed')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "entry['answer']", "x.__class__", "9**9**9", "(9**99)**99", "open('f')",
    "integrate(x**2, x)", "lambda: 1", "[1, 2]", "'24'",
])
def test_safe_expression_rejects(text):
    assert not rg.safe_expression(text, frozenset({"x", "C"}), frozenset({"sin", "exp"}))


def test_safe_expression_accepts_and_arithmetic():
    names, functions = frozenset({"x", "C"}), frozenset({"sin", "exp", "sqrt"})
    for text in ("-3*x**4/4 + 2*x + C", "-4*(-2*x - 8)**(3/2)/3 + C", "exp(2*x)*sin(x) + C", "x**-1"):
        assert rg.safe_expression(text, names, functions), text
    assert rg.arithmetic_value("4*(6 + 1 - 1)") == (24, [4, 6, 1, 1])
    assert rg.arithmetic_value("1/0") is None and rg.arithmetic_value("2**5") is None


def test_puzzle24_fix_checks_the_numbers():
    fam = family("rg/puzzle24")
    task = fam.task(0, level=0)
    entry = fam.task_entry(task)
    numbers = sorted(entry["metadata"]["numbers"])
    assert fam.score(task, fam.reference_completion(task), False)["correct"] == 1.0
    if numbers != [1, 2, 3, 4]:  # a constant 24 from other numbers: reasoning-gym accepts it
        assert fam.score(task, "<answer>4*3*2*1</answer>", False)["correct"] == 0.0


# --- the audit -----------------------------------------------------------------------------------------

class _Addition(Family):
    """n + 1 = ? with an honest exact-match verifier."""

    name = "test/honest"

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        n = int(rng.integers(1000))
        return Task(index=0, prompt=f"What is {n} + 1?", answer=str(n + 1))

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        answer = extract_answer(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        return {"terminal": float(answer == task.answer), "format": 1.0}


class _AcceptAll(_Addition):
    name = "test/accept_all"

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        return {"terminal": 1.0, "format": 1.0}


class _Evaluates(_Addition):
    name = "test/eval"

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        try:
            value = eval(extract_answer(completion) or "None")  # the planted bug
        except Exception:
            value = None
        return {"terminal": float(str(value) == task.answer), "format": 1.0}


class _Hangs(_Addition):
    name = "test/hangs"

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        time.sleep(60)
        raise AssertionError("not reached")


def test_audit_flags_a_verifier_that_accepts_anything(tmp_path, capsys):
    bad = audit.audit_family("test/accept_all", _AcceptAll, samples=2)
    assert bad.status == "FAIL" and bad.false_negatives == 0
    assert {"empty", "junk", "junk_tag", "near_miss", "two_tags"} <= set(bad.false_positives)
    good = audit.audit_family("test/honest", _Addition, samples=2)
    assert good.status == "clean" and good.fp == 0 and good.samples == 2
    out = tmp_path / "audit.json"
    families = {"test/accept_all": _AcceptAll, "test/honest": _Addition}
    assert audit.main(["--samples=2", f"--json={out}"], families=families) == 1
    report = json.loads(out.read_text())
    assert report["summary"]["with_fp"] == ["test/accept_all"]
    assert audit.main(["--samples=2", "--families=test/hon*"], families=families) == 0
    assert "test/accept_all" in capsys.readouterr().out


class _NumericSum(Family):
    """a + b = ? with the numeric verifier at its default tolerance (as ArithExpr and ASDiv pose it)."""

    name = "test/numeric"

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        a, b = (int(x) for x in rng.integers(1000, size=2))
        return Task(index=0, prompt=f"What is {a} + {b}?", answer=str(a + b),
                    verifier={"kind": "numeric", "answer": str(a + b)})


class _LooseNumericSum(_NumericSum):
    name = "test/loose_numeric"

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        task = super().sample(rng, level)
        return dataclasses.replace(task, verifier={**task.verifier, "rel_tol": 1e-6})


def test_audit_large_near_miss_checks_integer_references_exactly():
    """The audit re-poses an integer-reference task at 27,000,000 and answers ±1, +27: the numeric
    verifier's default tolerance passes it (integers compare exactly), a relative 1e-6 does not."""
    good = audit.audit_family("test/numeric", _NumericSum, samples=2)
    assert good.status == "clean" and good.fp == 0, good.examples
    task = _NumericSum(seed=0).task(0)
    assert [(kind, posed.verifier["answer"], text) for kind, posed, text in audit.large_integer_probes(
        _NumericSum(seed=0), task)] == [("large_near_miss", "27000000", f"<answer>{n}</answer>")
                                         for n in (27000001, 26999999, 27000027)]
    loose = audit.audit_family("test/loose_numeric", _LooseNumericSum, samples=2)
    assert loose.false_positives == {"large_near_miss": 2 * 3}, loose.false_positives
    assert "27000027" in " ".join(loose.examples)

def test_audit_flags_code_execution():
    report = audit.audit_family("test/eval", _Evaluates, samples=1)
    assert report.false_positives.get("code") == 1 and not hasattr(__import__("builtins"), audit.CANARY)


class _ForgeableCode(CodeFunction):
    """A planted bug: the verdict is "exit 0 and a marker printed" by the candidate's own process."""

    name = "test/forgeable_code"

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        from rlvr.sandbox import run

        program = strip_fences(extract_answer(completion) or "")
        entry = task.verifier["entry_point"]
        asserts = "".join(f"assert {entry}(*{args!r}) == {want!r}\n" for args, want in task.verifier["calls"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            done = run(python=f"{program}\n{asserts}print('DONE')\n", backend="process", trace_path=False)
        return {"terminal": float(done.ok and b"DONE" in done.stdout), "format": 1.0}


@pytest.mark.sandbox
def test_audit_hack_probes_flag_a_forgeable_code_verifier():
    """The code families' hack probes (rlvr.tasks.code_hacks; task 0's slice: the always-equal and subclass
    hacks) catch a verifier that trusts the candidate's process (the real one: test_code_hacks.py)."""
    bad = audit.audit_family("test/forgeable_code", _ForgeableCode, samples=1, levels="first")
    assert bad.status == "FAIL" and bad.false_negatives == 0
    assert {"hack:always_equal/object", "hack:subclass_eq/int"} <= set(bad.false_positives), bad.false_positives


def test_audit_time_box():
    start = time.monotonic()
    report = audit.audit_family("test/hangs", _Hangs, samples=2, budget=0.5)
    assert time.monotonic() - start < 10
    assert report.slow and report.status == "error" and "timed out" in report.errors[0]


def test_audit_game_of_life_halting_fixed_and_unfixed():
    unfixed = functools.partial(rg.ReasoningGymFamily, "game_of_life_halting", fixes=False)
    before = audit.audit_family("rg/game_of_life_halting", unfixed, samples=3, levels="first")
    assert before.false_positives.get("junk_tag") == 3 and before.status == "FAIL"
    after = audit.audit_family("rg/game_of_life_halting", FAMILIES["rg/game_of_life_halting"], samples=3,
                               levels="first")
    assert after.status == "clean", after.examples


def test_a_raising_reasoning_gym_scorer_is_a_verifier_error(monkeypatch):
    """A scorer that raises on an answer is a verifier error (raised: the RL producer records it with
    verifier_error 1 and leaves the sample out), not a 0 trained on; prime_factorization's scorer, the
    one that raised on malformed answers, has a format gate that scores them 0 first."""
    family = FAMILIES["rg/prime_factorization"](seed=0)
    task = family.task(0, level=0)
    assert family.score(task, family.reference_completion(task), False)["correct"] == 1.0
    for junk in ("<answer>zzz</answer>", "<answer>2 × 2, True, False</answer>"):
        assert family.score(task, junk, False)["reward"] == 0.0

    def broken(answer, entry, original):
        raise KeyError("metadata")

    monkeypatch.setitem(rg.FIXES, "prime_factorization", broken)
    with pytest.raises(rg.ScorerError, match="rg/prime_factorization: the scorer raised KeyError"):
        family.score(task, "<answer>12</answer>", False)

@pytest.mark.slow
def test_whole_registry_passes_the_audit(tmp_path, capsys):
    """The gate: every registered family, first and last level, 2 tasks each, every probe — no
    false positive, no false negative, no error (what `python -m rlvr.tasks.audit` checks). The CAD
    families' probes run OpenSCAD in gVisor (~2 s a score, over this test's 60 s budget per family):
    tests/test_cad_domain.py scores them at the first and last level instead."""
    names = sorted(name for name in FAMILIES if not name.startswith("cad_"))
    code = audit.main(["--samples=2", "--budget=60", f"--families={','.join(names)}",
                       f"--json={tmp_path / 'audit.json'}"])
    with open(tmp_path / "audit.json") as f:
        info = json.load(f)["summary"]
    assert code == 0, capsys.readouterr().out[-3000:]
    assert info["families"] == len(names) and info["clean"] == len(names) >= 100
