"""Engine replicas: one engine's slots split over N engines that step at the same time.

    engine = build_engine(cfg, params, tokenizer, replicas=2, max_slots=64, ...)  # 2 x 32 slots

Why: XLA:CPU runs a decode step's ops one after another, each small op on one thread, so one
engine keeps a 2-core CPU ~1.5-1.6 cores busy; two engines whose device calls are in flight at once
(each stepped from its own thread) fill both: 1.2-1.3x the fixed config's tokens/s, 1.16-1.22x the
realistic shape's (benchmarks/results/rollout_replicas.json). On a TPU or GPU one program already
fills the chip: keep replicas=1 there (the default).

`ReplicatedEngine` has the `Engine` interface that `EngineDriver`, the RL backends and the server
use. A request goes to the replica that already holds its prompt (the same prompt submitted
recently, as a GRPO group's samples are, or at least half of it in a replica's prefix cache, as a
conversation's next turn), else to the least loaded one, so a group still shares its prompt's
pages and a shared system prompt does not pull all traffic to one replica (`_route`). Requests without a sampling
seed get one drawn here, in submission order, from `seed`: the same seeds a single engine would
draw. The replicas share one copy of the decode weights.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Any

import numpy as np

from rlvr.rollout.engine import Engine, run_requests
from rlvr.rollout.types import Completion, Request

RECENT_PROMPTS = 4096  # prompts remembered for routing a group's later samples to its replica


def build_engine(cfg, params, tokenizer=None, *, replicas: int = 1, **options: Any) -> Engine | ReplicatedEngine:
    """An `Engine`, or with replicas > 1 a `ReplicatedEngine` of that many."""
    if replicas == 1:
        return Engine(cfg, params, tokenizer, **options)
    return ReplicatedEngine(cfg, params, tokenizer, replicas=replicas, **options)


class ReplicatedEngine:
    """`replicas` engines of max_slots / replicas slots each (see the module docstring)."""

    def __init__(self, cfg, params, tokenizer=None, *, replicas: int = 2, max_slots: int = 32, seed: int = 0,
                 num_pages: int | None = None, **options: Any):
        if replicas < 2 or max_slots % replicas:
            raise ValueError(f"replicas={replicas}: need 2 or more, dividing max_slots={max_slots}")
        each = {"max_slots": max_slots // replicas, "seed": seed, **options}
        if num_pages is not None:
            each["num_pages"] = (num_pages - 1) // replicas + 1
        self.replicas = [Engine(cfg, params, tokenizer, **each)]
        for _ in range(replicas - 1):
            self.replicas.append(Engine(cfg, params, tokenizer, **each))
            self.replicas[-1].params = self.replicas[0].params  # one copy of the decode weights
        first = self.replicas[0]
        self.cfg, self.decode_cfg, self.tokenizer = first.cfg, first.decode_cfg, first.tokenizer
        self.max_slots, self.max_len, self.page_size = max_slots, first.max_len, first.page_size
        self.kv_dtype, self.schedule_policy = first.kv_dtype, first.schedule_policy
        self.seed, self._seed_rng = seed, np.random.default_rng(seed)
        self._owner: dict[str, Engine] = {}
        self._stepping: dict[int, concurrent.futures.Future] = {}  # replica index -> its step in flight
        self._ready: list[Completion] = []  # completions of settled steps, not returned yet
        self._recent: collections.OrderedDict[int, Engine] = collections.OrderedDict()
        self._threads = concurrent.futures.ThreadPoolExecutor(replicas, thread_name_prefix="rlvr-replica")

    # --- routing ---------------------------------------------------------------------------

    def _route(self, request: Request) -> Engine:
        """The replica for a request: the one its prompt went to recently (a group's samples), else
        one whose prefix cache holds at least half of the prompt (a conversation's next turn) and
        that is not a full batch busier than the least loaded, else the least loaded (a shared
        system prompt alone does not pull every request to the replica that cached it first)."""
        key = hash(tuple(request.input_ids))  # (a collision only routes a request elsewhere)
        replica = self._recent.get(key)
        if replica is None:
            cached = [len(r.prefix.match(request.input_ids[:-1], touch=False)) * r.page_size for r in self.replicas]
            load = [r.num_running + r.num_waiting for r in self.replicas]
            each = self.replicas[0].max_slots
            holders = [i for i in range(len(self.replicas))
                       if 2 * cached[i] >= len(request.input_ids) and load[i] <= min(load) + each]
            best = (max(holders, key=lambda i: (cached[i], -load[i])) if holders else
                    min(range(len(self.replicas)), key=lambda i: (load[i], -cached[i])))
            replica = self.replicas[best]
        self._recent[key] = replica
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT_PROMPTS:
            self._recent.popitem(last=False)
        return replica

    def submit(self, request: Request) -> None:
        if request.sampling.sampling_seed is None and request.sampling.n == 1 and request.input_ids:
            seed = int(self._seed_rng.integers(2**31))
            request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, sampling_seed=seed))
        self._settle()  # (routing reads the replicas' queues and caches)
        replica = self._route(request)
        replica.submit(request)
        self._owner[request.rid] = replica

    # --- stepping --------------------------------------------------------------------------

    def step(self) -> list[Completion]:
        """Starts a step of every idle replica with work, each in its own thread, and returns when
        one has finished (with the completions of the finished ones). A replica's step runs on
        while the caller does other things; every other call waits for it first (`_settle`), so
        an engine is never used from two threads at once. Free-running, not lockstep: a replica
        does not wait at every step for the slower one."""
        for index, replica in enumerate(self.replicas):
            if index not in self._stepping and replica.has_work():
                self._stepping[index] = self._threads.submit(replica.step)
        if self._stepping and not self._ready:
            concurrent.futures.wait(list(self._stepping.values()), return_when=concurrent.futures.FIRST_COMPLETED)
        self._settle(only_finished=True)
        done, self._ready = self._ready, []
        for completion in done:
            self._owner.pop(completion.rid, None)
        return done

    def _settle(self, only_finished: bool = False) -> None:
        """Waits for the replicas' steps in flight (`only_finished`: takes those already done) and
        keeps their completions for the next `step`; a step's error is raised once all have
        stopped, so the caller's recovery (abort_all) finds no engine running."""
        futures = {i: f for i, f in self._stepping.items() if f.done() or not only_finished}
        concurrent.futures.wait(list(futures.values()))
        for index in futures:
            del self._stepping[index]
        errors = []
        for future in futures.values():
            try:
                self._ready.extend(future.result())
            except Exception as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
        if errors:
            if only_finished:
                self._settle()
            raise errors[0]

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Runs `requests` to completion; results in request order. Completions of requests
        submitted before (with `submit`) that finish meanwhile are kept for the next `step()`."""
        results, others = run_requests(self, requests)
        self._ready = others + self._ready
        return results

    def warmup(self, filters: bool = False) -> None:
        self._settle()
        for replica in self.replicas:  # one compiles, the others find the programs compiled
            replica.warmup(filters)

    # --- requests --------------------------------------------------------------------------

    def snapshot(self, rid: str) -> Completion | None:
        owner = self._owner.get(rid)
        return owner.snapshot(rid) if owner is not None else None

    def abort(self, rid: str, message: str = "aborted") -> None:
        self._settle()
        owner = self._owner.get(rid)
        if owner is not None:
            owner.abort(rid, message)

    def abort_all(self, message: str = "aborted") -> None:
        self._settle()
        for replica in self.replicas:
            replica.abort_all(message)

    def has_work(self) -> bool:
        return bool(self._ready or self._stepping) or any(r.has_work() for r in self.replicas)

    @property
    def num_running(self) -> int:
        return sum(r.num_running for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    # --- control ---------------------------------------------------------------------------

    def pause(self, mode: str = "in_place") -> int:
        self._settle()
        return sum(r.pause(mode) for r in self.replicas)

    def resume(self) -> None:
        self._settle()
        for replica in self.replicas:
            replica.resume()

    @property
    def paused(self) -> bool:
        return self.replicas[0].paused

    @property
    def released(self) -> set[str]:
        return set().union(*(r.released for r in self.replicas))

    def release_memory(self, tags: list[str]) -> None:
        self._settle()
        for replica in self.replicas:
            replica.release_memory(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self._settle()
        for replica in self.replicas:
            replica.resume_memory(tags)
        if "weights" in tags:
            self._share_weights()

    def update_weights(self, params, version: int) -> None:
        self._settle()
        self.replicas[0].update_weights(params, version)
        self._share_weights()

    def update_weights_from_disk(self, path: str, version: int) -> None:
        self._settle()
        self.replicas[0].update_weights_from_disk(path, version)
        self._share_weights()
        for replica in self.replicas[1:]:
            replica.model_path = path

    def _share_weights(self) -> None:
        first = self.replicas[0]
        for replica in self.replicas[1:]:
            replica.install_weights(first.params, first.weight_version)

    @property
    def weight_version(self) -> int:
        return self.replicas[0].weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._settle()
        for replica in self.replicas:
            replica.weight_version = version

    def flush_cache(self) -> None:
        self._settle()
        for replica in self.replicas:
            replica.flush_cache()
        self._recent.clear()

    # --- reporting -------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        info = self.replicas[0].model_info()
        return {**info, "server_args": {**info["server_args"], "max_running_requests": self.max_slots,
                                        "random_seed": self.seed, "dp_size": len(self.replicas),
                                        "max_total_num_tokens": sum(r.server_args()["max_total_num_tokens"]
                                                                    for r in self.replicas)}}

    def metrics(self) -> dict[str, Any]:
        """The replicas' counters and seconds summed (seconds are per replica: they overlap in
        time); the compile counts are the process's (shared programs); `replicas` their number."""
        each = [r.metrics() for r in self.replicas]
        out = {k: (v if k.startswith("compiles_") else
                   round(sum(m[k] for m in each), 4) if isinstance(v, float) else sum(m[k] for m in each))
               for k, v in each[0].items()}
        prompt = out.get("prefix_cache_prompt_tokens", 0)
        out["prefix_cache_hit_rate"] = round(out.get("prefix_cache_hit_tokens", 0) / prompt, 4) if prompt else 0.0
        return {**out, "replicas": len(self.replicas)}

    def close(self) -> None:
        concurrent.futures.wait(list(self._stepping.values()))
        self._threads.shutdown(wait=True)
