"""`EngineDriver`: runs a single-threaded rollout engine on a background thread.

The engine (`rlvr.rollout.engine.Engine`, or anything with its API) must only ever be called
from one thread. The driver owns that thread and gives everyone else a thread-safe interface:

* requests become `concurrent.futures.Future`s resolved with their `Completion`;
* `stream()` yields partial completions (from `engine.snapshot` after each step, only when the
  output grew), the last one final;
* control calls (abort, pause, resume, weight updates, cache flush) are queued as commands and
  executed between two `engine.step()` calls, so they never race a step.

The loop steps while the engine has work and is not paused, and otherwise sleeps on a condition
variable (no busy-spin). An exception in `step()` fails every in-flight future with that error
(the engine cannot say which request broke it), aborts what is left in the engine and keeps
the driver alive, so callers never hang.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from rlvr.rollout.types import Completion, Request

logger = logging.getLogger(__name__)

_STEP_ERROR_BACKOFF_S = (0.01, 0.05, 0.2, 1.0)  # after consecutive step() failures
_STREAM_POLL_S = 1.0


class DriverClosedError(RuntimeError):
    """The driver was closed before the request finished."""


class RequestRejected(ValueError):
    """`engine.submit` refused the request (bad ids, too long, ...): a client error."""


@dataclasses.dataclass
class _Stream:
    queue: queue.Queue
    key: int
    last_len: int = -1


def _copy(c: Completion) -> Completion:
    """A completion whose lists the engine can no longer mutate (snapshots cross threads)."""
    return dataclasses.replace(c, prompt_ids=list(c.prompt_ids), output_ids=list(c.output_ids),
                               output_logprobs=list(c.output_logprobs), output_versions=list(c.output_versions),
                               finish_reason=None if c.finish_reason is None else dict(c.finish_reason))


class EngineDriver:
    """Thread-safe front of a single-threaded engine; see the module docstring."""

    def __init__(self, engine: Any, name: str = "rlvr-engine-driver"):
        self.engine = engine
        # Read before the thread starts: from now on only the driver thread touches the engine.
        self.tokenizer = getattr(engine, "tokenizer", None)
        self._model_info: dict[str, Any] = dict(engine.model_info())
        self._cond = threading.Condition()
        self._commands: collections.deque[tuple[Callable[[], Any], Future | None]] = collections.deque()
        self._futures: dict[str, Future] = {}
        self._streams: dict[str, _Stream] = {}
        self._zombies: set[str] = set()  # failed rids the engine may still return
        self._pending_submits = 0
        self._failures = 0
        self._retry_at = 0.0
        self._closed = False
        self._stats = {"num_running_reqs": 0, "num_waiting_reqs": 0}
        self._metrics: dict[str, Any] = {}
        self._weight_version = int(getattr(engine, "weight_version", 0))
        self._paused = bool(getattr(engine, "paused", False))
        self.last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- the driver thread ----------------------------------------------------------------

    def _should_step(self) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        return bool(self.engine.has_work()) and not self.engine.paused and not getattr(self.engine, "released", ())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._commands and not self._should_step():
                    wait = self._retry_at - time.monotonic()
                    self._cond.wait(timeout=wait if wait > 0 else None)
                if self._closed:
                    return
                commands = list(self._commands)
                self._commands.clear()
            try:
                for fn, fut in commands:
                    self._execute(fn, fut)
                # After a command, step once even when paused: aborts come out of step().
                if commands or self._should_step():
                    self._step()
                self._refresh_stats()
            except Exception as e:  # a bug here must not kill the thread and hang every caller
                logger.exception("engine driver loop failed")
                self._fail_all(e)

    def _execute(self, fn: Callable[[], Any], fut: Future | None) -> None:
        try:
            result = fn()
        except Exception as e:
            self._refresh_stats()
            if fut is not None:
                fut.set_exception(e)
            return
        self._refresh_stats()
        if fut is not None:
            self._model_info = dict(self.engine.model_info())  # model_path / version may have changed
            fut.set_result(result)

    def _step(self) -> None:
        try:
            done = self.engine.step()
        except Exception as e:
            self._failures += 1
            delay = _STEP_ERROR_BACKOFF_S[min(self._failures, len(_STEP_ERROR_BACKOFF_S)) - 1]
            self._retry_at = time.monotonic() + delay
            logger.exception("engine.step() failed; failing the in-flight requests")
            self._fail_all(e)
            try:
                self.engine.abort_all()
            except Exception:
                logger.exception("engine.abort_all() after a failed step also failed")
            return
        self._failures, self._retry_at = 0, 0.0
        if done:
            self.last_progress = time.monotonic()
        for completion in done:
            self._finish(_copy(completion))
        self._push_snapshots()
        if not self.engine.has_work():
            with self._cond:
                self._zombies.clear()

    def _finish(self, completion: Completion) -> None:
        with self._cond:
            if completion.rid in self._zombies:
                self._zombies.discard(completion.rid)
                return
            fut = self._futures.pop(completion.rid, None)
            stream = self._streams.pop(completion.rid, None)
        if stream is not None:
            stream.queue.put((stream.key, completion))
        if fut is not None and not fut.done():
            fut.set_result(completion)

    def _push_snapshots(self) -> None:
        with self._cond:
            streams = list(self._streams.items())
        for rid, stream in streams:
            snap = self.engine.snapshot(rid)
            if snap is not None and len(snap.output_ids) > stream.last_len:
                stream.last_len = len(snap.output_ids)
                self.last_progress = time.monotonic()
                stream.queue.put((stream.key, _copy(snap)))

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            futures, streams = self._futures, self._streams
            self._futures, self._streams = {}, {}
            self._zombies |= set(futures)
        for stream in streams.values():
            stream.queue.put((stream.key, error))
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(error)

    def _refresh_stats(self) -> None:
        stats = {"num_running_reqs": int(self.engine.num_running), "num_waiting_reqs": int(self.engine.num_waiting)}
        version, paused = int(self.engine.weight_version), bool(self.engine.paused)
        metrics = self.engine.metrics() if hasattr(self.engine, "metrics") else {}
        with self._cond:
            self._stats, self._weight_version, self._paused, self._metrics = stats, version, paused, metrics

    # --- commands -------------------------------------------------------------------------

    def _enqueue(self, fn: Callable[[], Any], fut: Future | None) -> None:
        """Caller holds the lock."""
        if self._closed:
            raise DriverClosedError("EngineDriver is closed")
        self._commands.append((fn, fut))
        self._cond.notify()

    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Runs `fn` on the driver thread between steps and returns its result (or raises)."""
        fut: Future = Future()
        with self._cond:
            self._enqueue(fn, fut)
        return fut.result(timeout)

    def _do_submit(self, request: Request) -> None:
        with self._cond:
            self._pending_submits -= 1
            if request.rid not in self._futures:  # failed or closed before it reached the engine
                return
        try:
            self.engine.submit(request)
        except Exception as e:
            e = RequestRejected(f"{type(e).__name__}: {e}")
            with self._cond:
                fut = self._futures.pop(request.rid, None)
                stream = self._streams.pop(request.rid, None)
            if stream is not None:
                stream.queue.put((stream.key, e))
            if fut is not None:
                fut.set_exception(e)

    def _register(self, requests: Sequence[Request], streams: dict[str, _Stream] | None = None) -> list[Future]:
        """Registers futures (and streams) and queues the submits, atomically for the batch."""
        rids = [r.rid for r in requests]
        with self._cond:
            if self._closed:
                raise DriverClosedError("EngineDriver is closed")
            busy = [rid for rid in rids if rid in self._futures or rid in self._zombies]
            if busy or len(set(rids)) != len(rids):
                raise ValueError(f"request id(s) already in use: {busy or sorted(rids)}")
            futures = [Future() for _ in requests]
            for request, fut in zip(requests, futures, strict=True):
                self._futures[request.rid] = fut
                if streams is not None:
                    self._streams[request.rid] = streams[request.rid]
                self._pending_submits += 1
                self._enqueue(lambda r=request: self._do_submit(r), None)
        return futures

    # --- public API -----------------------------------------------------------------------

    def submit(self, request: Request) -> Future:
        """Queues `request` (sampling.n must be 1); the future resolves to its Completion."""
        return self._register([request])[0]

    def submit_many(self, requests: Sequence[Request]) -> list[Future]:
        """`submit` for several requests, all or none (duplicate rids raise ValueError)."""
        return self._register(list(requests))

    def stream_many(self, requests: Sequence[Request]) -> Iterator[tuple[int, Completion]]:
        """Yields `(index, partial completion)` for every request as outputs grow; each request's
        last item is final (finish_reason set). Closing the iterator early aborts what is left."""
        q: queue.Queue = queue.Queue()
        requests = list(requests)
        self._register(requests, {r.rid: _Stream(q, i) for i, r in enumerate(requests)})
        return self._drain(q, requests)

    def _drain(self, q: queue.Queue, requests: list[Request]) -> Iterator[tuple[int, Completion]]:
        remaining = set(range(len(requests)))
        try:
            while remaining:
                try:
                    key, item = q.get(timeout=_STREAM_POLL_S)
                except queue.Empty:
                    if not self._thread.is_alive():
                        raise DriverClosedError("EngineDriver thread is gone") from None
                    continue
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining.discard(key)
                yield key, item
        finally:
            if remaining and not self._closed:
                for key in remaining:
                    self.abort(requests[key].rid)

    def stream(self, request: Request) -> Iterator[Completion]:
        """Partial completions of one request as it decodes; the last one is final."""
        for _, completion in self.stream_many([request]):
            yield completion

    def generate(self, requests: Sequence[Request], timeout: float | None = None) -> list[Completion]:
        """Blocking: submits all requests and returns their completions in order."""
        return [fut.result(timeout) for fut in self.submit_many(requests)]

    def live_rids(self) -> list[str]:
        """Rids submitted through this driver that have not finished yet."""
        with self._cond:
            return list(self._futures)

    def abort(self, rid: str) -> None:
        """Aborts `rid` (no-op if unknown); its future resolves with finish_reason abort."""
        with self._cond:
            if not self._closed:
                self._enqueue(lambda: self.engine.abort(rid), None)

    def abort_all(self) -> None:
        """Aborts every running and waiting request."""
        with self._cond:
            if not self._closed:
                self._enqueue(self.engine.abort_all, None)

    def pause(self, mode: str = "in_place") -> int:
        """"in_place" freezes running requests (KV kept); "retract" puts them back in the queue
        (KV freed, recomputed on resume); "abort" aborts them. Returns their count."""
        return self._call(lambda: self.engine.pause(mode))

    def resume(self) -> None:
        self._call(self.engine.resume)

    def update_weights(self, params: Any, version: int) -> None:
        """Swaps in an in-process parameter pytree labelled `version`."""
        self._call(lambda: self.engine.update_weights(params, version))

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Loads an HF safetensors directory (rlvr.models.hf.export_hf_checkpoint) as `version`."""
        self._call(lambda: self.engine.update_weights_from_disk(path, version))

    def set_weight_version(self, version: int) -> None:
        """Relabels the current weights (SGLang's /update_weight_version)."""
        def relabel() -> None:
            setter = getattr(self.engine, "set_weight_version", None)
            if setter is not None:
                setter(version)
            else:
                self.engine.weight_version = version
        self._call(relabel)

    def flush_cache(self) -> None:
        """Drops the prefix cache; raises RuntimeError while requests hold KV."""
        self._call(self.engine.flush_cache)

    def release_memory(self, tags: Sequence[str]) -> None:
        """Frees device memory ("kv_cache", "weights"); the engine must hold no KV. Requests wait
        (the loop does not step) until `resume_memory` has brought everything back."""
        self._call(lambda: self.engine.release_memory(list(tags)))

    def resume_memory(self, tags: Sequence[str]) -> None:
        self._call(lambda: self.engine.resume_memory(list(tags)))

    def model_info(self) -> dict[str, Any]:
        return dict(self._model_info)

    def load(self) -> dict[str, int]:
        """{"num_running_reqs", "num_waiting_reqs"}; queued submits count as waiting."""
        with self._cond:
            stats = dict(self._stats)
            stats["num_waiting_reqs"] += self._pending_submits
        return stats

    def metrics(self) -> dict[str, Any]:
        """The engine's `metrics()` as of its last step (compiles, prefix cache, host/device time)."""
        with self._cond:
            return dict(self._metrics)

    @property
    def weight_version(self) -> int:
        with self._cond:
            return self._weight_version

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def close(self, timeout: float = 10.0) -> None:
        """Stops the thread; unfinished requests fail with DriverClosedError."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            commands = list(self._commands)
            self._commands.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        error = DriverClosedError("EngineDriver closed")
        for _, fut in commands:
            if fut is not None and not fut.done():
                fut.set_exception(error)
        self._fail_all(error)

    def __enter__(self) -> EngineDriver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
