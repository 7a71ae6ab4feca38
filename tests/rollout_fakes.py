"""A deterministic stand-in for `rlvr.rollout.engine.Engine` (same single-threaded API).

Output token i of a request is `(sum(prompt) + i + seed) % vocab_size` (seed 0 unless
`sampling_seed` is set) with logprob `-0.1 * i`, unless `output_fn(prompt_ids)` scripts the
tokens (then eos follows them). Each `step()` decodes `tokens_per_step` tokens for every running
request after sleeping `step_delay` seconds, so tests can watch streaming, pauses and aborts.
Extra log-probs are scripted too: prompt token p (p >= 1) has logprob `-0.01 * p` (p = 0: None);
the k "top" alternatives at a position whose token is t are `(t + j) % vocab` with logprob
`lp - 0.5 * j`; a requested id t has logprob `-1 - 0.001 * t`. Retract, memory release and
resume follow SGLang's rules (see the methods).
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
    retractions: int = 0


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
        self.released: set[str] = set()
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

    def _top(self, token: int, logprob: float, k: int) -> list[tuple[float, int]]:
        return [(logprob - 0.5 * j, (token + j) % self.vocab_size) for j in range(k)]

    def _complete(self, seq: _Seq, reason: dict[str, Any]) -> Completion:
        r, prompt = seq.request, list(seq.request.input_ids)
        c = Completion(rid=r.rid, prompt_ids=prompt, output_ids=list(seq.output_ids),
                       output_logprobs=list(seq.output_logprobs), output_versions=list(seq.output_versions),
                       finish_reason=reason, cached_tokens=seq.cached_tokens, weight_version=self.weight_version)
        start = r.logprob_start_len
        positions = range(start, len(prompt)) if start >= 0 else range(0)
        prompt_lps = [None if p == start else -0.01 * p for p in positions]
        if start >= 0:
            c.input_logprobs = prompt_lps
        if r.top_logprobs_num:
            c.input_top_logprobs = [None if lp is None else self._top(prompt[p], lp, r.top_logprobs_num)
                                    for p, lp in zip(positions, prompt_lps, strict=True)]
            c.output_top_logprobs = [self._top(t, lp, r.top_logprobs_num)
                                     for t, lp in zip(seq.output_ids, seq.output_logprobs, strict=True)]
        if r.token_ids_logprob:
            ids = [(-1 - 0.001 * t, t) for t in r.token_ids_logprob]
            c.input_token_ids_logprobs = [None if p == start else list(ids) for p in positions]
            c.output_token_ids_logprobs = [list(ids) for _ in seq.output_ids]
        return c

    def step(self) -> list[Completion]:
        self.steps += 1
        if self.fail_next_step is not None:
            error, self.fail_next_step = self.fail_next_step, None
            raise error
        done, self._finished = self._finished, []
        if self.paused or self.released:
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
        """"retract" puts running requests back at the head of the queue, output kept."""
        count = len(self._running) + len(self._waiting)
        if mode == "abort":
            self.abort_all()
        elif mode == "retract":
            for seq in self._running.values():
                seq.retractions += 1
            self._waiting[:0] = list(self._running.values())
            self._running.clear()
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
        """SGLang's rule: nothing running, and nothing queued unless paused (queued ones recompute)."""
        if self._running or (self._waiting and not self.paused):
            raise RuntimeError("cannot flush the cache while requests are running")
        self._seen_prompts.clear()

    def release_memory(self, tags: list[str]) -> None:
        if self._running or (self._waiting and not self.paused):
            raise RuntimeError("release_memory_occupation needs an idle engine (pause with 'retract' or 'abort')")
        if "kv_cache" in tags:
            self._seen_prompts.clear()
        self.released |= set(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self.released -= set(tags)

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
                "vocab_size": self.vocab_size, "context_length": self.context_length,
                "features": ["prompt_logprobs", "top_logprobs"]}


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
