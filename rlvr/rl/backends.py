"""Rollout backends for the RL trainer: the embedded JAX engine, or SGLang servers over HTTP.

Both have the same calls, each safe to call from any thread, so the trainer can push new
weights while a producer thread is generating (partial rollouts):

  generate(requests) -> completions     blocking, results in request order
  submit(requests) -> futures           non-blocking (the scheduler, rlvr.rl.scheduler)
  abort(rids)                           the futures of running requests resolve with finish_reason abort
  update_weights(params, version)       in-flight sequences continue on the new weights
  close()
  capacity                              sequences the backend runs at once (0 = unknown / unbounded)

`EmbeddedBackend` runs `rlvr.rollout.engine.Engine` behind an `EngineDriver` thread; weights
move in memory. `SGLangBackend` talks to `rlvr.rollout.server` or real SGLang servers through
`SGLangClient`; weights move as a Hugging Face checkpoint on a shared filesystem
(export -> /update_weights_from_disk with pause mode in_place), as slime and veRL do without
NCCL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import shutil
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from rlvr.rollout.driver import EngineDriver
from rlvr.rollout.replicas import build_engine
from rlvr.rollout.types import Completion, Request


class EmbeddedBackend:
    """The in-process engine on the trainer's devices."""

    def __init__(self, cfg, params, tokenizer, *, version: int = 0, **engine_options: Any):
        self.engine = build_engine(dataclasses.replace(cfg, value_head=False), _copy(params), tokenizer,
                                   **engine_options)
        self.engine.weight_version = version
        self.driver = EngineDriver(self.engine)

    @property
    def capacity(self) -> int:
        return int(self.engine.max_slots)

    @property
    def vision(self):
        """The policy's vision config (a VLM) or None: image tasks' prompts are laid out for it."""
        return self.engine.cfg.vision

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return self.driver.generate(list(requests))

    def submit(self, requests: Sequence[Request]) -> list[concurrent.futures.Future]:
        return self.driver.submit_many(list(requests))

    def abort(self, rids: Sequence[str]) -> None:
        for rid in rids:
            self.driver.abort(rid)

    def health(self) -> dict[str, float]:
        """Rollout-side metrics for the run's log: liveness, and the engine's compile counts,
        prefix-cache hit rate and host vs device-wait seconds (cumulative, as of its last step)."""
        engine = {k: float(v) for k, v in self.driver.metrics().items()
                  if k.startswith(("compiles_", "prefix_cache_hit_rate", "host_s", "device_wait_s"))}
        return {"rollout/servers_healthy": float(self.driver.alive), **{f"rollout/{k}": v for k, v in engine.items()}}

    def update_weights(self, params, version: int) -> None:
        # A copy: the train step donates (and so invalidates) the state's buffers.
        self.driver.update_weights(_copy(params), version)

    def close(self) -> None:
        self.driver.close()
        if hasattr(self.engine, "close"):  # a ReplicatedEngine's stepping threads
            self.engine.close()


class SGLangBackend:
    """SGLang servers (or the embedded HTTP server) at `urls`; weights synced through `export_dir`.
    With `router` (an sglang-router's URL), generation goes through the router and control to the
    servers at `urls`, or to the router's registered workers when `urls` is empty
    (`rlvr.rollout.router.RouterClient`).

    The client's coroutines run on one event loop in a background thread, so generation from the
    producer thread and weight updates from the trainer thread share one connection pool.
    """

    def __init__(self, urls: Sequence[str], cfg, export_dir: str, tokenizer_dir: str | None = None,
                 keep_exports: int = 2, router: str | None = None, **client_options: Any):

        self.cfg = dataclasses.replace(cfg, value_head=False)  # a LoRA policy: exported merged (`update_weights`)
        self.export_dir, self.tokenizer_dir = export_dir, tokenizer_dir
        self.keep_exports = keep_exports
        self._exports: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rlvr-sglang-client", daemon=True)
        self._thread.start()
        self.client = self._run(_make_client(list(urls), router, client_options))

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    capacity = 0  # the servers' own schedulers bound it; set rl.schedule.capacity to bound it here

    @property
    def vision(self):
        return self.cfg.vision

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        return self._run(self.client.generate(list(requests)))

    def submit(self, requests: Sequence[Request]) -> list[concurrent.futures.Future]:
        async def one(request: Request) -> Completion:
            return (await self.client.generate([request]))[0]
        return [asyncio.run_coroutine_threadsafe(one(r), self.loop) for r in requests]

    def abort(self, rids: Sequence[str]) -> None:
        """Best effort: /abort_request to every healthy server (the request then answers with
        finish_reason abort; a retry already re-sent elsewhere runs on)."""
        for rid in rids:
            self._run(self.client.abort(rid), timeout=30)

    def health(self) -> dict[str, float]:
        """Servers healthy, and requests retried / failed over to another server (cumulative); behind
        a router also the router's health and the requests sent to a worker directly."""
        report = self.client.report()
        out = {"rollout/servers_healthy": float(sum(s["healthy"] for s in report["servers"].values())),
               "rollout/retries": float(report["retries"]), "rollout/failovers": float(report["failovers"])}
        if "router" in report:
            out.update({"rollout/router_healthy": float(report["router"]["healthy"]),
                        "rollout/direct": float(report["direct"]),
                        "rollout/stale_answers": float(report["stale_answers"])})
        return out

    def update_weights(self, params, version: int) -> None:
        from rlvr.models import hf, lora

        path = os.path.join(self.export_dir, f"weights_v{version}")
        # a LoRA policy goes out merged (adapters folded in on device, a QLoRA base dequantised): the
        # servers reload plain weights from disk (SGLang's own LoRA serving is not used)
        plain = lora.merge(self.cfg, _policy(params))
        hf.export_hf_checkpoint(lora.without_lora(self.cfg), plain, path, tokenizer_dir=self.tokenizer_dir)
        self._run(self.client.update_weights_from_disk(path, version, pause_mode="in_place"))
        self._exports.append(path)
        while len(self._exports) > self.keep_exports:  # servers being revived re-sync from the latest
            shutil.rmtree(self._exports.pop(0), ignore_errors=True)

    def close(self) -> None:
        try:
            self._run(self.client.aclose(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


async def _make_client(urls, router, options):
    """An SGLangClient over `urls`, or a RouterClient for `router` (created on the loop that will use it)."""
    from rlvr.rollout.client import SGLangClient
    from rlvr.rollout.router import RouterClient

    if router is None:
        return SGLangClient(urls, **options)
    if urls:
        return RouterClient(router, urls, **options)
    return await RouterClient.discover(router, **options)


def _policy(params):
    """The policy's params without a PPO value head (sampling does not use it)."""
    return {k: v for k, v in params.items() if k != "value_proj"}


def _copy(params):
    """A copy of the policy's params: the train step donates (and so invalidates) its buffers."""
    return jax.tree.map(jnp.copy, _policy(params))
