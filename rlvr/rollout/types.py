"""The data that crosses the rollout interface (engine, server and client alike).

Field names follow SGLang's native `/generate` protocol (`sampling_params`, `meta_info`),
so the embedded engine, its HTTP server and remote SGLang servers are interchangeable.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SamplingParams:
    """SGLang's `sampling_params` (the subset rlvr implements; unknown keys are rejected).

    `logit_bias` maps token ids to additive logit biases; `regex` / `json_schema` / `choices`
    constrain the output (at most one); `stop_regex` finishes at the first match in the output text."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = all
    min_p: float = 0.0
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None  # same seed + same prompt -> same tokens
    n: int = 1
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    stop_regex: list[str] = dataclasses.field(default_factory=list)
    regex: str | None = None
    json_schema: str | None = None
    choices: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> SamplingParams:
        values = dict(values or {})
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"sampling_params: unsupported keys {unknown}; supported: {sorted(names)}")
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"sampling_params.max_new_tokens={self.max_new_tokens}: must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"sampling_params.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling_params.top_p={self.top_p}: must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling_params.top_k={self.top_k}: must be -1 (all) or positive")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"sampling_params.min_p={self.min_p}: must be in [0, 1]")
        if self.n < 1:
            raise ValueError(f"sampling_params.n={self.n}: must be >= 1")
        if self.min_new_tokens < 0:
            raise ValueError(f"sampling_params.min_new_tokens={self.min_new_tokens}: must be >= 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"sampling_params.{name}={getattr(self, name)}: must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"sampling_params.repetition_penalty={self.repetition_penalty}: must be in (0, 2] "
                             "(1 = no penalty)")
        if sum(bool(x) for x in (self.regex, self.json_schema, self.choices)) > 1:
            raise ValueError("sampling_params: only one of regex, json_schema and choice can be set")

    @property
    def constraint(self) -> tuple[str, Any] | None:
        """("regex" | "json_schema" | "choices", value) when the output is constrained."""
        for kind in ("regex", "json_schema", "choices"):
            if getattr(self, kind):
                return kind, getattr(self, kind)
        return None

    @property
    def penalized(self) -> bool:
        """True when penalties or logit biases change the logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1
                    or self.logit_bias)


@dataclasses.dataclass
class Request:
    """One sample to generate. Log-prob extras (SGLang's names): `logprob_start_len >= 0` also asks
    for the prompt's log-probs from that position on; `top_logprobs_num` for the k most likely
    tokens at each position; `token_ids_logprob` for the log-probs of these ids at each position.
    `image_data` (a VLM; SGLang's name): one image per run of `<|image_pad|>` in `input_ids`, in
    order, each a path, a data URL or base64 (rlvr.rollout.images)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] = dataclasses.field(default_factory=list)
    image_data: list[Any] = dataclasses.field(default_factory=list)


TopLogprobs = list[tuple[float, int]]  # (logprob, token id), most likely first


def _items(pairs: TopLogprobs | None) -> list[list[Any]] | None:
    return None if pairs is None else [[lp, t, None] for lp, t in pairs]


@dataclasses.dataclass
class Completion:
    """A finished (or aborted) sequence. `output_logprobs[i]` is the log-prob of output_ids[i]
    under the distribution it was sampled from (the policy at the request's temperature, top-k,
    top-p and min-p; `rlvr.kernels.chunked_logprob.sampling_logits`), which is what the trainer
    scores with the same settings; `output_versions[i]` is the weight version that produced
    token i (partial rollouts)."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict[str, Any]  # {"type": "stop", "matched": id|str} | {"type": "length", "length": n} | abort
    cached_tokens: int = 0
    weight_version: int = 0
    text: str | None = None
    # Filled only when the request asked for them (see Request): prompt positions from
    # `logprob_start_len` on (the first is None: nothing precedes it), then per output token.
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    output_top_logprobs: list[TopLogprobs] | None = None
    input_token_ids_logprobs: list[TopLogprobs | None] | None = None
    output_token_ids_logprobs: list[TopLogprobs] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def meta_info(self, return_logprob: bool = False) -> dict[str, Any]:
        """SGLang's `meta_info` for this completion."""
        info = {"id": self.rid, "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "weight_version": str(self.weight_version)}
        if return_logprob:
            info["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                             zip(self.output_logprobs, self.output_ids, strict=True)]
            info["output_token_logprobs_length"] = len(self.output_ids)
            start = len(self.prompt_ids) - len(self.input_logprobs or [])
            info["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                            zip(self.input_logprobs or [], self.prompt_ids[start:], strict=True)]
            for side in ("input", "output"):
                for kind in ("top_logprobs", "token_ids_logprobs"):
                    rows = getattr(self, f"{side}_{kind}")
                    if rows is not None:
                        info[f"{side}_{kind}"] = [_items(row) for row in rows]
        return info
