"""`SGLangClient`: async rollouts against SGLang servers (real GPU SGLang or `rlvr.rollout.server`).

Generation uses SGLang's native `/generate` with `input_ids`, `return_logprob=True`,
`no_stop_trim=True`, `skip_special_tokens=False` and `spaces_between_special_tokens=False` (as slime
does), so prompt ids, output ids and per-token logprobs are exact and map straight back into
`Completion`s for the trainer (`meta_info.output_token_logprobs` = `[[logprob, token_id, text], ...]`,
`meta_info.weight_version` for staleness accounting).

Routing: each request goes to the healthy server with the fewest requests in flight; requests
with a `session_id` stick to one server (LRU-bounded map) so multi-turn conversations reuse the
prefix cache, and the n samples of one request stick together for the same reason. Behind an
sglang-router use `rlvr.rollout.router.RouterClient`: the router forwards generation only (its
control routes answer 404) and silently drops some sampling parameters.

Fault tolerance: per-request timeout; retries with exponential backoff on connection errors,
timeouts and HTTP 408/429/5xx; FAILOVER when a server dies mid-rollout: it is marked unhealthy and
the request is re-sent to another server under a fresh rid (`{rid}.retry{k}`; the abandoned
attempt is aborted best-effort), while the returned `Completion` keeps the original rid. Each
request yields exactly one Completion: a trajectory is never lost silently and never returned
twice. Unhealthy servers are re-probed with `GET /health` every `recheck_interval` seconds and,
if weights were updated meanwhile, re-synced from the last checkpoint before taking traffic.
`report()` gives each server's health and the fault counters (failed attempts, servers marked down,
retries, failovers), so a run can log what the servers' failures cost.

Using it with real SGLang (CUDA machines)::

    python -m sglang.launch_server --model-path /ckpt/step0 --port 30000   # one per GPU group
    python -m sglang_router.launch_router --worker-urls http://w1:30000 http://w2:30000 --port 30100

    client = SGLangClient(["http://w1:30000", "http://w2:30000"])
    client = RouterClient("http://router:30100", ["http://w1:30000", "http://w2:30000"])  # rlvr.rollout.router
    completions = client.generate_sync([Request("q0", prompt_ids, SamplingParams(n=8, max_new_tokens=512))])

Weight sync from the JAX trainer needs no torch: export with
`rlvr.models.hf.export_hf_checkpoint(cfg, params, "/shared/ckpt/step_100", tokenizer_dir=...)` to a
filesystem every server can read, then `await client.update_weights_from_disk("/shared/ckpt/step_100",
100)`, which pauses every server, posts `/update_weights_from_disk` to each, and continues them.
The embedded server (`python -m rlvr.rollout.server --hf_dir=DIR`) speaks the same protocol.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from rlvr.rollout.types import Completion, Request, SamplingParams

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class SGLangError(RuntimeError):
    """A request that failed for good (non-retryable status, or retries exhausted)."""

    def __init__(self, message: str, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


@dataclasses.dataclass
class _Server:
    url: str
    healthy: bool = True
    inflight: int = 0
    assigned: int = 0
    retry_at: float = 0.0
    probing: bool = False
    weight_version: int | None = None
    failed: int = 0  # attempts that failed on this server
    marked_down: int = 0  # times it was marked unhealthy


def _version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0  # SGLang's initial label is "default"


def _extra_sampling(sp: SamplingParams) -> dict[str, Any]:
    """The non-default penalties, bias, constraint and stop_regex of `sp`, in SGLang's names
    (a `choices` constraint is sent as the equivalent regex)."""
    extra: dict[str, Any] = {}
    for name, default in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(sp, name) != default:
            extra[name] = getattr(sp, name)
    if sp.logit_bias:
        extra["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    if sp.stop_regex:
        extra["stop_regex"] = list(sp.stop_regex)
    constraint = sp.constraint
    if constraint is not None:
        from rlvr.rollout.grammar import constraint_regex

        kind, value = constraint
        extra.update({"regex": constraint_regex(kind, value)} if kind == "choices" else {kind: value})
    return extra


class SGLangClient:
    """Async client over one or more SGLang servers; see the module docstring."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 600.0, connect_timeout: float = 10.0,
                 max_retries: int = 5, backoff: float = 0.5, max_backoff: float = 8.0,
                 recheck_interval: float = 5.0, health_timeout: float = 10.0, unavailable_timeout: float = 120.0,
                 max_sessions: int = 10_000, max_connections: int = 1024, update_timeout: float = 600.0):
        if not urls:
            raise ValueError("SGLangClient needs at least one server URL")
        self._servers = [_Server(url.rstrip("/")) for url in urls]
        self._by_url = {s.url: s for s in self._servers}
        self.timeout = httpx.Timeout(timeout, connect=min(connect_timeout, timeout))
        self.max_retries = max_retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self.recheck_interval = recheck_interval
        self.health_timeout = health_timeout
        self.unavailable_timeout = unavailable_timeout
        self.update_timeout = update_timeout
        self.max_sessions = max_sessions
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._sessions: collections.OrderedDict[Any, str] = collections.OrderedDict()
        self._weights: tuple[str, int] | None = None
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self.retries = 0  # attempts after a request's first
        self.failovers = 0  # of which sent straight on to another server because the first died

    # --- plumbing -------------------------------------------------------------------------

    def _http(self, server: _Server) -> httpx.AsyncClient:
        """The connection pool of `server` in the running loop (one pool per server: httpcore's
        scheduling cost grows with pool size x queued requests)."""
        loop = asyncio.get_running_loop()
        if self._client_loop is not loop:
            self._clients = {}  # pools of a finished loop cannot be reused
            self._client_loop = loop
        client = self._clients.get(server.url)
        if client is None:
            client = self._clients[server.url] = httpx.AsyncClient(limits=self._limits, timeout=self.timeout)
        return client

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Closes the HTTP connections of the current event loop."""
        if self._client_loop is asyncio.get_running_loop():
            for task in list(self._tasks):
                task.cancel()
            clients, self._clients = self._clients, {}
            for client in clients.values():
                await client.aclose()

    def close(self) -> None:
        """Drops the HTTP connections (call `aclose` from inside an event loop instead)."""
        clients, self._clients = self._clients, {}
        if not clients or self._client_loop is None or self._client_loop.is_closed():
            return

        async def close_all() -> None:
            for client in clients.values():
                await client.aclose()
        try:
            asyncio.run(close_all())
        except Exception:  # pools bound to a loop still running elsewhere: dropping them is enough
            pass

    def healthy_urls(self) -> list[str]:
        return [s.url for s in self._servers if s.healthy]

    def report(self) -> dict[str, Any]:
        """{"servers": {url: {healthy, inflight, assigned, failed_attempts, marked_down}}, "retries",
        "failovers"}: the client's view of its servers (no request is sent)."""
        servers = {s.url: {"healthy": s.healthy, "inflight": s.inflight, "assigned": s.assigned,
                           "failed_attempts": s.failed, "marked_down": s.marked_down} for s in self._servers}
        return {"servers": servers, "retries": self.retries, "failovers": self.failovers}

    def _delay(self, attempt: int) -> float:
        base = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return base * (0.5 + random.random() / 2)

    # --- routing and health ---------------------------------------------------------------

    def _mark_down(self, server: _Server, error: BaseException) -> None:
        if server.healthy:
            logger.warning("SGLang server %s marked unhealthy: %s", server.url, error)
            server.marked_down += 1
        server.healthy = False
        server.retry_at = time.monotonic() + self.recheck_interval

    async def _probe(self, server: _Server) -> bool:
        """GET /health; on success (and weights re-synced if needed) the server takes traffic again."""
        if server.probing:
            return server.healthy
        server.probing, was_healthy = True, server.healthy
        try:
            resp = await self._http(server).get(server.url + "/health", timeout=self.health_timeout)
            if resp.status_code != 200:
                raise SGLangError(f"/health answered {resp.status_code}", resp.status_code, server.url)
            if self._weights is not None:  # a restarted server comes back with its initial weights
                await self._resync(server)
            server.healthy = True
            if not was_healthy:
                logger.info("SGLang server %s is healthy again", server.url)
        except (httpx.HTTPError, SGLangError, ValueError, TypeError, AttributeError) as e:
            server.healthy = False
            server.retry_at = time.monotonic() + self.recheck_interval
            logger.debug("probe of %s failed: %s", server.url, e)
        finally:
            server.probing = False
        return server.healthy

    async def _resync(self, server: _Server) -> None:
        assert self._weights is not None
        path, version = self._weights
        info = (await self._http(server).get(server.url + "/model_info", timeout=self.health_timeout)).json()
        if _version(info.get("weight_version")) != version:
            resp = await self._http(server).post(server.url + "/update_weights_from_disk", timeout=self.update_timeout,
                                           json={"model_path": path, "weight_version": str(version)})
            if resp.status_code != 200 or not resp.json().get("success"):
                raise SGLangError(f"weight re-sync failed: {resp.text[:300]}", resp.status_code, server.url)
        server.weight_version = version

    def _pick(self, session: Any, avoid: set[str]) -> _Server | None:
        now = time.monotonic()
        for server in self._servers:
            if not server.healthy and not server.probing and now >= server.retry_at:
                self._spawn(self._probe(server))
        healthy = [s for s in self._servers if s.healthy]
        if session is not None and session in self._sessions:
            server = self._by_url[self._sessions[session]]
            if server.healthy and server.url not in avoid:
                self._sessions.move_to_end(session)
                return server
        candidates = [s for s in healthy if s.url not in avoid] or healthy
        if not candidates:
            return None
        server = min(candidates, key=lambda s: (s.inflight, s.assigned))
        if session is not None:
            self._sessions[session] = server.url
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        return server

    async def _acquire(self, session: Any, avoid: set[str]) -> _Server:
        """The server for the next attempt (in-flight count taken); waits while none is healthy."""
        deadline = time.monotonic() + self.unavailable_timeout
        attempt = 0
        while True:
            server = self._pick(session, avoid)
            if server is not None:
                server.inflight += 1
                server.assigned += 1
                return server
            await asyncio.gather(*(self._probe(s) for s in self._servers if not s.probing))
            if any(s.healthy for s in self._servers):
                continue
            if time.monotonic() > deadline:
                raise SGLangError(f"no healthy SGLang server among {[s.url for s in self._servers]}")
            attempt += 1
            await asyncio.sleep(min(self._delay(attempt), max(0.0, deadline - time.monotonic())))

    # --- generation -----------------------------------------------------------------------

    @staticmethod
    def payload(request: Request, rid: str) -> dict[str, Any]:
        """The native /generate body for one sample (exact-token settings, as slime sends)."""
        sp = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_new_tokens, "min_new_tokens": sp.min_new_tokens, "temperature": sp.temperature,
            "top_p": sp.top_p, "top_k": sp.top_k, "min_p": sp.min_p, "stop": list(sp.stop),
            "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos, "skip_special_tokens": False,
            "no_stop_trim": True, "spaces_between_special_tokens": False}
        if sp.sampling_seed is not None:
            params["sampling_seed"] = sp.sampling_seed
        params.update(_extra_sampling(sp))
        body = {"input_ids": list(request.input_ids), "sampling_params": params, "return_logprob": True, "rid": rid}
        if request.image_data:  # a VLM's prompt images, one per placeholder run (SGLang's image_data)
            body["image_data"] = list(request.image_data)
        return body

    @staticmethod
    def parse(request: Request, out: dict[str, Any]) -> Completion:
        """A Completion from one /generate answer (keeps the caller's rid)."""
        meta = out["meta_info"]
        items = meta.get("output_token_logprobs") or []
        ids = [int(t) for t in out["output_ids"]] if out.get("output_ids") is not None else [int(x[1]) for x in items]
        logprobs = [float(x[0]) for x in items]
        if len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} output ids but {len(logprobs)} logprobs")
        version = _version(meta.get("weight_version"))
        versions = meta.get("output_weight_versions") or [version] * len(ids)
        return Completion(rid=request.rid, prompt_ids=list(request.input_ids), output_ids=ids,
                          output_logprobs=logprobs, output_versions=[int(v) for v in versions],
                          finish_reason=meta.get("finish_reason") or {"type": "unknown"},
                          cached_tokens=int(meta.get("cached_tokens") or 0), weight_version=version,
                          text=out.get("text"))

    def _body(self, server: _Server, request: Request, rid: str) -> dict[str, Any]:
        """The /generate body sent to `server` (a router client trims what its router would drop)."""
        return self.payload(request, rid)

    async def _attempt(self, server: _Server, request: Request, rid: str) -> Completion | BaseException:
        """One POST /generate: the Completion, or the retryable error (non-retryable ones raise)."""
        try:
            resp = await self._http(server).post(server.url + "/generate", json=self._body(server, request, rid),
                                           timeout=self.timeout)
        except (httpx.ConnectTimeout, httpx.ConnectError) as e:  # nobody listens there
            self._mark_down(server, e)
            return e
        except httpx.TimeoutException as e:  # slow, not dead: abandon the attempt
            self._spawn(self._abort_quietly(server, rid))
            return e
        except httpx.TransportError as e:  # reset or closed mid-answer: the server is gone
            self._mark_down(server, e)
            return e
        if resp.status_code == 200:
            try:
                return self.parse(request, resp.json())
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise SGLangError(f"malformed /generate answer from {server.url}: {e}", 200, server.url) from e
        error = SGLangError(f"{server.url}/generate answered {resp.status_code}: {resp.text[:500]}",
                            resp.status_code, server.url)
        if resp.status_code not in RETRY_STATUS:
            raise error
        return error

    async def _generate_one(self, request: Request, session: Any) -> Completion:
        avoid: set[str] = set()
        for attempt in range(self.max_retries + 1):
            server = await self._acquire(session, avoid)
            rid = request.rid if attempt == 0 else f"{request.rid}.retry{attempt}"
            try:
                result = await self._attempt(server, request, rid)
            finally:
                server.inflight -= 1
            if isinstance(result, Completion):
                return result
            logger.info("request %s failed on %s (%s: %s); retrying", request.rid, server.url,
                        type(result).__name__, result)
            server.failed += 1
            avoid.add(server.url)
            failover = isinstance(result, httpx.TransportError) and not server.healthy
            if attempt < self.max_retries:
                self.retries += 1
                if failover and any(s.healthy for s in self._servers):
                    self.failovers += 1
                else:
                    await asyncio.sleep(self._delay(attempt + 1))
        raise SGLangError(f"request {request.rid} failed after {self.max_retries + 1} attempts: {result}") from result

    async def _abort_quietly(self, server: _Server, rid: str) -> None:
        try:
            await self._http(server).post(server.url + "/abort_request", json={"rid": rid}, timeout=self.health_timeout)
        except httpx.HTTPError:
            pass

    async def generate(self, requests: Sequence[Request],
                       session_ids: Sequence[Any] | None = None) -> list[Completion]:
        """One Completion per sample, in order; a request with n > 1 yields n (rids `{rid}_{i}`,
        seeds `sampling_seed + i`). `session_ids[i]` pins request i's server (multi-turn reuse)."""
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise ValueError("request ids must be unique within one generate() call")
        if session_ids is not None and len(session_ids) != len(requests):
            raise ValueError(f"{len(session_ids)} session ids for {len(requests)} requests")
        jobs = []
        for j, request in enumerate(requests):
            session = session_ids[j] if session_ids is not None else None
            sp = request.sampling
            if sp.n == 1:
                jobs.append((request, session))
                continue
            group = session if session is not None else ("group", request.rid)
            for i in range(sp.n):
                seed = None if sp.sampling_seed is None else sp.sampling_seed + i
                one = dataclasses.replace(sp, n=1, sampling_seed=seed)
                jobs.append((Request(f"{request.rid}_{i}", list(request.input_ids), one), group))
        tasks = [asyncio.ensure_future(self._generate_one(r, s)) for r, s in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise

    def generate_sync(self, requests: Sequence[Request], session_ids: Sequence[Any] | None = None) -> list[Completion]:
        """Blocking `generate` (runs its own event loop; not callable from inside one)."""
        async def run() -> list[Completion]:
            try:
                return await self.generate(requests, session_ids)
            finally:
                await self.aclose()
        return asyncio.run(run())

    # --- control --------------------------------------------------------------------------

    async def _broadcast(self, path: str, body: Any = None, method: str = "POST", timeout: float | None = None,
                         healthy_only: bool = True) -> dict[str, Any]:
        """{url: decoded answer | exception} for every (healthy) server, concurrently."""
        targets = [s for s in self._servers if s.healthy or not healthy_only]

        async def one(server: _Server) -> Any:
            try:
                resp = await self._http(server).request(method, server.url + path, json=body,
                                                  timeout=timeout or self.health_timeout)
            except httpx.TransportError as e:
                self._mark_down(server, e)
                return e
            if resp.status_code >= 400:
                return SGLangError(f"{server.url}{path} answered {resp.status_code}: {resp.text[:300]}",
                                   resp.status_code, server.url)
            try:
                return resp.json() if resp.content else None
            except ValueError:
                return resp.text
        results = await asyncio.gather(*(one(s) for s in targets))
        return dict(zip([s.url for s in targets], results, strict=True))

    async def pause(self, mode: str = "abort") -> dict[str, Any]:
        """POST /pause_generation on every healthy server ("abort", "retract" or "in_place")."""
        return await self._broadcast("/pause_generation", {"mode": mode})

    async def resume(self) -> dict[str, Any]:
        """POST /continue_generation on every healthy server."""
        return await self._broadcast("/continue_generation", {})

    async def update_weights_from_disk(self, path: str, version: int, pause_mode: str = "in_place",
                                       abort_all_requests: bool = False) -> dict[str, Any]:
        """pause -> /update_weights_from_disk on every server -> continue. With `pause_mode="in_place"`
        running requests continue on the new weights (their tokens carry both versions); SGLang cannot
        flush its prefix cache with requests frozen in place, so the update asks it not to and a
        /flush_cache follows, which succeeds on a server with nothing running (a synchronous step's
        weight sync) and is refused (400) where requests run: there the radix cache keeps pages of the
        old weights until they are evicted. "abort" flushes with the update. Servers that are down are
        re-synced when they come back."""
        self._weights = (path, int(version))
        body = {"model_path": path, "weight_version": str(version), "abort_all_requests": abort_all_requests,
                "flush_cache": pause_mode != "in_place"}
        await self.pause(pause_mode)
        try:
            results = await self._broadcast("/update_weights_from_disk", body, timeout=self.update_timeout)
            if pause_mode == "in_place":  # the cache holds the old weights' KV: drop it where nothing runs
                await self._broadcast("/flush_cache")
        finally:
            await self.resume()
        failed = {}
        for url, result in results.items():
            if isinstance(result, dict) and result.get("success"):
                self._by_url[url].weight_version = int(version)
            elif not isinstance(result, httpx.TransportError):  # dead servers get re-synced later
                failed[url] = result
        if failed:
            raise SGLangError(f"weight update to version {version} failed on {failed}")
        return results

    async def health(self) -> dict[str, bool]:
        """Probes every server (GET /health) and returns {url: healthy}."""
        await asyncio.gather(*(self._probe(s) for s in self._servers if not s.probing))
        return {s.url: s.healthy for s in self._servers}

    async def loads(self) -> dict[str, dict[str, int]]:
        """{url: {"num_running_reqs", "num_waiting_reqs"}} from GET /v1/loads of every healthy server.
        A server that dies meanwhile is marked down and left out; one that answers with an error
        (e.g. a router, which has no /v1/loads) raises: an empty answer would read as "idle"."""
        out, failed = {}, {}
        for url, result in (await self._broadcast("/v1/loads", method="GET")).items():
            if isinstance(result, dict):
                rows = result.get("loads") or [result]
                out[url] = {key: sum(int(row.get(key, 0)) for row in rows)
                            for key in ("num_running_reqs", "num_waiting_reqs")}
            elif not isinstance(result, httpx.TransportError):
                failed[url] = result
        if failed:
            raise SGLangError(f"GET /v1/loads failed on {failed}; behind an sglang-router, give the client "
                              "the workers' URLs (rlvr.rollout.router.RouterClient)")
        return out

    async def abort(self, rid: str) -> None:
        """POST /abort_request {"rid": rid} to every healthy server (the request answers with
        finish_reason abort; a retry already re-sent under another rid runs on)."""
        await self._broadcast("/abort_request", {"rid": rid})

    async def abort_all(self, wait_idle: bool = True, timeout: float = 30.0) -> None:
        """POST /abort_request {"abort_all": true}; with `wait_idle`, repeats until /v1/loads shows
        every server idle (slime's loop), for at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            await self._broadcast("/abort_request", {"abort_all": True})
            if not wait_idle:
                return
            loads = await self.loads()
            if all(v["num_running_reqs"] + v["num_waiting_reqs"] == 0 for v in loads.values()):
                return
            if time.monotonic() > deadline:
                raise SGLangError(f"servers still busy after abort_all: {loads}")
            await asyncio.sleep(0.05)
