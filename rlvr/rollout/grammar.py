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
    """The regex of a JSON schema (outlines-core; whitespace between tokens is at most one space)."""
    from outlines_core.json_schema import build_regex_from_schema

    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        return build_regex_from_schema(text)
    except Exception as e:  # a malformed schema or one outlines-core cannot express
        raise ValueError(f"json_schema cannot be compiled: {e}") from None


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
