"""Procedural task families: generated on the fly, unlimited, instant, with exact reference answers.

Each family is a `base.Family` whose `sample(rng, level)` draws one task at a difficulty level
(0 = easiest; each level raises a size: operand magnitude, number of operations, string or list
length, number of fields, tool operations). Every family is deterministic in
`(seed, stream, index, level)` (see `Family.task`) and uses the answer-tag format: the prompt ends
with `base.ANSWER_INSTRUCTION`, and the reference completion is the reference answer in the tag.

  algebra_linear      solve a linear equation for integer x                     math verifier
  arith_expr          evaluate an integer expression with parentheses            numeric
  fraction_sum        add/subtract fractions, answer in lowest terms             math (+ lowest-terms check)
  string_reverse      reverse a string                                           exact
  string_upper_count  count a letter (both cases) in a mixed-case string         exact
  string_caesar       decode a Caesar cipher (shift unknown at the top level)    exact, case-insensitive
  list_sort           sort integers                                              regex (comma-separated)
  list_dedupe         drop repeated integers, first occurrences kept             regex
  list_max_k          the k largest integers, descending                         regex
  json_person         a JSON object meeting a generated schema and given values  json_schema
  code_function       write a small Python function                              code (calls judged on the host)
  tool_bank           bank operations as tool calls                              tool_state ("bank")
  tool_files          file operations as tool calls                              tool_state ("files")

code_function: the program goes inside the answer tag, in a ```python fence (the HumanEval
convention; the verifier strips the fence, a bare program inside the tag works too).
"""

from __future__ import annotations

import fractions
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from rlvr.tasks.base import ANSWER_INSTRUCTION, Family, Task, chat_messages, pick, uniform_levels
from rlvr.tasks.verifiers import TOOL_SETS, apply_tool_calls

LOWER = "abcdefghijklmnopqrstuvwxyz"
WORDS = ("apple", "river", "stone", "light", "green", "table", "music", "paper", "house", "cloud", "bread",
         "chair", "dream", "earth", "field", "glass", "heart", "horse", "lemon", "money", "night", "ocean",
         "plant", "queen", "radio", "smile", "sugar", "tiger", "train", "water", "woman", "world", "yellow",
         "garden", "winter", "summer", "forest", "silver", "market", "window", "bridge", "candle", "planet",
         "rabbit", "pencil", "orange", "castle", "mirror", "basket", "doctor")
NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory",
         "nina", "oscar", "peggy", "rupert", "sybil", "trent", "victor", "walter", "zoe")
CITIES = ("Paris", "Oslo", "Lima", "Tokyo", "Cairo", "Dublin", "Quito", "Seoul", "Rome", "Perth")


def _task(question: str, answer: str, verifier: dict, **metadata: Any) -> Task:
    """A tag-format task: the question plus the answer instruction, as raw prompt and chat."""
    prompt = f"{question}\n\n{ANSWER_INSTRUCTION}"
    return Task(index=0, prompt=prompt, answer=answer, messages=chat_messages(prompt), verifier=verifier,
                metadata=metadata)


def _int(rng: np.random.Generator, low: int, high: int, nonzero: bool = False) -> int:
    """Uniform integer in [low, high] (optionally never 0)."""
    while True:
        value = int(rng.integers(low, high + 1))
        if value or not nonzero:
            return value


# ----------------------------------------------------------------------------------------- math


def _linear(coefficient: int, constant: int = 0) -> str:
    """`3x - 4`, `-x`, `x + 2`: a readable linear expression in x."""
    x = {1: "x", -1: "-x"}.get(coefficient, f"{coefficient}x")
    if constant == 0:
        return x
    return f"{x} {'+' if constant > 0 else '-'} {abs(constant)}"


class AlgebraLinear(Family):
    """Solve for integer x (never 0). Level 0: ax + b = c, small positive; 1: signed, larger;
    2: x on both sides; 3: a(x + b) + cx = dx + e with larger coefficients."""

    name, domain = "algebra_linear", "math"
    SIZES = (5, 12, 20, 30)

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        size = self.SIZES[level]
        x = _int(rng, 1, 10) if level == 0 else _int(rng, -size, size, nonzero=True)
        a = _int(rng, 2, size) if level == 0 else _int(rng, -size, size, nonzero=True)
        b = _int(rng, 1, 10) if level == 0 else _int(rng, -3 * size, 3 * size, nonzero=True)
        if level <= 1:
            equation = f"{_linear(a, b)} = {a * x + b}"
        elif level == 2:  # ax + b = dx + e
            d = self._other(rng, size, a)
            equation = f"{_linear(a, b)} = {_linear(d, (a - d) * x + b)}"
        else:  # a(x + b) + cx = dx + e
            c = _int(rng, -size, size, nonzero=True)
            d = self._other(rng, size, a + c)
            left = f"{a}(x {'+' if b > 0 else '-'} {abs(b)}) {'+' if c > 0 else '-'} {_linear(abs(c))}"
            equation = f"{left} = {_linear(d, a * (x + b) + (c - d) * x)}"
        question = f"Solve for x: {equation}"
        return _task(question, str(x), {"kind": "math", "answer": str(x)}, equation=equation)

    @staticmethod
    def _other(rng: np.random.Generator, size: int, coefficient: int) -> int:
        """A nonzero coefficient for the right side that differs from the left's (one solution)."""
        while True:
            d = _int(rng, -size, size, nonzero=True)
            if d != coefficient:
                return d


class ArithExpr(Family):
    """Evaluate an integer expression of + - * with parentheses; level = number of operations
    (2, 3, 5, 7) and operand size. A product's right operand is a small leaf, to keep values sane."""

    name, domain = "arith_expr", "math"
    OPS = (2, 3, 5, 7)
    MAX_OPERAND = (9, 20, 50, 99)
    PRECEDENCE = {"+": 1, "-": 1, "*": 2}

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def _build(self, rng: np.random.Generator, ops: int, high: int) -> tuple[str, int, int]:
        """(text, value, precedence) of a random expression with `ops` operators."""
        if ops == 0:
            value = _int(rng, 1, high)
            return str(value), value, 3
        op = pick(rng, "+-*")
        if op == "*":
            left_text, left_value, left_prec = self._build(rng, ops - 1, high)
            right_value = _int(rng, 2, 9)
            right, right_prec = str(right_value), 3
        else:
            split = _int(rng, 0, ops - 1)
            left_text, left_value, left_prec = self._build(rng, split, high)
            right, right_value, right_prec = self._build(rng, ops - 1 - split, high)
        prec = self.PRECEDENCE[op]
        if left_prec < prec:
            left_text = f"({left_text})"
        if right_prec < prec or (right_prec == prec and op == "-"):
            right = f"({right})"
        value = {"+": left_value + right_value, "-": left_value - right_value, "*": left_value * right_value}[op]
        return f"{left_text} {op} {right}", value, prec

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        text, value, _ = self._build(rng, self.OPS[level], self.MAX_OPERAND[level])
        question = f"Compute the value of this expression: {text}"
        return _task(question, str(value), {"kind": "numeric", "answer": str(value)}, expression=text,
                     operations=self.OPS[level])


def _fraction_text(value: fractions.Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


_PLAIN_FRACTION = re.compile(r"\$?\s*(-?)\s*(\d+)\s*(?:/\s*(\d+))?\s*\$?")
_LATEX_FRACTION = re.compile(r"\$?\s*(-?)\s*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}\s*\$?")


def in_lowest_terms(answer: str) -> bool:
    """The answer is written as an integer or a reduced fraction: "7/12", "-3", "\\frac{7}{12}"."""
    found = _PLAIN_FRACTION.fullmatch(answer.strip()) or _LATEX_FRACTION.fullmatch(answer.strip())
    if found is None:
        return False
    if found.group(3) is None:
        return True
    numerator, denominator = int(found.group(2)), int(found.group(3))
    return denominator > 1 and math.gcd(numerator, denominator) == 1


class FractionSum(Family):
    """Add (and, from level 2, subtract) 2..5 fractions; the answer must be in lowest terms. Level =
    number of fractions and denominator size. Math verifier for the value, plus a lowest-terms check."""

    name, domain = "fraction_sum", "math"
    COUNTS = (2, 3, 4, 5)
    MAX_DENOMINATOR = (6, 10, 15, 20)

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        while True:
            terms = []
            for _ in range(self.COUNTS[level]):
                denominator = _int(rng, 2, self.MAX_DENOMINATOR[level])
                terms.append(fractions.Fraction(_int(rng, 1, denominator - 1), denominator))
            signs = [1] + [pick(rng, (1, -1)) if level >= 2 else 1 for _ in terms[1:]]
            total = sum(s * t for s, t in zip(signs, terms, strict=True))
            if total != 0:
                break
        text = f"{terms[0].numerator}/{terms[0].denominator}" + "".join(
            f" {'+' if sign > 0 else '-'} {t.numerator}/{t.denominator}"
            for sign, t in zip(signs[1:], terms[1:], strict=True))
        question = (f"Compute {text}. Write the result as a fraction a/b in lowest terms "
                    "(or as an integer if it is whole).")
        answer = _fraction_text(total)
        return _task(question, answer, {"kind": "math", "answer": answer}, expression=text)

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        """The math verifier's verdict, and 0 unless the answer is written in lowest terms."""
        answer = self.answer_text(completion)
        if answer is not None and not truncated and not in_lowest_terms(answer):
            return {"terminal": 0.0, "format": 1.0}
        return super().verify(task, completion, truncated)


# ----------------------------------------------------------------------------------------- strings

STRING_LENGTHS = ((4, 6), (8, 12), (14, 20), (24, 32))


def _random_string(rng: np.random.Generator, level: int, alphabet: str) -> str:
    low, high = STRING_LENGTHS[level]
    return "".join(pick(rng, alphabet) for _ in range(_int(rng, low, high)))


class StringReverse(Family):
    """Reverse a string; level = length (4-6 … 24-32), mixed case and digits from level 2."""

    name, domain = "string_reverse", "strings"

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        alphabet = LOWER if level < 2 else LOWER + LOWER.upper() + "0123456789"
        text = _random_string(rng, level, alphabet)
        question = f'Reverse the string "{text}" (write its characters in reverse order, without quotes).'
        return _task(question, text[::-1], {"kind": "exact", "answer": text[::-1]}, length=len(text))


class StringUpperCount(Family):
    """How often a letter occurs (upper and lower case both count) in a mixed-case string; level =
    length. The string is drawn from a few letters so counts are not trivially 0 or 1."""

    name, domain = "string_upper_count", "strings"

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        letters = "".join(pick(rng, LOWER) for _ in range(5))
        text = "".join(c.upper() if rng.random() < 0.5 else c for c in _random_string(rng, level, letters))
        letter = pick(rng, letters)
        count = text.lower().count(letter)
        question = (f"How many times does the letter '{letter}' occur in the string \"{text}\"? Count both "
                    "upper-case and lower-case occurrences. Answer with the number only.")
        return _task(question, str(count), {"kind": "exact", "answer": str(count)}, length=len(text))


def caesar(text: str, shift: int) -> str:
    """Shift each lower-case letter forward by `shift` places (wrapping z to a)."""
    return "".join(LOWER[(LOWER.index(c) + shift) % 26] if c in LOWER else c for c in text)


class StringCaesar(Family):
    """Decode a Caesar cipher of 1, 2, 4 or 6 words; the shift is given, except at level 3."""

    name, domain = "string_caesar", "strings"
    WORD_COUNTS = (1, 2, 4, 6)

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        plain = " ".join(pick(rng, WORDS) for _ in range(self.WORD_COUNTS[level]))
        shift = _int(rng, 1, 25)
        how = (f"shifting each letter forward by {shift} places in the alphabet (z wraps to a)" if level < 3
               else "shifting each letter forward by an unknown number of places (the plaintext is English words)")
        question = (f"The text \"{caesar(plain, shift)}\" was encoded with a Caesar cipher, {how}. "
                    "Decode it and give the plaintext.")
        return _task(question, plain, {"kind": "exact", "answer": plain, "case_sensitive": False},
                     shift=shift, words=self.WORD_COUNTS[level])


# ----------------------------------------------------------------------------------------- lists


def list_pattern(items: Sequence[int]) -> str:
    """A regex for exactly these integers, comma-separated, spaces free, optional [ ]."""
    return r"\[?\s*" + r"\s*,\s*".join(re.escape(str(x)) for x in items) + r"\s*\]?"


def _list_task(question: str, items: Sequence[int], **metadata: Any) -> Task:
    answer = ", ".join(str(x) for x in items)
    question += " Answer with the numbers, comma-separated."
    return _task(question, answer, {"kind": "regex", "pattern": list_pattern(items)}, **metadata)


LIST_LENGTHS = (5, 8, 12, 18)
LIST_RANGES = ((0, 20), (0, 99), (-99, 99), (-999, 999))


class ListSort(Family):
    """Sort integers ascending; level = list length (5 … 18) and value range (incl. negatives)."""

    name, domain = "list_sort", "lists"

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        low, high = LIST_RANGES[level]
        items = [_int(rng, low, high) for _ in range(LIST_LENGTHS[level])]
        return _list_task(f"Sort these integers in ascending order: {items}.", sorted(items), length=len(items))


class ListDedupe(Family):
    """Remove repeats, keeping each number's first occurrence in order; level = list length. The values
    come from a range smaller than the list, so there are repeats."""

    name, domain = "list_dedupe", "lists"
    LENGTHS = (6, 10, 15, 22)

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        length = self.LENGTHS[level]
        low = LIST_RANGES[level][0] // 10
        items = [_int(rng, low, low + (2 * length) // 3) for _ in range(length)]
        unique = list(dict.fromkeys(items))
        question = (f"Remove the repeated numbers from this list, keeping the first occurrence of each number "
                    f"in its original order: {items}.")
        return _list_task(question, unique, length=length)


class ListMaxK(Family):
    """The k largest of distinct integers, largest first; level = list length and k."""

    name, domain = "list_max_k", "lists"
    LENGTHS = (6, 10, 15, 22)
    KS = ((1, 2), (2, 3), (3, 5), (4, 7))

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        low, high = LIST_RANGES[level]
        items = [int(x) + low for x in rng.choice(high - low + 1, self.LENGTHS[level], replace=False)]
        k = _int(rng, *self.KS[level])
        question = f"List the {k} largest numbers of {items}, from largest to smallest."
        return _list_task(question, sorted(items, reverse=True)[:k], length=len(items), k=k)


# ----------------------------------------------------------------------------------------- JSON


class Field(NamedTuple):
    name: str
    schema: dict
    fixed: Any  # the value the prompt dictates (checked through the verifier's `expected`), or None
    text: str  # the field as the prompt describes it
    example: Any  # a valid value (for the reference answer)


def _field_name(rng: np.random.Generator) -> Field:
    value = pick(rng, NAMES).capitalize()
    return Field("name", {"type": "string"}, value, f'"name": the string "{value}"', value)


def _field_age(rng: np.random.Generator) -> Field:
    low = _int(rng, 0, 50)
    high = low + _int(rng, 5, 40)
    return Field("age", {"type": "integer", "minimum": low, "maximum": high}, None,
                 f'"age": an integer from {low} to {high}', _int(rng, low, high))


def _field_city(rng: np.random.Generator) -> Field:
    options = [str(c) for c in rng.choice(CITIES, 3, replace=False)]
    return Field("city", {"enum": options}, None, f'"city": one of {json.dumps(options)}', pick(rng, options))


def _field_email(rng: np.random.Generator) -> Field:
    domain = pick(rng, ("example.com", "mail.org", "post.net"))
    return Field("email", {"type": "string", "pattern": "^[a-z]+@" + re.escape(domain) + "$"}, None,
                 f'"email": lower-case letters, then "@{domain}"', f"{pick(rng, NAMES)}@{domain}")


def _field_score(rng: np.random.Generator) -> Field:
    step = pick(rng, (0.5, 0.25))
    return Field("score", {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": step}, None,
                 f'"score": a number from 0 to 100, a multiple of {step}', _int(rng, 0, int(100 / step)) * step)


def _field_active(rng: np.random.Generator) -> Field:
    value = bool(rng.random() < 0.5)
    return Field("active", {"type": "boolean"}, value, f'"active": the boolean {json.dumps(value)}', value)


def _field_tags(rng: np.random.Generator) -> Field:
    low = _int(rng, 1, 3)
    high = low + _int(rng, 0, 2)
    schema = {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": low, "maxItems": high,
              "uniqueItems": True}
    count = f"{low} to {high}" if high > low else f"exactly {low}"
    return Field("tags", schema, None, f'"tags": a list of {count} distinct non-empty strings',
                 [str(w) for w in rng.choice(WORDS, low, replace=False)])


def _field_id(rng: np.random.Generator) -> Field:
    value = _int(rng, 1000, 9999)
    return Field("id", {"type": "integer"}, value, f'"id": the integer {value}', value)


def _field_phone(rng: np.random.Generator) -> Field:
    example = f"{_int(rng, 100, 999)}-{_int(rng, 1000, 9999)}"
    return Field("phone", {"type": "string", "pattern": r"^\d{3}-\d{4}$"}, None,
                 '"phone": a string of 3 digits, a hyphen and 4 digits', example)


def _field_address(rng: np.random.Generator) -> Field:
    city = pick(rng, CITIES)
    schema = {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
              "properties": {"street": {"type": "string", "minLength": 3}, "city": {"const": city},
                             "zip": {"type": "string", "pattern": r"^\d{5}$"}}}
    text = (f'"address": an object with exactly the keys "street" (a string of 3 or more characters), "city" '
            f'(the string "{city}") and "zip" (a string of 5 digits)')
    example = {"street": f"{_int(rng, 1, 99)} {pick(rng, WORDS).capitalize()} Street", "city": city,
               "zip": str(_int(rng, 10000, 99999))}
    return Field("address", schema, None, text, example)


FIELDS: tuple[Callable[[np.random.Generator], Field], ...] = (
    _field_age, _field_city, _field_email, _field_score, _field_active, _field_tags, _field_id, _field_phone,
    _field_address)


class JsonPerson(Family):
    """Emit a JSON object for a person meeting generated field specs (types, ranges, enums, patterns,
    nested objects), with some values fixed by the prompt (the verifier's `expected`: "name" always, so
    not just any valid object passes). Level = number of fields (2, 3, 5, 7); from level 2 some fields
    are optional."""

    name, domain = "json_person", "structured"
    FIELD_COUNTS = (2, 3, 5, 7)

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        picked = rng.choice(len(FIELDS), self.FIELD_COUNTS[level] - 1, replace=False)
        fields = [_field_name(rng)] + [FIELDS[int(i)](rng) for i in picked]
        properties, required, expected, lines, reference = {}, [], {}, [], {}
        for field in fields:
            optional = level >= 2 and field.fixed is None and rng.random() < 0.3
            properties[field.name] = field.schema
            if field.fixed is not None:
                expected[field.name] = field.fixed
            if not optional:
                required.append(field.name)
            if not optional or rng.random() < 0.5:
                reference[field.name] = field.example
            lines.append(f"- {field.text}{' (optional)' if optional else ''}")
        schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        question = ("Write a JSON object describing a person with these keys and no others:\n" + "\n".join(lines)
                    + "\nGive the JSON object only.")
        verifier = {"kind": "json_schema", "schema": schema, "expected": expected}
        return _task(question, json.dumps(reference), verifier, fields=len(fields))


# ----------------------------------------------------------------------------------------- code


def _problem_sum_multiples(rng: np.random.Generator) -> dict:
    m = _int(rng, 2, 5)
    cases = [[_int(rng, -20, 50) for _ in range(_int(rng, 0, 8))] for _ in range(5)]
    return {"name": "sum_multiples", "args": ["nums"],
            "spec": f"returns the sum of the numbers in the list `nums` that are divisible by {m} (0 for none)",
            "code": f"def sum_multiples(nums):\n    return sum(x for x in nums if x % {m} == 0)\n",
            "cases": [(c,) for c in cases]}


def _problem_reverse_words(rng: np.random.Generator) -> dict:
    separator = pick(rng, (" ", ",", "-"))
    cases = [separator.join(pick(rng, WORDS) for _ in range(_int(rng, 1, 6))) for _ in range(5)]
    return {"name": "reverse_words", "args": ["text"],
            "spec": f"takes a string of words separated by {json.dumps(separator)} and returns the words in reverse "
                    f"order, joined by the same separator",
            "code": f"def reverse_words(text):\n    return {json.dumps(separator)}.join(text.split("
                    f"{json.dumps(separator)})[::-1])\n",
            "cases": [(c,) for c in cases]}


def _problem_fizzbuzz(rng: np.random.Generator) -> dict:
    a, b = (int(x) for x in rng.choice(np.arange(2, 8), 2, replace=False))
    wa, wb = pick(rng, ("Fizz", "Ping", "Tik")), pick(rng, ("Buzz", "Pong", "Tok"))
    cases = [_int(rng, 0, 40) for _ in range(5)]
    return {"name": "fizzbuzz", "args": ["n"],
            "spec": f"returns a list of strings for the numbers 1 to n: \"{wa}{wb}\" if the number is divisible by "
                    f"both {a} and {b}, \"{wa}\" if only by {a}, \"{wb}\" if only by {b}, else the number itself "
                    "as a string",
            "code": f"def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n"
                    f"        word = ('{wa}' if i % {a} == 0 else '') + ('{wb}' if i % {b} == 0 else '')\n"
                    f"        out.append(word or str(i))\n    return out\n",
            "cases": [(c,) for c in cases]}


def _problem_running_extreme(rng: np.random.Generator) -> dict:
    which, word = pick(rng, (("max", "largest"), ("min", "smallest")))
    cases = [[_int(rng, -50, 50) for _ in range(_int(rng, 0, 10))] for _ in range(5)]
    return {"name": f"running_{which}", "args": ["nums"],
            "spec": f"returns a list whose i-th element is the {word} of nums[0], ..., nums[i] (an empty list for "
                    "an empty input)",
            "code": f"def running_{which}(nums):\n    out = []\n    for x in nums:\n"
                    f"        out.append(x if not out else {which}(out[-1], x))\n    return out\n",
            "cases": [(c,) for c in cases]}


def _problem_run_length(rng: np.random.Generator) -> dict:
    letters = "".join(pick(rng, LOWER) for _ in range(3))
    cases = ["".join(pick(rng, letters) * _int(rng, 1, 4) for _ in range(_int(rng, 0, 6))) for _ in range(6)]
    return {"name": "run_length", "args": ["text"],
            "spec": "returns the run-length encoding of `text`: each maximal run of one character becomes the "
                    "character followed by the run's length (\"aaab\" -> \"a3b1\"; \"\" -> \"\")",
            "code": "def run_length(text):\n    out = []\n    i = 0\n    while i < len(text):\n"
                    "        j = i\n        while j < len(text) and text[j] == text[i]:\n            j += 1\n"
                    "        out.append(text[i] + str(j - i))\n        i = j\n    return ''.join(out)\n",
            "cases": [(c,) for c in cases]}


def _problem_balanced(rng: np.random.Generator) -> dict:
    pairs = [str(p) for p in rng.choice(["()", "[]", "{}", "<>"], 2, replace=False)]
    chars = "".join(pairs)
    cases = ["".join(pick(rng, chars) for _ in range(_int(rng, 0, 8))) for _ in range(4)]
    cases += [pairs[0][0] + pairs[1] + pairs[0][1], pairs[1][0] + pairs[0][0] + pairs[1][1] + pairs[0][1]]
    closing = ", ".join(f"{p[1]!r}: {p[0]!r}" for p in pairs)
    return {"name": "is_balanced", "args": ["text"],
            "spec": f"returns True if the brackets in `text` (which contains only the characters {chars}) are "
                    f"balanced and properly nested, with bracket pairs {' and '.join(pairs)}; else False",
            "code": f"def is_balanced(text):\n    closing = {{{closing}}}\n    stack = []\n"
                    "    for c in text:\n        if c in closing:\n"
                    "            if not stack or stack.pop() != closing[c]:\n                return False\n"
                    "        else:\n            stack.append(c)\n    return not stack\n",
            "cases": [(c,) for c in cases]}


def _problem_merge_intervals(rng: np.random.Generator) -> dict:
    def intervals() -> list[list[int]]:
        out = []
        for _ in range(_int(rng, 0, 6)):
            start = _int(rng, 0, 30)
            out.append([start, start + _int(rng, 0, 8)])
        return out

    return {"name": "merge_intervals", "args": ["intervals"],
            "spec": "takes a list of [start, end] integer intervals (start <= end, in any order) and returns the "
                    "list of merged intervals sorted by start, where intervals that overlap or touch (one's end "
                    "equals the other's start) are merged, each as a [start, end] list",
            "code": "def merge_intervals(intervals):\n    merged = []\n    for start, end in sorted(intervals):\n"
                    "        if merged and start <= merged[-1][1]:\n"
                    "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n"
                    "            merged.append([start, end])\n    return merged\n",
            "cases": [(intervals(),) for _ in range(7)]}


def _problem_lis(rng: np.random.Generator) -> dict:
    cases = [[_int(rng, 0, 20) for _ in range(_int(rng, 0, 10))] for _ in range(7)]
    return {"name": "longest_increasing", "args": ["nums"],
            "spec": "returns the length of the longest strictly increasing subsequence of `nums` (not necessarily "
                    "contiguous; 0 for an empty list)",
            "code": "def longest_increasing(nums):\n    best = []\n    for i, x in enumerate(nums):\n"
                    "        best.append(1 + max([best[j] for j in range(i) if nums[j] < x], default=0))\n"
                    "    return max(best, default=0)\n",
            "cases": [(c,) for c in cases]}


# Problems by level: harder levels need longer programs (more state, more cases to get right).
CODE_PROBLEMS: tuple[tuple[Callable[[np.random.Generator], dict], ...], ...] = (
    (_problem_sum_multiples, _problem_reverse_words),
    (_problem_fizzbuzz, _problem_running_extreme),
    (_problem_run_length, _problem_balanced),
    (_problem_merge_intervals, _problem_lis),
)

def code_calls(problem: dict) -> list[list]:
    """The tests as [[args, expected], ...] in JSON form: judged on the host by rlvr.sandbox."""
    namespace: dict[str, Any] = {}
    exec(problem["code"], namespace)  # our own reference implementation
    function = namespace[problem["name"]]
    return json.loads(json.dumps([[list(args), function(*args)] for args in problem["cases"]]))


class CodeFunction(Family):
    """Write a small Python function from a spec with random parameters; graded by running tests.
    Level 0: one-liners; 1: a loop (fizzbuzz variant, running max); 2: run-length encoding, bracket
    matching; 3: interval merging, longest increasing subsequence."""

    name, domain = "code_function", "code"

    def audit_allowed(self) -> dict[str, str]:
        reason = ("the verdict is the tests' verdict on the fenced program: prose or repeats around the "
                  "fence do not change what runs")
        return {"multi": reason, "overlong_filler": reason, "overlong_repeat": reason}

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        from rlvr.tasks.code_hacks import audit_hack_probes, fenced_answer

        return audit_hack_probes(task.index, task.verifier["entry_point"], fenced_answer)

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        problem = pick(rng, CODE_PROBLEMS[level])(rng)
        signature = f"{problem['name']}({', '.join(problem['args'])})"
        question = (f"Write a Python function `{signature}` that {problem['spec']}.\n\nPut the complete program "
                    "in a ```python code block inside the answer tags.")
        calls = code_calls(problem)
        verifier = {"kind": "code", "calls": calls, "entry_point": problem["name"], "timeout_s": 10}
        return _task(question, problem["code"], verifier, problem=problem["name"])

    def reference_completion(self, task: Task) -> str | None:
        """The reference program, fenced, inside the answer tag: what the prompt asks for."""
        return f"<answer>\n```python\n{task.answer.rstrip()}\n```\n</answer>"


# ----------------------------------------------------------------------------------------- tools


def tool_call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


TOOL_CALL_INSTRUCTION = ("Your answer is the tool calls in the order to run them, each written as "
                         '<tool_call>{"name": ..., "arguments": {...}}</tool_call>, with nothing else.')
OP_COUNTS = (1, 2, 4, 6)


class ToolFamily(Family):
    """Shared by the tool families: describe the state and the operations in words; the reference is the
    call sequence, and the verifier replays any answer on the initial state and compares with the target.
    Level = number of operations (1, 2, 4, 6)."""

    domain = "tools"
    tools = ""
    description = ""

    def levels(self) -> list[int]:
        return uniform_levels(4)

    def initial(self, rng: np.random.Generator) -> dict:
        raise NotImplementedError

    def operation(self, rng: np.random.Generator, state: dict) -> tuple[str, dict, str]:
        """(tool name, arguments, the operation in words), valid on `state`."""
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        initial = self.initial(rng)
        state, calls, steps = dict(initial), [], []
        for _ in range(OP_COUNTS[level]):
            name, arguments, words = self.operation(rng, state)
            TOOL_SETS[self.tools][name](state, **arguments)
            calls.append((name, arguments))
            steps.append(f"{len(steps) + 1}. {words}")
        assert apply_tool_calls(TOOL_SETS[self.tools], initial, calls) == state
        question = (f"{self.description}\n\nCurrent state: {json.dumps(initial)}\n\nDo the following, in order:\n"
                    + "\n".join(steps) + f"\n\n{TOOL_CALL_INSTRUCTION}")
        answer = "\n".join(tool_call_text(n, a) for n, a in calls)
        verifier = {"kind": "tool_state", "tools": self.tools, "initial": initial, "target": state}
        return _task(question, answer, verifier, operations=len(calls))


class ToolBank(ToolFamily):
    name, tools = "tool_bank", "bank"
    description = (
        "You operate a bank through tools. The state maps each account to its balance (whole units). Tools:\n"
        "- deposit(account, amount): add amount to an existing account\n"
        "- withdraw(account, amount): take amount from an account; fails if the balance is too low\n"
        "- transfer(source, target, amount): move amount between two existing accounts; fails if the source "
        "balance is too low\n"
        "- open_account(name): open a new account with balance 0")

    def initial(self, rng: np.random.Generator) -> dict:
        names = [str(n) for n in rng.choice(NAMES, _int(rng, 2, 4), replace=False)]
        return {n: 5 * _int(rng, 0, 40) for n in names}

    def operation(self, rng: np.random.Generator, state: dict) -> tuple[str, dict, str]:
        funded = [a for a in state if state[a] > 0]
        kind = pick(rng, ("deposit", "deposit", "withdraw", "transfer", "transfer", "open_account"))
        if (kind in ("withdraw", "transfer") and not funded) or (kind == "transfer" and len(state) < 2):
            kind = "deposit"
        if kind == "open_account":
            new = [n for n in NAMES if n not in state]
            name = pick(rng, new)
            return "open_account", {"name": name}, f"Open a new account for {name}."
        if kind == "deposit":
            account, amount = pick(rng, list(state)), 5 * _int(rng, 1, 20)
            return "deposit", {"account": account, "amount": amount}, f"Deposit {amount} into {account}'s account."
        source = pick(rng, funded)
        amount = 5 * _int(rng, 1, max(1, state[source] // 5))
        if kind == "withdraw":
            return "withdraw", {"account": source, "amount": amount}, f"{source} withdraws {amount}."
        target = pick(rng, [a for a in state if a != source])
        return "transfer", {"source": source, "target": target, "amount": amount}, \
            f"{source} sends {amount} to {target}."


class ToolFiles(ToolFamily):
    name, tools = "tool_files", "files"
    description = (
        "You edit a small file store through tools. The state maps each path to its text content. Tools:\n"
        "- write(path, content): create the file, or replace its content\n"
        "- append(path, content): add content to the end of an existing file (nothing is inserted between)\n"
        "- delete(path): remove an existing file\n"
        "- rename(source, target): rename an existing file to a path that does not exist yet")

    def audit_allowed(self) -> dict[str, str]:
        return {"overlong_repeat": "the verdict is the final state: repeating the writes reaches the same state"}

    def initial(self, rng: np.random.Generator) -> dict:
        words = [str(w) for w in rng.choice(WORDS, _int(rng, 2, 4), replace=False)]
        return {f"{w}.txt": " ".join(pick(rng, WORDS) for _ in range(_int(rng, 1, 3))) for w in words}

    def _new_path(self, rng: np.random.Generator, state: dict) -> str:
        return pick(rng, [f"{w}.{ext}" for w in WORDS for ext in ("txt", "md") if f"{w}.{ext}" not in state])

    def operation(self, rng: np.random.Generator, state: dict) -> tuple[str, dict, str]:
        kind = pick(rng, ("write", "append", "append", "delete", "rename"))
        if not state or kind == "delete" and len(state) < 2:
            kind = "write"
        if kind == "write":
            path = pick(rng, list(state)) if state and rng.random() < 0.3 else self._new_path(rng, state)
            content = state.get(path)
            while content == state.get(path):  # every operation changes the state
                content = " ".join(pick(rng, WORDS) for _ in range(_int(rng, 1, 3)))
            verb = "Overwrite" if path in state else "Create"
            return "write", {"path": path, "content": content}, \
                f"{verb} {json.dumps(path)} with the content {json.dumps(content)}."
        path = pick(rng, list(state))
        if kind == "append":
            content = " " + pick(rng, WORDS)
            return "append", {"path": path, "content": content}, \
                f"Append the text {json.dumps(content)} to {json.dumps(path)}."
        if kind == "delete":
            return "delete", {"path": path}, f"Delete {json.dumps(path)}."
        target = self._new_path(rng, state)
        return "rename", {"source": path, "target": target}, f"Rename {json.dumps(path)} to {json.dumps(target)}."


# ----------------------------------------------------------------------------------------- table

FAMILIES: dict[str, type[Family]] = {
    "algebra_linear": AlgebraLinear,
    "arith_expr": ArithExpr,
    "fraction_sum": FractionSum,
    "string_reverse": StringReverse,
    "string_upper_count": StringUpperCount,
    "string_caesar": StringCaesar,
    "list_sort": ListSort,
    "list_dedupe": ListDedupe,
    "list_max_k": ListMaxK,
    "json_person": JsonPerson,
    "code_function": CodeFunction,
    "tool_bank": ToolBank,
    "tool_files": ToolFiles,
}
