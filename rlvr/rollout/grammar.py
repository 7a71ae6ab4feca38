"""Constrained decoding on the host side: token automata for regexes and JSON schemas.

A `Grammar` compiles a regex (SGLang's `regex`, a `json_schema` through outlines-core's
schema-to-regex, a `choice` list, or the forced tool-call format) against the tokenizer's
vocabulary into a token-level automaton (outlines-core `Index`: the tokens allowed in each state
and the state each leads to). The engine keeps one automaton state per constrained sequence and
applies `mask(state, budget)` to the logits on the device (a packed bit row per sequence), so the
model can only write text the grammar accepts.

Length budget: every state knows the fewest tokens that reach an accepting state, and a token is
allowed only if the output can still be completed within max_new_tokens after it. So an output
that stops at max_new_tokens is still a complete match (a JSON schema's output always parses),
whatever the model prefers; where the budget is too small to finish at all, the tokens closest to
finishing are allowed. End of sequence (eos or a stop token) is allowed exactly in accepting states.

Compiled grammars are cached per (kind, text, tokenizer); masks per (state, budget class).
"""

from __future__ import annotations

import collections
import json
import math
import threading
import weakref
from typing import Any

import numpy as np

from rlvr.rollout.vocab import token_bytes

_META = set("\\.+*?()|[]{}^$#&-~")
MAX_GRAMMARS = 256  # compiled grammars kept per tokenizer (least recently used dropped)


def escape(text: str) -> str:
    """A regex matching `text` literally (outlines-core's regex dialect)."""
    out = []
    for ch in text:
        if ch in _META:
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{{{ord(ch):02X}}}")
        else:
            out.append(ch)
    return "".join(out)


def schema_regex(schema: str | dict[str, Any]) -> str:
    """The regex of a JSON schema (outlines-core; whitespace between tokens is at most one space).
    Numeric bounds, which outlines-core drops, are enforced here: an integer's minimum / maximum
    (exclusive ones too) become an exact digit-range regex, a number's with integer bounds one
    with a fraction, and a bounded number with `multipleOf` its list of values (up to 1024).
    Not enforced: uniqueItems, other number bounds."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        tree = json.loads(schema) if isinstance(schema, str) else schema
        ranges: list[str] = []
        regex = build_regex_from_schema(json.dumps(_bounded(tree, ranges)))
    except Exception as e:  # a malformed schema or one outlines-core cannot express
        raise ValueError(f"json_schema cannot be compiled: {e}") from None
    for k, pattern in enumerate(ranges):
        regex = regex.replace(f'"{_RANGE}{k}__"', f"({pattern})")
    return regex


_RANGE = "__rlvr_numeric_range_"
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _bounded(node: Any, ranges: list[str]) -> Any:
    """`node` with every bounded numeric subschema replaced by a placeholder constant whose regex
    is appended to `ranges` (schema_regex puts it back in place of the constant's literal)."""
    if not isinstance(node, dict):
        return node
    pattern = _numeric_pattern(node)
    if pattern is not None:
        ranges.append(pattern)
        return {"const": f"{_RANGE}{len(ranges) - 1}__"}
    out = dict(node)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: _bounded(sub, ranges) for name, sub in node[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_bounded(sub, ranges) for sub in node[key]]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            out[key] = _bounded(node[key], ranges)
    return out


def _numeric_pattern(node: dict[str, Any]) -> str | None:
    kind = node.get("type")
    keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    if kind not in ("integer", "number") or not any(k in node for k in keys):
        return None
    lo, hi = node.get("minimum"), node.get("maximum")
    if isinstance(node.get("exclusiveMinimum"), int | float):
        lo = node["exclusiveMinimum"] + (1 if kind == "integer" else 0)
    if isinstance(node.get("exclusiveMaximum"), int | float):
        hi = node["exclusiveMaximum"] - (1 if kind == "integer" else 0)
    if kind == "integer":
        return integer_range_regex(None if lo is None else math.ceil(lo), None if hi is None else math.floor(hi))
    step = node.get("multipleOf")
    if step and lo is not None and hi is not None and (hi - lo) / step <= 1024:
        values = [round(k * step, 12) for k in range(math.ceil(lo / step), math.floor(hi / step) + 1)]
        return "|".join(escape(json.dumps(v)) for v in values)
    if all(isinstance(b, int) for b in (lo, hi)) and 0 <= lo < hi and not node.get("exclusiveMaximum"):
        return f"({integer_range_regex(lo, hi - 1)})(\\.[0-9]+)?|{hi}(\\.0+)?"
    return None


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """A regex matching exactly the JSON integers in [lo, hi] (None: unbounded on that side)."""
    parts = []
    if lo is None or lo < 0:  # negatives: -n for n in [max(1, -hi), -lo]
        n_lo = 1 if hi is None or hi >= 0 else -hi
        n_hi = None if lo is None else -lo
        parts += ["-" + p for p in _nonnegative(n_lo, n_hi)]
    if hi is None or hi >= 0:
        parts += _nonnegative(max(lo or 0, 0), hi)
    return "|".join(parts) if parts else "(?!)"


def _nonnegative(lo: int, hi: int | None) -> list[str]:
    """Patterns of the integers in [lo, hi] (lo >= 0; hi None = unbounded), by digit count."""
    patterns, start = [], lo
    while hi is None or start <= hi:
        digits = len(str(start))
        if hi is None and start == 10 ** (digits - 1) and digits > 1:
            return patterns + [f"[1-9][0-9]{{{digits - 1},}}"]
        end = 10**digits - 1 if hi is None else min(hi, 10**digits - 1)
        patterns += _same_length(str(start), str(end))
        start = end + 1
    return patterns


def _same_length(a: str, b: str) -> list[str]:
    """Patterns of the integers from a to b, both written with the same number of digits."""
    if a == b:
        return [a]
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [a[0] + p for p in _same_length(a[1:], b[1:])]
    rest = len(a) - 1
    out, first, last, tail = [], a[0], b[0], []
    if a[1:] != "0" * rest:
        out += [a[0] + p for p in _same_length(a[1:], "9" * rest)]
        first = chr(ord(a[0]) + 1)
    if b[1:] != "9" * rest:
        tail = [b[0] + p for p in _same_length("0" * rest, b[1:])]
        last = chr(ord(b[0]) - 1)
    if first <= last:
        out.append((first if first == last else f"[{first}-{last}]") + "[0-9]" * rest)
    return out + tail


def constraint_regex(kind: str, value: Any) -> str:
    if kind == "regex":
        return value
    if kind == "json_schema":
        return schema_regex(value)
    if kind == "choices":
        return "(" + "|".join(escape(c) for c in value) + ")"
    raise ValueError(f"unknown constraint {kind!r}")


class Grammar:
    """A regex compiled for one vocabulary (see the module docstring)."""

    def __init__(self, regex: str, tokenizer: Any, vocab_size: int):
        from outlines_core import Index

        self.vocab_size = vocab_size
        self.eos = tokenizer.eos_id
        try:
            index = Index(regex, _vocabulary(tokenizer))
        except Exception as e:
            raise ValueError(f"constraint cannot be compiled for this vocabulary: {e}") from None
        self.initial = index.get_initial_state()
        self.final = frozenset(index.get_final_states())
        edges = index.get_transitions()
        self.next: dict[int, dict[int, int]] = {s: {t: n for t, n in out.items() if t != self.eos}
                                                 for s, out in edges.items()}
        self.distance = _distances(self.next, self.final)
        self._ranked: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._masks: dict[tuple[int, int], np.ndarray] = {}
        self._lock = threading.Lock()

    def advance(self, state: int, token: int) -> int | None:
        """The state after `token`, or None if the grammar does not allow it there."""
        return self.next.get(state, {}).get(token)

    def allowed(self, state: int, budget: int) -> np.ndarray:
        """Token ids allowed in `state` with `budget` tokens left (eos / stops not included)."""
        tokens, need = self._rank(state)
        if not len(tokens):
            return tokens
        fits = int(np.searchsorted(need, budget - 1, side="right"))
        return tokens[: max(fits, int(np.searchsorted(need, need[0], side="right")))]

    def mask(self, state: int, budget: int, stop_ids: list[int]) -> np.ndarray:
        """Packed bits (uint8 [ceil(V / 8)], little-endian bit order) of the allowed tokens; stop
        ids (eos, stop_token_ids) are allowed in accepting states only."""
        tokens, need = self._rank(state)
        key = (state, budget if len(need) and budget <= need[-1] else -1)
        with self._lock:
            cached = self._masks.get(key)
        if cached is not None:
            return cached
        row = np.zeros(self.vocab_size, bool)
        row[self.allowed(state, budget)] = True
        if state in self.final or not row.any():
            row[[t for t in stop_ids if 0 <= t < self.vocab_size]] = True
        packed = np.packbits(row, bitorder="little")
        with self._lock:
            if len(self._masks) > 4096:
                self._masks.clear()
            self._masks[key] = packed
        return packed

    def _rank(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """(allowed tokens, tokens each then needs to finish), sorted by the latter."""
        ranked = self._ranked.get(state)
        if ranked is None:
            out = self.next.get(state, {})
            tokens = np.fromiter(out.keys(), np.int64, len(out))
            need = np.fromiter((self.distance.get(n, 1 << 30) for n in out.values()), np.int64, len(out))
            order = np.argsort(need, kind="stable")
            ranked = self._ranked[state] = (tokens[order], need[order])
        return ranked


def _distances(edges: dict[int, dict[int, int]], final: frozenset[int]) -> dict[int, int]:
    """Fewest tokens from each state to an accepting one (breadth-first over reversed edges)."""
    reverse: dict[int, set[int]] = collections.defaultdict(set)
    for state, out in edges.items():
        for nxt in out.values():
            reverse[nxt].add(state)
    distance = dict.fromkeys(final, 0)
    queue = collections.deque(final)
    while queue:
        state = queue.popleft()
        for prev in reverse.get(state, ()):
            if prev not in distance:
                distance[prev] = distance[state] + 1
                queue.append(prev)
    return distance


_VOCABS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_GRAMMARS: weakref.WeakKeyDictionary[Any, collections.OrderedDict] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def _vocabulary(tokenizer: Any) -> Any:
    """outlines-core's Vocabulary of a tokenizer: every non-special token's bytes."""
    from outlines_core import Vocabulary

    with _CACHE_LOCK:
        vocab = _VOCABS.get(tokenizer)
    if vocab is None:
        if tokenizer.eos_id is None:
            raise ValueError("constrained decoding needs a tokenizer with an eos token")
        pieces: dict[bytes, list[int]] = {}
        for token_id, raw in enumerate(token_bytes(tokenizer)):
            if raw and token_id != tokenizer.eos_id:
                pieces.setdefault(raw, []).append(token_id)
        vocab = Vocabulary(tokenizer.eos_id, pieces)
        with _CACHE_LOCK:
            _VOCABS[tokenizer] = vocab
    return vocab


def compile_constraint(kind: str, value: Any, tokenizer: Any, vocab_size: int) -> Grammar:
    """The (cached) grammar of a request's constraint; ValueError if it cannot be compiled."""
    if tokenizer is None:
        raise ValueError("constrained decoding needs a tokenizer")
    key = (kind, value if isinstance(value, str) else tuple(value), vocab_size)
    with _CACHE_LOCK:
        cache = _GRAMMARS.setdefault(tokenizer, collections.OrderedDict())
        grammar = cache.get(key)
        if grammar is not None:
            cache.move_to_end(key)
            return grammar
    grammar = Grammar(constraint_regex(kind, value), tokenizer, vocab_size)
    with _CACHE_LOCK:
        cache[key] = grammar
        while len(cache) > MAX_GRAMMARS:
            cache.popitem(last=False)
    return grammar
