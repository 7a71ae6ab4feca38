"""Incremental stop-string matching: each new token's text is decoded and searched once.

`StopStrings.feed(output_ids)` is called after every batch of new tokens. It decodes only the new
tokens (with a few earlier ones as context, so byte-level BPE pieces and leading spaces come out
as in a full decode; a token that ends inside a multi-byte character waits for the next one) and
searches the new text plus the last `longest stop - 1` characters before it, so the work per token
does not grow with the output. A match reports how many tokens to keep: up to and including the
first token whose text completes the stop string, as a full re-decode would.
"""

from __future__ import annotations

import bisect

_CONTEXT_TOKENS = 4  # earlier tokens decoded with the new ones: a piece's text can depend on them


class StopStrings:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""  # the text of the first `self.done` tokens
        self.done = 0
        self.ends: list[int] = []  # ends[i]: len(self.text) once token i is decoded

    def feed(self, output_ids: list[int]) -> tuple[str, int] | None:
        """(the first stop string in the output, tokens to keep), or None."""
        while self.stops and self.done < len(output_ids):
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
        hits = [(index, stop) for stop in self.stops if (index := self.text.find(stop, start)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        return stop, bisect.bisect_left(self.ends, index + len(stop)) + 1
