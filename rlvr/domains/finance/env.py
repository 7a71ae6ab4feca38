"""`FinanceDocsEnv`: a filing behind tools, a question, and an answer checked against the raw data.

Tools (declared to the chat template):

  search(query)            lines of the filing (its Markdown rendering: statements and notes) containing
                           every word of the query, at most `SEARCH_LINES`
  read_table(statement)    "income statement" | "balance sheet" | "cash flow statement": the statement's
                           table as extracted from the filing's PDF (reportlab writes it, pdfplumber reads it:
                           the `docs` extra), one row per line, cells separated by " | "
  calculator(expression)   exact arithmetic (rlvr.envs.calculator: an AST walk, never eval)
  python(code)             with `python=True`: a program run in the sandbox (rlvr.envs.sandboxes)

`compact=True` (tiny byte-level models, the RL smoke run): the question alone as the opening message, no
tool declarations, observations cut to 300 characters.

Rewards (rlvr.envs.tool_env): terminal = the family's verdict on the answer (rlvr.domains.finance.families
`verify.score_answer`: the same check as the single-turn family, against the raw data); process
`cell_located` (Shaping.cell_located x the fraction of the cells the answer rests on that a tool output
showed: item and amount on one line) and `tool_result_in_answer` (a number a tool returned appears in
the answer); format and safety penalties as in every tool environment.

    user       You are analysing the annual report of Lumen Technologies ... What was Inventories at the
               end of 2018? ...
    assistant  <tool_call>{"name": "read_table", "arguments": {"statement": "balance sheet"}}</tool_call>
    tool       Line item | 2017 | 2018 | 2019 ...  Inventories | 2,773 | 3,485 | 4,468 ...
    assistant  <answer>3,485</answer>
"""

from __future__ import annotations

import functools
import io
import re
from typing import Any

from rlvr.domains.finance import generate as gen
from rlvr.domains.finance import verify as fv
from rlvr.envs.calculator import CalcError, evaluate, format_number
from rlvr.envs.tool_env import ToolEnv
from rlvr.envs.tools import Tool, ToolError, call_text, truncate
from rlvr.tasks.base import ANSWER_INSTRUCTION, Task

SEARCH_LINES = 12
_NUMBER = re.compile(r"\(?-?\d[\d,]*(?:\.\d+)?\)?")


def opening_messages(filing: gen.Filing, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": (
        f"You are analysing the annual report of {filing.company} for {filing.years[0]}-{filing.years[-1]} "
        f"(amounts {filing.scale_words()}). The filing is not shown: use the tools to search it, to read its "
        f"statements' tables from its PDF, and to calculate.\n\n{question}\n\n{ANSWER_INSTRUCTION}")}]


@functools.lru_cache(maxsize=32)
def pdf_tables(pdf: bytes) -> dict[str, list[list[str]]]:
    """statement -> its table's rows, extracted from the PDF with pdfplumber (one statement per page)."""
    try:
        import pdfplumber
    except ImportError as e:
        raise ImportError("read_table needs pdfplumber: pip install -e '.[docs]'") from e
    out = {}
    with pdfplumber.open(io.BytesIO(pdf)) as document:
        for statement, page in zip(gen.STATEMENTS, document.pages, strict=False):
            tables = page.extract_tables()
            out[statement] = [[cell or "" for cell in row] for row in tables[0]] if tables else []
    return out


def target_cells(filing: gen.Filing, check: dict) -> list[tuple[str, int]]:
    """The cells an answer to `check` rests on."""
    if check["type"] in ("amount", "fix"):
        return [(check["item"], check["year"])]
    if check["type"] == "ratio":
        return fv.metric_cells(check["metric"], check["year"])
    return [cell for m, y in check["truth"]["required"] for cell in fv.metric_cells(m, y)]


class FinanceDocsEnv(ToolEnv):
    """See the module doc. Options: python (offer the sandboxed python tool) and the sandbox options of make_env."""

    name = "finance_docs"
    uses_sandbox = True  # make_env passes `sandbox` (the python tool's)
    default_max_turns = 6
    default_time_budget_s = 60.0

    def __init__(self, task: Task, *, python: bool = False, compact: bool = False, sandbox: Any = None,
                 **options: Any):
        self.filing = gen.Filing.from_json(task.metadata["filing"])
        self.check = task.metadata["check"]
        self.values = gen.shown_values(self.filing, self.check)
        self.lines = [ln for ln in gen.to_markdown(self.filing, self.values).splitlines() if ln.strip()]
        self.python, self.sandbox, self.compact = python, sandbox, compact
        self.outputs: list[str] = []  # successful tool outputs
        if compact:  # tiny byte-level models: no tool declarations, the question alone, short observations
            options.setdefault("declare_tools", False)
            options.setdefault("output_chars", 300)
        super().__init__(task, **options)

    def opening(self) -> list[dict[str, Any]]:
        if self.compact:
            return [{"role": "user", "content": f"{self.task.metadata['question']}\n\n{ANSWER_INSTRUCTION}"}]
        return self.task.chat()

    def make_tools(self) -> dict[str, Tool]:
        def obj(name: str, description: str, **extra: Any) -> dict[str, Any]:
            return {"type": "object", "properties": {name: {"type": "string", "description": description, **extra}},
                    "required": [name], "additionalProperties": False}

        tools = {
            "search": Tool(self._search, "search", "Lines of the filing that contain every word of the query.",
                           obj("query", "words to look for, e.g. 'inventories' or 'restatement'")),
            "read_table": Tool(self._read_table, "read_table", "A statement's table, extracted from the filing's PDF.",
                               obj("statement", "which statement", enum=list(gen.STATEMENTS))),
            "calculator": Tool(self._calculate, "calculator", "Evaluate an arithmetic expression exactly.",
                               obj("expression", "numbers, + - * / ** and parentheses")),
        }
        if self.python:
            tools["python"] = Tool(self._python, "python", "Run a Python program in a sandbox; returns what it prints.",
                                   obj("code", "the program"))
        return tools

    def _search(self, query: str) -> str:
        words = query.lower().split()
        if not words:
            raise ToolError("empty query")
        found = [ln for ln in self.lines if all(w in ln.lower() for w in words)]
        if not found:
            return "no line contains all of: " + ", ".join(words)
        more = f"\n[{len(found) - SEARCH_LINES} more lines]" if len(found) > SEARCH_LINES else ""
        return "\n".join(found[:SEARCH_LINES]) + more

    def pdf(self) -> bytes:
        if not hasattr(self, "_pdf"):
            self._pdf = gen.to_pdf(self.filing, self.values)
        return self._pdf

    def _read_table(self, statement: str) -> str:
        rows = pdf_tables(self.pdf()).get(statement)
        if not rows:
            raise ToolError(f"no table for {statement!r}; statements: {', '.join(gen.STATEMENTS)}")
        return f"{gen.title(self.filing, statement)}\n" + "\n".join(" | ".join(row) for row in rows)

    def _calculate(self, expression: str) -> str:
        try:
            return format_number(evaluate(expression))
        except CalcError as e:
            raise ToolError(str(e)) from None

    def _python(self, code: str) -> str:
        from rlvr.envs.sandboxes import record
        from rlvr.envs.tool_use import python_output

        result = self.sandbox.run_python(code)
        self.sandbox_log.append({**record(result, "python"), "code": truncate(code, 4000)})
        return python_output(result)

    def after_calls(self, record: dict[str, Any], rewards: dict[str, float]) -> None:
        if record["status"] != "ok":
            return
        self.outputs.append(record["output"])
        cells = target_cells(self.filing, self.check)
        lines = [ln for out in self.outputs for ln in out.splitlines()]
        located = sum(any(item in ln and gen.amount_text(self.values[item][year]) in ln for ln in lines)
                      for item, year in cells)
        self.earn("cell_located", self.shaping.cell_located * located / len(cells), rewards)

    def on_answer(self, answer: str, rewards: dict[str, float]) -> None:
        numbers = {n.strip("()") for out in self.outputs for n in _NUMBER.findall(out) if len(n.strip("()")) > 1}
        if any(re.search(rf"(?<![\d.,]){re.escape(n)}(?![\d,]|\.\d)", answer) for n in numbers):
            self.earn("tool_result_in_answer", self.shaping.tool_result_in_answer, rewards)

    def judge(self) -> float:
        if self.answer is None:
            return 0.0
        return float(fv.score_answer(self.answer, self.filing, self.check)["terminal"])

    def options(self) -> dict[str, Any]:
        return {**super().options(), "python": self.python, "compact": self.compact}


def _statement_of(item: str) -> str:
    return next((s for s, items in gen.STATEMENTS.items() if item in items), "")


def reference_turns(task: Task) -> list[str]:
    """The scripted episode: read (or search) what the answer rests on, calculate a ratio, answer."""
    filing = gen.Filing.from_json(task.metadata["filing"])
    check = task.metadata["check"]
    if check["type"] == "fix":
        reads = list(gen.STATEMENTS)
    else:
        reads = list(dict.fromkeys(_statement_of(item) for item, _ in target_cells(filing, check)))
    calls = [call_text("read_table", {"statement": s}) if s else
             call_text("search", {"query": check.get("item", "revenue")}) for s in reads]
    turns = ["\n".join(calls)]
    if check["type"] == "ratio":
        values = [str(filing.value(i, y)) for i, y in fv.metric_cells(check["metric"], check["year"])]
        formula = {"ratio": "100*{0}/{1}", "growth": "100*({0}-{1})/{1}", "average_ratio": "100*{0}/(({1}+{2})/2)",
                   "days": "365*{0}/{1}"}[fv.METRICS[check["metric"]][2]]
        turns.append(call_text("calculator", {"expression": formula.format(*values)}))
    return [*turns, f"<answer>{task.answer}</answer>"]
