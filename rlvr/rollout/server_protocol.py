"""SGLang's native `/generate` protocol: strict request parsing and response building.

Every malformed request becomes an `ApiError` (HTTP 4xx, SGLang-style `{"error": {...}}` body)
before anything reaches the engine: wrong JSON types, both or neither of `text` / `input_ids`,
empty inputs, out-of-vocab ids, unknown or unsupported keys (a non-default value of a feature the
rlvr engine does not implement, e.g. `frequency_penalty`, is refused rather than silently
ignored, so an RL run never trains on samples drawn from a different distribution than asked).
Keys with no effect on sampling (`extra_key`, `spaces_between_special_tokens`, ...) are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any

from rlvr.rollout.types import Completion, Request, SamplingParams

MAX_INT32 = 2**31 - 1
MAX_ITEMS = 8192  # prompts x n per call
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "PayloadTooLarge",
                500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailable"}


class ApiError(Exception):
    """An HTTP error answered as `{"error": {"message", "type", "code"}}`."""

    def __init__(self, message: str, status: int = 400, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or _ERROR_TYPES.get(status, "Error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "code": self.status}}


@dataclasses.dataclass
class ModelLimits:
    """What request validation needs to know about the served model."""

    vocab_size: int
    context_length: int | None = None
    tokenizer: Any = None  # rlvr.models.tokenizer.Tokenizer or None (input_ids only)

    @classmethod
    def from_model_info(cls, info: dict[str, Any], tokenizer: Any) -> ModelLimits:
        vocab = info.get("vocab_size") or (tokenizer.vocab_size if tokenizer is not None else None)
        if not isinstance(vocab, int) or vocab <= 0:
            raise ValueError(f"model_info() must report a positive vocab_size, got {vocab!r}")
        ctx = next((info[k] for k in ("context_length", "max_context_length", "max_len", "max_seq_len",
                                      "max_position_embeddings") if is_int(info.get(k))), None)
        return cls(vocab, ctx, tokenizer)


# --- JSON and scalar checks ----------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes, allow_empty: bool = False) -> Any:
    """The decoded body; `{}` for an empty body when `allow_empty`. NaN/Infinity are refused."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise ApiError("empty request body: expected a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ApiError(f"invalid JSON body: {e}") from None


def expect_object(value: Any, where: str = "request body") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ApiError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_int(name: str, x: Any, lo: int, hi: int) -> int:
    if not is_int(x):
        raise ApiError(f"{name} must be an integer, got {json.dumps(x)[:80]}")
    if not lo <= x <= hi:
        raise ApiError(f"{name}={x} is out of range [{lo}, {hi}]")
    return x


def check_float(name: str, x: Any, lo: float, hi: float) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ApiError(f"{name} must be a finite number, got {json.dumps(x)[:80]}")
    if not lo <= x <= hi:
        raise ApiError(f"{name}={x} is out of range [{lo}, {hi}]")
    return float(x)


def check_bool(name: str, x: Any) -> bool:
    if not isinstance(x, bool):
        raise ApiError(f"{name} must be a boolean, got {json.dumps(x)[:80]}")
    return x


def check_str(name: str, x: Any, allow_empty: bool = False) -> str:
    if not isinstance(x, str) or (not x and not allow_empty):
        raise ApiError(f"{name} must be a non-empty string, got {json.dumps(x)[:80]}")
    return x


def check_ids(name: str, x: Any, vocab: int, allow_empty: bool = False) -> list[int]:
    if not isinstance(x, list) or (not x and not allow_empty):
        raise ApiError(f"{name} must be a non-empty list of token ids")
    for t in x:
        if not is_int(t) or not 0 <= t < vocab:
            raise ApiError(f"{name}: token id {json.dumps(t)[:40]} is not an integer in [0, {vocab})")
    return list(x)


def check_fields(body: dict[str, Any], supported: set[str], ignored: set[str], unsupported: dict[str, Any],
                 where: str = "request") -> None:
    """Unknown keys and non-default values of unimplemented features are errors."""
    for key, value in body.items():
        if key in supported or key in ignored:
            continue
        if key in unsupported:
            if value is not None and value != unsupported[key]:
                raise ApiError(f"{where}.{key}={json.dumps(value)[:80]} is not supported by the rlvr engine")
            continue
        raise ApiError(f"{where}: unknown field {key!r}; supported: {sorted(supported)}")


# --- sampling_params -----------------------------------------------------------------------

_SAMPLING_INT = {"max_new_tokens": (0, MAX_INT32), "min_new_tokens": (0, MAX_INT32), "top_k": (-1, MAX_INT32),
                 "sampling_seed": (-(2**63), 2**63 - 1), "n": (1, 1024)}
_SAMPLING_FLOAT = {"temperature": (0.0, 1e6), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}
_SAMPLING_BOOL = {"ignore_eos", "skip_special_tokens", "no_stop_trim"}
SAMPLING_IGNORED = {"spaces_between_special_tokens", "stream_interval", "custom_params"}
SAMPLING_UNSUPPORTED: dict[str, Any] = {
    "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {},
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "stop_regex": None}


def parse_sampling(values: Any, limits: ModelLimits, where: str = "sampling_params") -> SamplingParams:
    """A validated `SamplingParams` from SGLang's `sampling_params` dict (None = defaults)."""
    values = {} if values is None else expect_object(values, where)
    supported = set(_SAMPLING_INT) | set(_SAMPLING_FLOAT) | _SAMPLING_BOOL | {"stop", "stop_token_ids"}
    check_fields(values, supported, SAMPLING_IGNORED, SAMPLING_UNSUPPORTED, where)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{where}.{key}"
        if value is None or key not in supported:
            continue
        if key in _SAMPLING_INT:
            kwargs[key] = check_int(name, value, *_SAMPLING_INT[key])
        elif key in _SAMPLING_FLOAT:
            kwargs[key] = check_float(name, value, *_SAMPLING_FLOAT[key])
        elif key in _SAMPLING_BOOL:
            kwargs[key] = check_bool(name, value)
        elif key == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or len(stops) > 64:
                raise ApiError(f"{name} must be a string or a list of at most 64 strings")
            kwargs[key] = [check_str(name, s) for s in stops]
        else:
            kwargs[key] = check_ids(name, value, limits.vocab_size, allow_empty=True)
    if kwargs.get("stop") and limits.tokenizer is None:
        raise ApiError(f"{where}.stop needs a tokenizer; this server has none (use stop_token_ids)")
    try:
        params = SamplingParams(**kwargs)
        params.validate()
    except ValueError as e:
        raise ApiError(str(e)) from None
    return params


def encode_text(tokenizer: Any, text: str, name: str) -> list[int]:
    """`tokenizer.encode` with special tokens (as SGLang tokenizes `text`); 400 on unencodable text."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=True)
    except Exception as e:  # e.g. lone surrogates in the JSON string
        raise ApiError(f"{name} cannot be tokenized: {type(e).__name__}: {e}") from None
    if not ids:
        raise ApiError(f"{name} tokenizes to an empty prompt")
    return list(ids)


def check_length(prompt_len: int, max_new_tokens: int, limits: ModelLimits) -> None:
    ctx = limits.context_length
    if ctx is not None and prompt_len + max_new_tokens > ctx:
        raise ApiError(f"Requested token count exceeds the model's maximum context length of {ctx} tokens: "
                       f"{prompt_len} prompt + {max_new_tokens} max_new_tokens")


# --- /generate request ---------------------------------------------------------------------

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                   "top_logprobs_num", "return_text_in_logprobs", "stream", "return_prompt_token_ids"}
GENERATE_IGNORED = {"extra_key", "cache_salt", "priority", "routing_key", "routed_dp_rank", "data_parallel_rank",
                    "log_metrics", "bootstrap_host", "bootstrap_port", "bootstrap_room", "modalities"}
GENERATE_UNSUPPORTED: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "lora_path": None,
    "custom_logit_processor": None, "return_hidden_states": False, "return_routed_experts": False,
    "return_entropy": False, "token_ids_logprob": None, "session_params": None, "return_sampling_mask": False}


@dataclasses.dataclass
class OutputOptions:
    """How one request's completion is rendered back."""

    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclasses.dataclass
class GenerateInput:
    requests: list[Request]  # prompt-major: p0s0 .. p0s(n-1), p1s0, ...
    options: list[OutputOptions]
    batch: bool  # answer with a list
    stream: bool


def parse_prompts(body: dict[str, Any], limits: ModelLimits) -> tuple[list[list[int]], bool]:
    """(token ids per prompt, is_batch) from exactly one of `text` / `input_ids`."""
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise ApiError("exactly one of 'text' and 'input_ids' must be given")
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or len(texts) > MAX_ITEMS or not all(isinstance(t, str) and t for t in texts):
            raise ApiError("'text' must be a non-empty string or a non-empty list of non-empty strings")
        if limits.tokenizer is None:
            raise ApiError("this server has no tokenizer: send 'input_ids' instead of 'text'")
        return [encode_text(limits.tokenizer, t, "text") for t in texts], batch
    if not isinstance(ids, list) or not ids or len(ids) > MAX_ITEMS:
        raise ApiError("'input_ids' must be a non-empty list of token ids or a list of such lists")
    if all(isinstance(x, list) for x in ids):
        return [check_ids(f"input_ids[{i}]", x, limits.vocab_size) for i, x in enumerate(ids)], True
    return [check_ids("input_ids", ids, limits.vocab_size)], False


def _per_item(body: dict[str, Any], key: str, count: int) -> list[bool]:
    value = body.get(key)
    if value is None:
        return [False] * count
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(f"'{key}' has {len(value)} entries for {count} prompts")
        return [check_bool(key, v) for v in value]
    return [check_bool(key, value)] * count


def make_rids(rid: Any, num_prompts: int, n: int, batch: bool) -> list[str]:
    """SGLang's rid rules: None -> uuid4 hex; a str is a prefix (`f"{rid}_{k}"`) unless there is a
    single output; a list names every prompt (`f"{rid}_{i}"` per sample when n > 1) or every output."""
    total = num_prompts * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str) and rid:
        return [rid] if total == 1 and not batch else [f"{rid}_{k}" for k in range(total)]
    if not isinstance(rid, list) or not all(isinstance(r, str) and r for r in rid):
        raise ApiError("'rid' must be a non-empty string or a list of non-empty strings")
    if len(rid) == total:
        rids = list(rid)
    elif len(rid) == num_prompts:
        rids = [f"{r}_{i}" for r in rid for i in range(n)]
    else:
        raise ApiError(f"'rid' has {len(rid)} entries for {num_prompts} prompts x n={n}")
    if len(set(rids)) != len(rids):
        raise ApiError("'rid' entries must be unique")
    return rids


def expand(prompts: list[list[int]], params: list[SamplingParams], rids: list[str],
           limits: ModelLimits) -> list[Request]:
    """n>1 becomes n requests per prompt (prompt-major); sample i gets sampling_seed + i."""
    requests = []
    for j, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        check_length(len(prompt), sp.max_new_tokens, limits)
        for i in range(sp.n):
            seed = sp.sampling_seed + i if sp.sampling_seed is not None and sp.n > 1 else sp.sampling_seed
            one = dataclasses.replace(sp, n=1, sampling_seed=seed, stop=list(sp.stop),
                                      stop_token_ids=list(sp.stop_token_ids))
            requests.append(Request(rid=rids[j * sp.n + i], input_ids=list(prompt), sampling=one))
    return requests


def parse_generate(body: Any, limits: ModelLimits) -> GenerateInput:
    """Validates a `/generate` body (`GenerateReqInput`) into engine requests."""
    body = expect_object(body)
    check_fields(body, GENERATE_FIELDS, GENERATE_IGNORED, GENERATE_UNSUPPORTED)
    prompts, batch = parse_prompts(body, limits)
    sampling = body.get("sampling_params")
    if isinstance(sampling, list):
        if len(sampling) != len(prompts):
            raise ApiError(f"'sampling_params' has {len(sampling)} entries for {len(prompts)} prompts")
        params = [parse_sampling(sp, limits, f"sampling_params[{i}]") for i, sp in enumerate(sampling)]
    else:
        params = [parse_sampling(sampling, limits)] * len(prompts)
    n = params[0].n
    if any(p.n != n for p in params):
        raise ApiError("all prompts of a batch must use the same sampling_params.n")
    if len(prompts) * n > MAX_ITEMS:
        raise ApiError(f"{len(prompts)} prompts x n={n} exceeds {MAX_ITEMS} outputs per call")
    if body.get("logprob_start_len") not in (None, -1):
        raise ApiError("logprob_start_len >= 0 (prompt logprobs) is not supported by the rlvr engine")
    if body.get("top_logprobs_num") not in (None, 0):
        raise ApiError("top_logprobs_num > 0 is not supported by the rlvr engine")
    stream = check_bool("stream", body.get("stream", False))
    text_lp = check_bool("return_text_in_logprobs", body.get("return_text_in_logprobs", False))
    prompt_ids = check_bool("return_prompt_token_ids", body.get("return_prompt_token_ids", False))
    logprob = _per_item(body, "return_logprob", len(prompts))
    rids = make_rids(body.get("rid"), len(prompts), n, batch)
    requests = expand(prompts, params, rids, limits)
    options = [OutputOptions(logprob[j], text_lp, prompt_ids, params[j].skip_special_tokens, params[j].no_stop_trim)
               for j in range(len(prompts)) for _ in range(n)]
    return GenerateInput(requests, options, batch or n > 1, stream)


# --- responses -----------------------------------------------------------------------------


def output_text(c: Completion, tokenizer: Any, skip_special_tokens: bool = True, no_stop_trim: bool = False) -> str:
    """The decoded completion; unless `no_stop_trim`, the matched stop token / string is cut off."""
    if tokenizer is None:
        return c.text or ""
    ids = list(c.output_ids)
    matched = (c.finish_reason or {}).get("matched") if (c.finish_reason or {}).get("type") == "stop" else None
    if not no_stop_trim and is_int(matched) and ids and ids[-1] == matched:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not no_stop_trim and isinstance(matched, str) and matched:
        pos = text.find(matched)
        if pos >= 0:
            text = text[:pos]
    return text


def generate_output(c: Completion, opts: OutputOptions, tokenizer: Any, start: float,
                    index: int | None = None) -> dict[str, Any]:
    """One `/generate` answer: `{text, output_ids, meta_info}` (+ `index` in batch streams)."""
    meta = c.meta_info(return_logprob=opts.return_logprob)
    meta["e2e_latency"] = time.monotonic() - start
    if opts.return_logprob:
        meta["output_weight_versions"] = list(c.output_versions)  # rlvr extension (partial rollouts)
        if opts.return_text_in_logprobs and tokenizer is not None:
            for item in meta["output_token_logprobs"]:
                item[2] = tokenizer.decode([item[1]])
    out: dict[str, Any] = {"text": output_text(c, tokenizer, opts.skip_special_tokens, opts.no_stop_trim),
                           "output_ids": list(c.output_ids), "meta_info": meta}
    if opts.return_prompt_token_ids:
        out["prompt_token_ids"] = list(c.prompt_ids)
    if index is not None:
        out["index"] = index
    return out


def record_of(endpoint: str, body: Any, c: Completion, text: str | None) -> dict[str, Any]:
    """What a training recorder receives for one finished request: exact ids and logprobs."""
    return {"endpoint": endpoint, "rid": c.rid, "prompt_ids": list(c.prompt_ids), "output_ids": list(c.output_ids),
            "output_logprobs": list(c.output_logprobs), "output_versions": list(c.output_versions),
            "weight_version": c.weight_version, "finish_reason": c.finish_reason, "cached_tokens": c.cached_tokens,
            "text": text, "request": body, "time": time.time()}
