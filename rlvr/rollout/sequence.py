"""Host-side state of one request in the engine: its pages and progress, its output, its stops,
its extras (grammar state, extra log-probs, output carried over a retraction: `extras`).

`Sequence.accept` takes a call's sampled tokens up to the first stop condition and says why the
sequence finished, if it did; `sampling_table` / `write_sampling_row` hold every slot's sampling
parameters as the arrays the device functions read (`penalty_arrays` and the requested log-prob
ids join them only while a running request uses them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rlvr.rollout import extras as extras_lib
from rlvr.rollout.images import PromptImages
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
    weights_epoch: int = 0  # the engine's weight updates when it was placed: older KV never enters the cache
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: dict[str, Any] | None = None
    extras: extras_lib.Extras = dataclasses.field(default_factory=extras_lib.Extras)
    image: PromptImages | None = None  # a VLM prompt's images (rlvr.rollout.images)
    arrival: int = 0  # the engine's step count at submit: requests submitted together share it

    @property
    def prompt(self) -> list[int]:
        return self.request.input_ids

    @property
    def key(self) -> list[int]:
        """The prompt as the prefix cache keys it: image placeholders stand for their image's content."""
        return self.prompt if self.image is None else self.image.keys

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    def accept(self, tokens: list[int], logprobs: list[float], version: int,
               more: dict[str, np.ndarray] | None = None) -> dict[str, Any] | None:
        """Appends sampled tokens (and their extra log-probs `more`, rows per token) up to the first
        stop condition (a stop token past min_new_tokens, max_new, or the first stop string or
        stop_regex match, whichever comes first); returns the finish reason, or None while the
        sequence runs on. A token outside the grammar aborts the sequence."""
        min_new, carried = self.request.sampling.min_new_tokens, self.extras.carried_tokens
        end, reason = len(tokens), None
        for i, token in enumerate(tokens):
            count = len(self.output) + i + 1
            if token in self.stop_ids and count >= min_new:
                end, reason = i + 1, {"type": "stop", "matched": token}
                break
            if count >= self.max_new:
                end, reason = i + 1, {"type": "length", "length": carried + count}
                break
        self.output += tokens[:end]
        self.logprobs += logprobs[:end]
        self.versions += [version] * end
        extras_lib.record_outputs(self.extras, self.request, more or {}, end)
        if not extras_lib.advance(self.extras, tokens[:end], self.stop_ids):
            reason = {"type": "abort", "message": "constrained decoding: a token outside the grammar was sampled",
                      "status_code": 500}
        # stop strings span a retraction: they see the output carried over too
        hit = None if self.stops is None else self.stops.feed(list(self.extras.carried[0]) + self.output)
        if hit is not None:
            keep = hit[1] - carried
            del self.output[keep:], self.logprobs[keep:], self.versions[keep:]
            del self.extras.output_top[hit[1]:], self.extras.output_ids[hit[1]:]
            reason = {"type": "stop", "matched": hit[0]}
        return reason

    def retracted(self) -> Sequence:
        """This running sequence as a new waiting one that continues from its prompt plus its
        output (pause mode "retract"); it samples exactly the tokens it would have."""
        reset = dict(slot=-1, prefilled=0, cached_tokens=0, device_tokens=0, pages=[], nodes=[], budget=0)
        if not self.output:
            return dataclasses.replace(self, **reset)
        carried = tuple(list(a) + list(b) for a, b in
                        zip(self.extras.carried, (self.output, self.logprobs, self.versions), strict=True))
        return dataclasses.replace(
            self, **reset, request=extras_lib.retracted(self.request, self.output),
            image=None if self.image is None else self.image.extended(self.output),
            max_new=self.max_new - len(self.output), output=[], logprobs=[], versions=[],
            extras=dataclasses.replace(self.extras, carried=carried))


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
    if "rope_delta" in table:
        table["rope_delta"][slot] = 0 if seq.image is None else seq.image.delta
    stops = sorted(seq.stop_ids)[:MAX_STOP_IDS]
    table["stop_ids"][slot] = -1
    table["stop_ids"][slot, : len(stops)] = stops
    penalty_row(table, slot, seq.request)
    ids_row(table, slot, seq.request)


def penalty_arrays(slots: int, vocab: int) -> dict[str, np.ndarray]:
    """The sampling table's arrays for penalties and logit_bias (`logit_process`)."""
    return {"frequency_penalty": np.zeros(slots, np.float32), "presence_penalty": np.zeros(slots, np.float32),
            "repetition_penalty": np.ones(slots, np.float32), "logit_bias": np.zeros((slots, vocab), np.float32)}


def penalty_row(table: dict[str, np.ndarray], slot: int, request: Request) -> None:
    if "frequency_penalty" not in table:
        return
    sp = request.sampling
    table["frequency_penalty"][slot], table["presence_penalty"][slot] = sp.frequency_penalty, sp.presence_penalty
    table["repetition_penalty"][slot] = sp.repetition_penalty
    table["logit_bias"][slot] = 0.0
    for token, bias in sp.logit_bias.items():
        if 0 <= token < table["logit_bias"].shape[1]:
            table["logit_bias"][slot, token] = bias


def ids_row(table: dict[str, np.ndarray], slot: int, request: Request) -> None:
    if "logprob_ids" not in table:
        return
    table["logprob_ids"][slot] = 0
    table["logprob_ids"][slot, : len(request.token_ids_logprob)] = request.token_ids_logprob
