"""Procedural task families: for every family and level, the reference completion scores full reward
and junk (empty, off-format, empty tag, the reference plus a wrong alternative) scores 0; tasks are
deterministic; higher levels are harder by a measurable proxy; plus per-family checks of the
generated content against an independent computation."""

import json
import re
import shutil
import warnings
from fractions import Fraction

import numpy as np
import pytest

from rlvr.tasks import procedural
from rlvr.tasks.base import ANSWER_INSTRUCTION, Family, RewardWeights, Task
from rlvr.tasks.procedural import FAMILIES
from rlvr.tasks.verifiers import TOOL_SETS, apply_tool_calls, parse_tool_calls, run_verifier

REQUIRED = {"algebra_linear", "arith_expr", "fraction_sum", "string_reverse", "string_upper_count", "string_caesar",
            "list_sort", "list_dedupe", "list_max_k", "json_person", "code_function", "tool_bank", "tool_files"}
TASKS_PER_LEVEL = 20


@pytest.fixture(autouse=True)
def process_executor(monkeypatch):
    """Run candidate programs as plain processes here (fast); test_verifiers covers runsc."""
    monkeypatch.setenv("RLVR_CODE_EXECUTOR", "process")
    warnings.filterwarnings("ignore", "sandbox backend .process. is for development only", RuntimeWarning)


def cases():
    return [(name, level) for name, cls in FAMILIES.items() for level in cls().levels()]


def test_table():
    assert REQUIRED <= set(FAMILIES)
    for name, cls in FAMILIES.items():
        family = cls(seed=3, weights=RewardWeights())
        assert isinstance(family, Family) and family.name == name and family.domain
        assert len(family.levels()) >= 3 and family.levels()[0] == 0
        assert family.answer_format == "tag"


@pytest.mark.parametrize("name, level", cases())
def test_self_check(name, level):
    """Reference -> correct 1 and reward 1 (default weights); junk and ref-plus-a-wrong-alternative -> 0."""
    family = FAMILIES[name](seed=0)
    for index in range(TASKS_PER_LEVEL):
        task = family.task(index, level=level)
        assert task.family == name and task.level == level and task.index == index
        assert task.prompt.endswith(ANSWER_INSTRUCTION) and task.chat()[-1]["content"] == task.prompt
        assert Task.from_json(json.loads(json.dumps(task.to_json()))) == task  # plain JSON values only
        scored = family.score(task, family.reference_completion(task), truncated=False)
        assert scored["correct"] == 1.0 and scored["reward"] == 1.0, (task, scored)
        assert family.score(task, family.reference_completion(task), truncated=True)["correct"] == 0.0
        for junk in ("", "zzz", "<answer></answer>", f"<answer>{task.answer}, 0</answer>"):
            assert family.score(task, junk, truncated=False)["correct"] == 0.0, (task, junk)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_deterministic(name):
    first, second = FAMILIES[name](seed=5), FAMILIES[name](seed=5)
    for level in first.levels():
        for index in (0, 7):
            assert first.task(index, level=level).to_json() == second.task(index, level=level).to_json()
    assert first.task(3, stream=1, level=1) == second.task(3, stream=1, level=1)
    drawn = {json.dumps(first.task(i, level=1).to_json(), sort_keys=True) for i in range(10)}
    assert len(drawn) >= 9  # different indices give different tasks
    other_seed = FAMILIES[name](seed=6)
    assert sum(other_seed.task(i, level=2).to_json() != first.task(i, level=2).to_json() for i in range(5)) >= 4


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_higher_levels_are_harder(name):
    """Proxy: the mean size of prompt plus reference answer grows with the level."""
    family = FAMILIES[name](seed=1)
    sizes = [np.mean([len(t.prompt) + len(t.answer) for t in (family.task(i, level=level) for i in range(20))])
             for level in family.levels()]
    assert all(a < b for a, b in zip(sizes, sizes[1:], strict=False)), sizes


# ----------------------------------------------------------------------------------------- per family


def tasks(name, level=None, count=20):
    family = FAMILIES[name](seed=2)
    return family, [family.task(i, level=level) for i in range(count)]


def evaluate(side, x):
    """A side of a generated linear equation ("13(x - 45) - 23x") at x."""
    return eval(re.sub(r"(\d)([x(])", r"\1*\2", side), {"x": x})


def test_algebra_linear_solution_satisfies_the_equation():
    for level in range(4):
        for task in tasks("algebra_linear", level)[1]:
            left, right = task.metadata["equation"].split(" = ")
            x = int(task.answer)
            assert evaluate(left, x) == evaluate(right, x) and evaluate(left, x + 1) != evaluate(right, x + 1)
            assert x != 0, task.metadata
    family, (task, *_) = tasks("algebra_linear", 2)
    assert family.score(task, f"<answer>x = {task.answer}</answer>", False)["correct"] == 1.0


def test_arith_expr_answer_is_the_value():
    family, generated = tasks("arith_expr", 3)
    for task in generated:
        assert eval(task.metadata["expression"]) == int(task.answer)
        assert task.metadata["expression"].count(" ") == 2 * 7
    assert any("(" in t.metadata["expression"] for t in generated)


def test_fraction_sum_needs_lowest_terms():
    family, generated = tasks("fraction_sum", 2)
    for task in generated:
        assert Fraction(eval(task.metadata["expression"].replace("/", "*Fraction(1)/"))) == Fraction(task.answer)
    task = next(t for t in generated if "/" in t.answer)
    numerator, denominator = task.answer.split("/")
    unreduced = f"{2 * int(numerator)}/{2 * int(denominator)}"
    assert run_verifier(task.verifier, unreduced) == 1.0  # the same value ...
    assert family.score(task, f"<answer>{unreduced}</answer>", False)["correct"] == 0.0  # ... not in lowest terms
    latex = f"\\frac{{{numerator.lstrip('-')}}}{{{denominator}}}"
    latex = "-" + latex if numerator.startswith("-") else latex
    assert family.score(task, f"<answer>{latex}</answer>", False)["correct"] == 1.0
    assert procedural.in_lowest_terms("-7/12") and procedural.in_lowest_terms("3")
    assert not procedural.in_lowest_terms("6/4") and not procedural.in_lowest_terms("4/1")
    assert not procedural.in_lowest_terms("0.5")


def test_string_families():
    for task in tasks("string_reverse", 3)[1]:
        assert f'"{task.answer[::-1]}"' in task.prompt
    for task in tasks("string_upper_count", 2)[1]:
        letter, text = re.search(r"letter '(.)' occur in the string \"(\w+)\"", task.prompt).groups()
        assert text.lower().count(letter) == int(task.answer)
    family, generated = tasks("string_caesar", 1)
    for task in generated:
        cipher = re.search(r'The text "([a-z ]+)"', task.prompt).group(1)
        assert procedural.caesar(cipher, 26 - task.metadata["shift"]) == task.answer
    assert family.score(generated[0], f"<answer>{generated[0].answer.upper()}</answer>", False)["correct"] == 1.0


def test_list_families():
    for task in tasks("list_sort", 3)[1]:
        items = json.loads(re.search(r"(\[.*?\])", task.prompt).group(1))
        assert task.answer == ", ".join(map(str, sorted(items)))
    for task in tasks("list_dedupe", 2)[1]:
        items = json.loads(re.search(r"(\[.*?\])", task.prompt).group(1))
        unique = [x for i, x in enumerate(items) if x not in items[:i]]
        assert task.answer == ", ".join(map(str, unique)) and len(unique) < len(items)
    family, generated = tasks("list_max_k", 3)
    for task in generated:
        items = json.loads(re.search(r"of (\[.*?\])", task.prompt).group(1))
        assert task.answer == ", ".join(map(str, sorted(items)[::-1][: task.metadata["k"]]))
    task = generated[0]
    assert family.score(task, f"<answer>[{task.answer.replace(' ', '')}]</answer>", False)["correct"] == 1.0


def test_json_person_needs_the_prompted_values():
    family, generated = tasks("json_person", 3)
    for task in generated:
        reference = json.loads(task.answer)
        expected = task.verifier["expected"]
        assert expected["name"] in task.prompt and all(reference[k] == v for k, v in expected.items())
        for key in expected:
            wrong = {**reference, key: not reference[key] if isinstance(reference[key], bool) else
                     (reference[key] + 1 if isinstance(reference[key], int) else reference[key] + "x")}
            assert run_verifier(task.verifier, json.dumps(wrong)) == 0.0
        assert run_verifier(task.verifier, json.dumps({**reference, "extra": 1})) == 0.0
        assert run_verifier(task.verifier, f"```json\n{task.answer}\n```") == 1.0


def test_code_function_rejects_wrong_programs():
    family = FAMILIES["code_function"](seed=4)
    for level in range(4):
        task = family.task(0, level=level)
        name = task.metadata["problem"]
        assert task.verifier["calls"] and "tests" not in task.verifier and task.verifier["entry_point"] == name
        assert family.score(task, f"<answer>{task.answer}</answer>", False)["correct"] == 1.0  # unfenced works too
        wrong = f"<answer>\n```python\ndef {name}(*args):\n    return None\n```\n</answer>"
        assert family.score(task, wrong, False)["correct"] == 0.0


def test_code_function_reference_passes_in_runsc(monkeypatch):
    if shutil.which("runsc") is None:
        pytest.fail("runsc (gVisor) is not installed: apt-get install -y runsc")
    monkeypatch.setenv("RLVR_CODE_EXECUTOR", "runsc")
    family = FAMILIES["code_function"](seed=0)
    for level in family.levels():
        task = family.task(1, level=level)
        assert family.score(task, family.reference_completion(task), False)["correct"] == 1.0


@pytest.mark.parametrize("name", ["tool_bank", "tool_files"])
def test_tool_families(name):
    family, generated = tasks(name, 3)
    for task in generated:
        spec = task.verifier
        calls = parse_tool_calls(task.answer)
        assert len(calls) == 6 == task.metadata["operations"]
        assert apply_tool_calls(TOOL_SETS[spec["tools"]], spec["initial"], calls) == spec["target"]
        assert json.dumps(spec["initial"]) in task.prompt
        assert run_verifier(spec, task.answer.rsplit("\n", 1)[0]) == 0.0  # every operation counts: drop the last
