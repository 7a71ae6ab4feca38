"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models` over the engine.

Chat prompts are rendered with the tokenizer's own chat template (tools included), and
`<tool_call>{json}</tool_call>` blocks in the output (the Qwen / Hermes convention the ChatML
template asks for) become OpenAI `tool_calls`. SGLang's extensions are honoured: `top_k`, `min_p`,
`min_tokens`, `stop_token_ids`, `ignore_eos`, `no_stop_trim`, `skip_special_tokens`, and for RL
callers `return_token_ids` (each choice gets `prompt_token_ids` and `token_ids`, the exact ids)
and `return_meta_info` (each choice gets the native `meta_info`, output logprobs included).

Recording sessions (`SessionRecorder`, for black-box agents trained with RL): a trainer opens a
session and points an unmodified OpenAI client at `http://host:port/sessions/<id>/v1`; every
completion served under that base URL is recorded in the session with the exact ids the engine saw
and sampled (see `SessionRecorder`). Tool-call `arguments` keep the model's own JSON text, so an
agent that sends the assistant message back re-renders the sampled tokens (where the template's
tool-call format matches what the model wrote).

Not implemented (answered 400, not ignored): `stream`, `echo`, `suffix`, penalties, `logit_bias`,
`tool_choice` "required" or a named function, non-text message parts. Logprobs carry only the
sampled token (`top_logprobs` lists hold that one entry).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from rlvr.rollout.server_http import Reply
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
    parse_json,
    parse_sampling,
    record_of,
)
from rlvr.rollout.types import Completion, Request

logger = logging.getLogger(__name__)

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
_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


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


def _raw_arguments(block: str, args: Any) -> str:
    """The arguments' JSON text exactly as the model wrote it in `block` (so an agent that sends the
    call back gets the same tokens from the chat template), else `json.dumps(args)`."""
    decoder = json.JSONDecoder()
    for key in _ARGUMENTS_KEY.finditer(block):
        try:
            value, end = decoder.raw_decode(block, key.end())
        except ValueError:
            continue
        if value == args and type(value) is type(args):
            return block[key.end():end]
    return json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content without the parsed blocks, OpenAI tool_calls) from `<tool_call>{json}</tool_call>`.
    A call's `arguments` string is the model's own JSON text of the arguments object (valid JSON,
    whitespace and key order as sampled), so the chat template re-renders it token for token."""
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
        arguments = args if isinstance(args, str) else _raw_arguments(match.group(1), args)
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


# --- recording sessions (black-box agents) -------------------------------------------------

SESSION_PREFIX = "/sessions"
_SESSION_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")
_SESSION_ROUTES: dict[tuple[str, ...], tuple[str, str]] = {  # path after /sessions/<id> -> (method, action)
    (): ("GET", "get"), ("close",): ("POST", "close"), ("v1", "chat", "completions"): ("POST", "chat"),
    ("v1", "completions"): ("POST", "completions"), ("v1", "models"): ("GET", "models")}
_MAX_SESSION_ERRORS = 64


@dataclasses.dataclass
class _Session:
    id: str
    metadata: dict[str, Any]
    created: float  # wall clock
    last_active: float  # recorder clock (monotonic unless injected)
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    errors: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    calls: int = 0  # calls started (failed ones included)
    tokens: int = 0  # prompt + output ids recorded
    inflight: dict[str, int] = dataclasses.field(default_factory=dict)  # engine rid -> call number

    def snapshot(self, state: str) -> dict[str, Any]:
        return {"id": self.id, "state": state, "metadata": dict(self.metadata), "created": self.created,
                "calls": self.calls, "tokens": self.tokens, "records": list(self.records), "errors": list(self.errors)}


class SessionRecorder:
    """Per-agent recording sessions over the OpenAI endpoints (thread-safe).

    A trainer opens a session, hands the agent `base_url(sid)` (`http://host:port/sessions/<sid>/v1`:
    any OpenAI client works unmodified, only its base URL changes), and reads the records with
    `close(sid)` (or `GET /sessions/<sid>` remotely). Each choice of each `chat/completions` or
    `completions` call served under that URL appends one record, in completion order:

        prompt_ids, output_ids            exactly what the engine saw and sampled (never re-tokenised)
        output_logprobs, output_versions  behaviour log-prob and weight version per output token
        weight_version, finish_reason, cached_tokens, text, rid, endpoint
        request                           the request body as sent (messages, tools, sampling options)
        response                          the choice as returned (message with tool_calls, finish_reason)
        session, call, choice             session id, call number (in start order), choice index (n > 1)
        start_time, end_time, latency_s   wall-clock time of the HTTP call

    Failed calls (4xx/5xx) are kept in the session's `errors`. The server's global recorder (if any)
    still receives every record (the same dict, once the call has finished), tagged with `session`.

    Memory is bounded: a session idle for `ttl_s` (no call in flight) expires and its records are
    dropped; opening more than `max_sessions` evicts the least recently active one; a session
    refuses calls (429) after `max_calls` calls or `max_tokens` recorded ids (every call stores its
    whole prompt, so a session's memory grows with calls x context; ~40 bytes per id). `close` frees the
    session at once and aborts its requests still in flight; later calls to it get 404.

    Routes (installed by `attach(server)` in front of the app's own routes):
        POST /sessions                       open (body: optional {"id", "metadata"}) -> {"id", "base_url"}
        GET  /sessions                       the open sessions (no records)
        GET  /sessions/<id>                  the session's records and errors
        DELETE /sessions/<id>, POST /sessions/<id>/close   close: records and errors, then freed
        POST /sessions/<id>/v1/chat/completions, /sessions/<id>/v1/completions, GET /sessions/<id>/v1/models
    """

    def __init__(self, ttl_s: float = 3600.0, max_sessions: int = 4096, max_calls: int = 512,
                 max_tokens: int = 4_000_000, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_sessions, self.max_calls, self.max_tokens = ttl_s, max_sessions, max_calls, max_tokens
        self.clock = clock
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()  # LRU order
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why (bounded)
        self._lock = threading.Lock()
        self._app: Any = None
        self.expired = 0  # sessions dropped by the TTL or the max_sessions cap

    # --- Python API -----------------------------------------------------------------------

    def attach(self, target: Any) -> SessionRecorder:
        """Serves the session routes on a `RolloutHTTPServer` (or its `RolloutApp`): they are
        matched before the app's own routes, which are unchanged."""
        app = getattr(target, "app", target)
        if getattr(app, "sessions", None) is not None:
            raise ValueError("this app already has a SessionRecorder attached")
        inner = app.dispatch

        def dispatch(method: str, path: str, raw: bytes, cancelled: Callable[[], bool]) -> Reply:
            clean = path.rstrip("/") or "/"
            if clean == SESSION_PREFIX or clean.startswith(SESSION_PREFIX + "/"):
                return self._dispatch(app, method, clean, raw, cancelled)
            return inner(method, path, raw, cancelled)

        app.dispatch, app.sessions, self._app = dispatch, self, app
        return self

    def open(self, session_id: str | None = None, metadata: dict[str, Any] | None = None) -> str:
        """A new session's id (`session_id` if given: 1-128 of [A-Za-z0-9._~-], unused)."""
        sid = uuid.uuid4().hex if session_id is None else session_id
        if not isinstance(sid, str) or not _SESSION_ID.fullmatch(sid):
            raise ValueError(f"session id must be 1-128 characters of [A-Za-z0-9._~-], got {sid!r}")
        evicted = []
        with self._lock:
            self._sweep_locked()
            if sid in self._sessions:
                raise ValueError(f"session {sid!r} is already open")
            while len(self._sessions) >= self.max_sessions:
                old = next((s for s in self._sessions.values() if not s.inflight), None)
                if old is None:
                    raise RuntimeError(f"{len(self._sessions)} sessions have requests in flight: none to evict")
                self._drop_locked(old.id, "evicted (max_sessions)")
                evicted.append(old.id)
            self._gone.pop(sid, None)
            self._sessions[sid] = _Session(sid, dict(metadata or {}), time.time(), self.clock())
        if evicted:
            logger.warning("session cap %d reached: evicted %s", self.max_sessions, evicted)
        return sid

    def base_url(self, session_id: str, server_url: str | None = None) -> str:
        """The OpenAI base URL of a session (`server_url` defaults to the attached server's address)."""
        if server_url is None:
            if self._app is None:
                raise ValueError("no server attached: pass server_url")
            host, port = self._app.address[:2]
            server_url = f"http://{host if host not in ('', '0.0.0.0', '::') else '127.0.0.1'}:{port}"
        return f"{server_url.rstrip('/')}{SESSION_PREFIX}/{session_id}/v1"

    def records(self, session_id: str) -> list[dict[str, Any]]:
        """The session's records so far (KeyError if it is not open)."""
        return self.snapshot(session_id)["records"]

    def snapshot(self, session_id: str) -> dict[str, Any]:
        """{"id", "state", "metadata", "created", "calls", "tokens", "records", "errors"}."""
        with self._lock:
            self._sweep_locked()
            return self._get_locked(session_id).snapshot("open")

    def close(self, session_id: str) -> dict[str, Any]:
        """Frees the session and returns its final `snapshot` (state "closed"); requests of it still in
        flight are aborted (their records are dropped). KeyError if it is not open (never opened,
        already closed, expired or evicted: the message says which)."""
        with self._lock:
            session = self._get_locked(session_id)
            self._drop_locked(session_id, "closed")
            inflight = list(session.inflight)
        abort = getattr(getattr(self._app, "driver", None), "abort", None)
        for rid in inflight if abort is not None else ():
            abort(rid)
        return session.snapshot("closed")

    def sweep(self) -> list[str]:
        """Expires sessions idle for more than `ttl_s` (also done on every open / lookup)."""
        with self._lock:
            return self._sweep_locked()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._sessions

    def session_ids(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    # --- internals ------------------------------------------------------------------------

    def _get_locked(self, sid: str) -> _Session:
        session = self._sessions.get(sid)
        if session is None:
            why = self._gone.get(sid)
            raise KeyError(f"session {sid!r} is {why}" if why else f"no session {sid!r}")
        return session

    def _drop_locked(self, sid: str, why: str) -> None:
        del self._sessions[sid]
        self._gone[sid] = why
        while len(self._gone) > 4 * self.max_sessions:
            self._gone.popitem(last=False)
        if why != "closed":
            self.expired += 1

    def _sweep_locked(self) -> list[str]:
        now = self.clock()
        stale = [s.id for s in self._sessions.values() if not s.inflight and now - s.last_active > self.ttl_s]
        for sid in stale:
            self._drop_locked(sid, "expired (ttl)")
        if stale:
            logger.warning("expired %d idle recording sessions (ttl %.0f s)", len(stale), self.ttl_s)
        return stale

    def _begin(self, sid: str) -> int:
        with self._lock:
            self._sweep_locked()
            try:
                session = self._get_locked(sid)
            except KeyError as e:
                raise ApiError(f"{e.args[0]}: open one with POST {SESSION_PREFIX}", 404) from None
            if session.calls >= self.max_calls or session.tokens >= self.max_tokens:
                raise ApiError(f"session {sid!r} reached its limit ({self.max_calls} calls, {self.max_tokens} "
                               "recorded tokens)", 429, "TooManyRequests")
            session.calls += 1
            session.last_active = self.clock()
            self._sessions.move_to_end(sid)
            return session.calls - 1

    def _track(self, sid: str, rids: list[str], call: int, add: bool) -> None:
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:
                return
            for rid in rids:
                if add:
                    session.inflight[rid] = call
                else:
                    session.inflight.pop(rid, None)
            session.last_active = self.clock()

    def _commit(self, sid: str, records: list[dict[str, Any]] | None, error: dict[str, Any] | None) -> None:
        with self._lock:
            session = self._sessions.get(sid)
            if session is None:  # closed or evicted while the call ran
                return
            session.last_active = self.clock()
            if error is not None:
                session.errors.append(error)
                del session.errors[:-_MAX_SESSION_ERRORS]
            for record in records or ():
                session.records.append(record)
                session.tokens += len(record["prompt_ids"]) + len(record["output_ids"])

    def _dispatch(self, app: Any, method: str, path: str, raw: bytes, cancelled: Callable[[], bool]) -> Reply:
        parts = path.split("/")[2:]  # "", "sessions", <id>, ...
        if not parts:
            return self._allow(method, {"GET", "POST"}) or (
                self._open_remote(raw) if method == "POST" else Reply(200, {"sessions": self._listing()}))
        sid, rest = parts[0], tuple(parts[1:])
        if rest not in _SESSION_ROUTES:
            raise ApiError(f"no route {path}", 404)
        want, action = _SESSION_ROUTES[rest]
        allowed = {want, "DELETE"} if action == "get" else {want}
        refused = self._allow(method, allowed)
        if refused is not None:
            return refused
        try:
            if action == "get" and method == "GET":
                return Reply(200, self.snapshot(sid))
            if action in ("get", "close"):
                return Reply(200, self.close(sid))
        except KeyError as e:
            raise ApiError(e.args[0], 404) from None
        if action == "models":
            self._begin_check(sid)
            return Reply(200, models(app))
        endpoint, fn = (("/v1/chat/completions", chat_completions) if action == "chat"
                        else ("/v1/completions", completions))
        return Reply(200, self._serve(app, sid, endpoint, fn, raw, cancelled))

    def _begin_check(self, sid: str) -> None:
        with self._lock:
            if sid not in self._sessions:
                raise ApiError(f"no open session {sid!r}", 404)

    @staticmethod
    def _allow(method: str, allowed: set[str]) -> Reply | None:
        if method in allowed:
            return None
        reply = Reply(405, ApiError(f"method {method} not allowed here", 405).body())
        reply.headers["Allow"] = ", ".join(sorted(allowed))
        return reply

    def _listing(self) -> list[dict[str, Any]]:
        with self._lock:
            self._sweep_locked()
            return [{"id": s.id, "metadata": s.metadata, "created": s.created, "calls": s.calls,
                     "records": len(s.records)} for s in self._sessions.values()]

    def _open_remote(self, raw: bytes) -> Reply:
        body = expect_object(parse_json(raw, allow_empty=True))
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise ApiError("metadata must be an object")
        try:
            sid = self.open(body.get("id"), metadata)
        except (ValueError, RuntimeError) as e:
            raise ApiError(str(e), 409 if "already open" in str(e) else 400) from None
        return Reply(200, {"id": sid, "base_url": self.base_url(sid), "path": f"{SESSION_PREFIX}/{sid}/v1"})

    def _serve(self, app: Any, sid: str, endpoint: str, fn: Callable[..., dict[str, Any]], raw: bytes,
               cancelled: Callable[[], bool]) -> dict[str, Any]:
        call = self._begin(sid)
        proxy = _SessionApp(app, self, sid, call)
        start_time, start = time.time(), time.monotonic()
        try:
            reply = fn(proxy, parse_json(raw), cancelled)
        except Exception as e:
            status = e.status if isinstance(e, ApiError) else 500
            self._commit(sid, None, {"call": call, "endpoint": endpoint, "status": status,
                                     "message": getattr(e, "message", None) or f"{type(e).__name__}: {e}",
                                     "start_time": start_time, "end_time": time.time()})
            proxy.forward()
            raise
        end_time, latency = time.time(), time.monotonic() - start
        for record, choice in zip(proxy.records, reply["choices"], strict=True):
            response = {k: v for k, v in choice.items() if k in ("index", "message", "text", "finish_reason")}
            record.update(response=response, session=sid, call=call, choice=choice["index"], start_time=start_time,
                          end_time=end_time, latency_s=latency)
        self._commit(sid, proxy.records, None)
        proxy.forward()
        return reply


class _SessionApp:
    """The app as seen by one session call: records go to the session, in-flight rids are tracked
    (so closing the session aborts them); everything else is the real app."""

    def __init__(self, app: Any, sessions: SessionRecorder, sid: str, call: int):
        self._app, self._sessions, self._sid, self._call = app, sessions, sid, call
        self.records: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)

    def run(self, requests: list[Request], cancelled: Any = None) -> list[Completion]:
        rids = [r.rid for r in requests]
        self._sessions._track(self._sid, rids, self._call, add=True)
        try:
            return self._app.run(requests, cancelled)
        finally:
            self._sessions._track(self._sid, rids, self._call, add=False)

    def record(self, endpoint: str, body: Any, c: Completion, text: str | None) -> None:
        self.records.append(record_of(endpoint, body, c, text))

    def forward(self) -> None:
        """Hands the call's records to the server's global recorder (if any), tagged with the session."""
        recorder = getattr(self._app, "recorder", None)
        for record in self.records if recorder is not None else ():
            try:
                recorder({"session": self._sid, **record})
            except Exception:
                logger.exception("recorder failed on %s", record["rid"])
