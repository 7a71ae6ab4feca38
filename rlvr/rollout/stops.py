"""Incremental stop-string matching: each new token's text is decoded and searched once.

`StopStrings.feed(output_ids)` is called after every batch of new tokens. It decodes only the new
tokens (with a few earlier ones as context, so byte-level BPE pieces and leading spaces come out
as in a full decode; a token that ends inside a multi-byte character waits for the next one) and
searches the new text plus the last `longest stop - 1` characters before it, so the work per token
does not grow with the output. A match reports how many tokens to keep: up to and including the
first token whose text completes the stop string, as a full re-decode would. Stop regexes
(`stop_regex`) are searched over the whole text so far (a match may need more than the new text);
the first match to end wins, a stop string before a regex match ending at the same token.
"""

from __future__ import annotations

import bisect
import re

_CONTEXT_TOKENS = 4  # earlier tokens decoded with the new ones: a piece's text can depend on them


class StopStrings:
    def __init__(self, tokenizer, stops: list[str], regexes: list[str] = ()):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.regexes = [_compile(pattern) for pattern in regexes]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the text of the first `self.done` tokens
        self.done = 0
        self.ends: list[int] = []  # ends[i]: len(self.text) once token i is decoded

    def feed(self, output_ids: list[int]) -> tuple[str, int] | None:
        """(the first stop string in the output, tokens to keep), or None."""
        while (self.stops or self.regexes) and self.done < len(output_ids):
            end = self._complete_piece_end(output_ids)
            if end is None:
                return None  # the output ends inside a character: wait for more tokens
            start = max(len(self.text) - self.longest + 1, 0)
            self.text += self._new_text(output_ids, end)
            self.ends += [len(self.text)] * (end - self.done)
            self.done = end
            hit = self._search(start)
            if hit is not None:
                return hit
        return None

    def _context(self) -> int:
        return max(self.done - _CONTEXT_TOKENS, 0)

    def _complete_piece_end(self, ids: list[int]) -> int | None:
        """The smallest end > done whose text does not stop inside a character."""
        for end in range(self.done + 1, len(ids) + 1):
            if not self.tokenizer.decode(ids[self._context():end]).endswith("\ufffd"):
                return end
        return None

    def _new_text(self, ids: list[int], end: int) -> str:
        before = self.tokenizer.decode(ids[self._context():self.done])
        piece = self.tokenizer.decode(ids[self._context():end])
        if piece.startswith(before):
            return piece[len(before):]
        return self.tokenizer.decode(ids[:end])[len(self.text):]  # a decoder that rewrote the context

    def _search(self, start: int) -> tuple[str, int] | None:
        found = []
        hits = [(index, stop) for stop in self.stops if (index := self.text.find(stop, start)) >= 0]
        if hits:
            index, stop = min(hits)
            found.append((self._tokens_to(index + len(stop)), 0, stop))
        matches = [m for pattern in self.regexes if (m := pattern.search(self.text))]
        if matches:
            match = min(matches, key=lambda m: m.end())
            found.append((self._tokens_to(match.end()), 1, match.group(0)))
        if not found:
            return None
        keep, _, matched = min(found)
        return matched, keep

    def _tokens_to(self, end: int) -> int:
        """Tokens to keep so that the text covers its first `end` characters."""
        return bisect.bisect_left(self.ends, end) + 1


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"sampling_params.stop_regex {pattern!r} does not compile: {e}") from None
