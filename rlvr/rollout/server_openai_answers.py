"""OpenAI answers: the response object of a call, or its SSE stream of chunks.

`serve(app, call, cancelled)` runs a parsed call (`OpenAICall`, from `server_openai`) on the
engine and answers with one JSON object, or with `stream: true` an SSE stream of chunks
(`stream_options.include_usage` adds a last chunk with the usage, `continuous_usage_stats` one per
chunk), then `data: [DONE]`. Text is streamed as it settles: an incomplete UTF-8 character or a
suffix that could begin a stop string is held back until known; in chat, tool calls go out as
one delta per call once their `<tool_call>` block closes (`tool_calls.ToolCallStream`). A stream
returns (as its generator value) the response it would have been unstreamed, for recorders.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Generator, Iterator
from typing import Any

from rlvr.rollout.server_protocol import is_int, output_text
from rlvr.rollout.tool_calls import ToolCallStream, held_back, parse_tool_calls
from rlvr.rollout.types import Completion, Request, SamplingParams
from rlvr.rollout.vocab import token_bytes, token_text


@dataclasses.dataclass
class OpenAICall:
    """One parsed OpenAI call: the engine requests and how to render their completions."""

    endpoint: str
    body: dict[str, Any]
    requests: list[Request]
    sampling: SamplingParams
    top: int | None = None  # log-probs: None = none, else the number of alternatives per position
    echo: list[str] | None = None  # completions: the prompt text per prompt
    parse_tools: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    tokenizer: Any = None
    response_id: str = ""  # the response's `id`; choice k's engine rid is f"{response_id}_{k}" (or rid itself)
    start: float = dataclasses.field(default_factory=time.monotonic)  # for the recorded latency

    @property
    def kind(self) -> str:
        return "chat.completion" if self.endpoint == "/v1/chat/completions" else "text_completion"

    def text(self, c: Completion) -> str:
        return output_text(c, self.tokenizer, self.sampling.skip_special_tokens, self.sampling.no_stop_trim)


def _finish(c: Completion) -> str | None:
    kind = (c.finish_reason or {}).get("type")
    return None if kind is None else {"stop": "stop", "length": "length"}.get(kind, "abort")


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


def _completion_logprobs(c: Completion, call: OpenAICall, first: int, with_input: bool, at: int = 0) -> dict[str, Any]:
    """OpenAI's legacy logprobs for output tokens from `first` on (and the prompt's with echo);
    `at` is the text offset of the first token listed."""
    tok = call.tokenizer
    meta = c.meta_info(return_logprob=True)
    items = (meta["input_token_logprobs"] if with_input else []) + meta["output_token_logprobs"][first:]
    tops = (meta.get("input_top_logprobs", []) if with_input else []) + meta.get("output_top_logprobs", [])[first:]
    tokens = [token_text(tok, t) for _, t, _ in items]
    offsets = []
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = None
    if call.top:
        top = [None if row is None else {token_text(tok, t): lp for lp, t, _ in row} for row in tops]
    return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in items], "text_offset": offsets,
            "top_logprobs": top}


def _completion_choices(app: Any, call: OpenAICall, done: list[Completion]) -> list[dict[str, Any]]:
    choices = []
    for k, c in enumerate(done):
        text = call.text(c)
        app.record(call.endpoint, call.body, c, text, call.response_id, k, call.start)
        echo = call.echo[k // call.sampling.n] if call.echo is not None else ""
        lp = None if call.top is None else _completion_logprobs(c, call, 0, call.echo is not None, 0)
        text = echo + text
        choices.append(_extras({"index": k, "text": text, "logprobs": lp, "finish_reason": _finish(c)}, c, call.body))
    return choices


def _chat_logprobs(c: Completion, call: OpenAICall, first: int = 0) -> dict[str, Any]:
    tok = call.tokenizer
    tops = c.output_top_logprobs or [[] for _ in c.output_ids]
    content = []
    for token, lp, row in list(zip(c.output_ids, c.output_logprobs, tops, strict=True))[first:]:
        content.append({**_entry(tok, token, lp), "top_logprobs": [_entry(tok, t, v) for v, t in row][:call.top]})
    return {"content": content}


def _entry(tokenizer: Any, token: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token)
    raw = token_bytes(tokenizer)[token] if tokenizer is not None and token < tokenizer.vocab_size else None
    return {"token": text, "logprob": logprob, "bytes": list(raw if raw is not None else text.encode("utf-8"))}


def _chat_choices(app: Any, call: OpenAICall, done: list[Completion]) -> list[dict[str, Any]]:
    choices = []
    for k, c in enumerate(done):
        text = call.text(c)
        app.record(call.endpoint, call.body, c, text, call.response_id, k, call.start)
        content, calls = parse_tool_calls(text) if call.parse_tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": None}
        finish = _finish(c)
        if calls:
            message["tool_calls"] = calls
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": k, "message": message, "finish_reason": finish,
                  "logprobs": _chat_logprobs(c, call) if call.top is not None else None}
        choices.append(_extras(choice, c, call.body))
    return choices


def _response(app: Any, call: OpenAICall, done: list[Completion], rid: str) -> dict[str, Any]:
    build = _chat_choices if call.kind == "chat.completion" else _completion_choices
    return {"id": rid, "object": call.kind, "created": int(time.time()), "model": app.model_name,
            "choices": build(app, call, done), "usage": _usage(done, call.sampling.n)}


def serve(app: Any, call: OpenAICall, cancelled: Any) -> dict[str, Any] | Iterator[bytes]:
    prefix = "chatcmpl" if call.kind == "chat.completion" else "cmpl"
    rid = call.response_id or f"{prefix}-{uuid.uuid4().hex}"
    if not call.body.get("stream"):
        return _response(app, call, app.run(call.requests, cancelled), rid)
    return _stream(app, call, app.stream(call.requests), rid)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


@dataclasses.dataclass
class _ChoiceState:
    """What one streamed choice has sent so far."""

    text: str = ""
    tokens: int = 0
    started: bool = False
    tools: ToolCallStream | None = None
    calls: int = 0


def _delta_text(call: OpenAICall, state: _ChoiceState, c: Completion) -> str:
    """New settled text of a partial (or the rest of a final) completion."""
    text = call.text(c)
    if c.finish_reason is None:
        text = text[: len(text) - held_back(text, list(call.sampling.stop))]
    if not text.startswith(state.text):
        return ""  # the decoded prefix changed (rare: a later token merged with earlier bytes)
    delta, state.text = text[len(state.text):], text
    return delta


def _chunk(app: Any, call: OpenAICall, rid: str, choice: dict[str, Any], usage: Any = None) -> bytes:
    chunk = {"id": rid, "object": call.kind + (".chunk" if call.kind == "chat.completion" else ""),
             "created": int(time.time()), "model": app.model_name, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return _sse(chunk)


def _chat_deltas(call: OpenAICall, state: _ChoiceState, c: Completion, text: str) -> list[dict[str, Any]]:
    deltas: list[dict[str, Any]] = []
    if not state.started:
        deltas.append({"role": "assistant", "content": ""})
        state.started = True
    final = c.finish_reason is not None
    if state.tools is not None:
        content, calls = state.tools.feed(text, final)
        state.calls += len(calls)
    else:
        content, calls = text, []
    if content:
        deltas.append({"content": content})
    if calls:
        deltas.append({"tool_calls": calls})
    return deltas


def _stream_chunks(app: Any, call: OpenAICall, state: _ChoiceState, index: int, c: Completion, rid: str,
                   usage: Any) -> Iterator[bytes]:
    """The chunks one partial (or final) completion adds to the stream."""
    sent = len(state.text)
    text = _delta_text(call, state, c)
    first, state.tokens = state.tokens, len(c.output_ids)
    final = _finish(c)
    if call.kind == "text_completion":
        echo = call.echo[index // call.sampling.n] if call.echo is not None else ""
        with_input = bool(echo) and not state.started
        lp = None if call.top is None else _completion_logprobs(c, call, first, with_input,
                                                                 0 if with_input else len(echo) + sent)
        if not state.started:
            text, state.started = echo + text, True
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": final}
        if call.body.get("return_token_ids"):
            choice["token_ids"] = list(c.output_ids[first:])
        yield _chunk(app, call, rid, _extras(choice, c, {}) if final else choice, usage)
        return
    lp = None if call.top is None else _chat_logprobs(c, call, first)
    deltas = _chat_deltas(call, state, c, text)
    if not deltas and lp is not None and lp["content"]:
        deltas = [{}]  # held-back text: the tokens' log-probs still go out
    for k, delta in enumerate(deltas):
        yield _chunk(app, call, rid, {"index": index, "delta": delta, "logprobs": lp if k == 0 else None,
                                      "finish_reason": None}, usage)
    if final:
        reason = "tool_calls" if final == "stop" and state.calls else final
        yield _chunk(app, call, rid, _extras({"index": index, "delta": {}, "logprobs": None,
                                              "finish_reason": reason}, c, {}), usage)


def _stream(app: Any, call: OpenAICall, partials: Iterator[tuple[int, Completion]],
            rid: str) -> Generator[bytes, None, dict[str, Any] | None]:
    """SSE chunks of a streamed call; returns the full response (as if not streamed) at the end."""
    states = [_ChoiceState(tools=ToolCallStream() if call.parse_tools else None) for _ in call.requests]
    finals: dict[int, Completion] = {}
    try:
        for index, c in partials:
            usage = _usage([c], 1) if call.continuous_usage else None
            yield from _stream_chunks(app, call, states[index], index, c, rid, usage)
            if c.finish_reason is not None:
                finals[index] = c
    except Exception as e:
        yield _sse(app.error_of(e).body())
        yield b"data: [DONE]\n\n"
        return None
    finally:
        partials.close()  # type: ignore[attr-defined]  # aborts unfinished requests
    done = [finals[i] for i in range(len(call.requests))]
    response = _response(app, call, done, rid)  # records the answers (rlvr.flywheel.capture) before [DONE]
    if call.include_usage:
        yield _sse({"id": rid, "object": f"{call.kind}.chunk" if call.kind == "chat.completion" else call.kind,
                    "created": int(time.time()), "model": app.model_name, "choices": [],
                    "usage": _usage(done, call.sampling.n)})
    yield b"data: [DONE]\n\n"
    return response
