"""In-loop scheduling of rollout and sandbox work: priority, preemption, degradation, utilisation.

The scheduler owns the two resource classes an RL batch uses:

  inference   the rollout backend's servers (the embedded engine, or SGLang servers): at most
              `capacity` sequences in flight (default: the engine's slots). Work arrives as
              groups (a task and its `group_size` requests) and as episode turns (multi-turn
              tasks: one request each, submitted by the episode threads as they go). Highest
              priority first; smaller lower-priority groups backfill capacity the head of the
              queue cannot use.
  sandbox     the verifier workers (code run in gVisor, math in worker processes): each sample is
              scored as soon as it is generated (verification overlaps the rest of the generation),
              highest priority first, `workers` at a time.

Priorities come from `rl.schedule.priorities` ("family_or_domain=weight,..."; default 1), so a
researcher can say which domains matter most when resources are short.

Preemption: when a waiting group has higher priority than in-flight ones and there is no room
for it, the lowest-priority, newest in-flight groups are aborted and re-queued, and the room is
held for it. Their finished samples are kept; the aborted requests are re-sent later with the
same sampling seeds, so with unchanged weights they produce the same tokens: nothing is lost and
nothing is scored twice. A group is preempted at most `max_preemptions` times.

Degradation instead of stalling the trainer: a batch is LAGGING once it has run longer than
`deadline_s` (absolute) or `lag_factor` x the mean duration of recent batches. Then, by how far
past that threshold it is (x1, x1.5, x2), for all work below the protected priority (the highest
configured one when priorities differ; with no priorities set, all work):
  1. shorter budgets  groups and turns are dispatched with max_new_tokens x `budget_fraction`;
  2. fewer samples    an in-flight group with `min_group_size` finished samples is cut: its other
                      requests are aborted and it trains on what it has (advantages over that
                      smaller group): the straggler fix of single-domain runs;
  3. skip a domain    waiting groups of the lowest priority are dropped; the producer draws the
                      rest of the batch from the other families (only when a protected domain
                      exists to draw from).
Cutting stragglers biases a group toward its shorter completions; it trades that bias for a
trainer that does not wait on the slowest sequence. All of it is off by default.

Metrics per batch (time-weighted): `util/inference` (share of the batch with a sequence in
flight), `util/inference_slots` (mean in-flight sequences / capacity), `util/sandbox` (busy
verifier seconds / (workers x batch)), `queue/inference` and `queue/sandbox` (mean waiting groups
/ scoring jobs), `sched/preemptions`, `sched/degraded_budget`, `sched/degraded_cut`,
`sched/skipped_groups`, and `verify_s` (scoring left after the last sample was generated: the part
not overlapped).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlvr.rollout.types import Completion, Request

LEVELS = (1.0, 1.5, 2.0)  # degradation steps, in multiples of the lag threshold: budget, cut, skip


@dataclasses.dataclass(frozen=True)
class SchedulePolicy:
    """How a round's work is ordered and degraded (`rl.schedule`; see the module docstring)."""

    priorities: Mapping[str, float] = dataclasses.field(default_factory=dict)
    capacity: int = 0  # sequences in flight; 0 = the backend's own limit (embedded: engine slots)
    preempt: bool = True
    max_preemptions: int = 2
    lag_factor: float = 0.0  # 0 = no relative lag threshold
    deadline_s: float = 0.0  # 0 = no absolute threshold
    budget_fraction: float = 0.5
    min_group_size: int = 2
    skip: bool = True

    @classmethod
    def from_config(cls, schedule) -> SchedulePolicy:
        """From the `rl.schedule` ConfigDict (priorities as "name=weight,...")."""
        return cls(priorities=parse_priorities(schedule.priorities), capacity=schedule.capacity,
                   preempt=schedule.preempt, max_preemptions=schedule.max_preemptions,
                   lag_factor=schedule.lag_factor, deadline_s=schedule.deadline_s,
                   budget_fraction=schedule.budget_fraction, min_group_size=schedule.min_group_size,
                   skip=schedule.skip)

    def protected(self) -> float:
        """Work at or above this priority is never degraded: the highest configured priority when
        the priorities differ (with none set, or all equal, everything may be degraded)."""
        values = {*self.priorities.values(), 1.0}
        return max(values) if len(values) > 1 else float("inf")

    def priority(self, family: str, domain: str = "") -> float:
        """A task's priority: its family's weight, else its domain's, else 1."""
        return float(self.priorities.get(family, self.priorities.get(domain, 1.0)))


def parse_priorities(text: str) -> dict[str, float]:
    """"math=2,code=0.5" -> {"math": 2.0, "code": 0.5}; errors name rl.schedule.priorities."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not name.strip():
            raise ValueError(f"rl.schedule.priorities: {item!r} is not name=weight "
                             "(e.g. rl.schedule.priorities='math=2,code=1')")
    return out


@dataclasses.dataclass(eq=False)
class GroupJob:
    """Requests that are scheduled together: a task's group (scored with `score`), or one episode
    turn (`score=None`, never skipped or cut)."""

    key: int
    family: str
    priority: float
    requests: list[Request]
    score: Callable[[Completion], Any] | None = None
    skippable: bool = True
    results: list[Any] = dataclasses.field(default_factory=list)  # per request: score() result or None
    done: dict[int, Completion] = dataclasses.field(default_factory=dict)
    pending: dict[int, str] = dataclasses.field(default_factory=dict)  # request index -> rid in flight
    scoring: list[tuple[int, concurrent.futures.Future]] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    aborting: str = ""  # "" | "preempt" | "cut": why its in-flight requests are being aborted
    degraded: list[str] = dataclasses.field(default_factory=list)
    skipped: bool = False
    error: BaseException | None = None
    dispatched_at: float = 0.0
    order: int = 0  # arrival order (ties between equal priorities)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)


class Usage:
    """Time-weighted integrals of counters since `reset` (utilisation and queue lengths)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._lock = threading.Lock()  # set from the dispatcher and from scoring threads
        self.levels: dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.start = self._last = self.clock()
            self.area: dict[str, float] = {}

    def set(self, name: str, value: float) -> None:
        with self._lock:
            now = self.clock()
            for key, level in self.levels.items():
                self.area[key] = self.area.get(key, 0.0) + level * (now - self._last)
            self._last = now
            self.levels[name] = value

    def mean(self, name: str) -> float:
        self.set(name, self.levels.get(name, 0.0))
        return self.area.get(name, 0.0) / max(self._last - self.start, 1e-9)


class PriorityWorkers:
    """Runs scoring jobs on `executor`, at most `workers` at once, highest priority first."""

    def __init__(self, executor: concurrent.futures.Executor, workers: int, usage: Usage):
        self.executor, self.workers, self.usage = executor, max(1, workers), usage
        self._heap: list[tuple[float, int, Callable[[], Any], concurrent.futures.Future]] = []
        self._order = itertools.count()
        self._running = 0
        self._lock = threading.Lock()

    def submit(self, priority: float, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            heapq.heappush(self._heap, (-priority, next(self._order), fn, future))
            self._pump()
        return future

    def _pump(self) -> None:
        """Caller holds the lock."""
        while self._heap and self._running < self.workers:
            _, _, fn, future = heapq.heappop(self._heap)
            self._running += 1
            self.executor.submit(self._run, fn, future)
        self.usage.set("sandbox_busy", self._running)
        self.usage.set("sandbox_queue", len(self._heap))

    def _run(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # scoring functions record their own failures; this is a bug path
            future.set_exception(e)
        finally:
            with self._lock:
                self._running -= 1
                self._pump()


class Scheduler:
    """The rollout/sandbox scheduler of one RL run (see the module docstring).

    A dispatcher thread owns the queue and the in-flight groups; callers `run` a round of groups
    (blocking, with scoring) or `generate` one episode turn (blocking). `begin_batch`/`end_batch`
    bracket a train batch: the lag threshold is relative to earlier batches, and the metrics
    cover the batch. `backend` needs `submit(requests) -> futures`, `abort(rids)` and `capacity`
    (rlvr.rl.backends)."""

    def __init__(self, policy: SchedulePolicy, backend, scorer: concurrent.futures.Executor, score_workers: int,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.05, unbounded: bool = False):
        backend = backend if hasattr(backend, "submit") else BlockingBackend(backend)
        self.policy, self.backend, self.clock, self.poll_s = policy, backend, clock, poll_s
        # unbounded (rl.deterministic_rollout): every request goes to the backend at once and the engine's own
        # queue admits them, in submission order; holding some back until others complete would make what
        # the engine batches together depend on timing
        self.capacity = 0 if unbounded else policy.capacity or int(getattr(backend, "capacity", 0) or 0)
        self.protected = policy.protected()
        self.usage = Usage(clock)
        self.scores = PriorityWorkers(scorer, score_workers, self.usage)
        self.batch_start: float | None = None
        self.batch_durations: list[float] = []
        self.verify_tail_s = 0.0
        self._counts_lock = threading.Lock()
        self.counts = dict.fromkeys(("preemptions", "degraded_budget", "degraded_cut", "skipped_groups"), 0)
        self._events: queue.Queue = queue.Queue()
        self._waiting: list[GroupJob] = []
        self._inflight: list[GroupJob] = []
        self._attempt = itertools.count()
        self._order = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rlvr-scheduler", daemon=True)
        self._thread.start()

    # --- callers ----------------------------------------------------------------------------

    def submit(self, job: GroupJob) -> GroupJob:
        return self.submit_all([job])[0]

    def submit_all(self, jobs: Sequence[GroupJob]) -> Sequence[GroupJob]:
        """Queues `jobs` together: they are dispatched in one pass (one backend call)."""
        if self._closed:
            raise RuntimeError("the scheduler is closed")
        for job in jobs:
            job.results = [None] * len(job.requests)
        self._events.put(("jobs", list(jobs)))
        return jobs

    def wait(self, job: GroupJob) -> GroupJob:
        while not job.finished.wait(1.0):
            if not self._thread.is_alive():
                raise RuntimeError("the scheduler's dispatcher thread died")
        if job.error is not None:
            raise job.error
        return job

    def run(self, jobs: Sequence[GroupJob]) -> dict[int, GroupJob]:
        """Generates and scores every job's group; returns {key: job} with `.results` (None where
        a cut group dropped a sample; skipped jobs have `skipped=True`)."""
        self.submit_all(jobs)
        for job in jobs:
            self.wait(job)
        generated = self.clock()
        for job in jobs:
            for index, future in job.scoring:
                job.results[index] = future.result()
        self.verify_tail_s += self.clock() - generated
        return {job.key: job for job in jobs}

    def generate(self, requests: Sequence[Request], priority: float = 1.0, family: str = "") -> list[Completion]:
        """One episode turn (blocking), scheduled with its task's priority."""
        job = self.wait(self.submit(GroupJob(-1, family, priority, list(requests), skippable=False)))
        return [job.done[i] for i in range(len(requests))]

    def begin_batch(self) -> None:
        self.batch_start = self.clock()
        self.usage.reset()
        self.verify_tail_s = 0.0
        with self._counts_lock:
            self.counts = dict.fromkeys(self.counts, 0)

    def end_batch(self) -> dict[str, float]:
        """The batch's metrics (see the module docstring); its duration sets later lag thresholds."""
        if self.batch_start is not None:
            self.batch_durations.append(self.clock() - self.batch_start)
        self.batch_start = None
        out = {"util/inference": self.usage.mean("inference_busy"),
               "queue/inference": self.usage.mean("inference_queue"),
               "util/sandbox": self.usage.mean("sandbox_busy") / self.scores.workers,
               "queue/sandbox": self.usage.mean("sandbox_queue"), "verify_s": self.verify_tail_s}
        if self.capacity:
            out["util/inference_slots"] = self.usage.mean("inference_slots") / self.capacity
        with self._counts_lock:
            out.update({f"sched/{k}": float(v) for k, v in self.counts.items()})
        return out

    def close(self) -> None:
        self._closed = True
        self._events.put(("close",))
        self._thread.join(timeout=10)

    # --- lag and degradation ----------------------------------------------------------------

    def lag_threshold(self) -> float | None:
        """Seconds into a batch after which it counts as lagging (None: degradation off)."""
        candidates = []
        if self.policy.deadline_s > 0:
            candidates.append(self.policy.deadline_s)
        if self.policy.lag_factor > 0 and self.batch_durations:
            recent = self.batch_durations[-8:]
            candidates.append(self.policy.lag_factor * sum(recent) / len(recent))
        return min(candidates) if candidates else None

    def level(self) -> int:
        """0 (on time) to 3: how many degradation steps apply now."""
        threshold, start = self.lag_threshold(), self.batch_start
        if threshold is None or start is None:
            return 0
        elapsed = self.clock() - start
        return sum(elapsed >= threshold * step for step in LEVELS)

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self.counts[name] += 1

    # --- the dispatcher thread ----------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            try:
                event = self._events.get(timeout=self.poll_s)
            except queue.Empty:
                event = None
            while event is not None:
                if event[0] == "close":
                    self._fail_all(RuntimeError("the scheduler was closed"))
                    return
                self._handle(event)
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    event = None
            try:
                self._schedule()
            except Exception as e:  # a bug or a dead backend: fail the waiting callers, keep serving
                self._fail_all(e)

    def _handle(self, event: tuple) -> None:
        if event[0] == "jobs":
            for job in event[1]:
                job.order = next(self._order)
                self._waiting.append(job)
            self._sort()
        else:
            self._on_completion(*event[1:])

    def _sort(self) -> None:
        self._waiting.sort(key=lambda j: (-j.priority, j.order))

    def _schedule(self) -> None:
        level = self.level()
        if level >= 3:
            self._skip_lowest()
        self._dispatch(level)
        if level >= 2:
            self._cut_stragglers()
        running = self.in_flight()
        self.usage.set("inference_busy", float(running > 0))
        self.usage.set("inference_slots", running)
        self.usage.set("inference_queue", len(self._waiting))

    def in_flight(self) -> int:
        return sum(len(j.pending) for j in self._inflight)

    def _need(self, job: GroupJob) -> int:
        return len(job.requests) - len(job.done)

    def _dispatch(self, level: int) -> None:
        """Highest priority first; smaller lower-priority groups backfill free capacity, unless a
        waiting group preempts them (its capacity is then reserved until the aborts land). The
        groups started in one pass go to the backend in one call, in that order."""
        started = []
        for job in list(self._waiting):
            free = self.capacity - self.in_flight() if self.capacity else None
            if free is None or self._need(job) <= free or not self._inflight:
                self._waiting.remove(job)
                started.append((job, self._start(job, level)))
            elif self._reserve_for(job, free):
                break
        if started:
            self._submit(started)

    def _reserve_for(self, job: GroupJob, free: int) -> bool:
        """Preempts lower-priority groups so `job` fits; True when capacity is (being) freed for it."""
        if not self.policy.preempt:
            return False
        freeing = sum(len(j.pending) for j in self._inflight if j.aborting)
        if freeing and self._need(job) <= free + freeing:
            return True  # aborts in flight already make room
        victims, gain = [], 0
        candidates = [j for j in self._inflight if j.priority < job.priority and not j.aborting and j.pending
                      and j.preemptions < self.policy.max_preemptions]
        for victim in sorted(candidates, key=lambda j: (j.priority, -j.dispatched_at)):
            if self._need(job) <= free + freeing + gain:
                break
            victims.append(victim)
            gain += len(victim.pending)
        if self._need(job) > free + freeing + gain:
            return False  # preempting everything below it would not make room: backfill instead
        for victim in victims:
            victim.aborting = "preempt"
            victim.preemptions += 1
            self._count("preemptions")
            self.backend.abort(list(victim.pending.values()))
        return True

    def _start(self, job: GroupJob, level: int) -> list[Request]:
        if level >= 1 and job.priority < self.protected and "budget" not in job.degraded:
            job.degraded.append("budget")
            self._count("degraded_budget")
        requests = []
        for i, request in enumerate(job.requests):
            if i in job.done:
                continue
            if "budget" in job.degraded:
                budget = max(1, int(request.sampling.max_new_tokens * self.policy.budget_fraction))
                request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling,
                                                                                    max_new_tokens=budget))
            rid = request.rid if not job.preemptions else f"{request.rid}.p{next(self._attempt)}"
            requests.append(dataclasses.replace(request, rid=rid))
            job.pending[i] = rid
        job.dispatched_at = self.clock()
        self._inflight.append(job)
        return requests

    def _submit(self, started: list[tuple[GroupJob, list[Request]]]) -> None:
        """Sends the requests of the jobs just started to the backend, in one call."""
        try:
            futures = self.backend.submit([r for _, requests in started for r in requests])
        except Exception as e:
            for job, _ in started:
                job.pending.clear()
                self._finish(job, e)
            return
        futures = iter(futures)
        for job, _ in started:
            for i, future in zip(list(job.pending), futures, strict=False):
                future.add_done_callback(lambda f, job=job, i=i: self._events.put(("done", job, i, f)))

    def _cut_stragglers(self) -> None:
        for job in self._inflight:
            if (job.skippable and job.priority < self.protected and not job.aborting and job.pending
                    and len(job.done) >= self.policy.min_group_size):
                job.aborting = "cut"
                job.degraded.append("cut")
                self._count("degraded_cut")
                self.backend.abort(list(job.pending.values()))

    def _skip_lowest(self) -> None:
        skippable = [j for j in self._waiting if j.skippable and not j.done and j.priority < self.protected]
        if not self.policy.skip or not skippable or self.protected == float("inf"):
            return  # skipping needs another, protected domain to fill the batch
        lowest = min(j.priority for j in skippable)
        for job in [j for j in skippable if j.priority == lowest]:
            self._waiting.remove(job)
            job.skipped = True
            job.degraded.append("skip")
            self._count("skipped_groups")
            job.finished.set()

    def _on_completion(self, job: GroupJob, index: int, future: concurrent.futures.Future) -> None:
        if index not in job.pending:
            return
        job.pending.pop(index)
        try:
            completion = future.result()
        except Exception as e:  # the backend failed this request: the job fails (the producer records it)
            job.error = job.error or e
            completion = None
        if completion is not None:
            aborted = (completion.finish_reason or {}).get("type") == "abort"
            if not (aborted and job.aborting):
                completion = dataclasses.replace(completion, rid=job.requests[index].rid)
                job.done[index] = completion
                if job.score is not None:
                    job.scoring.append((index, self.scores.submit(job.priority,
                                                                  lambda c=completion: job.score(c))))
        if job.pending:
            return
        self._inflight.remove(job)
        if job.aborting == "preempt" and len(job.done) < len(job.requests) and job.error is None:
            job.aborting = ""
            self._waiting.append(job)
            self._sort()
            return
        self._finish(job, job.error)

    def _finish(self, job: GroupJob, error: BaseException | None) -> None:
        if job in self._inflight:
            self._inflight.remove(job)
        job.aborting, job.error = "", error
        job.finished.set()

    def _fail_all(self, error: BaseException) -> None:
        for job in [*self._waiting, *self._inflight]:
            if job.pending:
                self.backend.abort(list(job.pending.values()))
            job.pending.clear()
            self._finish(job, error)
        self._waiting.clear()


class BlockingBackend:
    """`submit`/`abort` for a backend that only has a blocking `generate` (a user's own, or a test
    double): each request is generated on a short-lived thread of its own (nothing is left running
    when the work is done); aborts are not possible (no-ops), so such a backend is never preempted
    or cut early, only ordered."""

    def __init__(self, backend):
        self.inner, self.capacity = backend, int(getattr(backend, "capacity", 0) or 0)

    def submit(self, requests: Sequence[Request]) -> list[concurrent.futures.Future]:
        futures = []
        for request in requests:
            future: concurrent.futures.Future = concurrent.futures.Future()
            threading.Thread(target=self._generate, args=(request, future), name="rlvr-generate",
                             daemon=True).start()
            futures.append(future)
        return futures

    def _generate(self, request: Request, future: concurrent.futures.Future) -> None:
        try:
            future.set_result(self.inner.generate([request])[0])
        except BaseException as e:  # the scheduler fails the job with it
            future.set_exception(e)

    def abort(self, rids: Sequence[str]) -> None:
        pass


class TurnBackend:
    """The `generate` of a backend for episode threads (rlvr.envs.rollout): each turn goes through
    the scheduler with its episode's priority. `episodes` maps an episode's rid (turn rids are
    `{rid}-turn{n}`) to (priority, family)."""

    def __init__(self, scheduler: Scheduler, episodes: Mapping[str, tuple[float, str]]):
        self.scheduler, self.episodes = scheduler, episodes

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        rid = requests[0].rid.rsplit("-turn", 1)[0]
        priority, family = self.episodes.get(rid, (1.0, ""))
        return self.scheduler.generate(requests, priority, family)
