"""Bug injection: single-line mutations of Python source, and a guarded in-process check that a bug bites.

`mutations(source, first_line, last_line)` lists every candidate bug whose edit is confined to one line
of the source (so the fix is a one-line edit, and the file keeps its formatting):

  off_by_one          an integer constant +-1; `range(stop)` -> `range(stop - 1)` / `range(stop + 1)`
  wrong_operator      + <-> -, * -> +, / <-> //, % -> //; < <-> <=, > <-> >=, == <-> !=, in <-> not in;
                      and <-> or; += <-> -=
  swapped_arguments   the first two positional arguments of a call, or the operands of a
                      non-commutative operator or a comparison, swapped
  wrong_constant      an integer constant c (not 0 or 1) -> 2c; a short string literal changed
  missing_return      `return expr` -> `expr`
  negated_condition   the condition of an if / while / conditional expression negated
  syntax_error        the colon of an if / for / while header removed

Docstrings, annotations and f-strings are never mutated. A `Mutation` is (kind, line index, the
original line, the buggy line): applying it replaces the line, so it can be stored as data (the
HumanEval bug table) and reversed exactly (the reference fix).

`guarded_outcomes(source, function, calls)` runs a function of trusted-but-mutated code in this
process, under a line-event budget (`sys.settrace`), to tell whether a mutation breaks any test and
still terminates; it is for our own function bank only (small pure functions), never for model output.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from rlvr.sandbox import pyast

KINDS = ("off_by_one", "wrong_operator", "swapped_arguments", "wrong_constant", "missing_return",
         "negated_condition", "syntax_error")

_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%"}
_BINOP_SWAP = {ast.Add: "-", ast.Sub: "+", ast.Mult: "+", ast.Div: "//", ast.FloorDiv: "/", ast.Mod: "//"}
_CMPOPS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
           ast.NotIn: "not in"}
_CMP_SWAP = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "==", ast.In: "not in",
             ast.NotIn: "in"}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)


@dataclasses.dataclass(frozen=True)
class Mutation:
    kind: str
    line: int  # 0-based index into source.split("\n")
    old: str
    new: str

    def apply(self, source: str) -> str:
        lines = source.split("\n")
        if lines[self.line] != self.old:
            raise ValueError(f"mutation does not apply: line {self.line} is {lines[self.line]!r}, not {self.old!r}")
        lines[self.line] = self.new
        return "\n".join(lines)

    def applies(self, source: str) -> bool:
        lines = source.split("\n")
        return 0 <= self.line < len(lines) and lines[self.line] == self.old

    def to_json(self) -> list:
        return [self.kind, self.line, self.old, self.new]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> Mutation:
        return cls(str(value[0]), int(value[1]), str(value[2]), str(value[3]))


def _seg(line: str, start: int, end: int) -> str:
    return line.encode()[start:end].decode()


def _edit(line: str, start: int, end: int, text: str) -> str:
    raw = line.encode()
    return (raw[:start] + text.encode() + raw[end:]).decode()


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of docstrings, annotations and everything inside f-strings."""
    skip: set[int] = set()

    def all_of(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                all_of(first)
        if isinstance(node, ast.JoinedStr):
            all_of(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            all_of(node.returns)
        if isinstance(node, ast.arg):
            all_of(node.annotation)
        if isinstance(node, ast.AnnAssign):
            all_of(node.annotation)
    return skip


def _one_line(*nodes: ast.AST) -> bool:
    lines = {n.lineno for n in nodes} | {n.end_lineno for n in nodes}
    return len(lines) == 1


def _operator_edit(line: str, left: ast.AST, right: ast.AST, old: str, new: str) -> str | None:
    """Replace operator `old` in the text between `left` and `right` (same line) with `new`."""
    start, end = left.end_col_offset, right.col_offset
    between = _seg(line, start, end)
    words = old[0].isalpha()
    index = -1
    if words:
        for i in range(len(between) - len(old) + 1):
            if between[i:i + len(old)] == old and (i == 0 or not between[i - 1].isalnum()) \
                    and (i + len(old) == len(between) or not between[i + len(old)].isalnum()):
                index = i
                break
    else:
        index = between.find(old)
        if index >= 0 and between[index:index + len(old) + 1] in ("//", "**", "<=", ">=", "==") and len(old) == 1:
            return None
    if index < 0:
        return None
    return _edit(line, start, end, between[:index] + new + between[index + len(old):])


def _string_variant(value: str) -> str | None:
    if value == "":
        return " "
    if value == " ":
        return ""
    if len(value) > 20 or any(c in value for c in "\\\n'\""):
        return None
    swapped = value.swapcase()
    if swapped != value:
        return swapped
    return value + value[-1]


def mutations(source: str, first_line: int = 0, last_line: int | None = None) -> list[Mutation]:
    """Every single-line mutation of `source` on lines [first_line, last_line) (0-based), deduplicated, in
    source order; each (except syntax_error) still parses."""
    tree = pyast.parse(source)
    lines = source.split("\n")
    last_line = len(lines) if last_line is None else last_line
    skip = _skipped_nodes(tree)
    found: list[Mutation] = []

    def add(kind: str, lineno: int, new_line: str | None) -> None:
        index = lineno - 1
        if new_line is None or not first_line <= index < last_line or new_line == lines[index]:
            return
        found.append(Mutation(kind, index, lines[index], new_line))

    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "lineno"):
            continue
        line = lines[node.lineno - 1]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP and _one_line(node.left, node.right):
            add("wrong_operator", node.lineno,
                _operator_edit(line, node.left, node.right, _BINOPS[type(node.op)], _BINOP_SWAP[type(node.op)]))
            if isinstance(node.op, _NON_COMMUTATIVE):
                add("swapped_arguments", node.lineno, _swap(line, node.left, node.right))
        elif isinstance(node, ast.AugAssign) and type(node.op) in (ast.Add, ast.Sub) \
                and _one_line(node.target, node.value):
            old = _BINOPS[type(node.op)] + "="
            add("wrong_operator", node.lineno,
                _operator_edit(line, node.target, node.value, old, _BINOP_SWAP[type(node.op)] + "="))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP_SWAP \
                and _one_line(node.left, node.comparators[0]):
            op = type(node.ops[0])
            add("wrong_operator", node.lineno, _operator_edit(line, node.left, node.comparators[0], _CMPOPS[op],
                                                              _CMP_SWAP[op]))
            if op not in (ast.In, ast.NotIn, ast.Eq, ast.NotEq):
                add("swapped_arguments", node.lineno, _swap(line, node.left, node.comparators[0]))
        elif isinstance(node, ast.BoolOp) and len(node.values) == 2 and _one_line(*node.values):
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            add("wrong_operator", node.lineno, _operator_edit(line, node.values[0], node.values[1], old, new))
        elif isinstance(node, ast.Constant) and _one_line(node):
            text = _seg(line, node.col_offset, node.end_col_offset)
            if type(node.value) is int and text.isdigit():
                add("off_by_one", node.lineno, _edit(line, node.col_offset, node.end_col_offset, str(node.value + 1)))
                if node.value > 0:
                    add("off_by_one", node.lineno,
                        _edit(line, node.col_offset, node.end_col_offset, str(node.value - 1)))
                if node.value > 1:
                    add("wrong_constant", node.lineno,
                        _edit(line, node.col_offset, node.end_col_offset, str(node.value * 2)))
            elif type(node.value) is str and len(text) >= 2 and text[0] in "'\"" and text[-1] == text[0] \
                    and not text.startswith(text[0] * 3):
                variant = _string_variant(node.value)
                if variant is not None:
                    add("wrong_constant", node.lineno,
                        _edit(line, node.col_offset, node.end_col_offset, text[0] + variant + text[0]))
        elif isinstance(node, ast.Return) and node.value is not None and _one_line(node):
            if _seg(line, node.col_offset, node.col_offset + 6) == "return":
                add("missing_return", node.lineno, _edit(line, node.col_offset, node.value.col_offset, ""))
        elif isinstance(node, ast.Call) and _one_line(node):
            positional = [a for a in node.args if not isinstance(a, ast.Starred)]
            if len(node.args) >= 2 and len(positional) == len(node.args):
                add("swapped_arguments", node.lineno, _swap(line, node.args[0], node.args[1]))
            if isinstance(node.func, ast.Name) and node.func.id == "range" and 1 <= len(node.args) <= 2:
                stop = node.args[0] if len(node.args) == 1 else node.args[1]
                if not isinstance(stop, ast.Constant):
                    text = _seg(line, stop.col_offset, stop.end_col_offset)
                    for delta in (" - 1", " + 1"):
                        add("off_by_one", node.lineno, _edit(line, stop.col_offset, stop.end_col_offset, text + delta))
        if isinstance(node, (ast.If, ast.While, ast.IfExp)) and _one_line(node.test):
            add("negated_condition", node.test.lineno, _negate(lines[node.test.lineno - 1], node.test))
        if isinstance(node, (ast.If, ast.While, ast.For)):
            header = node.iter if isinstance(node, ast.For) else node.test
            if header.end_lineno == node.lineno and node.body and node.body[0].lineno > node.lineno:
                stripped = line.rstrip()
                if stripped.endswith(":") and "#" not in line:
                    add("syntax_error", node.lineno, stripped[:-1])
    out, seen = [], set()
    for m in sorted(found, key=lambda m: (m.line, KINDS.index(m.kind), m.new)):
        if (m.line, m.new) in seen:
            continue
        seen.add((m.line, m.new))
        if (m.kind == "syntax_error") != (not _parses(m.apply(source))):
            continue
        out.append(m)
    return out


def _swap(line: str, a: ast.AST, b: ast.AST) -> str | None:
    """Swap the source text of two nodes on one line (a before b)."""
    if a.lineno != b.lineno or a.end_col_offset > b.col_offset:
        return None
    text_a, text_b = _seg(line, a.col_offset, a.end_col_offset), _seg(line, b.col_offset, b.end_col_offset)
    if text_a == text_b:
        return None
    swapped = _edit(line, b.col_offset, b.end_col_offset, text_a)
    return _edit(swapped, a.col_offset, a.end_col_offset, text_b)


def _negate(line: str, test: ast.AST) -> str:
    text = _seg(line, test.col_offset, test.end_col_offset)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and text.startswith("not "):
        return _edit(line, test.col_offset, test.end_col_offset, text[4:].strip())
    simple = isinstance(test, (ast.Name, ast.Call, ast.Attribute, ast.Subscript, ast.Constant))
    return _edit(line, test.col_offset, test.end_col_offset, f"not {text}" if simple else f"not ({text})")


def _parses(source: str) -> bool:
    try:
        compile(source, "<mutation>", "exec", dont_inherit=True)
        return True
    except (SyntaxError, ValueError):
        return False


# ----------------------------------------------------------------------------------------- guarded checks


class _OverBudget(BaseException):
    """A BaseException: the code under test cannot swallow it with `except Exception`."""


def json_value(value: Any) -> Any:
    """`value` as the sandbox's verdict driver sends it (tuples become lists); TypeError for non-JSON values."""
    return json.loads(json.dumps(value, allow_nan=False))


def guarded_outcomes(source: str, function: str, calls: Sequence[tuple[Sequence[Any], Any]],
                     budget: int = 200_000) -> list[bool] | None:
    """Per call, whether `function(*args)` of `source` returns the expected JSON value; None when the
    source does not load or a call runs over `budget` trace events (a mutation that does not terminate).
    Trusted code only (see the module doc)."""
    from rlvr.sandbox.verdict import same_value

    namespace: dict[str, Any] = {"__name__": "rlvr_bug_check"}
    try:
        exec(compile(source, "<bug check>", "exec", dont_inherit=True), namespace)  # our own mutated bank code
    except Exception:  # noqa: BLE001
        return None
    fn = namespace.get(function)
    if not callable(fn):
        return None
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        count += 1
        if count > budget:
            raise _OverBudget
        return tracer

    previous = sys.gettrace()
    outcomes = []
    sys.settrace(tracer)
    try:
        for args, expected in calls:
            count = 0
            try:
                outcomes.append(same_value(json_value(fn(*copy.deepcopy(list(args)))), expected))
            except _OverBudget:
                return None
            except Exception:  # noqa: BLE001 - a raising bug is a failing test
                outcomes.append(False)
    finally:
        sys.settrace(previous)
    return outcomes
