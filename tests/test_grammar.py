"""Constrained decoding's host side (rlvr.rollout.grammar) without a model: numeric ranges against
brute force, the length budget against random walks, tool-call and choice grammars against the
parsers that read them back."""

import json
import re

import numpy as np
import pytest

from rlvr.models.tokenizer import byte_level_tokenizer
from rlvr.rollout.grammar import compile_constraint, integer_range_regex, schema_regex
from rlvr.rollout.tool_calls import parse_tool_calls, tool_call_regex

TOK = byte_level_tokenizer()


@pytest.mark.parametrize("lo,hi", [(0, 120), (-35, 7), (5, None), (None, -3), (None, None), (1000, 1000), (-99, -10),
                                   (7, 2)])
def test_integer_range_regex_matches_exactly_the_range(lo, hi):
    pattern = re.compile(f"(?:{integer_range_regex(lo, hi)})")
    for x in range(-2000, 2000):
        assert (pattern.fullmatch(str(x)) is not None) == ((lo is None or x >= lo) and (hi is None or x <= hi)), x
    assert not any(pattern.fullmatch(s) for s in ("-0", "007", "+5", "1.5", ""))


def test_schema_bounds_are_kept():
    schema = {"type": "object", "required": ["n", "x"], "properties": {
        "n": {"type": "integer", "exclusiveMinimum": 3, "maximum": 12},
        "x": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25}}}
    pattern = re.compile(schema_regex(schema))
    values = [json.loads(m) for m in (json.dumps({"n": n, "x": x}) for n in range(-5, 20) for x in
                                      (0.0, 0.25, 0.5, 0.3, 1.0, 1.25)) if pattern.fullmatch(m.replace(", ", ","))]
    assert {v["n"] for v in values} == set(range(4, 13)) and {v["x"] for v in values} == {0, 0.25, 0.5, 1.0}


def test_length_budget_always_finishes_in_time():
    """Random walks through the masks with a tight budget always end in an accepting state."""
    grammar = compile_constraint("json_schema", json.dumps({"type": "object"}), TOK, 300)
    eos = TOK.eos_id
    rng = np.random.default_rng(0)
    shortest = grammar.distance[grammar.initial]
    for budget in (shortest + 1, shortest + 5, 40):
        for _ in range(20):
            state, left, text = grammar.initial, budget, b""
            while True:
                allowed = np.flatnonzero(np.unpackbits(grammar.mask(state, left, [eos]), bitorder="little")[:300])
                token = int(rng.choice(allowed))
                if token == eos:
                    break
                state, left, text = grammar.advance(state, token), left - 1, text + bytes([token])
                assert left >= 0
                if left == 0:
                    break
            assert state in grammar.final and isinstance(json.loads(text), dict), text


def test_tool_call_and_choice_grammars_read_back():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "noop"}}]
    both = re.compile(tool_call_regex(tools))
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert both.fullmatch(text)
    content, calls = parse_tool_calls(text)
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "noop"]
    named = re.compile(tool_call_regex(tools, "noop"))
    assert not named.fullmatch(text) and named.fullmatch(text.split("\n<tool_call>\n")[0].replace("add", "noop")
                                                         .replace('{"a": 1}', "{}"))
    grammar = compile_constraint("choices", ["a.b", "c"], TOK, 300)
    assert grammar.advance(grammar.initial, ord("a")) is not None and grammar.advance(grammar.initial, ord(".")) is None
