"""The engine's per-request extras, host side: what a request asks beyond plain sampling.

* constrained decoding: the request's `grammar.Grammar` and its automaton state, advanced by every
  output token; the engine masks the logits with `mask(...)` (one token per device call);
* log-probs beyond the sampled token's: prompt log-probs (computed once at submission by one
  forward over the prompt, `device_fns.score`), the `top_logprobs_num` alternatives and the
  `token_ids_logprob` ids at every output position (collected from the device calls);
* a retracted request (pause mode "retract") carries the output it had, and continues from its
  prompt plus that output.

A `sequence.Sequence` holds its `Extras`; `Sequence.accept` advances them with every new token.
(`stop_regex` is matched with the stop strings, `stops.StopStrings`; penalties and logit_bias are
per-slot arrays of the sampling table, `sequence.penalty_arrays`.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rlvr.rollout.types import Completion, Request, TopLogprobs

TOP_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # compiled sizes of the top-k log-prob outputs


@dataclasses.dataclass
class Extras:
    """Host-side state of one sequence's extras (see the module docstring)."""

    grammar: Any = None  # grammar.Grammar
    state: int | None = None  # its automaton state
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    input_ids: list[TopLogprobs | None] | None = None
    output_top: list[TopLogprobs] = dataclasses.field(default_factory=list)
    output_ids: list[TopLogprobs] = dataclasses.field(default_factory=list)
    carried: tuple[list[int], list[float], list[int]] = ((), (), ())  # output before a retraction

    @property
    def carried_tokens(self) -> int:
        return len(self.carried[0])


def prepare(request: Request, tokenizer: Any, vocab_size: int) -> Extras:
    """The extras of a new request; ValueError for a constraint that does not compile."""
    extras = Extras()
    constraint = request.sampling.constraint
    if constraint is not None:
        from rlvr.rollout.grammar import compile_constraint

        extras.grammar = compile_constraint(*constraint, tokenizer, vocab_size)
        extras.state = extras.grammar.initial
    return extras


def top_bucket(k: int) -> int:
    return 0 if k <= 0 else next((b for b in TOP_BUCKETS if b >= k), k)


def score_prompt(extras: Extras, request: Request, own: np.ndarray, top: dict[str, np.ndarray]) -> None:
    """Prompt log-probs from `device_fns.score` (own [T], extras [T, ...]): entry p is the log-prob
    of prompt token p given the tokens before it, from logprob_start_len on (the first is None)."""
    start, n = request.logprob_start_len, len(request.input_ids)
    extras.input_logprobs = [None] + [float(x) for x in own[start:n - 1]] if start < n else []
    positions = range(start, n)
    if request.top_logprobs_num:
        k = request.top_logprobs_num
        extras.input_top = [None if p == start else _pairs(top["top_values"][p - 1, :k], top["top_ids"][p - 1, :k])
                            for p in positions]
    if request.token_ids_logprob:
        ids = request.token_ids_logprob
        extras.input_ids = [None if p == start else _pairs(top["ids_values"][p - 1, :len(ids)], ids)
                            for p in positions]


def _pairs(values: Any, ids: Any) -> TopLogprobs:
    return [(float(v), int(t)) for v, t in zip(values, ids, strict=True)]


def record_outputs(extras: Extras, request: Request, out: dict[str, np.ndarray], count: int) -> None:
    """Extra log-probs of `count` new output tokens (rows of the device call's outputs)."""
    if request.top_logprobs_num:
        k = request.top_logprobs_num
        extras.output_top += [_pairs(out["top_values"][j, :k], out["top_ids"][j, :k]) for j in range(count)]
    if request.token_ids_logprob:
        ids = request.token_ids_logprob
        extras.output_ids += [_pairs(out["ids_values"][j, :len(ids)], ids) for j in range(count)]


def advance(extras: Extras, tokens: list[int], stops: set[int]) -> bool:
    """Moves the automaton over new tokens; False if one of them is not allowed (a stop token
    ends the sequence and is not part of the grammar)."""
    if extras.grammar is None:
        return True
    for token in tokens:
        if token in stops:
            return True
        nxt = extras.grammar.advance(extras.state, token)
        if nxt is None:
            return False
        extras.state = nxt
    return True


def fill(c: Completion, extras: Extras, request: Request) -> Completion:
    """The completion with the extras it asked for, and any output carried over a retraction."""
    if extras.carried_tokens:
        out, lps, versions = extras.carried
        c.prompt_ids = c.prompt_ids[: len(c.prompt_ids) - len(out)]
        c.output_ids, c.output_logprobs = list(out) + c.output_ids, list(lps) + c.output_logprobs
        c.output_versions = list(versions) + c.output_versions
    if request.logprob_start_len >= 0:
        c.input_logprobs = extras.input_logprobs
        c.input_top_logprobs = extras.input_top
        c.input_token_ids_logprobs = extras.input_ids
    if request.top_logprobs_num:
        c.output_top_logprobs = list(extras.output_top)
    if request.token_ids_logprob:
        c.output_token_ids_logprobs = list(extras.output_ids)
    return c


def retracted(request: Request, output: list[int]) -> Request:
    """The request a retracted sequence continues as: its prompt plus the output it had, with
    the length limits reduced by that output (positions and seeds are unchanged, so it samples
    exactly the tokens it would have)."""
    sp = request.sampling
    n = len(output)
    sampling = dataclasses.replace(sp, max_new_tokens=max(sp.max_new_tokens - n, 0),
                                   min_new_tokens=max(sp.min_new_tokens - n, 0))
    return dataclasses.replace(request, input_ids=list(request.input_ids) + list(output), sampling=sampling,
                               logprob_start_len=-1)
