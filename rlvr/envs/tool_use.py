"""`ToolUseEnv`: arithmetic too large to do in one's head, where the calculator is the way to the answer.

Problems (`calc_problem(rng, level)`): a product of two numbers (`MULT_DIGITS[level]` operand digits)
or, one time in three, a sum of many terms (`SUM_TERMS[level]`: terms, digits). The episode: the model
calls the calculator (or, with `python=True`, the sandboxed python tool), reads the result and answers
in `<answer></answer>`.

Rewards: terminal 1 iff the answer is exactly the value (as a number: "10063" and "10063.0" agree,
"10,063" too; nothing within a tolerance); process `Shaping.tool_result_in_answer` when a successful
tool result appears in the answer; format penalties for malformed calls (rlvr.envs.tool_env).
`require_tool=True` also makes the terminal need a successful tool call.

Compact mode (`compact=True`, for tiny byte-level models): no system prompt and no tool declarations
(`tools` is None), the user message is just "Compute 347*29.", the tool is `calc` with one argument
`expr`, calls are written without spaces and the observation is just the number (or a short error):

    user       Compute 347*29.
    assistant  <tool_call>{"name":"calc","arguments":{"expr":"347*29"}}</tool_call>
    tool       10063
    assistant  <answer>10063</answer>
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rlvr.envs.calculator import CalcError, evaluate, format_number
from rlvr.envs.tool_env import ToolEnv
from rlvr.envs.tools import Tool, ToolError, call_text, truncate
from rlvr.tasks.base import ANSWER_INSTRUCTION, Task
from rlvr.tasks.verifiers import parse_number

MULT_DIGITS = ((2, 2), (3, 2), (3, 3), (4, 3), (4, 4))  # operand digits of a product, by level
SUM_TERMS = ((4, 3), (5, 3), (6, 4), (8, 4), (10, 5))  # (terms, digits) of a sum, by level
LEVELS = list(range(len(MULT_DIGITS)))


def _number(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1), 10 ** digits))


def calc_problem(rng: np.random.Generator, level: int) -> dict[str, Any]:
    """{"expression", "value" (str), "kind"}: a product, or a sum of many terms one time in three."""
    if rng.random() < 1 / 3:
        terms, digits = SUM_TERMS[level]
        numbers = [_number(rng, digits) for _ in range(terms)]
        expression, kind = "+".join(map(str, numbers)), "sum"
    else:
        a, b = (_number(rng, d) for d in MULT_DIGITS[level])
        expression, kind = f"{a}*{b}", "product"
    return {"expression": expression, "value": str(evaluate(expression)), "kind": kind}


def opening_messages(expression: str, compact: bool) -> list[dict[str, str]]:
    """The episode's first messages (also the family's `Task.messages`)."""
    if compact:
        return [{"role": "user", "content": f"Compute {expression}."}]
    return [{"role": "user", "content": f"Compute {expression}.\n\nUse the calculator tool for the arithmetic. "
                                        f"{ANSWER_INSTRUCTION}"}]


def tool_names(compact: bool) -> tuple[str, str]:
    """(calculator tool name, its argument name)."""
    return ("calc", "expr") if compact else ("calculator", "expression")


def reference_turns(task: Task, compact: bool | None = None) -> list[str]:
    """The scripted solution: one calculator call, then the answer."""
    compact = task.metadata.get("compact", False) if compact is None else compact
    name, argument = tool_names(compact)
    return [call_text(name, {argument: task.metadata["expression"]}, compact=compact),
            f"<answer>{task.metadata['value']}</answer>"]


def same_number(answer: str, value: str) -> bool:
    got, want = parse_number(answer.strip()), parse_number(value)
    return got is not None and got == want


class ToolUseEnv(ToolEnv):
    """See the module doc. Options: compact (default: the task's), python (offer the sandboxed python
    tool; not in compact mode), require_tool, and the sandbox options of `make_env` for python."""

    name = "tool_calc"
    default_max_turns = 4
    default_time_budget_s = 60.0

    def __init__(self, task: Task, *, compact: bool | None = None, python: bool = False, require_tool: bool = False,
                 sandbox: Any = None, **options: Any):
        self.compact = bool(task.metadata.get("compact", False) if compact is None else compact)
        self.python = python and not self.compact
        self.require_tool = require_tool
        self.sandbox = sandbox  # rlvr.envs.SandboxOptions (for the python tool)
        self.results: list[str] = []  # outputs of successful tool calls
        options.setdefault("declare_tools", not self.compact)
        options.setdefault("output_chars", 200 if self.compact else 2000)
        super().__init__(task, **options)

    def opening(self) -> list[dict[str, Any]]:
        return opening_messages(self.task.metadata["expression"], self.compact)

    def make_tools(self) -> dict[str, Tool]:
        name, argument = tool_names(self.compact)

        def calculate(**arguments: Any) -> str:
            try:
                return format_number(evaluate(arguments[argument]))
            except CalcError as e:
                raise ToolError(str(e)) from None

        schema = {"type": "object", "properties": {argument: {"type": "string", "description": (
            "an arithmetic expression: numbers, + - * / // % ** and parentheses")}},
            "required": [argument], "additionalProperties": False}
        tools = {name: Tool(calculate, name, "Evaluate an arithmetic expression exactly (integers of any size).",
                            schema)}
        if self.python:
            tools["python"] = Tool(self._python, "python", "Run a Python program in a sandbox and return what it "
                                   "prints (stdout, then stderr).",
                                   {"type": "object", "properties": {"code": {"type": "string"}},
                                    "required": ["code"], "additionalProperties": False})
        return tools

    def _python(self, code: str) -> str:
        from rlvr.envs.sandboxes import record

        result = self.sandbox.run_python(code)
        self.sandbox_log.append({**record(result, "python"), "code": truncate(code, 4000)})
        return python_output(result)

    def after_calls(self, record: dict[str, Any], rewards: dict[str, float]) -> None:
        if record["status"] == "ok" and record.get("name") in self._tools:
            self.results.append(record["output"].strip())

    def on_answer(self, answer: str, rewards: dict[str, float]) -> None:
        for result in self.results:
            if result and re.search(rf"(?<![\d.]){re.escape(result)}(?![\d.])", answer):
                self.earn("tool_result_in_answer", self.shaping.tool_result_in_answer, rewards)
                return

    def judge(self) -> float:
        if self.answer is None or (self.require_tool and not self.results):
            return 0.0
        return float(same_number(self.answer, self.task.metadata["value"]))

    def options(self) -> dict[str, Any]:
        return {**super().options(), "compact": self.compact, "python": self.python,
                "require_tool": self.require_tool}


def python_output(result: Any) -> str:
    """What the python tool shows: stdout, stderr, and the exit status or limit when not a clean exit."""
    from rlvr.sandbox import WALL_TIME

    parts = [result.text()]
    if result.stderr:
        parts.append(result.text("stderr"))
    if result.limit_hit == WALL_TIME:
        parts.append("[timed out]")
    elif result.limit_hit:
        parts.append(f"[stopped: {result.limit_hit} limit]")
    elif result.exit_code not in (0, None):
        parts.append(f"[exit code {result.exit_code}]")
    elif result.signal:
        parts.append(f"[killed by signal {result.signal}]")
    text = "\n".join(p.rstrip("\n") for p in parts if p)
    return text or "[no output]"
