"""Host-side state of one request in the engine: its pages and progress, its output, its stops.

`Sequence.accept` takes a call's sampled tokens up to the first stop condition and says why the
sequence finished, if it did; `sampling_table` / `write_sampling_row` hold every slot's sampling
parameters as the arrays the device functions read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rlvr.rollout.stops import StopStrings
from rlvr.rollout.types import Request

MAX_STOP_IDS = 8


@dataclasses.dataclass(eq=False)
class Sequence:
    request: Request
    seed: int
    max_new: int  # max_new_tokens, capped by what fits the engine's max_len
    stop_ids: frozenset[int]  # stop_token_ids, plus eos unless ignore_eos
    stops: StopStrings | None = None
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    nodes: list = dataclasses.field(default_factory=list)  # prefix-cache nodes this sequence reads
    prefilled: int = 0  # prompt tokens whose KV is written (or dispatched)
    cached_tokens: int = 0  # prompt tokens taken from cached or shared pages
    device_tokens: int = 0  # upper bound of prompt + output tokens on the device
    budget: int = 0  # pages still reserved for this sequence's worst case
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: dict[str, Any] | None = None

    @property
    def prompt(self) -> list[int]:
        return self.request.input_ids

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def accept(self, tokens: list[int], logprobs: list[float], version: int) -> dict[str, Any] | None:
        """Appends sampled tokens up to the first stop condition (a stop token past
        min_new_tokens, max_new, or the first stop string, whichever comes first); returns the
        finish reason, or None while the sequence runs on."""
        min_new = self.request.sampling.min_new_tokens
        end, reason = len(tokens), None
        for i, token in enumerate(tokens):
            count = len(self.output) + i + 1
            if token in self.stop_ids and count >= min_new:
                end, reason = i + 1, {"type": "stop", "matched": token}
                break
            if count >= self.max_new:
                end, reason = i + 1, {"type": "length", "length": count}
                break
        self.output += tokens[:end]
        self.logprobs += logprobs[:end]
        self.versions += [version] * end
        hit = None if self.stops is None else self.stops.feed(self.output)
        if hit is not None:
            del self.output[hit[1]:], self.logprobs[hit[1]:], self.versions[hit[1]:]
            reason = {"type": "stop", "matched": hit[0]}
        return reason


def sampling_table(slots: int) -> dict[str, np.ndarray]:
    return {"temperature": np.ones(slots, np.float32), "top_k": np.full(slots, -1, np.int32),
            "top_p": np.ones(slots, np.float32), "min_p": np.zeros(slots, np.float32),
            "seed": np.zeros(slots, np.int32), "min_new": np.zeros(slots, np.int32),
            "max_new": np.ones(slots, np.int32), "stop_ids": np.full((slots, MAX_STOP_IDS), -1, np.int32)}


def write_sampling_row(table: dict[str, np.ndarray], slot: int, seq: Sequence) -> None:
    sp = seq.request.sampling
    table["temperature"][slot], table["top_k"][slot], table["top_p"][slot] = sp.temperature, sp.top_k, sp.top_p
    table["min_p"][slot], table["seed"][slot], table["min_new"][slot] = sp.min_p, seq.seed, sp.min_new_tokens
    table["max_new"][slot] = seq.max_new
    stops = sorted(seq.stop_ids)[:MAX_STOP_IDS]
    table["stop_ids"][slot] = -1
    table["stop_ids"][slot, : len(stops)] = stops
