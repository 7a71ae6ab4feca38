"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models` over the engine.

This module parses requests into an `OpenAICall` (engine requests plus how to render them);
`server_openai_answers.serve` runs it and answers with one JSON object or, with `stream: true`,
an SSE stream of chunks. Also `/tokenize` and `/detokenize` (SGLang's, also under `/v1/`).

Chat prompts are rendered with the tokenizer's own chat template (tools included), and
`<tool_call>{json}</tool_call>` blocks in the output become OpenAI `tool_calls` (streamed as one
delta per call once its block closes; see `rlvr.rollout.tool_calls`). `tool_choice` "required" or
a named function and `response_format` (json_object, json_schema) constrain the output by
constrained decoding (engines with the "constraints" feature). SGLang's extensions are honoured:
`top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `regex` / `json_schema` (completions),
`stop_token_ids`, `stop_regex`, `ignore_eos`, `no_stop_trim`, `skip_special_tokens`, and for RL
callers `return_token_ids` (each choice gets `prompt_token_ids` and `token_ids`, the exact ids)
and `return_meta_info` (each choice gets the native `meta_info`, output logprobs included).
Unknown fields are ignored (logged once), as SGLang's request models do.

Message content parts: text, and for a vision-language model `image_url` parts (`{"url": ...}`: a
data URL with base64 PNG/JPEG, bare base64 or a path; each becomes
`<|vision_start|><|image_pad|><|vision_end|>` in the prompt, as Qwen2.5-VL's template writes it,
and the engine prefills the image there).

Not implemented (answered 400, not ignored): `suffix`, `continue_final_message`, LoRA, ebnf /
structural tags, audio / video / file message parts, image parts for a text-only model.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from rlvr.rollout import tool_calls
from rlvr.rollout.server_openai_answers import OpenAICall, serve
from rlvr.rollout.server_protocol import (
    ApiError,
    LogprobOptions,
    ModelLimits,
    ParsedSampling,
    check_bool,
    check_int,
    check_str,
    encode_text,
    expand,
    expand_image_tokens,
    expect_object,
    is_int,
    log_ignored,
    parse_sampling,
    refuse_unsupported,
)

# OpenAI (and SGLang extension) name -> sampling_params name.
_SAMPLING_NAMES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "min_tokens": "min_new_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids",
                   "stop_regex": "stop_regex", "ignore_eos": "ignore_eos", "seed": "sampling_seed", "n": "n",
                   "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim",
                   "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                   "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias", "regex": "regex"}
_COMMON = {*_SAMPLING_NAMES, "model", "logprobs", "return_token_ids", "return_meta_info", "rid", "stream",
           "stream_options", "max_tokens", "response_format"}
_UNSUPPORTED = ("suffix", "lora_path", "continue_final_message", "return_hidden_states", "ebnf",
                "custom_logit_processor", "session_params", "return_routed_experts", "return_sampling_mask")
_COMPLETION_FIELDS = {*_COMMON, "prompt", "echo", "json_schema"}
_CHAT_FIELDS = {*_COMMON, "messages", "tools", "tool_choice", "top_logprobs", "chat_template_kwargs",
                "max_completion_tokens"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _response_format(value: Any) -> str | None:
    """The json_schema (a JSON string) a `response_format` asks for, as SGLang maps it."""
    if value is None:
        return None
    fmt = expect_object(value, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return '{"type": "object"}'
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        schema = expect_object(spec, "response_format.json_schema").get("schema", fmt.get("schema"))
        if not isinstance(schema, dict):
            raise ApiError("response_format.json_schema.schema is required (a JSON schema object)")
        return json.dumps(schema)
    raise ApiError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _sampling(body: dict[str, Any], limits: ModelLimits, max_tokens: Any,
              constraint: tuple[str, str] | None) -> ParsedSampling:
    values = {native: body[name] for name, native in _SAMPLING_NAMES.items() if body.get(name) is not None}
    values["max_new_tokens"] = max_tokens
    json_schema = _response_format(body.get("response_format")) or body.get("json_schema")
    if json_schema is not None:
        values["json_schema"] = json_schema
    if constraint is not None:
        if any(values.get(k) for k in ("regex", "json_schema")):
            raise ApiError("tool_choice 'required' or a named tool cannot be combined with response_format or "
                           "regex: the tool-call constraint and the output constraint cannot both be honored")
        values[constraint[0]] = constraint[1]
    return parse_sampling(values, limits, where="request")


def _rids(body: dict[str, Any], prefix: str, count: int) -> tuple[str, list[str]]:
    """(the response id, the engine rid of each choice)."""
    rid = body.get("rid")
    base = check_str("rid", rid) if rid is not None else f"{prefix}-{uuid.uuid4().hex}"
    return base, [base] if count == 1 and rid is not None else [f"{base}_{k}" for k in range(count)]


def _common(body: Any, fields: set[str], where: str) -> dict[str, Any]:
    body = dict(expect_object(body))
    refuse_unsupported(body, _UNSUPPORTED, "request")
    log_ignored(where, sorted(set(body) - fields - set(_UNSUPPORTED)))
    for key in ("return_token_ids", "return_meta_info", "stream"):
        check_bool(key, body.get(key) or False)
    if body.get("model") is not None:
        check_str("model", body["model"])
    return body


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    options = body.get("stream_options")
    if options is None:
        return False, False
    options = expect_object(options, "stream_options")
    return (check_bool("stream_options.include_usage", options.get("include_usage") or False),
            check_bool("stream_options.continuous_usage_stats", options.get("continuous_usage_stats") or False))


# --- /v1/completions -----------------------------------------------------------------------


def _prompts(prompt: Any, limits: ModelLimits) -> tuple[list[list[int]], list[str | None]]:
    """OpenAI `prompt` (a string, a list of strings, a token list, or a list of token lists) as
    (token ids, text as given or None for token prompts) per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("'prompt' must be a string, a list of strings or a list of token-id lists")
    if all(is_int(t) for t in prompt):
        prompt = [prompt]
    ids, texts = [], []
    for i, p in enumerate(prompt):
        text = p if isinstance(p, str) and p else None
        if text is not None:
            if limits.tokenizer is None:
                raise ApiError("this server has no tokenizer: send token ids as 'prompt'")
            p = encode_text(limits.tokenizer, text, f"prompt[{i}]")
        if not isinstance(p, list) or not p or not all(is_int(t) and 0 <= t < limits.vocab_size for t in p):
            raise ApiError(f"prompt[{i}] must be a non-empty string or list of token ids in [0, {limits.vocab_size})")
        ids.append(p)
        texts.append(text)
    return ids, texts


def _parse_completion(app: Any, body: Any) -> OpenAICall:
    body = _common(body, _COMPLETION_FIELDS, "/v1/completions")
    limits: ModelLimits = app.limits
    logprobs = body.get("logprobs")
    top = None if logprobs is None else check_int("logprobs", logprobs, 0, 20)
    echo = check_bool("echo", body.get("echo") or False)
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens <= 0):
        raise ApiError(f"max_tokens must be a positive integer, got {json.dumps(max_tokens)[:40]}")
    ids, texts = _prompts(body.get("prompt"), limits)
    sp = _sampling(body, limits, max_tokens, None)
    lp = LogprobOptions(0 if echo and top is not None else -1, top or 0)
    if lp.start >= 0:
        limits.require("prompt_logprobs", "echo with logprobs (prompt log-probs)")
    if lp.top:
        limits.require("top_logprobs", "logprobs > 0 (top log-probs)")
    response_id, rids = _rids(body, "cmpl", len(ids) * sp.params.n)
    requests = expand(ids, [sp] * len(ids), rids, limits, [lp] * len(ids))
    tok = limits.tokenizer
    echoes = [t if t is not None else (tok.decode(p, skip_special_tokens=True) if tok is not None else "")
              for p, t in zip(ids, texts, strict=True)] if echo else None
    include, continuous = _stream_options(body)
    return OpenAICall("/v1/completions", body, requests, sp.params, top, echoes, False, include, continuous, tok,
                      response_id)


def completions(app: Any, body: Any, cancelled: Any = None) -> dict[str, Any] | Iterator[bytes]:
    """POST /v1/completions: the response, or with stream=true its SSE chunks."""
    call = _parse_completion(app, body)
    return serve(app, call, cancelled)


# --- /v1/chat/completions ------------------------------------------------------------------


def _content(message: dict[str, Any], i: int, images: list[str], limits: ModelLimits) -> str | None:
    """The message's text; its image parts become the placeholder block and their URLs join `images`."""
    from rlvr.data.images import IMAGE_PAD, VISION_END, VISION_START

    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                limits.require("images", f"messages[{i}].content[{j}] (an image_url part)")
                url = part.get("image_url")
                images.append(_image_url(url.get("url") if isinstance(url, dict) else url, i, j))
                texts.append(VISION_START + IMAGE_PAD + VISION_END)
                continue
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content[{j}]: only text and image_url parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(f"messages[{i}].content must be a string, null or a list of text / image_url parts")


def _image_url(url: Any, i: int, j: int) -> str:
    if not isinstance(url, str) or not url or url.startswith(("http://", "https://")):
        raise ApiError(f"messages[{i}].content[{j}].image_url.url: give the image inline (a data:image/...;base64 "
                       "URL, base64 or a local path); this server fetches nothing from the network")
    return url


def _messages(value: Any, limits: ModelLimits) -> tuple[list[dict[str, Any]], list[str]]:
    """(the messages with string contents, the image URLs of their image parts in order)."""
    if not isinstance(value, list) or not value:
        raise ApiError("'messages' must be a non-empty list")
    out, images = [], []
    for i, message in enumerate(value):
        message = dict(expect_object(message, f"messages[{i}]"))
        if message.get("role") not in _ROLES:
            raise ApiError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        message["content"] = _content(message, i, images, limits)
        if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
            raise ApiError(f"messages[{i}].tool_calls must be a list")
        out.append(message)
    return out, images


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ApiError("'tools' must be a list")
    for i, tool in enumerate(value):
        fn = expect_object(tool, f"tools[{i}]").get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict) or \
                not isinstance(fn.get("name"), str):
            raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
    return value or None


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("none" | "auto" | "required", the named function or None); SGLang's default is "auto"
    with tools and "none" without."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise ApiError("tool_choice 'required' needs 'tools'")
        return choice, None
    fn = expect_object(choice, "tool_choice").get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                       "'function': {'name': ...}}")
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise ApiError(f"tool_choice names function {name!r}, which is not among 'tools'")
    return "required", name


def _render(app: Any, body: dict[str, Any], tools: list[dict[str, Any]] | None) -> tuple[list[int], list[str]]:
    """(the chat prompt's ids, its image URLs: one per image placeholder, not yet expanded)."""
    tokenizer = app.limits.tokenizer
    if tokenizer is None:
        raise ApiError("this server has no tokenizer, so no chat template: use /generate with input_ids")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object")
    messages, images = _messages(body.get("messages"), app.limits)
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                            **kwargs)
    except ApiError:
        raise
    except Exception as e:  # jinja errors, bad message shapes for this template
        raise ApiError(f"chat template failed: {type(e).__name__}: {e}") from None
    if not ids or any(not 0 <= t < app.limits.vocab_size for t in ids):
        raise ApiError("the rendered chat prompt is empty or has ids outside the model's vocabulary")
    return list(ids), images


def _parse_chat(app: Any, body: Any) -> OpenAICall:
    body = _common(body, _CHAT_FIELDS, "/v1/chat/completions")
    limits: ModelLimits = app.limits
    want = check_bool("logprobs", body.get("logprobs") or False)
    top = check_int("top_logprobs", body.get("top_logprobs") or 0, 0, 20)
    if body.get("stream") and (body.get("return_token_ids") or body.get("return_meta_info")):
        raise ApiError("return_token_ids / return_meta_info are not supported with streaming on "
                       "/v1/chat/completions (as in SGLang): set stream=false")
    tools = _tools(body.get("tools"))
    choice, name = _tool_choice(body, tools)
    constraint = None
    if choice == "required":
        limits.require("constraints", "tool_choice 'required' or a named function (constrained decoding)")
        constraint = ("regex", tool_calls.tool_call_regex(tools or [], name))
    prompt, images = _render(app, body, tools)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    sp = _sampling(body, limits, max_tokens, constraint)
    if want and top:
        limits.require("top_logprobs", "top_logprobs > 0")
    lp = LogprobOptions(-1, top if want else 0)
    response_id, rids = _rids(body, "chatcmpl", sp.params.n)
    requests = expand([prompt], [sp], rids, limits, [lp], [images])
    include, continuous = _stream_options(body)
    return OpenAICall("/v1/chat/completions", body, requests, sp.params, top if want else None, None,
                      bool(tools) and choice != "none", include, continuous, limits.tokenizer, response_id)


def chat_completions(app: Any, body: Any, cancelled: Any = None) -> dict[str, Any] | Iterator[bytes]:
    """POST /v1/chat/completions (tools rendered by the chat template, tool calls parsed back)."""
    return serve(app, _parse_chat(app, body), cancelled)


# --- models, tokenize, detokenize ----------------------------------------------------------


def models(app: Any) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [model_card(app)]}


def model_card(app: Any) -> dict[str, Any]:
    return {"id": app.model_name, "object": "model", "created": int(app.start_time), "owned_by": "rlvr",
            "root": app.model_path, "max_model_len": app.limits.context_length}


def tokenize(app: Any, body: Any) -> dict[str, Any]:
    """POST /tokenize (/v1/tokenize): `prompt` (a string or a list) or chat `messages`."""
    body = expect_object(body)
    tok = app.limits.tokenizer
    if tok is None:
        raise ApiError("this server has no tokenizer")
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise ApiError("Exactly one of 'prompt' or 'messages' must be provided.")
    special = check_bool("add_special_tokens", body.get("add_special_tokens", True))
    max_len = app.limits.context_length or -1
    if body.get("messages") is not None:
        ids, images = _render(app, body, _tools(body.get("tools")))
        if images:
            ids = expand_image_tokens(ids, images, app.limits)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}
    prompt = body["prompt"]
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise ApiError("'prompt' must be a string or a list of strings")
    try:
        ids = [list(tok.encode(t, add_special_tokens=special)) for t in texts]
    except Exception as e:  # lone surrogates
        raise ApiError(f"prompt cannot be tokenized: {type(e).__name__}: {e}") from None
    if isinstance(prompt, str):
        return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": max_len}
    return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": max_len}


def detokenize(app: Any, body: Any) -> dict[str, Any]:
    """POST /detokenize (/v1/detokenize): `tokens` (a list of ids or a list of such lists)."""
    body = expect_object(body)
    tok = app.limits.tokenizer
    if tok is None:
        raise ApiError("this server has no tokenizer")
    tokens = body.get("tokens")
    skip = check_bool("skip_special_tokens", body.get("skip_special_tokens", True))
    vocab = app.limits.vocab_size
    nested = isinstance(tokens, list) and bool(tokens) and all(isinstance(x, list) for x in tokens)
    rows = tokens if nested else [tokens]
    for row in rows:
        if not isinstance(row, list) or not all(is_int(t) and 0 <= t < vocab for t in row):
            raise ApiError(f"'tokens' must be a list of token ids in [0, {vocab}) or a list of such lists")
    texts = [tok.decode(row, skip_special_tokens=skip) for row in rows]
    return {"text": texts if nested else texts[0]}
