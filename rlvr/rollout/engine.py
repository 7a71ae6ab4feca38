"""The embedded rollout engine: paged KV cache, continuous batching, shared group prefixes.

Same model code and params as the trainer (`rlvr.models.transformer.forward`), so its
log-probs equal the trainer's for the same tokens. One `step()`:
  1. admits waiting requests into free slots (a request whose prompt equals a running one's
     shares that prompt's KV pages; only the partly filled last page is copied),
  2. prefills one fixed-size chunk of every unfinished prompt (chunked prefill),
  3. decodes `decode_steps` tokens for every running sequence in one device call,
  4. retires finished sequences, freeing their slots and pages for waiting requests.
Single-threaded: call it from one thread (`rlvr.rollout.driver.EngineDriver` does).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlvr.models.config import ModelConfig
from rlvr.models.transformer import init_paged_cache, unstack_layers
from rlvr.rollout import device_fns
from rlvr.rollout.pages import PagePool
from rlvr.rollout.types import Completion, Request

MAX_STOP_IDS = 8


@dataclasses.dataclass
class _Sequence:
    request: Request
    seed: int
    slot: int = -1
    pages: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0  # prompt tokens whose KV is in the cache
    cached_tokens: int = 0  # prompt tokens taken from a shared prefix
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: dict[str, Any] | None = None

    @property
    def prompt(self) -> list[int]:
        return self.request.input_ids

    @property
    def length(self) -> int:
        """Tokens that exist: prompt plus sampled output."""
        return len(self.prompt) + len(self.output)


class Engine:
    """Generates completions for `Request`s with the policy `params` (see module docstring)."""

    def __init__(self, cfg: ModelConfig, params, tokenizer=None, *, max_slots: int = 32, max_len: int = 512,
                 page_size: int = 16, num_pages: int | None = None, decode_steps: int = 8,
                 prefill_rows: int = 4, prefill_chunk: int = 64, seed: int = 0, model_path: str = ""):
        if max_len % page_size:
            raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
        self.cfg, self.tokenizer = cfg, tokenizer
        # Decoding runs the same layers unscanned, on per-layer weights (see unstack_layers).
        self.decode_cfg = dataclasses.replace(cfg, scan_layers=False)
        self._shardings = jax.tree.map(lambda x: x.sharding, params)
        self.params = unstack_layers(params)
        self.max_slots, self.max_len, self.page_size = max_slots, max_len, page_size
        self.decode_steps, self.prefill_rows, self.prefill_chunk = decode_steps, prefill_rows, prefill_chunk
        self.pages_per_row = max_len // page_size
        self.pages = PagePool(num_pages or max_slots * self.pages_per_row + 1)
        self.pool = {k: v for k, v in init_paged_cache(cfg, self.pages.capacity, page_size).items()
                     if k != "page_table"}
        self.page_table = np.zeros((max_slots, self.pages_per_row), np.int32)
        self.waiting: deque[_Sequence] = deque()
        self.slots: list[_Sequence | None] = [None] * max_slots
        self.finished: list[Completion] = []
        self.weight_version, self.paused, self.model_path = 0, False, model_path
        self._seed_rng = np.random.default_rng(seed)

    # --- public API ----------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if request.sampling.n != 1:
            raise ValueError("Engine.submit takes n=1 requests; expand n into separate rids")
        if not request.input_ids:
            raise ValueError(f"request {request.rid}: empty input_ids")
        if len(request.input_ids) >= self.max_len:
            raise ValueError(f"request {request.rid}: prompt of {len(request.input_ids)} tokens does not fit "
                             f"max_len={self.max_len}")
        bad = [t for t in request.input_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"request {request.rid}: token ids {bad[:5]} outside the vocabulary "
                             f"[0, {self.cfg.vocab_size})")
        seed = request.sampling.sampling_seed
        seed = int(self._seed_rng.integers(2**31)) if seed is None else int(seed)
        self.waiting.append(_Sequence(request, seed % 2**31))

    def step(self) -> list[Completion]:
        """One scheduling iteration; returns the completions finished in it."""
        if not self.paused:
            self._admit()
            self._prefill()
            self._decode()
        done, self.finished = self.finished, []
        return done

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Runs `requests` to completion; results in request order."""
        for request in requests:
            self.submit(request)
        results: dict[str, Completion] = {}
        while len(results) < len(requests):
            if self.paused:
                raise RuntimeError("engine is paused; resume() before generate()")
            for completion in self.step():
                results[completion.rid] = completion
        return [results[r.rid] for r in requests]

    def snapshot(self, rid: str) -> Completion | None:
        for seq in self._running():
            if seq.request.rid == rid:
                return self._completion(seq, finish=None)
        return None

    def abort(self, rid: str, message: str = "aborted") -> None:
        for seq in list(self.waiting) + self._running():
            if seq.request.rid == rid:
                self._finish(seq, {"type": "abort", "message": message, "status_code": 200})

    def abort_all(self, message: str = "aborted") -> None:
        for seq in list(self.waiting) + self._running():
            self._finish(seq, {"type": "abort", "message": message, "status_code": 200})

    def pause(self, mode: str = "in_place") -> int:
        """"in_place": keep sequences and caches; "abort": abort them all."""
        count = self.num_running + self.num_waiting
        if mode == "abort":
            self.abort_all("paused with mode=abort")
        elif mode != "in_place":
            raise ValueError(f"pause mode {mode!r}: use 'in_place' or 'abort'")
        self.paused = True
        return count

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, params, version: int) -> None:
        """New params (resharded to the current ones' shardings); in-flight sequences keep
        their caches and continue with the new weights; tokens are tagged by version."""
        params = jax.tree.map(jax.device_put, params, self._shardings)
        self.params = unstack_layers(params)
        self.weight_version = int(version)

    def update_weights_from_disk(self, path: str, version: int) -> None:
        from rlvr.models import hf

        cfg, params = hf.load_hf_checkpoint(path)
        fields = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "tie_word_embeddings", "qkv_bias", "qk_norm")
        diff = [f for f in fields if getattr(cfg, f) != getattr(self.cfg, f)]
        if diff:
            raise ValueError(f"{path}: architecture differs from the served model in {diff}")
        self.update_weights(params, version)
        self.model_path = path

    def flush_cache(self) -> None:
        if self.num_running:
            raise RuntimeError("cannot flush the cache while requests are running")
        self.pages.reset()

    def has_work(self) -> bool:
        return bool(self.waiting or self._running() or self.finished)

    @property
    def num_running(self) -> int:
        return len(self._running())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "model_type": self.cfg.family, "is_generation": True,
                "vocab_size": self.cfg.vocab_size, "weight_version": str(self.weight_version),
                "max_len": self.max_len, "architectures": [self.cfg.family]}

    # --- scheduling ----------------------------------------------------------------------

    def _running(self) -> list[_Sequence]:
        return [s for s in self.slots if s is not None]

    def _admit(self) -> None:
        deferred = deque()
        while self.waiting and None in self.slots:
            seq = self.waiting.popleft()
            leader = self._prefix_leader(seq)
            if leader is None and self._has_pending_twin(seq):
                deferred.append(seq)  # wait until the twin's prompt is cached, then share it
                continue
            if not self.pages.can_allocate(self.pages_per_row):
                deferred.append(seq)
                break
            slot = self.slots.index(None)
            seq.slot, self.slots[slot] = slot, seq
            if leader is not None:
                self._share_prefix(seq, leader)
        self.waiting.extendleft(reversed(deferred))

    def _prefix_leader(self, seq: _Sequence) -> _Sequence | None:
        """A running sequence with the same prompt whose prompt (but the last token) is cached."""
        for other in self._running():
            if other.prompt == seq.prompt and other.prefilled >= len(seq.prompt) - 1:
                return other
        return None

    def _has_pending_twin(self, seq: _Sequence) -> bool:
        return any(o.prompt == seq.prompt and o.prefilled < len(o.prompt) - 1 for o in self._running())

    def _share_prefix(self, seq: _Sequence, leader: _Sequence) -> None:
        """Share the leader's full prompt pages; copy the partly filled one; recompute only
        the last prompt token (whose logits give this sample's own first token)."""
        shared_tokens = len(seq.prompt) - 1
        full = shared_tokens // self.page_size
        seq.pages = self.pages.share(leader.pages[:full])
        if shared_tokens % self.page_size:
            (page,) = self.pages.allocate(1)
            self.pool = device_fns.copy_pages(self.pool, jnp.asarray([leader.pages[full]]), jnp.asarray([page]))
            seq.pages.append(page)
        seq.prefilled = seq.cached_tokens = shared_tokens
        self._sync_table(seq)

    def _ensure_pages(self, seq: _Sequence, tokens: int) -> None:
        needed = min(math.ceil(tokens / self.page_size), self.pages_per_row) - len(seq.pages)
        if needed > 0:
            seq.pages += self.pages.allocate(needed)
            self._sync_table(seq)

    def _sync_table(self, seq: _Sequence) -> None:
        self.page_table[seq.slot, :] = 0
        self.page_table[seq.slot, : len(seq.pages)] = seq.pages

    def _sampling_arrays(self, seqs: list[_Sequence | None]) -> dict[str, jax.Array]:
        rows = len(seqs)
        out = {"temperature": np.ones(rows, np.float32), "top_k": np.full(rows, -1, np.int32),
               "top_p": np.ones(rows, np.float32), "min_p": np.zeros(rows, np.float32),
               "seed": np.zeros(rows, np.int32), "min_new": np.zeros(rows, np.int32),
               "max_new": np.ones(rows, np.int32), "stop_ids": np.full((rows, MAX_STOP_IDS), -1, np.int32)}
        for i, seq in enumerate(seqs):
            if seq is None:
                continue
            sp = seq.request.sampling
            out["temperature"][i], out["top_k"][i], out["top_p"][i] = sp.temperature, sp.top_k, sp.top_p
            out["min_p"][i], out["seed"][i], out["min_new"][i] = sp.min_p, seq.seed, sp.min_new_tokens
            out["max_new"][i] = self._max_new(seq)
            stops = list(sp.stop_token_ids)
            if not sp.ignore_eos and self._eos_id() is not None:
                stops.append(self._eos_id())
            out["stop_ids"][i, : len(stops[:MAX_STOP_IDS])] = stops[:MAX_STOP_IDS]
        return {k: jnp.asarray(v) for k, v in out.items()}

    def _max_new(self, seq: _Sequence) -> int:
        return min(seq.request.sampling.max_new_tokens, self.max_len - len(seq.prompt))

    def _eos_id(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_id

    def _prefill(self) -> None:
        pending = [s for s in self._running() if s.prefilled < len(s.prompt)]
        for start in range(0, len(pending), self.prefill_rows):
            self._prefill_rows(pending[start: start + self.prefill_rows])

    def _prefill_shape(self, seqs: list[_Sequence]) -> tuple[int, int]:
        """The smallest of the fixed (rows, chunk) buckets that fits: a single request
        admitted into a freed slot does not pay for a full-size prefill."""
        rows = 1 if len(seqs) == 1 else self.prefill_rows
        longest = max(len(s.prompt) - s.prefilled for s in seqs)
        small = max(self.prefill_chunk // 4, 1)
        return rows, (small if longest <= small else self.prefill_chunk)

    def _prefill_rows(self, seqs: list[_Sequence]) -> None:
        rows, chunk = self._prefill_shape(seqs)
        tokens = np.zeros((rows, chunk), np.int32)
        positions = np.zeros((rows, chunk), np.int32)
        segments = np.zeros((rows, chunk), np.int32)
        table = np.zeros((rows, self.pages_per_row), np.int32)
        for i, seq in enumerate(seqs):
            end = min(seq.prefilled + chunk, len(seq.prompt))
            self._ensure_pages(seq, end)
            n = end - seq.prefilled
            tokens[i, :n] = seq.prompt[seq.prefilled: end]
            positions[i, :n] = np.arange(seq.prefilled, end)
            segments[i, :n] = 1
            table[i] = self.page_table[seq.slot]
        sampling = self._sampling_arrays(seqs + [None] * (rows - len(seqs)))
        self.pool, tok, logprob = device_fns.prefill(self.decode_cfg, self.params, self.pool, jnp.asarray(table),
                                                     jnp.asarray(tokens), jnp.asarray(positions),
                                                     jnp.asarray(segments), sampling)
        tok, logprob = np.asarray(tok), np.asarray(logprob)
        for i, seq in enumerate(seqs):
            seq.prefilled = min(seq.prefilled + chunk, len(seq.prompt))
            if seq.prefilled == len(seq.prompt):
                if self._max_new(seq) <= 0:
                    self._finish(seq, {"type": "length", "length": 0})
                else:
                    self._append(seq, [int(tok[i])], [float(logprob[i])])

    def _decode(self) -> None:
        seqs = [s if s is not None and s.prefilled == len(s.prompt) and s.output and s.finish is None else None
                for s in self.slots]
        if not any(seqs):
            return
        tokens = np.zeros(self.max_slots, np.int32)
        positions = np.zeros(self.max_slots, np.int32)
        generated = np.zeros(self.max_slots, np.int32)
        for i, seq in enumerate(seqs):
            if seq is not None:
                self._ensure_pages(seq, seq.length + self.decode_steps)
                tokens[i], positions[i], generated[i] = seq.output[-1], seq.length - 1, len(seq.output)
        active = np.array([s is not None for s in seqs])
        table = self.page_table[:, : self._read_pages(seqs)]
        self.pool, toks, logprobs, emitted = device_fns.decode(
            self.decode_cfg, self.decode_steps, self.params, self.pool, jnp.asarray(table),
            jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(active), jnp.asarray(generated),
            self._sampling_arrays(seqs))
        toks, logprobs, emitted = np.asarray(toks), np.asarray(logprobs), np.asarray(emitted)
        for i, seq in enumerate(seqs):
            if seq is not None:
                n = int(emitted[i])
                self._append(seq, toks[i, :n].tolist(), logprobs[i, :n].tolist())

    def _read_pages(self, seqs: list[_Sequence | None]) -> int:
        """Pages each row attends over in this decode call: the longest row's need rounded
        up to a power of two (a few fixed shapes), so short sequences do not read (and
        mask) the full max_len worth of cache every step."""
        need = max(math.ceil((s.length + self.decode_steps) / self.page_size) for s in seqs if s is not None)
        return min(1 << max(need - 1, 0).bit_length(), self.pages_per_row)

    # --- finishing -----------------------------------------------------------------------

    def _append(self, seq: _Sequence, tokens: list[int], logprobs: list[float]) -> None:
        """Adds sampled tokens, then finishes the sequence at the first stop condition."""
        sp = seq.request.sampling
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos or self._eos_id() is None else {self._eos_id()})
        for token, logprob in zip(tokens, logprobs, strict=True):
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.weight_version)
            if token in stops and len(seq.output) >= sp.min_new_tokens:
                return self._finish(seq, {"type": "stop", "matched": token})
            if len(seq.output) >= self._max_new(seq):
                return self._finish(seq, {"type": "length", "length": len(seq.output)})
        if sp.stop and self.tokenizer is not None:
            self._check_stop_strings(seq)

    def _check_stop_strings(self, seq: _Sequence) -> None:
        text = self.tokenizer.decode(seq.output)
        hits = [(text.find(s), s) for s in seq.request.sampling.stop if s and s in text]
        if not hits:
            return
        index, stop = min(hits)
        end = index + len(stop)
        for keep in range(1, len(seq.output) + 1):  # the first token whose text covers the stop
            if len(self.tokenizer.decode(seq.output[:keep])) >= end:
                del seq.output[keep:], seq.logprobs[keep:], seq.versions[keep:]
                break
        self._finish(seq, {"type": "stop", "matched": stop})

    def _finish(self, seq: _Sequence, reason: dict[str, Any]) -> None:
        if seq.finish is not None:
            return
        seq.finish = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot >= 0 and self.slots[seq.slot] is seq:
            self.slots[seq.slot] = None
            self.pages.release(seq.pages)
            seq.pages = []
        self.finished.append(self._completion(seq, reason))

    def _completion(self, seq: _Sequence, finish: dict[str, Any] | None) -> Completion:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output, skip_special_tokens=seq.request.sampling.skip_special_tokens)
            matched = (finish or {}).get("matched")
            if isinstance(matched, str) and not seq.request.sampling.no_stop_trim and matched in text:
                text = text[: text.rfind(matched)]
        return Completion(rid=seq.request.rid, prompt_ids=list(seq.prompt), output_ids=list(seq.output),
                          output_logprobs=list(seq.logprobs), output_versions=list(seq.versions),
                          finish_reason=finish, cached_tokens=seq.cached_tokens,
                          weight_version=self.weight_version, text=text)
