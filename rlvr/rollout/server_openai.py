"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models` over the engine.

Chat prompts are rendered with the tokenizer's own chat template (tools included), and
`<tool_call>{json}</tool_call>` blocks in the output (the Qwen / Hermes convention the ChatML
template asks for) become OpenAI `tool_calls`. SGLang's extensions are honoured: `top_k`, `min_p`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `no_stop_trim`, `skip_special_tokens`, and for RL
callers `return_token_ids` (each choice gets `prompt_token_ids` and `token_ids`, the exact ids)
and `return_meta_info` (each choice gets the native `meta_info`, output logprobs included).

Not implemented (answered 400, not ignored): `stream`, `echo`, `suffix`, penalties, `logit_bias`,
`tool_choice` "required" or a named function, non-text message parts. Logprobs carry only the
sampled token (`top_logprobs` lists hold that one entry).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from rlvr.rollout.server_protocol import (
    ApiError,
    ModelLimits,
    check_bool,
    check_fields,
    check_int,
    check_str,
    encode_text,
    expand,
    expect_object,
    is_int,
    output_text,
    parse_sampling,
)
from rlvr.rollout.types import Completion, Request

# OpenAI name -> sampling_params name.
_SAMPLING_NAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
                   "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "min_tokens": "min_new_tokens", "stop": "stop", "stop_token_ids": "stop_token_ids",
                   "ignore_eos": "ignore_eos", "seed": "sampling_seed", "n": "n",
                   "skip_special_tokens": "skip_special_tokens", "no_stop_trim": "no_stop_trim"}
_COMMON = {*_SAMPLING_NAMES, "model", "logprobs", "return_token_ids", "return_meta_info", "rid"}
_IGNORED = {"user", "stream_options", "spaces_between_special_tokens", "extra_key", "cache_salt", "priority",
            "metadata", "store", "service_tier", "separate_reasoning", "stream_reasoning", "parallel_tool_calls"}
_UNSUPPORTED: dict[str, Any] = {"stream": False, "echo": False, "suffix": None, "presence_penalty": 0,
                                "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {}, "lora_path": None,
                                "continue_final_message": False, "response_format": {"type": "text"},
                                "return_hidden_states": False, "best_of": 1}
_COMPLETION_FIELDS = {*_COMMON, "prompt"}
_CHAT_FIELDS = {*_COMMON, "messages", "tools", "tool_choice", "top_logprobs", "chat_template_kwargs"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _sampling(body: dict[str, Any], limits: ModelLimits, default_max: int | None):
    values = {native: body[name] for name, native in _SAMPLING_NAMES.items() if body.get(name) is not None}
    if "max_new_tokens" not in values and default_max is not None:
        values["max_new_tokens"] = default_max
    return parse_sampling(values, limits, where="request")


def _rids(body: dict[str, Any], prefix: str, count: int) -> list[str]:
    rid = body.get("rid")
    base = check_str("rid", rid) if rid is not None else f"{prefix}-{uuid.uuid4().hex}"
    return [base] if count == 1 and rid is not None else [f"{base}_{k}" for k in range(count)]


def _finish(c: Completion) -> str:
    kind = (c.finish_reason or {}).get("type")
    return {"stop": "stop", "length": "length"}.get(kind, "abort")


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else str(token)


def _extras(choice: dict[str, Any], c: Completion, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("return_token_ids"):
        choice["prompt_token_ids"], choice["token_ids"] = list(c.prompt_ids), list(c.output_ids)
    if body.get("return_meta_info"):
        choice["meta_info"] = c.meta_info(return_logprob=True)
    matched = (c.finish_reason or {}).get("matched")
    choice["matched_stop"] = matched if is_int(matched) or isinstance(matched, str) else None
    return choice


def _usage(completions: list[Completion], n: int) -> dict[str, int]:
    prompt = sum(c.prompt_tokens for c in completions[::n])  # n samples share one prompt
    done = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _check_common(body: dict[str, Any]) -> None:
    for key in ("return_token_ids", "return_meta_info"):
        check_bool(key, body.get(key, False))
    if body.get("model") is not None:
        check_str("model", body["model"])


# --- /v1/completions -----------------------------------------------------------------------


def _prompts(prompt: Any, limits: ModelLimits) -> list[list[int]]:
    """OpenAI `prompt`: a string, a list of strings, a token list, or a list of token lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError("'prompt' must be a string, a list of strings or a list of token-id lists")
    if all(is_int(t) for t in prompt):
        prompt = [prompt]
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str) and p:
            if limits.tokenizer is None:
                raise ApiError("this server has no tokenizer: send token ids as 'prompt'")
            p = encode_text(limits.tokenizer, p, f"prompt[{i}]")
        if not isinstance(p, list) or not p or not all(is_int(t) and 0 <= t < limits.vocab_size for t in p):
            raise ApiError(f"prompt[{i}] must be a non-empty string or list of token ids in [0, {limits.vocab_size})")
        out.append(p)
    return out


def completions(app: Any, body: Any, cancelled: Any = None) -> dict[str, Any]:
    """POST /v1/completions."""
    body = expect_object(body)
    check_fields(body, _COMPLETION_FIELDS, _IGNORED, _UNSUPPORTED)
    _check_common(body)
    limits: ModelLimits = app.limits
    logprobs = body.get("logprobs")
    if logprobs is not None:
        check_int("logprobs", logprobs, 0, 20)
    prompts = _prompts(body.get("prompt"), limits)
    sp = _sampling(body, limits, default_max=16)
    requests = expand(prompts, [sp] * len(prompts), _rids(body, "cmpl", len(prompts) * sp.n), limits)
    done = app.run(requests, cancelled)
    choices = []
    for k, c in enumerate(done):
        text = output_text(c, limits.tokenizer, sp.skip_special_tokens, sp.no_stop_trim)
        app.record("/v1/completions", body, c, text)
        lp = None
        if logprobs is not None:
            tokens = [_token_text(limits.tokenizer, t) for t in c.output_ids]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            lp = {"tokens": tokens, "token_logprobs": list(c.output_logprobs), "text_offset": offsets,
                  "top_logprobs": [{t: v} for t, v in zip(tokens, c.output_logprobs, strict=True)] if logprobs
                  else None}
        choices.append(_extras({"index": k, "text": text, "logprobs": lp, "finish_reason": _finish(c)}, c, body))
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": app.model_name, "choices": choices, "usage": _usage(done, sp.n)}


# --- /v1/chat/completions ------------------------------------------------------------------


def _content(message: dict[str, Any], i: int) -> str | None:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"messages[{i}].content: only text parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(f"messages[{i}].content must be a string, null or a list of text parts")


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ApiError("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(value):
        message = dict(expect_object(message, f"messages[{i}]"))
        if message.get("role") not in _ROLES:
            raise ApiError(f"messages[{i}].role must be one of {sorted(_ROLES)}")
        message["content"] = _content(message, i)
        if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
            raise ApiError(f"messages[{i}].tool_calls must be a list")
        out.append(message)
    return out


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


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the parsed blocks, OpenAI tool_calls) from `<tool_call>{json}</tool_call>`."""
    calls, kept, last = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # not a well-formed call: leave it in the content
        kept.append(text[last:match.start()])
        last = match.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": arguments}})
    content = ("".join(kept) + text[last:]).strip() if calls else text
    return content or None, calls


def _render(app: Any, body: dict[str, Any]) -> list[int]:
    tokenizer = app.limits.tokenizer
    if tokenizer is None:
        raise ApiError("this server has no tokenizer, so no chat template: use /generate with input_ids")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object")
    try:
        ids = tokenizer.apply_chat_template(_messages(body.get("messages")), tools=_tools(body.get("tools")),
                                            add_generation_prompt=True, tokenize=True, **kwargs)
    except ApiError:
        raise
    except Exception as e:  # jinja errors, bad message shapes for this template
        raise ApiError(f"chat template failed: {type(e).__name__}: {e}") from None
    if not ids or any(not 0 <= t < app.limits.vocab_size for t in ids):
        raise ApiError("the rendered chat prompt is empty or has ids outside the model's vocabulary")
    return list(ids)


def _chat_logprobs(c: Completion, tokenizer: Any, top: int) -> dict[str, Any]:
    content = []
    for token, lp in zip(c.output_ids, c.output_logprobs, strict=True):
        text = _token_text(tokenizer, token)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        content.append({**entry, "top_logprobs": [entry] if top else []})
    return {"content": content}


def chat_completions(app: Any, body: Any, cancelled: Any = None) -> dict[str, Any]:
    """POST /v1/chat/completions (tools rendered by the chat template, tool calls parsed back)."""
    body = expect_object(body)
    check_fields(body, _CHAT_FIELDS, _IGNORED, _UNSUPPORTED)
    _check_common(body)
    want_logprobs = check_bool("logprobs", body.get("logprobs", False))
    top = check_int("top_logprobs", body.get("top_logprobs") or 0, 0, 20)
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none", None):
        raise ApiError("tool_choice must be 'auto' or 'none' (forced calls need constrained decoding)")
    prompt = _render(app, body)
    limits: ModelLimits = app.limits
    default_max = None if limits.context_length is None else max(1, limits.context_length - len(prompt))
    sp = _sampling(body, limits, default_max)
    requests: list[Request] = expand([prompt], [sp], _rids(body, "chatcmpl", sp.n), limits)
    done = app.run(requests, cancelled)
    parse = bool(body.get("tools")) and tool_choice != "none"
    choices = []
    for k, c in enumerate(done):
        text = output_text(c, limits.tokenizer, sp.skip_special_tokens, sp.no_stop_trim)
        app.record("/v1/chat/completions", body, c, text)
        content, calls = parse_tool_calls(text) if parse else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": None}
        finish = _finish(c)
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": k, "message": message, "finish_reason": finish,
                  "logprobs": _chat_logprobs(c, limits.tokenizer, top) if want_logprobs else None}
        choices.append(_extras(choice, c, body))
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": app.model_name, "choices": choices, "usage": _usage(done, sp.n)}


def models(app: Any) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": app.model_name, "object": "model", "created": int(app.start_time),
                                        "owned_by": "rlvr", "root": app.model_path,
                                        "max_model_len": app.limits.context_length}]}
