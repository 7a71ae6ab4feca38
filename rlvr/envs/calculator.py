"""A safe calculator: arithmetic expressions evaluated by walking their AST (never `eval`).

    evaluate("347*29")          -> 10063
    evaluate("(2**64 + 1) % 7") -> 3                     (big integers are exact)
    evaluate("7/2")             -> 3.5, evaluate("8/2") -> 4 (exact division gives an int)
    evaluate("abs(-3) + max(1, 2)") -> 5

Allowed: integer and float literals, + - * / // % **, unary + and -, parentheses and the functions
in `FUNCTIONS`. Everything else (names, attributes, calls of anything else, strings, comparisons,
`^`) is a `CalcError` with a short message, as are division by zero and results too large:

- the expression is at most `MAX_CHARS` characters and `MAX_NODES` syntax nodes;
- every integer (operand or result) has at most `MAX_DIGITS` decimal digits; a power is refused
  *before* it is computed when its result would exceed that (|base|**exp is bounded from the
  operands' bit lengths), so `9**9**9` costs nothing;
- floats must stay finite.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from rlvr.sandbox import pyast

MAX_CHARS = 500
MAX_NODES = 200
MAX_DIGITS = 1000
_MAX_BITS = int(MAX_DIGITS * math.log2(10)) + 1
_LIMIT = 10 ** MAX_DIGITS

Number = int | float


class CalcError(ValueError):
    """The expression is not allowed or cannot be evaluated (the message says why)."""


def _check(value: Number) -> Number:
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, int):
        if abs(value) >= _LIMIT:
            raise CalcError(f"result too large (more than {MAX_DIGITS} digits)")
        return value
    if not math.isfinite(value):
        raise CalcError("result is not a finite number")
    return value


def _divide(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalcError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


def _floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalcError("division by zero")
    return a // b


def _mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalcError("modulo by zero")
    return a % b


def _power(a: Number, b: Number) -> Number:
    if isinstance(b, int) and isinstance(a, int) and b >= 0:
        if abs(a) > 1 and (abs(a).bit_length() - 1) * b > _MAX_BITS:
            raise CalcError(f"result too large (more than {MAX_DIGITS} digits)")
        return a ** b
    if a == 0 and b < 0:
        raise CalcError("zero to a negative power")
    try:
        result = float(a) ** float(b)
    except (OverflowError, ZeroDivisionError) as e:
        raise CalcError(f"power out of range: {e}") from None
    if isinstance(result, complex):
        raise CalcError("power of a negative number to a fractional exponent")
    return result


_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _divide,
    ast.FloorDiv: _floordiv, ast.Mod: _mod, ast.Pow: _power,
}


def _round(x: Number, digits: int = 0) -> Number:
    if not isinstance(digits, int) or abs(digits) > 100:
        raise CalcError("round: digits must be a small integer")
    return round(x) if digits == 0 else round(x, digits)


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise CalcError("sqrt of a negative number")
    if isinstance(x, int):
        root = math.isqrt(x)
        if root * root == x:
            return root
    return math.sqrt(x)


FUNCTIONS: dict[str, Callable[..., Number]] = {"abs": abs, "min": min, "max": max, "round": _round,
                                               "sqrt": _sqrt}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.BitXor):
            raise CalcError("'^' is not a power here: write a**b")
        if type(node.op) not in _BINARY:
            raise CalcError(f"operator {type(node.op).__name__} is not supported")
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int) \
                and left.bit_length() + right.bit_length() > _MAX_BITS + 1:
            raise CalcError(f"result too large (more than {MAX_DIGITS} digits)")
        try:
            return _check(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise CalcError("result out of range") from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords:
        if node.func.id not in FUNCTIONS:
            raise CalcError(f"unknown function {node.func.id!r}; known: {', '.join(FUNCTIONS)}")
        args = [_eval(a) for a in node.args]
        try:
            return _check(FUNCTIONS[node.func.id](*args))
        except (TypeError, ValueError, OverflowError) as e:
            raise CalcError(f"{node.func.id}: {e}") from None
    if isinstance(node, ast.Name):
        raise CalcError(f"unknown name {node.id!r}: only numbers, operators and {', '.join(FUNCTIONS)}()")
    if isinstance(node, ast.Tuple):
        raise CalcError("one expression only (no commas: write 1234, not 1,234)")
    raise CalcError(f"{type(node).__name__} is not allowed in a calculator expression")


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression (see the module doc); CalcError when not allowed."""
    if not isinstance(expression, str):
        raise CalcError("the expression must be a string")
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = pyast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not a valid arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    return _eval(tree)


def format_number(value: Number) -> str:
    """Ints in full; floats as Python's shortest repr (integral floats without '.0' when exact)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return str(int(value))
    return str(value)
