"""Recording sessions over the OpenAI endpoints, for black-box agents trained with RL.

A trainer opens a session and points an unmodified OpenAI client at
`http://host:port/sessions/<id>/v1`; every completion served under that base URL (streamed or not)
is recorded in the session with the exact ids the engine saw and sampled (see `SessionRecorder`).
Tool-call `arguments` keep the model's own JSON text, so an agent that sends the assistant message
back re-renders the sampled tokens (where the template's tool-call format matches what the model
wrote).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any

from rlvr.rollout.server_http import Reply
from rlvr.rollout.server_openai import chat_completions, completions, models
from rlvr.rollout.server_protocol import ApiError, expect_object, parse_json, record_of
from rlvr.rollout.types import Completion, Request

logger = logging.getLogger(__name__)

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
        return self._serve(app, sid, endpoint, fn, raw, cancelled)

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

    def _serve(self, app: Any, sid: str, endpoint: str, fn: Callable[..., Any], raw: bytes,
               cancelled: Callable[[], bool]) -> Reply:
        call = self._begin(sid)
        proxy = _SessionApp(app, self, sid, call)
        start_time, start = time.time(), time.monotonic()
        try:
            reply = fn(proxy, parse_json(raw), cancelled)
        except Exception as e:
            status = e.status if isinstance(e, ApiError) else 500
            self._fail(sid, proxy, call, endpoint, status, getattr(e, "message", None) or f"{type(e).__name__}: {e}",
                       start_time)
            raise
        if isinstance(reply, dict):
            self._done(sid, proxy, call, reply, start_time, start)
            return Reply(200, reply)
        return Reply(stream=self._recorded(reply, sid, proxy, call, endpoint, start_time, start))

    def _recorded(self, chunks: Generator[bytes, None, dict[str, Any] | None], sid: str, proxy: _SessionApp,
                  call: int, endpoint: str, start_time: float, start: float) -> Iterator[bytes]:
        """A streamed call's chunks; its records are committed once the stream has ended."""
        response = None
        try:
            response = yield from chunks
        finally:
            if response is not None:
                self._done(sid, proxy, call, response, start_time, start)
            else:
                self._fail(sid, proxy, call, endpoint, 499, "the stream ended before every choice finished",
                           start_time)

    def _fail(self, sid: str, proxy: _SessionApp, call: int, endpoint: str, status: int, message: str,
              start_time: float) -> None:
        self._commit(sid, None, {"call": call, "endpoint": endpoint, "status": status, "message": message,
                                 "start_time": start_time, "end_time": time.time()})
        proxy.forward()

    def _done(self, sid: str, proxy: _SessionApp, call: int, reply: dict[str, Any], start_time: float,
              start: float) -> None:
        end_time, latency = time.time(), time.monotonic() - start
        for record, choice in zip(proxy.records, reply["choices"], strict=True):
            response = {k: v for k, v in choice.items() if k in ("index", "message", "text", "finish_reason")}
            record.update(response=response, session=sid, call=call, choice=choice["index"], start_time=start_time,
                          end_time=end_time, latency_s=latency)
        self._commit(sid, proxy.records, None)
        proxy.forward()


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

    def stream(self, requests: list[Request]) -> Iterator[tuple[int, Completion]]:
        rids = [r.rid for r in requests]
        self._sessions._track(self._sid, rids, self._call, add=True)
        try:
            yield from self._app.stream(requests)
        finally:
            self._sessions._track(self._sid, rids, self._call, add=False)

    def record(self, endpoint: str, body: Any, c: Completion, text: str | None, response_id: str | None = None,
               index: int = 0, start: float | None = None) -> None:
        label = getattr(self._app, "label", str)
        self.records.append(record_of(endpoint, body, c, text, response_id, index, start, label(c.weight_version)))

    def forward(self) -> None:
        """Hands the call's records to the server's global recorder (if any), tagged with the session."""
        recorder = getattr(self._app, "recorder", None)
        for record in self.records if recorder is not None else ():
            try:
                recorder({"session": self._sid, **record})
            except Exception:
                logger.exception("recorder failed on %s", record["rid"])
