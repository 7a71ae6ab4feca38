"""The resources of `rlvr.launch.simulate` (read its module docstring first): the event loop,
time-averaged levels, inference servers and worker pools (verifier threads, sandbox workers,
episode threads). Internal; the public API is `rlvr.launch.simulate`, the RL loop that uses
these is `rlvr.launch.simulate_loop`.

Every callback runs at one simulated instant; durations are scheduled on the loop.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class Sim(Protocol):
    """What the resources use of the simulation that owns them (`simulate_loop.Sim`), named here so
    this module does not import the loop above it."""

    config: Any
    loop: Loop
    trainer: Any
    levels: Any
    counts: dict[str, float]

    policy: Callable[[Any], Any]  # the dispatch order's sort key

    def record_wait(self, resource: str, priority: float, seconds: float) -> None: ...
    def next_arrival(self) -> int: ...
    def server_activity(self, delta: int) -> None: ...


class Loop:
    """A heap of (time, order, callback): ties run in the order they were scheduled."""

    def __init__(self):
        self.now, self._heap, self._order, self.stopped = 0.0, [], itertools.count(), False

    def at(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (self.now + max(delay, 0.0), next(self._order), fn))

    def run(self, max_events: int) -> None:
        for _ in range(max_events):
            if self.stopped or not self._heap:
                return
            self.now, _, fn = heapq.heappop(self._heap)
            fn()
        raise RuntimeError(f"simulation exceeded {max_events} events; shrink num_steps or the batch")


class Levels:
    """Named piecewise-constant quantities and their time integrals (for time averages)."""

    def __init__(self, loop: Loop):
        self.loop = loop
        self.value: dict[str, float] = defaultdict(float)
        self.area: dict[str, float] = defaultdict(float)
        self.since: dict[str, float] = defaultdict(float)

    def set(self, name: str, value: float) -> None:
        now = self.loop.now
        self.area[name] += self.value[name] * (now - self.since[name])
        self.since[name], self.value[name] = now, value

    def add(self, name: str, delta: float) -> None:
        self.set(name, self.value[name] + delta)

    def snapshot(self) -> dict[str, float]:
        now = self.loop.now
        return {k: self.area[k] + self.value[k] * (now - self.since[k]) for k in self.value}


def tokens(dist: Any, rng: np.random.Generator, low: int = 1) -> int:
    """A token count drawn from `dist` (a rlvr.launch.simulate.Dist), at least `low`."""
    return max(low, int(round(dist.sample(rng))))


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request on a server (a sample, or one turn of an episode)."""

    prefix: Any  # prompt identity for prefix sharing (None: shares nothing)
    prompt: int
    target: int  # output tokens
    priority: float
    on_done: Callable[[Request], None]
    arrival: int = -1
    need: int = 0  # tokens to prefill: the prompt, or prompt + output after an eviction
    prefilled: int = 0
    out: int = 0
    first_version: int = -1
    last_version: int = -1
    aborted: bool = False
    submitted_at: float = 0.0
    admitted: bool = False
    server: Server | None = None


class Server:
    """One inference server: slots, continuous batching, weight syncs between iterations. A run of
    decode-only iterations with nothing to admit is one event ("cruise"), cut short when a
    request, an abort, a sync or a change of the trainer's state needs an iteration boundary."""

    def __init__(self, sim: Sim):
        self.sim, self.e, self.max_slots = sim, sim.config.engine, sim.config.max_slots
        self.slots: list[Request] = []
        self.waiting: list[Request] = []
        self.version, self.state, self.token = 0, "idle", 0
        self.sync_waiters: list[Callable[[], None]] = []
        self.sync_version = 0
        self.cruise: tuple[float, float, int, list[Request]] | None = None
        self.inflight = self.assigned = 0
        self._slots_level = self._busy = self._waiting_level = 0
        self._kick_pending = False

    # --- requests and control ---------------------------------------------------------------

    def submit(self, r: Request) -> None:
        r.need = r.need or r.prompt
        self.waiting.append(r)
        self._levels()
        if len(self.slots) < self.max_slots or self.sim.config.engine_preempt:
            self.cut()
        if self.state == "idle" and not self._kick_pending:  # requests of the same instant start together
            self._kick_pending = True
            self.sim.loop.at(0.0, self._deferred_kick)

    def abort(self, r: Request) -> None:
        """The request ends with finish "abort" (delivered at this instant, after the caller returns)."""
        r.aborted = True
        if r in self.waiting:
            self.waiting.remove(r)
            self.sim.loop.at(0.0, lambda: self._finish(r))
        elif self.state == "iterating":
            self.cut()  # leaves the slot at the end of the current iteration
        elif r in self.slots:
            self.slots.remove(r)
            self.sim.loop.at(0.0, lambda: self._finish(r))
        self._levels()

    def request_sync(self, version: int, done: Callable[[], None]) -> None:
        self.sync_version = version
        self.sync_waiters.append(done)
        self.cut()
        self.kick()

    def cut(self) -> None:
        """Ends a cruise at the iteration now running."""
        if self.state != "iterating" or self.cruise is None or self.cruise[2] <= 1:
            return
        start, cost, iterations, decoding = self.cruise
        done = min(iterations, int((self.sim.loop.now - start) // cost) + 1)
        if done < iterations:
            self.cruise = (start, cost, done, decoding)
            self._schedule_end(start + done * cost - self.sim.loop.now)

    def _deferred_kick(self) -> None:
        self._kick_pending = False
        self.kick()

    def kick(self) -> None:
        if self.state != "idle":
            return
        if self.sync_waiters:
            self.state = "syncing"
            self.sim.loop.at(self.sim.config.weight_sync_s, self._synced)
            return
        if self.waiting or self.slots:
            self._iterate()

    def _synced(self) -> None:
        self.version, waiters, self.sync_waiters = self.sync_version, self.sync_waiters, []
        self.state = "idle"
        for done in waiters:
            done()
        self.kick()

    # --- one iteration ------------------------------------------------------------------------

    def _iterate(self) -> None:
        aborted = [s for s in self.slots if s.aborted]
        for s in aborted:
            self.slots.remove(s)
            self._finish(s)
        if self.sim.config.engine_preempt:
            self._evict()
        self._admit()
        self._levels()
        if not self.slots:
            return
        e, now = self.e, self.sim.loop.now
        prefill, prefilling = self._prefill()
        decoding = [s for s in self.slots if s.prefilled == s.need and 1 <= s.out < s.target]
        decode = e.decode_a + e.decode_b * len(decoding) + e.decode_slot_s * self.max_slots if decoding else 0.0
        cost = prefill + e.step_overhead_s + decode
        cost *= 1.0 + self.sim.config.colocated if self.sim.trainer.training else 1.0
        iterations = 1
        if not prefilling and decoding and not (self.waiting and len(self.slots) < self.max_slots):
            iterations = min(math.ceil((s.target - s.out) / e.decode_steps) for s in decoding)
        self.state = "iterating"
        self.cruise = (now, max(cost, 1e-12), iterations, decoding)
        self._schedule_end(iterations * self.cruise[1])

    def _schedule_end(self, delay: float) -> None:
        self.token += 1
        token = self.token
        self.sim.loop.at(delay, lambda: self._end(token))

    def _end(self, token: int) -> None:
        if token != self.token:
            return
        _, _, iterations, decoding = self.cruise
        self.cruise = None
        for s in decoding:
            self._emit(s, min(iterations * self.e.decode_steps, s.target - s.out))
        done = [s for s in self.slots if s.aborted or s.out >= s.target]
        self.slots = [s for s in self.slots if not (s.aborted or s.out >= s.target)]
        self.state = "delivering"  # every completion of the iteration is out before the next starts
        for s in done:
            self._finish(s)
        self.state = "idle"
        self.kick()
        self._levels()

    def _emit(self, s: Request, n: int) -> None:
        if n <= 0:
            return
        s.out += n
        if s.first_version < 0:
            s.first_version = self.version
        s.last_version = self.version

    def _admit(self) -> None:
        """Free slots to waiting requests in policy order; a request whose prompt twin is still
        prefilling waits for it, one whose twin is cached shares its prompt (rlvr Engine._admit)."""
        if not self.waiting or len(self.slots) >= self.max_slots:
            return
        self.waiting.sort(key=self.sim.policy)
        kept = []
        for i, r in enumerate(self.waiting):
            if len(self.slots) >= self.max_slots:
                kept += self.waiting[i:]
                break
            leader = twin = False
            if self.e.share_prefix and r.prefix is not None and r.prefilled == 0:
                for o in self.slots:
                    if o.prefix is r.prefix:
                        if o.prefilled >= o.need - 1:
                            leader = True
                            break
                        twin = True
            if twin and not leader:
                kept.append(r)
                continue
            self.slots.append(r)
            if not r.admitted:
                r.admitted = True
                self.sim.record_wait("inference", r.priority, self.sim.loop.now - r.submitted_at)
            if leader:
                r.prefilled = r.need - 1
        self.waiting = kept

    def _evict(self) -> None:
        """Higher-priority waiting requests take the slots of lower-priority running ones, which
        go back to waiting and later prefill their prompt and output again (SGLang-style)."""
        free = self.max_slots - len(self.slots)
        for r in sorted(self.waiting, key=self.sim.policy):
            if free > 0:
                free -= 1
                continue
            key = self.sim.policy(r)  # only for a request the policy admits first (no thrashing)
            victim = min((s for s in self.slots if s.priority < r.priority and key < self.sim.policy(s)),
                         key=lambda s: (s.priority, -s.arrival), default=None)
            if victim is None:
                return
            self.slots.remove(victim)
            victim.need, victim.prefilled, victim.prefix = victim.prompt + victim.out, 0, None
            self.waiting.append(victim)
            self.sim.counts["evictions"] += 1

    def _prefill(self) -> tuple[float, int]:
        """Prefill calls for every slot with prompt left (rows x one chunk each); returns (seconds,
        sequences prefilled)."""
        e, cost = self.e, 0.0
        pending = [s for s in self.slots if s.prefilled < s.need]
        small = max(e.prefill_chunk // 4, 1)
        for i in range(0, len(pending), e.prefill_rows):
            part = pending[i: i + e.prefill_rows]
            rows = 1 if len(part) == 1 else e.prefill_rows
            chunk = small if max(s.need - s.prefilled for s in part) <= small else e.prefill_chunk
            cost += e.prefill_a + e.prefill_b * rows * chunk
            for s in part:
                s.prefilled = min(s.prefilled + chunk, s.need)
                if s.prefilled == s.need:
                    self._emit(s, 1)
        return cost, len(pending)

    def _finish(self, r: Request) -> None:
        self.inflight -= 1
        r.on_done(r)

    def _levels(self) -> None:
        levels = self.sim.levels
        levels.add("inference/slots", len(self.slots) - self._slots_level)
        busy = int(bool(self.slots))
        if busy != self._busy:
            levels.add("inference/busy", busy - self._busy)
            self.sim.server_activity(busy - self._busy)
        self._slots_level, self._busy = len(self.slots), busy
        waiting = len(self.waiting)
        levels.add("inference/waiting", waiting - self._waiting_level)
        self._waiting_level = waiting


@dataclasses.dataclass(eq=False)
class Job:
    priority: float
    arrival: int
    start: Callable[[Callable[[], None]], None]
    submitted_at: float


class Pool:
    """`workers` workers serving jobs in policy order; `start(release)` runs a job, which calls
    `release()` when it frees its worker."""

    def __init__(self, sim: Sim, name: str, workers: int):
        self.sim, self.name, self.workers, self.busy = sim, name, workers, 0
        self._heap: list[tuple[tuple, int, Job]] = []

    def submit(self, priority: float, start: Callable[[Callable[[], None]], None]) -> None:
        job = Job(priority, self.sim.next_arrival(), start, self.sim.loop.now)
        heapq.heappush(self._heap, (self.sim.policy(job), job.arrival, job))
        self.sim.levels.add(f"{self.name}/queue", 1)
        self._pump()

    def _pump(self) -> None:
        while self._heap and self.busy < self.workers:
            _, _, job = heapq.heappop(self._heap)
            self.busy += 1
            self.sim.levels.add(f"{self.name}/queue", -1)
            self.sim.levels.add(f"{self.name}/busy", 1)
            self.sim.record_wait(self.name, job.priority, self.sim.loop.now - job.submitted_at)
            job.start(self._release)

    def _release(self) -> None:
        self.busy -= 1
        self.sim.levels.add(f"{self.name}/busy", -1)
        self._pump()


@dataclasses.dataclass(eq=False)
class Group:
    """A task and its group_size samples in one round (lengths and durations drawn up front)."""

    task: Any
    priority: float
    arrival: int
    prompt: int
    outputs: list[int]
    verify: list[float]
    passes: list[bool]
    episodes: list[list[tuple[int, float, int]]] | None  # per sample: turns of (output, tool_s, observation)
    samples: dict[int, tuple[int, int, int]] = dataclasses.field(default_factory=dict)  # tokens, versions
    done: dict[int, Request] = dataclasses.field(default_factory=dict)
    pending: dict[int, Request] = dataclasses.field(default_factory=dict)
    preemptions: int = 0
    aborting: str = ""
    dispatched_at: float = -1.0

