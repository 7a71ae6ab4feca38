"""`RouterClient`: rollouts through SGLang's router (`sglang-router`), control fanned out to its workers.

The router (a Rust load balancer: cache-aware, round-robin or power-of-two routing, health checks,
retries on a dead worker) forwards `/generate` and the OpenAI routes, but answers 404 to the control
routes RL needs (`/update_weights_from_disk`, `/pause_generation`, `/continue_generation`,
`/abort_request`, `/update_weight_version`, memory release/resume, `/get_load`, `/v1/loads`). So:

* generation goes to the router (`POST {router}/generate`, one sample per request: the router's own
  policy places it; our retries sit on top of the router's);
* control goes to every worker directly: weight sync (pause -> update -> flush -> continue, then every
  worker's `/model_info` must report the new version, else `SGLangError` names the worker), pause,
  continue, abort, loads, health. The workers are given, or read from the router's `GET /workers`
  (`router_workers`), and re-read before each weight sync so a worker registered later is synced too;
* sampling parameters the router drops from `sampling_params` (`ROUTER_DROPS`: logit_bias, stop_regex,
  custom_params; measured on sglang-router 0.3.2) would silently change what is sampled: a request
  carrying one goes straight to a worker (least in flight, with the base client's failover) and is
  counted in `report()["direct"]`. `spaces_between_special_tokens` only shapes the detokenized text, so
  it is not sent to the router and the router's answers carry no `text` (`Completion.text` is None:
  the ids and log-probs are exact; decode `output_ids` where text is needed);
* a worker that rejoins the router before the client re-synced its weights would answer with an old
  version: an answer older than the version synced before the request was sent re-syncs the stale
  workers and is retried (`report()["stale_answers"]`); if that does not help, `SGLangError`.

    client = RouterClient("http://127.0.0.1:30100", ["http://127.0.0.1:30001", "http://127.0.0.1:30002"])
    client = await RouterClient.discover("http://127.0.0.1:30100")   # workers from GET /workers
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from rlvr.rollout.client import SGLangClient, SGLangError, _Server, _version
from rlvr.rollout.types import Completion, Request

logger = logging.getLogger(__name__)

# sampling_params keys sglang-router 0.3.2 removes before forwarding /generate (they change the tokens)
ROUTER_DROPS = ("logit_bias", "stop_regex", "custom_params")
TEXT_ONLY = ("spaces_between_special_tokens",)  # dropped too, but it only shapes the detokenized text


async def router_workers(router: str, timeout: float = 10.0) -> list[str]:
    """The URLs of the regular workers registered with the router at `router` (GET /workers)."""
    async with httpx.AsyncClient(timeout=timeout) as http:
        resp = await http.get(router.rstrip("/") + "/workers")
    if resp.status_code != 200:
        raise SGLangError(f"{router}/workers answered {resp.status_code}: {resp.text[:300]} (is it an "
                          "sglang-router? give the worker URLs instead)", resp.status_code, router)
    rows = resp.json().get("workers") or []
    return [row["url"].rstrip("/") for row in rows if row.get("worker_type", "regular") == "regular"]


class _Direct:
    """The session of a request that must bypass the router (and the caller's own session)."""

    def __init__(self, session: Any):
        self.session = session


def dropped_by_router(request: Request) -> list[str]:
    """The sampling parameters of `request` that the router would drop (they must reach a worker)."""
    params = SGLangClient.payload(request, request.rid)["sampling_params"]
    return [key for key in ROUTER_DROPS if key in params]


class RouterClient(SGLangClient):
    """`SGLangClient` whose generation goes through the router at `router` and whose control goes
    to `workers` (see the module docstring). `discover=True` re-reads the workers from the router
    before each weight sync."""

    def __init__(self, router: str, workers: Sequence[str], *, discover: bool = False, **options: Any):
        if not workers:
            raise ValueError("RouterClient needs the router's worker URLs (or use RouterClient.discover)")
        super().__init__(workers, **options)
        self.router = _Server(router.rstrip("/"))
        if self.router.url in self._by_url:
            raise ValueError(f"{self.router.url} is both the router and a worker: give the workers' own URLs")
        self._options = options
        self.discover_workers = discover
        self.direct = 0  # requests sent to a worker directly (a parameter the router drops)
        self.stale_answers = 0  # router answers from a worker that had missed a weight sync
        self._synced = 0  # the version every healthy worker confirmed last

    @classmethod
    async def discover(cls, router: str, **options: Any) -> RouterClient:
        """A client over the workers the router has registered (re-read before each weight sync). A router
        still starting, or with no worker yet, is asked again every second for `unavailable_timeout` s."""
        deadline = time.monotonic() + options.get("unavailable_timeout", 120.0)
        while True:
            try:
                workers = await router_workers(router, options.get("health_timeout", 10.0))
            except httpx.TransportError as e:
                workers, why = [], f"unreachable ({type(e).__name__})"
            else:
                why = "has no workers registered"
            if workers:
                return cls(router, workers, discover=True, **options)
            if time.monotonic() > deadline:
                raise SGLangError(f"the router at {router} {why}", url=router)
            await asyncio.sleep(1.0)

    # --- generation -----------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The base report plus the router's health and the direct / stale-answer counts."""
        return {**super().report(), "router": {"url": self.router.url, "healthy": self.router.healthy,
                                               "failed_attempts": self.router.failed},
                "direct": self.direct, "stale_answers": self.stale_answers}

    def _body(self, server: _Server, request: Request, rid: str) -> dict[str, Any]:
        body = self.payload(request, rid)
        if server is self.router:
            for key in TEXT_ONLY:
                body["sampling_params"].pop(key, None)
        return body

    async def _acquire(self, session: Any, avoid: set[str]) -> _Server:
        """Generation's target: the router (waits, probing it, while it is unreachable). Workers
        marked down by a control call are re-probed (and re-synced) on the way."""
        if isinstance(session, _Direct):
            return await super()._acquire(session.session, avoid)
        now = time.monotonic()
        for server in self._servers:
            if not server.healthy and not server.probing and now >= server.retry_at:
                self._spawn(self._probe(server))
        deadline, attempt = now + self.unavailable_timeout, 0
        while not self.router.healthy and not await self._probe_router():
            if time.monotonic() > deadline:
                raise SGLangError(f"the router at {self.router.url} is unreachable", url=self.router.url)
            attempt += 1
            await asyncio.sleep(self._delay(attempt))
        self.router.inflight += 1
        self.router.assigned += 1
        return self.router

    async def _probe_router(self) -> bool:
        try:
            resp = await self._http(self.router).get(self.router.url + "/health", timeout=self.health_timeout)
            self.router.healthy = resp.status_code == 200
        except httpx.HTTPError:
            self.router.healthy = False
        return self.router.healthy

    async def _generate_one(self, request: Request, session: Any) -> Completion:
        if dropped_by_router(request):
            self.direct += 1
            return await super()._generate_one(request, _Direct(session))
        for _ in range(3):  # a worker re-synced answers fresh at the next try; a bound, not a loop forever
            synced = self._synced
            completion = await super()._generate_one(request, session)
            completion.text = None  # detokenized without our spaces_between_special_tokens: see the docstring
            if completion.weight_version >= synced:
                return completion
            self.stale_answers += 1
            logger.warning("request %s answered with weight version %d after every worker confirmed %d: "
                           "re-syncing the workers behind", request.rid, completion.weight_version, synced)
            if not await self._resync_stale():
                raise SGLangError(f"request {request.rid}: the router answered with weight version "
                                  f"{completion.weight_version} < {synced}, and none of the workers "
                                  f"{[s.url for s in self._servers]} is behind: the router has a worker this client "
                                  "does not sync (give every worker, or use RouterClient.discover)")
        raise SGLangError(f"request {request.rid}: stale answers (weight version {completion.weight_version} < "
                          f"{synced}) after re-syncing the workers three times")

    async def _abort_quietly(self, server: _Server, rid: str) -> None:
        if server is self.router:  # the router has no /abort_request: the workers do
            await self._broadcast("/abort_request", {"rid": rid})
        else:
            await super()._abort_quietly(server, rid)

    # --- control --------------------------------------------------------------------------

    async def versions(self) -> dict[str, int | BaseException]:
        """{worker url: the weight version its /model_info reports, or the error} (healthy workers)."""
        results = await self._broadcast("/model_info", method="GET")
        return {url: _version(r.get("weight_version")) if isinstance(r, dict) else r for url, r in results.items()}

    async def _resync_stale(self) -> int:
        """Re-syncs the healthy workers whose version is not the last synced one; returns how many."""
        stale = [url for url, version in (await self.versions()).items()
                 if isinstance(version, int) and self._weights is not None and version != self._weights[1]]
        for url in stale:
            await self._resync(self._by_url[url])
        return len(stale)

    async def refresh_workers(self) -> list[str]:
        """Adds the workers the router has registered since (GET /workers); returns the new ones."""
        found = await router_workers(self.router.url, self.health_timeout)
        new = [url for url in found if url not in self._by_url]
        for url in new:
            server = _Server(url)
            self._servers.append(server)
            self._by_url[url] = server
        return new

    async def update_weights_from_disk(self, path: str, version: int, pause_mode: str = "in_place",
                                       abort_all_requests: bool = False) -> dict[str, Any]:
        """The base weight sync on every worker, then each healthy worker's /model_info must report
        `version`: a worker that missed it raises `SGLangError` naming it (a dead one is re-synced
        when it comes back, and its stale answers are caught on the way back: see the docstring)."""
        if self.discover_workers:
            new = await self.refresh_workers()
            if new:
                logger.info("router %s has new workers %s: they are synced too", self.router.url, new)
        results = await super().update_weights_from_disk(path, version, pause_mode, abort_all_requests)
        missed = {url: v for url, v in (await self.versions()).items()
                  if not isinstance(v, httpx.TransportError) and v != int(version)}
        if missed:
            raise SGLangError(f"weight version {version} missing on workers {missed} after the sync "
                              f"(reported version or error per worker)")
        self._synced = int(version)
        return results
