"""Verifier workers: score (task, completion) jobs on local threads or on Ray actors, one interface.

The RL producer verifies every completion with `tasks.score(task, text, truncated)`. Code verifiers
wait on sandboxes and math verifiers on worker processes, so this work is CPU-bound and can outgrow
the trainer's host. `make_verifier_workers` returns one of two implementations of the same interface:

  score(task, text, truncated)  blocking and thread-safe: the reward dict, or raises what the verifier
                                raised (what the producer's scoring threads call per completion)
  submit(task, text, truncated) the same as a concurrent.futures.Future
  score_many(jobs) -> results   jobs are (Task, text, truncated); each result, in job order, is the
                                reward dict or the Exception its verifier raised
  concurrency                   how many callers can usefully wait in `score` at once
  stats() -> dict               calls, busy_s, workers_alive, restarts, resent, crashed
  close()

`local` (the default) scores in the calling thread, as the producer always did. `ray` runs a pool
of Ray actors on an existing cluster (`address`; its nodes need rlvr installed, as for any Ray job)
or on a local one started here; Ray is an optional extra (`pip install -e '.[ray]'`) imported only by
the Ray implementation. Each actor builds its own task mixture once, from the plain RL config dict
and seed (`factory(rl, seed)`, by default `rlvr.tasks.build_tasks`), so only task JSON and text go
out and reward dicts come back.

Fault tolerance (Ray): a dead actor (killed, out of memory, a verifier that crashes its process) is
replaced and the jobs it had in flight are sent again; each job's result is delivered exactly once.
The jobs that were running when it died are charged an attempt; a job that kills its worker
`max_attempts` times ends as a `WorkerCrashed` result instead of looping.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import importlib
import logging
import math
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from rlvr.tasks.base import Task

DEFAULT_FACTORY = "rlvr.tasks:build_tasks"
KINDS = ("local", "ray")
INSTALL_HINT = "pip install -e '.[ray]'"

Job = tuple[Task, str, bool]  # (task, completion text, truncated)
Result = dict[str, float] | Exception


class WorkerCrashed(RuntimeError):
    """A job whose scoring killed its worker process on every attempt (recorded, not retried again)."""


class VerifierWorkers(Protocol):
    """What the producer calls; implemented by LocalVerifierWorkers and RayVerifierWorkers."""

    concurrency: int

    def score(self, task: Task, text: str, truncated: bool) -> dict[str, float]: ...

    def submit(self, task: Task, text: str, truncated: bool) -> concurrent.futures.Future: ...

    def score_many(self, jobs: Sequence[Job]) -> list[Result]: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


@dataclasses.dataclass
class WorkerStats:
    """Counters since the pool started: `calls` jobs scored (reward or verifier error), `busy_s`
    seconds spent inside `score` summed over jobs, `restarts` dead workers replaced, `resent` jobs
    sent again after their worker died, `crashed` jobs that ended as WorkerCrashed."""

    calls: int = 0
    busy_s: float = 0.0
    restarts: int = 0
    resent: int = 0
    crashed: int = 0

    def to_dict(self, workers_alive: int) -> dict[str, float]:
        return {**dataclasses.asdict(self), "workers_alive": workers_alive}


def load_factory(path: str) -> Callable[[Any, int], Any]:
    """`"module:function"` -> the function (a task-mixture builder `(rl, seed) -> tasks`)."""
    module, colon, name = path.partition(":")
    if not colon or not module or not name:
        raise ValueError(f"verifier task factory {path!r}: write it as 'module:function' "
                         f"(default {DEFAULT_FACTORY!r})")
    return getattr(importlib.import_module(module), name)


def build_scorer(rl_config: Mapping[str, Any], seed: int, factory: str = DEFAULT_FACTORY) -> Any:
    """The task mixture (anything with `.score(task, text, truncated)`) built from a plain config dict."""
    import ml_collections

    return load_factory(factory)(ml_collections.ConfigDict(dict(rl_config)), seed)


def score_job(tasks: Any, task: Task, text: str, truncated: bool) -> tuple[Result, float]:
    """(reward dict or the verifier's exception, seconds spent): the one scoring call both pools make."""
    start = time.perf_counter()
    try:
        result: Result = dict(tasks.score(task, text, truncated))
    except Exception as e:  # the producer records it as a verifier failure
        result = e
    return result, time.perf_counter() - start


def _portable(result: Result) -> Result:
    """An exception that survives pickling as itself, else a RuntimeError carrying its type and text."""
    if not isinstance(result, Exception):
        return result
    try:
        pickle.loads(pickle.dumps(result))
        return result
    except Exception:
        return RuntimeError(f"{type(result).__name__}: {result}")


def _plain_config(rl_config: Any) -> dict[str, Any]:
    return rl_config.to_dict() if hasattr(rl_config, "to_dict") else dict(rl_config)


class LocalVerifierWorkers:
    """The local pool (the default): `score` runs in the calling thread, exactly what the producer
    did before; `submit`/`score_many` use `workers` threads of this process."""

    def __init__(self, tasks: Any, workers: int):
        self.tasks, self.workers, self.concurrency = tasks, workers, workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rlvr-verifier")
        self._stats, self._lock = WorkerStats(), threading.Lock()

    def score(self, task: Task, text: str, truncated: bool) -> dict[str, float]:
        result, seconds = score_job(self.tasks, task, text, truncated)
        with self._lock:
            self._stats.calls += 1
            self._stats.busy_s += seconds
        if isinstance(result, Exception):
            raise result
        return result

    def submit(self, task: Task, text: str, truncated: bool) -> concurrent.futures.Future:
        return self._pool.submit(self.score, task, text, truncated)

    def score_many(self, jobs: Sequence[Job]) -> list[Result]:
        return _gather([self.submit(*job) for job in jobs])

    def stats(self) -> dict[str, float]:
        with self._lock:
            return self._stats.to_dict(self.workers)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _gather(futures: Sequence[concurrent.futures.Future]) -> list[Result]:
    """Each future's reward dict or exception, in order."""
    return [f.exception() or f.result() for f in futures]


class ScoringActor:
    """Body of one Ray actor: builds the task mixture once, then scores task JSON + text."""

    def __init__(self, rl_config: dict[str, Any], seed: int, factory: str):
        from rlvr.envs.sandboxes import use_code_pool

        logging.getLogger("math_verify").setLevel(logging.ERROR)
        use_code_pool(int(rl_config.get("code_pool", 0)))  # this actor's code verdicts: a warm pool, as the trainer's
        self.tasks = build_scorer(rl_config, seed, factory)

    def ready(self) -> int:
        return os.getpid()

    def score(self, task_json: dict[str, Any], text: str, truncated: bool) -> tuple[Result, float]:
        result, seconds = score_job(self.tasks, Task.from_json(task_json), text, truncated)
        return _portable(result), seconds


@dataclasses.dataclass
class _Pending:
    """A submitted job: what goes over the wire, its caller's future, worker deaths charged to it."""

    payload: tuple[dict[str, Any], str, bool]
    future: concurrent.futures.Future
    attempts: int = 0


@dataclasses.dataclass
class _Slot:
    """One actor position in the pool; `generation` counts its replacements."""

    actor: Any
    ready_ref: Any
    generation: int = 0
    alive: bool = False
    inflight: dict = dataclasses.field(default_factory=dict)  # ObjectRef -> _Pending, in send order


class RayVerifierWorkers:
    """A pool of Ray actors scoring jobs (see the module doc). Callers in any thread `submit`; one
    dispatcher thread sends jobs to the least-loaded actor (at most `2 * threads_per_worker` in
    flight on each), collects results, and replaces dead actors."""

    def __init__(self, workers: int, rl_config: Mapping[str, Any], seed: int, address: str = "",
                 factory: str = DEFAULT_FACTORY, threads_per_worker: int = 1, cpus_per_worker: float = 1.0,
                 max_attempts: int = 3, start_timeout_s: float = 300.0, poll_s: float = 0.01):
        import ray

        self._ray, self._started_ray = ray, False
        if not ray.is_initialized():
            self._started_ray = True
            if address:
                ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
            else:
                ray.init(num_cpus=max(1, math.ceil(workers * cpus_per_worker)), include_dashboard=False,
                         logging_level=logging.ERROR, log_to_driver=False)
        self.threads, self.max_attempts, self.poll_s = threads_per_worker, max_attempts, poll_s
        self.capacity = 2 * threads_per_worker  # jobs in flight per actor: one running, one queued behind it
        self.concurrency = workers * self.capacity  # callers that can usefully block in `score` at once
        self._actor_cls = ray.remote(num_cpus=cpus_per_worker, max_concurrency=threads_per_worker,
                                     max_restarts=0)(ScoringActor)
        self._args = (_plain_config(rl_config), seed, factory)
        self._stats, self._turn = WorkerStats(), 0
        self._incoming: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._slots = [self._start_slot() for _ in range(workers)]
        self._await_start(start_timeout_s)
        self._thread = threading.Thread(target=self._loop, name="rlvr-ray-verifier", daemon=True)
        self._thread.start()

    def _start_slot(self, generation: int = 0) -> _Slot:
        actor = self._actor_cls.remote(*self._args)
        return _Slot(actor, actor.ready.remote(), generation)

    def _await_start(self, timeout_s: float) -> None:
        """Fails fast with the actor's own error when the mixture cannot be built (bad config)."""
        ray = self._ray
        try:
            ray.get([s.ready_ref for s in self._slots], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise TimeoutError(f"Ray verifier workers did not start within {timeout_s:.0f} s: does the "
                               f"cluster have {len(self._slots)} x the CPUs asked per worker free?") from None
        except ray.exceptions.RayError as e:
            self.close()
            raise RuntimeError(f"Ray verifier workers failed to build their task mixture: {e}") from e
        for slot in self._slots:
            slot.alive = True

    @property
    def actors(self) -> list[Any]:
        """The current actor handles (tests and diagnostics: kill one to exercise recovery)."""
        return [s.actor for s in self._slots]

    def inflight_counts(self) -> list[int]:
        """Jobs sent to each actor and not yet answered (diagnostics: where work is queued)."""
        return [len(s.inflight) for s in self._slots]

    def submit(self, task: Task, text: str, truncated: bool) -> concurrent.futures.Future:
        """A future of the reward dict (or of the verifier's exception, or WorkerCrashed)."""
        if self._closed.is_set():
            raise RuntimeError("Ray verifier workers are closed")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._incoming.put(_Pending((task.to_json(), text, bool(truncated)), future))
        return future

    def score(self, task: Task, text: str, truncated: bool) -> dict[str, float]:
        """Blocking, from any thread: the reward dict; raises what the verifier raised."""
        return self.submit(task, text, truncated).result()

    def score_many(self, jobs: Sequence[Job]) -> list[Result]:
        return _gather([self.submit(*job) for job in jobs])

    def _loop(self) -> None:
        """The dispatcher: owns the queue and every in-flight job until close()."""
        pending: collections.deque[_Pending] = collections.deque()
        try:
            while not self._closed.is_set():
                idle = not pending and not any(s.inflight for s in self._slots)
                try:
                    pending.append(self._incoming.get(timeout=0.1) if idle else self._incoming.get_nowait())
                    continue  # take every waiting submission before dispatching
                except queue.Empty:
                    pass
                self._dispatch(pending)
                refs = [ref for s in self._slots for ref in s.inflight]
                if refs:
                    self._ray.wait(refs, num_returns=1, timeout=self.poll_s)
                    for ref in self._ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
                        slot = next((s for s in self._slots if ref in s.inflight), None)
                        if slot is not None:  # None: already re-sent when its actor's death was handled
                            self._collect(slot, ref, pending)
                self._mark_started()
        except BaseException as e:  # Ray itself failed: fail the callers instead of leaving them waiting
            self._closed.set()  # and refuse new jobs
            self._fail_all(pending, e)
            raise
        self._fail_all(pending, RuntimeError("Ray verifier workers were closed with this job unscored"))

    def _fail_all(self, pending: collections.deque, error: BaseException) -> None:
        jobs = [*pending, *(job for s in self._slots for job in s.inflight.values())]
        while True:
            try:
                jobs.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)

    def _dispatch(self, pending: collections.deque) -> None:
        while pending:
            order = sorted(range(len(self._slots)), key=lambda i: (len(self._slots[i].inflight),
                                                                   (i - self._turn) % len(self._slots)))
            slot = self._slots[order[0]]
            if len(slot.inflight) >= self.capacity:
                return
            self._turn = (order[0] + 1) % len(self._slots)
            job = pending.popleft()
            slot.inflight[slot.actor.score.remote(*job.payload)] = job

    def _deliver(self, job: _Pending, value: Result, seconds: float) -> None:
        self._stats.calls += 1
        self._stats.busy_s += seconds
        if isinstance(value, Exception):
            job.future.set_exception(value)
        else:
            job.future.set_result(value)

    def _collect(self, slot: _Slot, ref: Any, pending: collections.deque) -> None:
        ray = self._ray
        try:
            value, seconds = ray.get(ref)
        except ray.exceptions.RayActorError:
            self._replace(slot, pending)
            return
        except ray.exceptions.RayError as e:  # e.g. a result that failed to deserialise
            value, seconds = e, 0.0
        slot.alive = True
        self._deliver(slot.inflight.pop(ref), value, seconds)

    def _replace(self, slot: _Slot, pending: collections.deque) -> None:
        """The slot's actor died: keep the results it did return, charge the jobs it was running,
        send the rest again (front of the queue, in order), and start a fresh actor."""
        ray = self._ray
        inflight, refs = slot.inflight, list(slot.inflight)  # in send order
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        ray.kill(slot.actor, no_restart=True)
        fresh = self._start_slot(slot.generation + 1)  # counted before any caller hears of the death
        slot.actor, slot.ready_ref, slot.generation, slot.alive = fresh.actor, fresh.ready_ref, fresh.generation, False
        slot.inflight = {}
        self._stats.restarts += 1
        failed = []
        for ref in refs:
            job = inflight.pop(ref)
            try:
                if ref in ready:
                    self._deliver(job, *ray.get(ref))
                    continue
            except ray.exceptions.RayError:
                pass
            failed.append(job)
        for n, job in reversed(list(enumerate(failed))):
            if n < self.threads:  # running when it died (a sequential actor runs calls in send order)
                job.attempts += 1
            if job.attempts >= self.max_attempts:
                self._stats.crashed += 1
                job.future.set_exception(WorkerCrashed(
                    f"verifier job killed its worker process {job.attempts} times (limit {self.max_attempts}); "
                    "recorded as a failure"))
            else:
                pending.appendleft(job)
                self._stats.resent += 1

    def _mark_started(self) -> None:
        """A replacement actor counts as alive once it has answered `ready`."""
        for slot in self._slots:
            if not slot.alive and self._ray.wait([slot.ready_ref], timeout=0)[0]:
                try:
                    self._ray.get(slot.ready_ref)
                    slot.alive = True
                except self._ray.exceptions.RayError:
                    pass  # died while starting: its jobs fail and it is replaced again

    def stats(self) -> dict[str, float]:
        """Counters (WorkerStats) and `workers_alive`: actors that have answered since their (re)start."""
        return self._stats.to_dict(sum(s.alive for s in self._slots))

    def close(self) -> None:
        """Stops the dispatcher (unscored jobs fail), kills the actors, and shuts Ray down only if
        this pool started it."""
        self._closed.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        for slot in getattr(self, "_slots", []):
            self._ray.kill(slot.actor, no_restart=True)
        self._slots = []
        if self._started_ray:
            self._ray.shutdown()
            self._started_ray = False


def _check(kind: str, workers: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"rl.verifier_backend={kind!r}: choose 'local' (threads in this process, the default) "
                         f"or 'ray' (actors on a Ray cluster; {INSTALL_HINT})")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"rl.verifier_workers={workers!r}: need a positive integer (threads for 'local', "
                         "actors for 'ray')")


def make_verifier_workers(kind: str, workers: int, rl_config: Mapping[str, Any], seed: int, address: str = "",
                          *, tasks: Any = None, factory: str = DEFAULT_FACTORY, threads_per_worker: int = 1,
                          cpus_per_worker: float = 1.0, max_attempts: int = 3) -> VerifierWorkers:
    """The verifier pool of `kind`: "local" (`workers` threads scoring with `tasks`, or with a mixture
    built from `rl_config` when None) or "ray" (`workers` actors, each building the mixture from
    `rl_config` (a ConfigDict or its `to_dict()`) and `seed`; `address` names an existing cluster,
    "" starts a local one). `factory` ("module:function") builds the mixture; `max_attempts` bounds
    how often a job may kill a Ray worker before it is recorded as WorkerCrashed."""
    _check(kind, workers)
    if kind == "local":
        if tasks is None:
            tasks = build_scorer(_plain_config(rl_config), seed, factory)
        return LocalVerifierWorkers(tasks, workers)
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise ImportError(f"rl.verifier_backend='ray' needs Ray, an optional extra: {INSTALL_HINT} "
                          "(or set rl.verifier_backend='local')") from e
    if max_attempts < 1 or threads_per_worker < 1:
        raise ValueError(f"Ray verifier workers: max_attempts={max_attempts} and threads_per_worker="
                         f"{threads_per_worker} must both be >= 1")
    return RayVerifierWorkers(workers, rl_config, seed, address, factory, threads_per_worker, cpus_per_worker,
                              max_attempts)
