"""The embedded rollout engine: paged KV cache, prefix cache, continuous batching, on-device decoding.

Same model code and params as the trainer (`rlvr.models.transformer.forward`), so its
log-probs equal the trainer's for the same tokens. One `step()`:
  1. admits waiting requests into free slots: a prompt's cached full pages (`pages.PrefixCache`:
     a shared system prompt, a group's prompt, earlier turns) are reused, and a request whose
     prompt equals a running one's also copies its partly filled last page;
  2. dispatches one fixed-size chunk of every unfinished prompt (chunked prefill); a chunk that
     ends its prompt samples the first token and arms the slot's on-device decode state;
  3. dispatches `decode_steps` decode steps for every running sequence in one device call (a
     `lax.while_loop` that exits early when all rows finish), continuing from the device state
     the previous call left (`device_fns`);
  4. only then reads the previous call's tokens and retires finished sequences, so the host's
     bookkeeping overlaps the device's next call.
Single-threaded: call it from one thread (`rlvr.rollout.driver.EngineDriver` does).

Compiled shapes are a bounded set (`warmup()` compiles them all up front): prefill [1 or
prefill_rows, prefill_chunk/4 or prefill_chunk] and one decode program (its attention loops over
the pages held, `kernels/paged_attention/ragged.py`); each x2 when a request uses
top-k/top-p/min-p. `metrics()` reports compile counts, the prefix-cache hit rate and host vs
device time.

Beyond plain sampling (each on only while a running request asks for it, so the plain path
compiles without it): penalties and logit_bias (`logit_process`), constrained decoding (grammar
masks, `grammar`; a batch with a constrained request decodes one token per call), prompt / top /
requested-id log-probs and stop_regex (`extras`, `sequence.Sequence.accept`), pause mode
"retract" and the release / resume of device memory.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlvr.kernels.paged_attention import ragged_pages
from rlvr.models.config import ModelConfig
from rlvr.models.transformer import init_paged_cache, unstack_layers
from rlvr.rollout import device_fns
from rlvr.rollout import extras as extras_lib
from rlvr.rollout.pages import PagePool, PrefixCache
from rlvr.rollout.sequence import Sequence, penalty_arrays, sampling_table, write_sampling_row
from rlvr.rollout.stops import StopStrings
from rlvr.rollout.types import Completion, Request

# The decode attention's page list comes in chunks of max(RAGGED_MIN_CHUNK, table / RAGGED_CHUNKS)
# entries, looped over on device: one compiled program whatever the pages held, padded by < 1 chunk.
RAGGED_CHUNKS, RAGGED_MIN_CHUNK = 16, 64


@dataclasses.dataclass
class _Inflight:
    """A dispatched device call whose tokens the host has not read yet."""
    kind: str  # "prefill" | "decode"
    seqs: list  # prefill: the rows' sequences (None = not completing); decode: per slot
    tokens: jax.Array
    logprobs: jax.Array
    emitted: jax.Array | None
    version: int
    extras: dict = dataclasses.field(default_factory=dict)  # extra log-probs (top-k, requested ids)


class Engine:
    """Generates completions for `Request`s with the policy `params` (see module docstring).

    dtype / kv_dtype: "float32" (default) or "bfloat16" for the rollout weights and compute /
    the KV pages (then log-probs, still computed in float32 from the logits, no longer equal
    the trainer's float32 ones bit for bit)."""

    def __init__(self, cfg: ModelConfig, params, tokenizer=None, *, max_slots: int = 32, max_len: int = 512,
                 page_size: int = 16, num_pages: int | None = None, decode_steps: int = 8,
                 prefill_rows: int = 4, prefill_chunk: int = 64, seed: int = 0, model_path: str = "",
                 dtype: str = "float32", kv_dtype: str | None = None):
        if max_len % page_size:
            raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
        self.cfg, self.tokenizer = cfg, tokenizer
        # Decoding runs the same layers unscanned, on per-layer weights (see unstack_layers), and a
        # tied output projection as its own [E, V] copy (the tied einsum transposes [V, E] per step).
        self.decode_cfg = dataclasses.replace(cfg, scan_layers=False, dtype=dtype, param_dtype=dtype,
                                              tie_word_embeddings=False)
        self.kv_dtype = kv_dtype or dtype
        self._shardings = jax.tree.map(lambda x: x.sharding, params)
        self.params = self._decode_params(params)
        self.max_slots, self.max_len, self.page_size = max_slots, max_len, page_size
        self.decode_steps, self.prefill_rows, self.prefill_chunk = decode_steps, prefill_rows, prefill_chunk
        self.pages_per_row = max_len // page_size
        self.pages = PagePool(num_pages or max_slots * self.pages_per_row + 1)
        self.prefix = PrefixCache(self.pages, page_size)
        self.pool = {k: v for k, v in init_paged_cache(cfg, self.pages.capacity, page_size, self.kv_dtype).items()
                     if k != "page_table"}
        self.page_table = np.zeros((max_slots, self.pages_per_row), np.int32)
        self.state = device_fns.init_state(max_slots)
        self.active = np.zeros(max_slots, bool)
        self._sampling = sampling_table(max_slots)
        self._sampling_device = None  # the table on device, refreshed after admissions change it
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.slots: list[Sequence | None] = [None] * max_slots
        self.finished: list[Completion] = []
        self.inflight: collections.deque[_Inflight] = collections.deque()
        self.weight_version, self.paused, self.model_path = 0, False, model_path
        self.released: set[str] = set()  # device memory given back (release_memory)
        self._host_params = None
        self._seed_rng = np.random.default_rng(seed)
        self._reserved = 0  # pages promised to running sequences' worst cases, not yet allocated
        self._times = {"host_s": 0.0, "device_wait_s": 0.0, "steps": 0, "decode_calls": 0, "prefill_calls": 0,
                       "generated_tokens": 0}
        # Set to a list to time every device call synchronously (no overlap; for calibration):
        # ("prefill", rows x chunk, s), ("decode", (rows decoding, max_slots), s), ("step", 0, host s).
        self.call_times: list[tuple[str, Any, float]] | None = None

    def _decode_params(self, params):
        params = unstack_layers(params)
        if self.cfg.tie_word_embeddings:
            params["lm_head"] = {"kernel": params["embed_tokens"].T}
        dtype = jnp.dtype(self.decode_cfg.param_dtype)
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

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
        sp = request.sampling
        eos = set() if sp.ignore_eos or self._eos_id() is None else {self._eos_id()}
        stops = None
        if (sp.stop or sp.stop_regex) and self.tokenizer is not None:
            stops = StopStrings(self.tokenizer, list(sp.stop), list(sp.stop_regex))
        budget = min(sp.max_new_tokens, self.max_len - len(request.input_ids))
        seq = Sequence(request, seed % 2**31, budget, frozenset(sp.stop_token_ids) | eos, stops,
                       extras=extras_lib.prepare(request, self.tokenizer, self.cfg.vocab_size))
        if request.logprob_start_len >= 0:
            self._score_prompt(seq)
        self.waiting.append(seq)

    def _score_prompt(self, seq: Sequence) -> None:
        """Prompt log-probs (and their extras) by one forward over the prompt, padded to a power
        of two (a few compiled shapes)."""
        request = seq.request
        n = len(request.input_ids)
        tokens = np.zeros(max(16, 1 << (n - 1).bit_length()), np.int32)
        tokens[:n] = request.input_ids
        ids = np.asarray(request.token_ids_logprob, np.int32) if request.token_ids_logprob else None
        own, top = device_fns.score(self.decode_cfg, extras_lib.top_bucket(request.top_logprobs_num), self.params,
                                    jnp.asarray(tokens), None if ids is None else jnp.asarray(ids))
        extras_lib.score_prompt(seq.extras, request, np.asarray(own), {k: np.asarray(v) for k, v in top.items()})

    def step(self) -> list[Completion]:
        """One scheduling iteration; returns the completions finished in it."""
        start, wait = time.perf_counter(), self._times["device_wait_s"]
        timed = 0.0 if self.call_times is None else sum(t for kind, _, t in self.call_times if kind != "step")
        dispatched = False
        if not self.paused and not self.released:
            self._prune_extras()
            self._admit()
            self._prefill()
            dispatched = self._decode()
        self._process(keep=1 if dispatched else 0)
        self._times["steps"] += 1
        self._times["host_s"] += time.perf_counter() - start - (self._times["device_wait_s"] - wait)
        if self.call_times is not None:
            calls = sum(t for kind, _, t in self.call_times if kind != "step") - timed
            self.call_times.append(("step", 0.0, time.perf_counter() - start - calls))
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
        """"in_place": keep sequences and caches; "retract": put the running sequences back at
        the head of the queue, their pages freed (the prefix cache keeps what it can), to be
        recomputed on resume; "abort": abort them all."""
        if mode not in ("in_place", "abort", "retract"):
            raise ValueError(f"pause mode {mode!r}: use 'in_place', 'retract' or 'abort'")
        self._process(keep=0)
        count = self.num_running + self.num_waiting
        if mode == "abort":
            self.abort_all("paused with mode=abort")
        elif mode == "retract":
            self.waiting.extendleft(reversed([self._retract(seq) for seq in self._running()]))
        self.paused = True
        return count

    def _retract(self, seq: Sequence) -> Sequence:
        """A running sequence as a waiting one that continues from its prompt plus its output."""
        self._release_slot(seq, cache=True)
        return seq.retracted()

    def release_memory(self, tags: list[str]) -> None:
        """Gives device memory back: "kv_cache" (the page pool, deleted; the prefix cache is
        flushed), "weights" (copied to the host and dropped: their device memory is freed unless
        someone else holds the same arrays, as an in-process trainer does). Needs no running
        sequence (pause with "retract" or "abort" first); nothing is admitted until every released
        tag is resumed."""
        if self.num_running:
            raise RuntimeError("release_memory_occupation needs an idle engine: pause with mode 'retract' or "
                               "'abort' first")
        self._process(keep=0)
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.flush_cache()
            for leaf in jax.tree.leaves(self.pool):
                leaf.delete()
            self.pool = None
        if "weights" in tags and "weights" not in self.released:
            self._host_params = (jax.device_get(self.params), jax.tree.map(lambda x: x.sharding, self.params))
            self.params = None
        self.released |= {t for t in tags if t in ("kv_cache", "weights")}

    def resume_memory(self, tags: list[str]) -> None:
        """Re-allocates what `release_memory` gave back: an empty page pool, the weights as they were."""
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.pool = {k: v for k, v in init_paged_cache(self.cfg, self.pages.capacity, self.page_size,
                                                           self.kv_dtype).items() if k != "page_table"}
        if "weights" in tags and "weights" in self.released:
            host, shardings = self._host_params
            self.params, self._host_params = jax.tree.map(jax.device_put, host, shardings), None
        self.released -= set(tags)

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, params, version: int) -> None:
        """New params (resharded to the current ones' shardings); in-flight sequences keep
        their caches and continue with the new weights; tokens are tagged by version."""
        self._process(keep=0)  # tokens of calls already dispatched belong to the old version
        params = jax.tree.map(jax.device_put, params, self._shardings)
        self.params = self._decode_params(params)
        self.weight_version = int(version)
        self.released.discard("weights")
        self._host_params = None

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
        self._process(keep=0)
        self.pages.reset()
        self.prefix.reset()

    def has_work(self) -> bool:
        return bool(self.waiting or self._running() or self.finished or self.inflight)

    @property
    def num_running(self) -> int:
        return len(self._running())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "model_type": self.cfg.family, "is_generation": True,
                "vocab_size": self.cfg.vocab_size, "weight_version": str(self.weight_version),
                "max_len": self.max_len, "architectures": [self.cfg.family], "features": _features()}

    def metrics(self) -> dict[str, Any]:
        """Compile counts, prefix-cache hits, host vs device-wait time, calls and tokens so far."""
        return {"compiles_prefill": device_fns.prefill._cache_size(),
                "compiles_decode": device_fns.decode._cache_size(),
                **self.prefix.stats(), **{k: round(v, 4) if isinstance(v, float) else v
                                          for k, v in self._times.items()},
                "pages_used": self.pages.used, "pages_total": self.pages.capacity - 1}

    def warmup(self, filters: bool = False) -> None:
        """Compiles every prefill and decode shape this engine can use, now (idle rows only:
        nothing is written), so a run pays compilation once, up front. `filters`: also the
        variants for requests with top-k, top-p or min-p."""
        self._process(keep=0)
        for variant in sorted({False, filters}):
            for rows in sorted({1, self.prefill_rows}):
                for chunk in sorted({self._small_chunk(), self.prefill_chunk}):
                    self._dispatch_prefill([], rows, chunk, variant)
            self._dispatch_decode([None] * self.max_slots, filters=variant)
        self._process(keep=0)

    # --- scheduling ----------------------------------------------------------------------

    def _running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def _admit(self) -> None:
        deferred = collections.deque()
        while self.waiting and None in self.slots:
            seq = self.waiting.popleft()
            nodes = self.prefix.match(seq.prompt[:-1])
            if self._prefix_pending(seq, len(nodes) * self.page_size):
                deferred.append(seq)  # a running prefill is about to cache more of this prompt
                continue
            twin = self._twin(seq)
            need = self._worst_case_pages(seq) - len(nodes)
            if not self._reserve(need):
                deferred.append(seq)
                break
            self._place(seq, nodes, twin, need)
        self.waiting.extendleft(reversed(deferred))

    def _place(self, seq: Sequence, nodes: list, twin: Sequence | None, budget: int) -> None:
        slot = self.slots.index(None)
        seq.slot, self.slots[slot] = slot, seq
        seq.budget = budget
        self.prefix.lock(nodes)
        seq.nodes = nodes
        seq.pages = self.pages.share([n.page for n in nodes])
        seq.prefilled = seq.cached_tokens = len(nodes) * self.page_size
        if twin is not None and seq.prefilled < len(seq.prompt) - 1:
            self._copy_partial_page(seq, twin)
        self.prefix.record(len(seq.prompt), seq.cached_tokens)
        self._sampling_row(slot, seq)
        self._sync_table(seq)

    def _prefix_pending(self, seq: Sequence, cached: int) -> bool:
        """True if a running prefill will soon cache more of this prompt than is cached now
        (a page more, or all of it but the last token for an identical prompt)."""
        for other in self._running():
            if other.prefilled >= len(other.prompt):
                continue
            usable = min(_common_prefix(seq.prompt, other.prompt), len(seq.prompt) - 1)
            if other.prefilled < usable and (usable == len(seq.prompt) - 1 or usable - cached >= self.page_size):
                return True
        return False

    def _twin(self, seq: Sequence) -> Sequence | None:
        """A running sequence with the same prompt whose prompt (but the last token) is written."""
        for other in self._running():
            if other.prompt == seq.prompt and other.prefilled >= len(seq.prompt) - 1:
                return other
        return None

    def _copy_partial_page(self, seq: Sequence, twin: Sequence) -> None:
        """The twin's partly filled prompt page, copied (copy-on-write): only the last prompt
        token is recomputed, its logits giving this sample's own first token."""
        index = len(seq.pages)
        (page,) = self._allocate(seq, 1)
        self.pool = device_fns.copy_pages(self.pool, jnp.asarray([twin.pages[index]]), jnp.asarray([page]))
        seq.pages.append(page)
        seq.prefilled = seq.cached_tokens = len(seq.prompt) - 1

    def _worst_case_pages(self, seq: Sequence) -> int:
        return math.ceil(min(len(seq.prompt) + seq.max_new, self.max_len) / self.page_size)

    def _reserve(self, count: int) -> bool:
        shortfall = self._reserved + count - len(self.pages.free)
        if shortfall > 0 and self.prefix.evict(shortfall) < shortfall:
            return False
        self._reserved += count
        return True

    def _allocate(self, seq: Sequence, count: int) -> list[int]:
        seq.budget -= count
        self._reserved -= count
        return self.pages.allocate(count)

    def _ensure_pages(self, seq: Sequence, tokens: int) -> None:
        needed = min(math.ceil(tokens / self.page_size), self.pages_per_row) - len(seq.pages)
        if needed > 0:
            seq.pages += self._allocate(seq, needed)
            self._sync_table(seq)

    def _sync_table(self, seq: Sequence) -> None:
        self.page_table[seq.slot, :] = 0
        self.page_table[seq.slot, : len(seq.pages)] = seq.pages

    def _sampling_row(self, slot: int, seq: Sequence) -> None:
        self._enable_extras(seq.request)
        write_sampling_row(self._sampling, slot, seq)
        self._sampling_device = None

    def _enable_extras(self, request: Request) -> None:
        """Adds the per-slot arrays a request needs (penalties and their token counts in the
        decode state; requested log-prob ids) while some running request uses them."""
        table, slots, vocab = self._sampling, self.max_slots, self.cfg.vocab_size
        if request.sampling.penalized and "frequency_penalty" not in table:
            table.update(penalty_arrays(slots, vocab))
            self.state = {**self.state, "counts": jnp.zeros((slots, vocab), jnp.int32)}
        width = table["logprob_ids"].shape[1] if "logprob_ids" in table else 0
        if len(request.token_ids_logprob) > width:
            ids = np.zeros((slots, 1 << (len(request.token_ids_logprob) - 1).bit_length()), np.int32)
            ids[:, :width] = table.get("logprob_ids", ids[:, :0])
            table["logprob_ids"] = ids

    def _prune_extras(self) -> None:
        """Drops the extra arrays no running request needs any more (back to the plain path)."""
        running = [s.request for s in self._running()]
        table = self._sampling
        if "frequency_penalty" in table and not any(r.sampling.penalized for r in running):
            for key in penalty_arrays(1, 1):
                del table[key]
            self.state = {k: v for k, v in self.state.items() if k != "counts"}
            self._sampling_device = None
        if "logprob_ids" in table and not any(r.token_ids_logprob for r in running):
            del table["logprob_ids"]
            self._sampling_device = None

    def _top(self, seqs: list) -> int:
        """The compiled number of top log-probs a call computes for these sequences (0: none)."""
        return extras_lib.top_bucket(max((s.request.top_logprobs_num for s in seqs if s is not None), default=0))

    def _masks(self, seqs: list, rows: int) -> jax.Array | None:
        """Packed grammar masks of constrained sequences (all tokens for the other rows), or None."""
        if not any(s is not None and s.extras.grammar is not None for s in seqs):
            return None
        masks = np.full((rows, -(-self.cfg.vocab_size // 8)), 255, np.uint8)
        for i, seq in enumerate(seqs):
            if seq is not None and seq.extras.grammar is not None:
                budget = seq.max_new - len(seq.output)
                masks[i] = seq.extras.grammar.mask(seq.extras.state, budget, sorted(seq.stop_ids))
        return jnp.asarray(masks)

    def _constrained(self) -> bool:
        return any(s.extras.grammar is not None and self.active[s.slot] for s in self._running())

    def _filters(self, slots: np.ndarray) -> bool:
        """Whether any of these rows asks for top-k, top-p or min-p (compiles the filter paths)."""
        table = self._sampling
        return bool(np.any((table["top_k"][slots] > 0) | (table["top_p"][slots] < 1) | (table["min_p"][slots] > 0)))

    def _eos_id(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_id

    # --- prefill -------------------------------------------------------------------------

    def _small_chunk(self) -> int:
        return max(self.prefill_chunk // 4, 1)

    def _prefill(self) -> None:
        pending = [s for s in self._running() if s.prefilled < len(s.prompt)]
        last_token = [s for s in pending if s.prefilled == len(s.prompt) - 1]
        if last_token:
            self._arm(last_token)
            pending = [s for s in pending if s.prefilled < len(s.prompt)]
        for start in range(0, len(pending), self.prefill_rows):
            seqs = pending[start: start + self.prefill_rows]
            rows = 1 if len(seqs) == 1 else self.prefill_rows
            longest = max(len(s.prompt) - s.prefilled for s in seqs)
            self._dispatch_prefill(seqs, rows, self._small_chunk() if longest <= self._small_chunk()
                                   else self.prefill_chunk)

    def _dispatch_prefill(self, seqs: list[Sequence], rows: int, chunk: int, filters: bool | None = None) -> None:
        tokens, positions, segments = (np.zeros((rows, chunk), np.int32) for _ in range(3))
        table = np.zeros((rows, self.pages_per_row), np.int32)
        slots, completes = np.zeros(rows, np.int32), np.zeros(rows, bool)
        finishing = [None] * rows
        for i, seq in enumerate(seqs):
            end = min(seq.prefilled + chunk, len(seq.prompt))
            self._ensure_pages(seq, end)
            n = end - seq.prefilled
            tokens[i, :n] = seq.prompt[seq.prefilled: end]
            positions[i, :n] = np.arange(seq.prefilled, end)
            segments[i, :n] = 1
            table[i], slots[i] = self.page_table[seq.slot], seq.slot
            seq.prefilled = end
            if end == len(seq.prompt):
                completes[i], finishing[i] = True, seq
                seq.device_tokens = end + 1
                self.active[seq.slot] = True
            self._cache_prompt_pages(seq)
        host_slots = slots[: len(seqs)]
        sampling = {k: v[slots] for k, v in self._sampling.items()}
        table, tokens, positions, segments, slots, completes, sampling = jax.device_put(
            (table, tokens, positions, segments, slots, completes, sampling))  # one transfer
        start = time.perf_counter()
        self.pool, self.state, tok, logprob, more = device_fns.prefill(
            self.decode_cfg, self._filters(host_slots) if filters is None else filters, self.params, self.pool,
            table, tokens, positions, segments, self.state, slots, completes, sampling, self._top(finishing),
            self._masks(finishing, rows))
        self._times["prefill_calls"] += 1
        self._time_call("prefill", rows * chunk, start, tok)
        self._restore_counts([s for s in finishing if s is not None])
        if any(finishing):
            self.inflight.append(_Inflight("prefill", finishing, tok, logprob, None, self.weight_version, more))

    def _arm(self, seqs: list[Sequence]) -> None:
        """Prompts with one token left go straight to decoding (`device_fns.arm`)."""
        slots = np.full(self.max_slots, self.max_slots, np.int32)
        tokens, positions = np.zeros(self.max_slots, np.int32), np.zeros(self.max_slots, np.int32)
        for i, seq in enumerate(seqs):
            slots[i], tokens[i], positions[i] = seq.slot, seq.prompt[-1], len(seq.prompt) - 1
            seq.prefilled = seq.device_tokens = len(seq.prompt)
            self.active[seq.slot] = True
        self.state = device_fns.arm(self.state, *jax.device_put((slots, tokens, positions)))
        self._restore_counts(seqs)

    def _restore_counts(self, seqs: list[Sequence]) -> None:
        """Penalties of retracted sequences count the output they had before (their slot's counts
        were just started over)."""
        carried = [s for s in seqs if s.extras.carried_tokens]
        if not carried or "counts" not in self.state:
            return
        counts = np.stack([np.bincount(s.extras.carried[0], minlength=self.cfg.vocab_size) for s in carried])
        slots = np.array([s.slot for s in carried], np.int32)
        self.state = device_fns.add_counts(self.state, jnp.asarray(slots), jnp.asarray(counts, jnp.int32))

    def _cache_prompt_pages(self, seq: Sequence) -> None:
        """Full prompt pages just dispatched go into the prefix cache (later readers are
        dispatched after the writes, so they see them)."""
        full = seq.prefilled // self.page_size
        if full > len(seq.nodes):
            nodes = self.prefix.insert(seq.prompt[: full * self.page_size], seq.pages[:full])
            self.prefix.lock(nodes[len(seq.nodes):])
            seq.nodes = nodes

    # --- decode --------------------------------------------------------------------------

    def _decode(self) -> bool:
        """Dispatches the next decode call; with a constrained sequence running, the call is one
        step and waits for the tokens before it (each mask follows from the token before)."""
        steps = self.decode_steps
        if self._constrained():
            self._process(keep=0)
            steps = 1
        seqs = [s if s is not None and self.active[s.slot] else None for s in self.slots]
        if not any(seqs):
            return False
        reach = np.zeros(self.max_slots, np.int64)  # tokens whose KV this call may write, per row
        for i, seq in enumerate(seqs):
            if seq is not None:
                final = len(seq.prompt) + seq.max_new
                reach[i] = min(seq.device_tokens + steps, final, self.max_len + 1) - 1
                self._ensure_pages(seq, reach[i])
                seq.device_tokens = min(seq.device_tokens + steps, final)
        self._dispatch_decode(seqs, reach, steps=steps)
        return True

    def _dispatch_decode(self, seqs: list, reach: np.ndarray | None = None, filters: bool | None = None,
                         steps: int | None = None) -> None:
        reach = np.zeros(self.max_slots, np.int64) if reach is None else reach
        entries = self.max_slots * self.pages_per_row
        chunk = max(RAGGED_MIN_CHUNK, -(-entries // RAGGED_CHUNKS))
        ragged = ragged_pages(self.page_table, reach, self.page_size, chunk, -(-entries // chunk))
        active = active_host = np.array([s is not None for s in seqs]) & self.active
        if self._sampling_device is None:
            self._sampling_device = jax.device_put(self._sampling)
        table, ragged, active = jax.device_put((self.page_table, ragged, active))  # one transfer
        filters = self._filters(np.flatnonzero(active_host)) if filters is None else filters
        mask = self._masks(seqs, self.max_slots)
        start = time.perf_counter()
        self.pool, self.state, toks, logprobs, emitted, more = device_fns.decode(
            self.decode_cfg, 1 if mask is not None else steps or self.decode_steps, filters, self.params, self.pool,
            table, ragged, self.state, active, self._sampling_device, self._top(seqs), mask)
        self._times["decode_calls"] += 1
        self._time_call("decode", (int(active_host.sum()), self.max_slots), start, emitted)
        self.inflight.append(_Inflight("decode", seqs, toks, logprobs, emitted, self.weight_version, more))

    def _time_call(self, kind: str, size: Any, start: float, output: jax.Array) -> None:
        if self.call_times is not None:
            jax.block_until_ready(output)
            self.call_times.append((kind, size, time.perf_counter() - start))

    # --- reading results -----------------------------------------------------------------

    def _process(self, keep: int) -> None:
        """Reads the tokens of all but the last `keep` dispatched calls, oldest first."""
        while len(self.inflight) > keep:
            call = self.inflight.popleft()
            start = time.perf_counter()
            tokens, logprobs = np.asarray(call.tokens), np.asarray(call.logprobs)
            emitted = None if call.emitted is None else np.asarray(call.emitted)
            more = {k: np.asarray(v) for k, v in call.extras.items()}
            self._times["device_wait_s"] += time.perf_counter() - start
            for i, seq in enumerate(call.seqs):
                if seq is None or seq.finish is not None:
                    continue
                if call.kind == "prefill":
                    if seq.max_new <= 0:
                        self._finish(seq, {"type": "length", "length": seq.extras.carried_tokens})
                    else:
                        self._append(seq, [int(tokens[i])], [float(logprobs[i])], call.version,
                                     {k: v[i][None] for k, v in more.items()})
                elif emitted[i]:
                    n = int(emitted[i])
                    self._append(seq, tokens[i, :n].tolist(), logprobs[i, :n].tolist(), call.version,
                                 {k: v[i, :n] for k, v in more.items()})

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float], version: int,
                more: dict[str, np.ndarray]) -> None:
        before = len(seq.output)
        reason = seq.accept(tokens, logprobs, version, more)
        self._times["generated_tokens"] += len(seq.output) - before
        if reason is not None:
            self._finish(seq, reason)

    # --- finishing -----------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        if seq.finish is not None:
            return
        seq.finish = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release_slot(seq, cache=reason["type"] != "abort")
        self.finished.append(self._completion(seq, reason))

    def _release_slot(self, seq: Sequence, cache: bool) -> None:
        """Frees a running sequence's slot and pages; with `cache`, the prefix cache keeps the KV
        of every token but the last (all of it is written)."""
        if seq.slot < 0 or self.slots[seq.slot] is not seq:
            return
        self.slots[seq.slot] = None
        self.active[seq.slot] = False
        if cache:
            self.prefix.insert(seq.prompt + seq.output[:-1], seq.pages)
        self.prefix.lock(seq.nodes, -1)
        self.pages.release(seq.pages)
        self._reserved -= seq.budget
        seq.pages, seq.nodes, seq.budget = [], [], 0

    def _completion(self, seq: Sequence, finish: dict[str, Any] | None) -> Completion:
        c = extras_lib.fill(Completion(
            rid=seq.request.rid, prompt_ids=list(seq.prompt), output_ids=list(seq.output),
            output_logprobs=list(seq.logprobs), output_versions=list(seq.versions), finish_reason=finish,
            cached_tokens=seq.cached_tokens, weight_version=self.weight_version), seq.extras, seq.request)
        if self.tokenizer is not None:
            c.text = self.tokenizer.decode(c.output_ids, skip_special_tokens=seq.request.sampling.skip_special_tokens)
            matched = (finish or {}).get("matched")
            if isinstance(matched, str) and not seq.request.sampling.no_stop_trim and matched in c.text:
                c.text = c.text[: c.text.rfind(matched)]
        return c


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _features() -> list[str]:
    """What this engine implements beyond plain sampling (server_protocol.ENGINE_FEATURES)."""
    features = ["penalties", "stop_regex", "prompt_logprobs", "top_logprobs"]
    try:
        import outlines_core  # noqa: F401  (the structured extra)
        features.append("constraints")
    except ImportError:
        pass
    return features
