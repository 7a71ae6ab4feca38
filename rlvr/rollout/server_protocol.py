"""SGLang's native `/generate` protocol: request parsing with SGLang's rules, and response building.

Accepted as SGLang accepts it (sglang 0.5.23, `sglang.api.v1` and `SamplingParams`): null means
the default, an empty value means unset (`stop_regex: []`, `regex: ""`, `token_ids_logprob: []`,
`image_data: []`), unknown top-level fields are ignored (logged once), an omitted max_new_tokens
is 128 clipped to the context (an explicit one that does not fit is a 400), `min_new_tokens >
max_new_tokens` is a 400, prompt/top log-prob fields count only with `return_logprob`.

Refused with a 4xx `ApiError` (SGLang-style `{"error": {...}}` body) before anything reaches the
engine: malformed JSON, wrong types, both or neither of `text` / `input_ids`, empty prompts,
out-of-vocabulary ids, unknown sampling params (as SGLang does), and any non-empty value of a
feature the engine lacks (video / audio inputs, LoRA, beam search, ebnf; images, penalties,
constraints or extra log-probs when the engine's `model_info()["features"]` does not list them): an
RL run never trains on samples drawn from another distribution than the one it asked for.
`image_data` (a VLM): per prompt an image or a list of them (a URL string: a data URL, base64 or a
path; or `{"url": ...}`), one per `<|image_pad|>` in the prompt; a batch gives one entry per prompt.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from rlvr.rollout.types import Completion, Request, SamplingParams

logger = logging.getLogger(__name__)

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
    features: frozenset[str] = frozenset()  # of ENGINE_FEATURES, as the engine's model_info() reports
    vision: Any = None  # a VLM's rlvr.models.config.VisionConfig (image placeholders), else None

    @classmethod
    def from_model_info(cls, info: dict[str, Any], tokenizer: Any, vision: Any = None) -> ModelLimits:
        vocab = info.get("vocab_size") or (tokenizer.vocab_size if tokenizer is not None else None)
        if not isinstance(vocab, int) or vocab <= 0:
            raise ValueError(f"model_info() must report a positive vocab_size, got {vocab!r}")
        ctx = next((info[k] for k in ("context_length", "max_context_length", "max_len", "max_seq_len",
                                      "max_position_embeddings") if is_int(info.get(k))), None)
        return cls(vocab, ctx, tokenizer, frozenset(info.get("features") or ()), vision)

    def require(self, feature: str, what: str) -> None:
        if feature not in self.features:
            raise ApiError(f"{what} is not supported by this engine (it lacks {feature!r})")


# What an engine may implement beyond plain sampling; `model_info()["features"]` lists its own.
ENGINE_FEATURES = {
    "penalties": "frequency / presence / repetition penalties and logit_bias",
    "constraints": "constrained decoding (regex, json_schema, choice)",
    "stop_regex": "stop_regex",
    "prompt_logprobs": "prompt log-probs (logprob_start_len >= 0)",
    "top_logprobs": "top_logprobs_num > 0 and token_ids_logprob",
    "images": "image inputs (image_data, image_url message parts): a vision-language model",
}


def refuse_unimplemented(params: SamplingParams, limits: ModelLimits, where: str) -> None:
    if params.penalized:
        limits.require("penalties", f"{where}: penalties / logit_bias")
    if params.constraint is not None:
        limits.require("constraints", f"{where}.{params.constraint[0]}")
    if params.stop_regex:
        limits.require("stop_regex", f"{where}.stop_regex")


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


def log_ignored(where: str, keys: Any) -> None:
    """Logs each ignored field name once per process (SGLang ignores unknown top-level fields)."""
    for key in keys:
        if (where, key) not in _LOGGED:
            _LOGGED.add((where, key))
            logger.info("ignoring %s field %r (no effect on the rlvr engine)", where, str(key)[:80])


_LOGGED: set[tuple[str, str]] = set()


def refuse_unsupported(values: dict[str, Any], names: Any, where: str) -> None:
    """Fields of features the rlvr engine lacks: empty values mean unset (as in SGLang), anything
    else is refused rather than silently ignored, so no sample is drawn from another distribution."""
    for key in names:
        value = values.get(key)
        if value not in (None, False, "", [], {}):
            raise ApiError(f"{where}.{key}={json.dumps(value)[:80]} is not supported by the rlvr engine")


# --- sampling_params -----------------------------------------------------------------------

# SGLang's sampling_params keys (sglang.api.v1 SamplingParams); others are refused, as SGLang does.
_SAMPLING_INT = {"max_new_tokens": (0, MAX_INT32), "min_new_tokens": (0, MAX_INT32), "top_k": (-1, 2**62),
                 "sampling_seed": (-(2**63), 2**63 - 1), "n": (1, 1024)}
_SAMPLING_FLOAT = {"temperature": (0.0, 1e30), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
                   "frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0),
                   "repetition_penalty": (0.0, 2.0)}
_SAMPLING_BOOL = {"ignore_eos", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens"}
_SAMPLING_STR = {"regex", "json_schema", "ebnf", "structural_tag"}  # "" = unset
SAMPLING_IGNORED = {"spaces_between_special_tokens", "stream_interval", "custom_params"}
SAMPLING_UNSUPPORTED = ("ebnf", "structural_tag", "beam_width", "watermark")
SAMPLING_KEYS = {*_SAMPLING_INT, *_SAMPLING_FLOAT, *_SAMPLING_BOOL, *_SAMPLING_STR, *SAMPLING_IGNORED,
                 *SAMPLING_UNSUPPORTED, "stop", "stop_token_ids", "stop_regex", "logit_bias", "choice"}
MAX_STOPS = 32  # SGLang's MAX_STOP_COUNT and MAX_STOP_REGEX_COUNT
MAX_NEW_TOKENS_OMITTED = 128  # SGLang's default when sampling_params has no max_new_tokens


@dataclasses.dataclass
class ParsedSampling:
    """`SamplingParams` plus how its max_new_tokens was given: an explicit value is checked against
    the context (400 if it does not fit, as SGLang does), an omitted (128) or null (unlimited) one is
    clipped to the context instead."""

    params: SamplingParams
    check_length: bool


def _strings(name: str, value: Any, limit: int = MAX_STOPS) -> list[str]:
    """A str or a list of str; empty strings dropped (empty = unset)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError(f"{name} must be a string or a list of strings")
    if len(items) > limit:
        raise ApiError(f"{name}: at most {limit} entries are allowed, got {len(items)}")
    return [s for s in items if s]


def _scalar(name: str, key: str, value: Any) -> Any:
    if key in _SAMPLING_INT:
        return check_int(name, value, *_SAMPLING_INT[key])
    if key in _SAMPLING_FLOAT:
        return check_float(name, value, *_SAMPLING_FLOAT[key])
    if key in _SAMPLING_BOOL:
        return check_bool(name, value)
    if not isinstance(value, str):
        raise ApiError(f"{name} must be a string, got {json.dumps(value)[:80]}")
    return value or None


def _logit_bias(name: str, value: Any, vocab: int) -> dict[int, float]:
    """SGLang's / OpenAI's `{"token id": bias}`; keys must be ids of the vocabulary."""
    out = {}
    for key, bias in expect_object(value, name).items():
        if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
            raise ApiError(f"{name} keys must be token ids in [0, {vocab}), got {key[:40]!r}")
        out[int(key)] = check_float(f"{name}[{key}]", bias, -100.0, 100.0)
    return out


def parse_sampling(values: Any, limits: ModelLimits, where: str = "sampling_params") -> ParsedSampling:
    """SGLang's `sampling_params` dict (None = defaults) with SGLang's rules: null means the default,
    an empty grammar / stop list means unset, temperature below 1e-6 is greedy, top_k of the
    vocabulary size or more (SGLang's default is 2**30) means all, unknown keys are refused."""
    values = {} if values is None else expect_object(values, where)
    unknown = sorted(set(values) - SAMPLING_KEYS)
    if unknown:
        raise ApiError(f"{where}: unknown field {unknown[0]!r} (SGLang refuses unknown sampling params too); "
                       f"known: {sorted(SAMPLING_KEYS)}")
    refuse_unsupported(values, SAMPLING_UNSUPPORTED, where)
    given = {k: v for k, v in values.items() if v is not None and k not in SAMPLING_IGNORED}
    scalars = {*_SAMPLING_INT, *_SAMPLING_FLOAT, *_SAMPLING_BOOL, *_SAMPLING_STR}
    kwargs: dict[str, Any] = {k: _scalar(f"{where}.{k}", k, v) for k, v in given.items() if k in scalars}
    if "stop" in given:
        kwargs["stop"] = _strings(f"{where}.stop", given["stop"])
    if "stop_regex" in given:
        kwargs["stop_regex"] = _strings(f"{where}.stop_regex", given["stop_regex"])
    if "stop_token_ids" in given:  # ids outside the vocabulary can never be sampled: dropping them is exact
        ids = given["stop_token_ids"]
        if not isinstance(ids, list) or not all(is_int(t) or t is None for t in ids):
            raise ApiError(f"{where}.stop_token_ids must be a list of integers")
        kwargs["stop_token_ids"] = [t for t in ids if t is not None and 0 <= t < limits.vocab_size]
    if "logit_bias" in given:
        kwargs["logit_bias"] = _logit_bias(f"{where}.logit_bias", given["logit_bias"], limits.vocab_size)
    if given.get("choice"):
        kwargs["choices"] = _strings(f"{where}.choice", given["choice"], limit=MAX_ITEMS)
    check = "max_new_tokens" in given
    if "max_new_tokens" not in values:
        kwargs["max_new_tokens"] = MAX_NEW_TOKENS_OMITTED
    elif not check:  # null: as many as the context allows
        kwargs["max_new_tokens"] = MAX_INT32
    if kwargs.get("temperature", 1.0) < 1e-6:
        kwargs["temperature"] = 0.0
    if kwargs.get("top_k", -1) >= limits.vocab_size:
        kwargs["top_k"] = -1
    if check and kwargs.get("min_new_tokens", 0) > kwargs["max_new_tokens"]:
        raise ApiError(f"{where}.min_new_tokens must be in [0, max_new_tokens({kwargs['max_new_tokens']})], "
                       f"got {kwargs['min_new_tokens']}")
    if (kwargs.get("stop") or kwargs.get("stop_regex")) and limits.tokenizer is None:
        raise ApiError(f"{where}.stop / stop_regex need a tokenizer; this server has none (use stop_token_ids)")
    kwargs = {k: v for k, v in kwargs.items() if k not in SAMPLING_IGNORED and v is not None}
    try:
        params = SamplingParams(**kwargs)
        params.validate()
    except ValueError as e:
        raise ApiError(str(e)) from None
    refuse_unimplemented(params, limits, where)
    return ParsedSampling(params, check)


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
                   "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream",
                   "return_prompt_token_ids", "image_data"}
# Fields of features the engine lacks: empty / false / null = unset, anything else is a 400.
GENERATE_UNSUPPORTED = ("input_embeds", "video_data", "audio_data", "lora_path",
                        "custom_logit_processor", "return_hidden_states", "return_routed_experts",
                        "return_entropy", "session_params", "return_sampling_mask")
# Anything else (extra_key, priority, custom_labels, ...) is ignored and logged once, as SGLang does.


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


def per_item(body: dict[str, Any], key: str, count: int, default: Any, check: Callable[[str, Any], Any]) -> list[Any]:
    """A field given once for the batch or as a list with one entry per prompt."""
    value = body.get(key)
    if value is None:
        return [default] * count
    if isinstance(value, list) and (key != "token_ids_logprob" or all(isinstance(v, list) for v in value) and value):
        if len(value) != count:
            raise ApiError(f"'{key}' has {len(value)} entries for {count} prompts")
        return [default if v is None else check(f"{key}[{i}]", v) for i, v in enumerate(value)]
    return [check(key, value)] * count


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


def fit_length(prompt_len: int, sampling: ParsedSampling, limits: ModelLimits) -> SamplingParams:
    """An explicit max_new_tokens must fit the context (400 otherwise); an omitted or null one is
    clipped to it (and min_new_tokens with it), as SGLang's scheduler does."""
    sp = sampling.params
    ctx = limits.context_length
    if sampling.check_length:
        check_length(prompt_len, sp.max_new_tokens, limits)
        return sp
    room = sp.max_new_tokens if ctx is None else max(0, min(sp.max_new_tokens, ctx - prompt_len))
    return dataclasses.replace(sp, max_new_tokens=room, min_new_tokens=min(sp.min_new_tokens, room))


@dataclasses.dataclass
class LogprobOptions:
    """Per-prompt log-prob requests: `start` >= 0 asks for prompt log-probs from that position."""

    start: int = -1
    top: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)


def expand(prompts: list[list[int]], params: list[ParsedSampling], rids: list[str], limits: ModelLimits,
           logprobs: list[LogprobOptions] | None = None, images: list[list[str]] | None = None) -> list[Request]:
    """n>1 becomes n requests per prompt (prompt-major); sample i gets sampling_seed + i. `images`:
    per prompt its image sources (`parse_images`)."""
    requests = []
    for j, (prompt, parsed) in enumerate(zip(prompts, params, strict=True)):
        if images is not None and images[j]:
            prompt = expand_image_tokens(prompt, images[j], limits)
        sp = fit_length(len(prompt), parsed, limits)
        lp = logprobs[j] if logprobs is not None else LogprobOptions()
        for i in range(sp.n):
            seed = sp.sampling_seed + i if sp.sampling_seed is not None and sp.n > 1 else sp.sampling_seed
            one = dataclasses.replace(sp, n=1, sampling_seed=seed, stop=list(sp.stop),
                                      stop_token_ids=list(sp.stop_token_ids))
            requests.append(Request(rid=rids[j * sp.n + i], input_ids=list(prompt), sampling=one,
                                    logprob_start_len=lp.start, top_logprobs_num=lp.top,
                                    token_ids_logprob=list(lp.token_ids),
                                    image_data=list(images[j]) if images is not None else []))
    return requests


def _image_source(item: Any, where: str) -> str:
    if isinstance(item, dict):
        item = item.get("url")
    if not isinstance(item, str) or not item:
        raise ApiError(f"{where}: an image is a URL string (data:image/...;base64, base64 or a path) or "
                       f"{{'url': ...}}, got {json.dumps(item)[:60]}")
    return item


def parse_images(value: Any, count: int, batch: bool, limits: ModelLimits, where: str = "image_data"
                 ) -> list[list[str]] | None:
    """Per prompt its image sources, from SGLang's `image_data` (None / [] = none)."""
    if value in (None, [], ""):
        return None
    limits.require("images", where)
    if not batch:
        items = value if isinstance(value, list) else [value]
        return [[_image_source(x, f"{where}[{i}]") for i, x in enumerate(items)]]
    if not isinstance(value, list) or len(value) != count:
        raise ApiError(f"{where}: a batch of {count} prompts needs a list of {count} entries (null for none)")
    return [[] if v in (None, []) else [_image_source(x, f"{where}[{j}][{i}]")
                                         for i, x in enumerate(v if isinstance(v, list) else [v])]
            for j, v in enumerate(value)]


def expand_image_tokens(prompt: list[int], sources: list[str], limits: ModelLimits) -> list[int]:
    """The prompt with each image's single placeholder expanded (its length then counts against the
    context as the engine sees it); a bad image or placeholder count is a 400."""
    from rlvr.data.images import image_grid
    from rlvr.rollout.images import expand_prompt

    try:
        grids = [image_grid(src, limits.vision) for src in sources]
        return expand_prompt(prompt, grids, limits.vision)
    except (ValueError, OSError) as e:
        raise ApiError(f"image_data: {e}") from None


def _logprob_options(body: dict[str, Any], prompts: list[list[int]], wanted: list[bool],
                     limits: ModelLimits) -> list[LogprobOptions]:
    """SGLang ignores logprob_start_len / top_logprobs_num / token_ids_logprob without return_logprob."""
    count = len(prompts)
    starts = per_item(body, "logprob_start_len", count, -1, lambda k, v: check_int(k, v, -1, MAX_INT32))
    tops = per_item(body, "top_logprobs_num", count, 0, lambda k, v: check_int(k, v, 0, 1024))
    ids = per_item(body, "token_ids_logprob", count, [],
                   lambda k, v: check_ids(k, v, limits.vocab_size, allow_empty=True))
    out = []
    for prompt, want, start, top, token_ids in zip(prompts, wanted, starts, tops, ids, strict=True):
        if not want:
            out.append(LogprobOptions())
            continue
        if start > len(prompt):
            raise ApiError(f"logprob_start_len={start} is higher than the number of input tokens {len(prompt)}")
        if start >= 0:
            limits.require("prompt_logprobs", "logprob_start_len >= 0 (prompt log-probs)")
        if top or token_ids:
            limits.require("top_logprobs", "top_logprobs_num / token_ids_logprob")
        out.append(LogprobOptions(start, top, token_ids))
    return out


def parse_generate(body: Any, limits: ModelLimits) -> GenerateInput:
    """Validates a `/generate` body (`GenerateReqInput`) into engine requests."""
    body = expect_object(body)
    refuse_unsupported(body, GENERATE_UNSUPPORTED, "request")
    if body.get("sampling_logprobs_mode") is not None:
        raise ApiError("sampling_logprobs_mode can only be set when return_sampling_mask=true")
    log_ignored("/generate", sorted(set(body) - GENERATE_FIELDS - set(GENERATE_UNSUPPORTED)
                                    - {"sampling_logprobs_mode"}))
    prompts, batch = parse_prompts(body, limits)
    sampling = body.get("sampling_params")
    if isinstance(sampling, list):
        if len(sampling) != len(prompts):
            raise ApiError(f"'sampling_params' has {len(sampling)} entries for {len(prompts)} prompts")
        params = [parse_sampling(sp, limits, f"sampling_params[{i}]") for i, sp in enumerate(sampling)]
    else:
        params = [parse_sampling(sampling, limits)] * len(prompts)
    n = params[0].params.n
    if any(p.params.n != n for p in params):
        raise ApiError("all prompts of a batch must use the same sampling_params.n")
    if len(prompts) * n > MAX_ITEMS:
        raise ApiError(f"{len(prompts)} prompts x n={n} exceeds {MAX_ITEMS} outputs per call")
    stream = check_bool("stream", body.get("stream", False))
    text_lp = check_bool("return_text_in_logprobs", body.get("return_text_in_logprobs") or False)
    prompt_ids = check_bool("return_prompt_token_ids", body.get("return_prompt_token_ids") or False)
    logprob = per_item(body, "return_logprob", len(prompts), False, check_bool)
    rids = make_rids(body.get("rid"), len(prompts), n, batch)
    images = parse_images(body.get("image_data"), len(prompts), batch, limits)
    requests = expand(prompts, params, rids, limits, _logprob_options(body, prompts, logprob, limits), images)
    options = [OutputOptions(logprob[j], text_lp, prompt_ids, params[j].params.skip_special_tokens,
                             params[j].params.no_stop_trim) for j in range(len(prompts)) for _ in range(n)]
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


_LOGPROB_LISTS = ("input_token_logprobs", "output_token_logprobs")
_LOGPROB_ROWS = ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")


def fill_logprob_texts(meta: dict[str, Any], tokenizer: Any) -> None:
    """Sets the text of every `[logprob, id, text]` item of meta_info (return_text_in_logprobs)."""
    items = [item for key in _LOGPROB_LISTS for item in meta.get(key, ())]
    items += [item for key in _LOGPROB_ROWS for row in meta.get(key, ()) for item in row or ()]
    for item in items:
        item[2] = tokenizer.decode([item[1]])


def generate_output(c: Completion, opts: OutputOptions, tokenizer: Any, start: float,
                    index: int | None = None, label: Callable[[int], str] = str) -> dict[str, Any]:
    """One `/generate` answer: `{text, output_ids, meta_info}` (+ `index` in batch streams);
    `label` names a weight version (SGLang's labels are strings)."""
    meta = c.meta_info(return_logprob=opts.return_logprob)
    meta["weight_version"] = label(c.weight_version)
    meta["e2e_latency"] = time.monotonic() - start
    if opts.return_logprob:
        meta["output_weight_versions"] = list(c.output_versions)  # rlvr extension (partial rollouts)
        if opts.return_text_in_logprobs and tokenizer is not None:
            fill_logprob_texts(meta, tokenizer)
    out: dict[str, Any] = {"text": output_text(c, tokenizer, opts.skip_special_tokens, opts.no_stop_trim),
                           "output_ids": list(c.output_ids), "meta_info": meta}
    if opts.return_prompt_token_ids:
        out["prompt_token_ids"] = list(c.prompt_ids)
    if index is not None:
        out["index"] = index
    return out


def record_of(endpoint: str, body: Any, c: Completion, text: str | None, response_id: str | None = None,
              index: int = 0, start: float | None = None, model_version: str | None = None) -> dict[str, Any]:
    """What a training recorder receives for one finished request: exact ids and logprobs, the id a
    client gives feedback on (`response_id`, choice `index`), the served version's label and the
    latency since `start` (time.monotonic)."""
    return {"endpoint": endpoint, "rid": c.rid, "prompt_ids": list(c.prompt_ids), "output_ids": list(c.output_ids),
            "output_logprobs": list(c.output_logprobs), "output_versions": list(c.output_versions),
            "weight_version": c.weight_version, "finish_reason": c.finish_reason, "cached_tokens": c.cached_tokens,
            "text": text, "request": body, "time": time.time(), "response_id": response_id or c.rid, "index": index,
            "model_version": model_version if model_version is not None else str(c.weight_version),
            "latency_s": None if start is None else round(time.monotonic() - start, 6)}
