"""The data that crosses the rollout interface (engine, server and client alike).

Field names follow SGLang's native `/generate` protocol (`sampling_params`, `meta_info`),
so the embedded engine, its HTTP server and remote SGLang servers are interchangeable.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SamplingParams:
    """SGLang's `sampling_params` (the subset rlvr implements; unknown keys are rejected)."""

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


@dataclasses.dataclass
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)


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
        return info
