"""A deterministic stand-in for `rlvr.rollout.engine.Engine` (same single-threaded API).

Output token i of a request is `(sum(prompt) + i + seed) % vocab_size` (seed 0 unless
`sampling_seed` is set) with logprob `-0.1 * i`, unless `output_fn(prompt_ids)` scripts the
tokens (then eos follows them). Each `step()` decodes `tokens_per_step` tokens for every running
request after sleeping `step_delay` seconds, so tests can watch streaming, pauses and aborts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from rlvr.rollout.types import Completion, Request


@dataclasses.dataclass
class _Seq:
    request: Request
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    output_versions: list[int] = dataclasses.field(default_factory=list)
    cached_tokens: int = 0


class FakeEngine:
    """Deterministic engine with the `Engine` API; `fail_next_step` injects one step() error."""

    def __init__(self, vocab_size: int = 300, tokenizer: Any = None, tokens_per_step: int = 4,
                 step_delay: float = 0.0, max_running: int = 256,
                 output_fn: Callable[[list[int]], list[int]] | None = None, context_length: int = 4096):
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.tokens_per_step = tokens_per_step
        self.step_delay = step_delay
        self.max_running = max_running
        self.output_fn = output_fn
        self.context_length = context_length
        self.weight_version = 0
        self.paused = False
        self.fail_next_step: Exception | None = None
        self.weight_paths: list[str] = []
        self.steps = 0
        self._waiting: list[_Seq] = []
        self._running: dict[str, _Seq] = {}
        self._finished: list[Completion] = []
        self._seen_prompts: list[tuple[int, ...]] = []

    # --- requests -------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if request.sampling.n != 1:
            raise ValueError("FakeEngine.submit: sampling.n must be 1")
        if not request.input_ids or any(not 0 <= t < self.vocab_size for t in request.input_ids):
            raise ValueError("FakeEngine.submit: empty prompt or token id out of range")
        if request.rid in self._running or any(s.request.rid == request.rid for s in self._waiting):
            raise ValueError(f"duplicate rid {request.rid}")
        self._waiting.append(_Seq(request))

    def _cached(self, prompt: tuple[int, ...]) -> int:
        best = 0
        for seen in self._seen_prompts:
            n = 0
            while n < min(len(seen), len(prompt) - 1) and seen[n] == prompt[n]:
                n += 1
            best = max(best, n)
        return best

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            seq = self._waiting.pop(0)
            prompt = tuple(seq.request.input_ids)
            seq.cached_tokens = self._cached(prompt)
            self._seen_prompts.append(prompt)
            self._running[seq.request.rid] = seq

    def _next_token(self, seq: _Seq) -> int:
        i = len(seq.output_ids)
        if self.output_fn is not None:
            script = self.output_fn(list(seq.request.input_ids))
            eos = self.tokenizer.eos_id if self.tokenizer is not None else 0
            return script[i] if i < len(script) else eos
        seed = seq.request.sampling.sampling_seed or 0
        return (sum(seq.request.input_ids) + i + seed) % self.vocab_size

    def _finish_reason(self, seq: _Seq) -> dict[str, Any] | None:
        sp, out = seq.request.sampling, seq.output_ids
        if out and len(out) > sp.min_new_tokens:
            eos = self.tokenizer.eos_id if self.tokenizer is not None else None
            if out[-1] in sp.stop_token_ids or (out[-1] == eos and not sp.ignore_eos):
                return {"type": "stop", "matched": out[-1]}
            if sp.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(out)
                for stop in sp.stop:
                    if stop in text:
                        return {"type": "stop", "matched": stop}
        if len(out) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        return None

    def _complete(self, seq: _Seq, reason: dict[str, Any]) -> Completion:
        return Completion(rid=seq.request.rid, prompt_ids=list(seq.request.input_ids),
                          output_ids=list(seq.output_ids), output_logprobs=list(seq.output_logprobs),
                          output_versions=list(seq.output_versions), finish_reason=reason,
                          cached_tokens=seq.cached_tokens, weight_version=self.weight_version)

    def step(self) -> list[Completion]:
        self.steps += 1
        if self.fail_next_step is not None:
            error, self.fail_next_step = self.fail_next_step, None
            raise error
        done, self._finished = self._finished, []
        if self.paused:
            return done
        if self.step_delay:
            time.sleep(self.step_delay)
        self._admit()
        for rid, seq in list(self._running.items()):
            for _ in range(self.tokens_per_step):
                reason = self._finish_reason(seq)
                if reason is None:
                    seq.output_logprobs.append(-0.1 * len(seq.output_ids))
                    seq.output_ids.append(self._next_token(seq))
                    seq.output_versions.append(self.weight_version)
                    reason = self._finish_reason(seq)
                if reason is not None:
                    done.append(self._complete(seq, reason))
                    del self._running[rid]
                    break
        return done

    def snapshot(self, rid: str) -> Completion | None:
        seq = self._running.get(rid)
        return None if seq is None else self._complete(seq, None)  # type: ignore[arg-type]

    def abort(self, rid: str, message: str = "Abort request") -> None:
        seq = self._running.pop(rid, None)
        for waiting in list(self._waiting):
            if waiting.request.rid == rid:
                self._waiting.remove(waiting)
                seq = waiting
        if seq is not None:
            self._finished.append(self._complete(seq, {"type": "abort", "message": message}))

    def abort_all(self) -> None:
        for rid in [*self._running, *(s.request.rid for s in self._waiting)]:
            self.abort(rid)

    # --- control --------------------------------------------------------------------------

    def pause(self, mode: str = "in_place") -> int:
        count = len(self._running) + len(self._waiting)
        if mode == "abort":
            self.abort_all()
        elif mode != "in_place":
            raise ValueError(f"pause mode {mode!r}")
        self.paused = True
        return count

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, params: Any, version: int) -> None:
        self.weight_version = int(version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no checkpoint directory at {path}")
        self.weight_paths.append(path)
        self.weight_version = int(version)

    def flush_cache(self) -> None:
        if self._running or self._waiting:
            raise RuntimeError("cannot flush the cache while requests are running")
        self._seen_prompts.clear()

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._finished)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "fake-model", "model_type": "fake", "architectures": ["FakeForCausalLM"],
                "vocab_size": self.vocab_size, "context_length": self.context_length}


# --- embedded servers for tests ------------------------------------------------------------


@dataclasses.dataclass
class ServerHandle:
    """A FakeEngine behind an EngineDriver behind the HTTP server."""

    engine: FakeEngine
    driver: Any
    server: Any
    records: list[dict[str, Any]]

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self, hard: bool = True) -> None:
        self.server.stop(hard=hard)
        self.driver.close()


def start_server(port: int = 0, **engine_kwargs: Any) -> ServerHandle:
    """FakeEngine(**engine_kwargs) (byte-level tokenizer unless given) served on 127.0.0.1:port."""
    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.rollout.driver import EngineDriver
    from rlvr.rollout.server import serve

    if "tokenizer" not in engine_kwargs:
        engine_kwargs["tokenizer"] = byte_level_tokenizer()
    engine = FakeEngine(**engine_kwargs)
    driver = EngineDriver(engine)
    records: list[dict[str, Any]] = []
    server, _ = serve(driver, port=port, recorder=records.append)
    return ServerHandle(engine, driver, server, records)


def wait_for(predicate: Callable[[], Any], timeout: float = 5.0, interval: float = 0.01) -> Any:
    """Polls `predicate` until truthy (returned) or raises TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout}s")
