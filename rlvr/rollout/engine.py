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

Reading order: this module (the public API, state, finishing), `slots` (admission, pages, the
sampling table: the `Slots` mixin), `dispatch` (the device calls and reading their tokens: the
`Dispatch` mixin), `device_fns` (the jitted functions themselves).

Compiled shapes are a bounded set (`warmup()` compiles them all up front): prefill [1 or
prefill_rows, prefill_chunk/4 or prefill_chunk], from a 64-token chunk also rows 2, 4, ... and half
chunks (`Dispatch._prefill_shapes`), and the decode programs: its attention runs over a contiguous
per-slot window gathered once per call, cut to what the call's rows reach (one of three window
lengths, `Dispatch.window_buckets`), or loops over the pages held (one program,
`kernels/paged_attention/ragged.py`): `decode_attention`; each x2 when a request uses
top-k/top-p/min-p. `metrics()` reports compile counts, the prefix-cache hit rate and host vs device
time.

Beyond plain sampling (each on only while a running request asks for it, so the plain path
compiles without it): penalties and logit_bias (`logit_process`), constrained decoding (grammar
masks, `grammar`; a batch with a constrained request decodes one token per call), prompt / top /
requested-id log-probs and stop_regex (`extras`, `sequence.Sequence.accept`), pause mode
"retract" and the release / resume of device memory.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlvr.kernels import native_build
from rlvr.kernels.bits import bits_pool
from rlvr.kernels.packed_matmul import native_unavailable_reason as packed_matmul_unavailable_reason
from rlvr.kernels.paged_attention import native_unavailable_reason
from rlvr.kernels.target import target_platform
from rlvr.models.config import ModelConfig
from rlvr.models.transformer import fuse_projections, init_paged_cache, pack_projections, unstack_layers
from rlvr.rollout import device_fns
from rlvr.rollout import extras as extras_lib
from rlvr.rollout import images as images_lib
from rlvr.rollout.compile_check import pool_spec
from rlvr.rollout.dispatch import Dispatch, _Inflight
from rlvr.rollout.pages import PagePool, PrefixCache
from rlvr.rollout.sequence import Sequence, sampling_table
from rlvr.rollout.slots import Slots
from rlvr.rollout.stops import StopStrings
from rlvr.rollout.types import Completion, Request

DECODE_ATTENTION = ("auto", "window", "ragged", "native")
DECODE_MATMUL = ("auto", "native", "xla")
# SGLang's names (first come first served, longest output first) and lof per batch of requests
# submitted together (`Slots._admission_key`)
SCHEDULE_POLICIES = ("batch_lof", "fcfs", "lof")
# "auto" decode attention, where the native kernel cannot run (TPU, GPU, no compiler, a sharded
# engine), uses the contiguous window up to this size (k + v, all layers): the fixed benchmark
# config's 32 slots x 192 tokens is 25 MB; the realistic one's 64 x 1,536, 600 MB.
WINDOW_AUTO_BYTES = 64 * 2**20


class Engine(Slots, Dispatch):
    """Generates completions for `Request`s with the policy `params` (see module docstring).

    dtype / kv_dtype: "float32" (default) or "bfloat16" for the rollout weights and compute /
    the KV pages (then log-probs, still computed in float32 from the logits, no longer equal
    the trainer's float32 ones bit for bit).
    decode_attention: how a decode call attends over the slots' KV. "window": the call gathers
    every slot's pages once into a contiguous [slots, max_len] window and its steps attend over it
    densely (no gather per layer and step; costs slots x max_len per step whatever the rows
    hold); "ragged": each step loops over the pages the rows hold (work follows the lengths,
    with a gather per layer and step); "native": as "ragged", through the C++ XLA:CPU kernel
    (kernels/paged_attention/native.cc, built on first use; 2.85x faster than "ragged" per
    layer-step at the realistic benchmark's shape, 1.25x its generate; 1.04-1.09x the window on
    the fixed config's sampler with the native matmul), CPU only; "auto" (default): "native" on CPU
    with the params on one device where the kernel builds, else "window" when that window (k and v,
    all layers) is at most WINDOW_AUTO_BYTES, else "ragged".
    decode_matmul: how the decode tree's projections are multiplied. "native": float32 weights packed
    once per weight load into column panels and multiplied by the C++ XLA:CPU kernel
    (kernels/packed_matmul, `pack_projections`), where XLA:CPU's matmul packs every weight again at
    every decode step; "xla": plain `x @ w`; "auto" (default): "native" for float32 weights on one
    CPU device with AVX-512 where the kernel builds, else "xla".
    schedule_policy: the order waiting requests take free slots: "fcfs" (submission order), "lof"
    (longest output first: the largest max_new_tokens first, as SGLang's --schedule-policy lof;
    long requests start early instead of running alone at the end of a batch of varied lengths,
    but a stream of long requests can starve a short one) or "batch_lof" (default: lof among the
    requests submitted together, between two steps, as `generate` or an RL step's batch does, and
    those batches in arrival order, so a request never waits for one submitted after it). Draws
    do not depend on the order (sampling is seeded by position), but logits computed beside other
    rows can differ in the last bits and flip a draw; with equal max_new_tokens all three are fcfs.
    prefix_cache: False turns the prefix cache off (SGLang's --disable-radix-cache): every request
    prefills its whole prompt, even a group's samples (for A/B timing, or to rule the cache out)."""

    def __init__(self, cfg: ModelConfig, params, tokenizer=None, *, max_slots: int = 32, max_len: int = 512,
                 page_size: int = 16, num_pages: int | None = None, decode_steps: int = 8,
                 prefill_rows: int = 4, prefill_chunk: int = 64, seed: int = 0, model_path: str = "",
                 dtype: str = "float32", kv_dtype: str | None = None, decode_attention: str = "auto",
                 image_max_pixels: int = 28 * 28 * 1280, schedule_policy: str = "batch_lof",
                 prefix_cache: bool = True, decode_matmul: str = "auto"):
        if max_len % page_size:
            raise ValueError(f"max_len={max_len} must be a multiple of page_size={page_size}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r}: use one of {DECODE_ATTENTION}")
        if decode_matmul not in DECODE_MATMUL:
            raise ValueError(f"decode_matmul={decode_matmul!r}: use one of {DECODE_MATMUL}")
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy={schedule_policy!r}: use one of {SCHEDULE_POLICIES}")
        self.schedule_policy = schedule_policy
        self.cfg, self.tokenizer = cfg, tokenizer
        # Decoding runs the same layers unscanned, on per-layer weights (see unstack_layers), and a
        # tied output projection as its own [E, V] copy (the tied einsum transposes [V, E] per step).
        self.decode_cfg = dataclasses.replace(cfg, scan_layers=False, dtype=dtype, param_dtype=dtype,
                                              tie_word_embeddings=False)
        self.kv_dtype = kv_dtype or dtype
        self._shardings = jax.tree.map(lambda x: x.sharding, params)
        self.native_matmul = self._native_matmul(decode_matmul, dtype)
        # Committed to their devices as `update_weights` commits new ones: uncommitted params (a
        # notebook's jnp arrays) would key every compiled program differently from the updated ones,
        # so the first weight update would recompile them all.
        self.params = self._decode_params(jax.tree.map(jax.device_put, params, self._shardings))
        self.max_slots, self.max_len, self.page_size = max_slots, max_len, page_size
        self.decode_steps, self.prefill_rows, self.prefill_chunk = decode_steps, prefill_rows, prefill_chunk
        self.pages_per_row = max_len // page_size
        window_bytes = 2 * cfg.num_layers * max_slots * max_len * cfg.num_kv_heads * cfg.head_dim * \
            jnp.dtype(self.kv_dtype).itemsize
        self.native_decode = self._native_decode(decode_attention)
        self.decode_window = decode_attention == "window" or (decode_attention == "auto" and not self.native_decode
                                                              and window_bytes <= WINDOW_AUTO_BYTES)
        self.pages = PagePool(num_pages or max_slots * self.pages_per_row + 1)
        self.prefix = PrefixCache(self.pages, page_size, enabled=prefix_cache)
        self.pool = self._new_pool()
        self.page_table = np.zeros((max_slots, self.pages_per_row), np.int32)
        self.state = self.on_mesh(device_fns.init_state(max_slots))
        self.active = np.zeros(max_slots, bool)
        self._sampling = sampling_table(max_slots)
        if cfg.vision is not None:  # decoding after an image prompt: M-RoPE id = position + the prompt's delta
            self._sampling["rope_delta"] = np.zeros(max_slots, np.int32)
        self.image_max_pixels = image_max_pixels
        self._sampling_device = None  # the table on device, refreshed after admissions change it
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.slots: list[Sequence | None] = [None] * max_slots
        self.draining: list[Sequence] = []  # slot given back, last tokens not read yet (`Slots._detach`)
        self.finished: list[Completion] = []
        self.inflight: collections.deque[_Inflight] = collections.deque()
        self.weight_version, self.paused, self.model_path = 0, False, model_path
        self.weights_epoch = 0  # weight updates so far (`update_weights`)
        self.released: set[str] = set()  # device memory given back (release_memory)
        self._host_params = None
        self.seed, self._seed_rng = seed, np.random.default_rng(seed)
        self._reserved = 0  # pages promised to running sequences' worst cases, not yet allocated
        self._times = {"host_s": 0.0, "device_wait_s": 0.0, "steps": 0, "decode_calls": 0, "prefill_calls": 0,
                       "generated_tokens": 0, "decode_loop_steps": 0, "decode_row_steps_paid": 0,
                       "decode_row_steps_used": 0, "decode_window_page_steps": 0}
        # Set to a list to time every device call synchronously (no overlap; for calibration):
        # ("prefill", rows x chunk, s), ("decode", (rows decoding, max_slots, loop steps, used row-steps), s),
        # ("step", 0, host s).
        self.call_times: list[tuple[str, Any, float]] | None = None

    def _new_pool(self) -> dict:
        """An empty page pool on the params' mesh, its KV heads split over the `tensor` axis where it
        divides them (`compile_check.pool_spec`: a tensor-parallel engine keeps each device's heads'
        pages, and the paged kernel's shard_map reads them there). On CPU a bf16 pool is stored as its
        uint16 bits (`rlvr.kernels.bits.bits_pool`): XLA:CPU copies the whole pool at every bitcast of
        a bf16 pool carried through the decode loop (four ~150 MB copies a step at the realistic shape)."""
        pool = {k: v for k, v in init_paged_cache(self.cfg, self.pages.capacity, self.page_size,
                                                  self.kv_dtype).items() if k != "page_table"}
        pool = bits_pool(pool) if target_platform() == "cpu" else pool
        mesh = self._mesh()
        if mesh is None:
            return pool
        return jax.device_put(pool, jax.sharding.NamedSharding(mesh, pool_spec(self.cfg, mesh)))

    def mesh_context(self):
        """The context the device calls are traced in: the params' mesh set (`jax.set_mesh`) when it
        has several devices, so the paged Pallas kernel runs inside a shard_map over it (a Mosaic
        kernel cannot be partitioned by XLA: `kernels/paged_attention/api.sharded_pallas`)."""
        mesh = self._mesh()
        return jax.set_mesh(mesh) if mesh is not None and mesh.size > 1 else contextlib.nullcontext()

    def on_mesh(self, tree):
        """`tree` replicated on the params' mesh, where the device functions return the page pool and
        the decode state: created uncommitted instead, the first call would compile a program that no
        later call (taking the previous call's outputs) uses, and the next call would compile again."""
        mesh = self._mesh()
        if mesh is None:
            return tree
        return jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    def _native_decode(self, decode_attention: str) -> bool:
        """Whether paged decode runs the native CPU kernel: when asked for (an error naming why it
        cannot run here, if so), or by "auto" where it can (not on a multi-device mesh: the custom
        call has no partitioning rule, so XLA would gather the pool onto every device)."""
        if decode_attention not in ("native", "auto"):
            return False  # "ragged" asked for: the kernel is not even built
        reason = native_unavailable_reason()
        if decode_attention == "native" and reason:
            raise ValueError(f"decode_attention='native' cannot run: {reason}; use 'ragged' or 'auto'")
        mesh = self._mesh()
        return decode_attention == "native" or (decode_attention == "auto" and reason is None and
                                                (mesh is None or mesh.size == 1))

    def _native_matmul(self, decode_matmul: str, dtype: str) -> bool:
        """Whether the decode tree's float32 projections are packed for the native matmul
        (`pack_projections`): when asked for (an error naming why it cannot run, if so), or by
        "auto" where it can: float32 weights on one CPU device, the kernel built."""
        if decode_matmul == "xla":
            return False
        reason = packed_matmul_unavailable_reason()
        mesh = self._mesh()
        if reason is None and jnp.dtype(dtype) != jnp.float32:
            reason = f"it multiplies float32 weights and the engine's dtype is {dtype!r}"
        if reason is None and mesh is not None and mesh.size > 1:
            reason = f"the params are on a {mesh.size}-device mesh (the custom call has no partitioning rule)"
        if decode_matmul == "native" and reason:
            raise ValueError(f"decode_matmul='native' cannot run: {reason}; use 'xla' or 'auto'")
        if decode_matmul == "auto" and reason is None and not native_build.cpu_has("avx512f"):
            # the kernel's 16-float vectors are one AVX-512 register; without AVX-512 the compiler emulates
            # them and the kernel ran ~25x slower than XLA's matmul (AMD EPYC with AVX2, 2026-12-07:
            # benchmarks/results/decode_matmul_cpu.json)
            return False
        return reason is None

    def _mesh(self) -> jax.sharding.Mesh | None:
        """The params' mesh (None when they are not on one)."""
        sharding = jax.tree.leaves(self._shardings)[0]
        return sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None

    def _decode_params(self, params):
        params = unstack_layers(params)
        if self.cfg.tie_word_embeddings:
            params["lm_head"] = {"kernel": params["embed_tokens"].T}
        dtype = jnp.dtype(self.decode_cfg.param_dtype)
        params = fuse_projections(jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                                               else x, params))
        return pack_projections(params) if self.native_matmul else params

    # --- public API ----------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if request.sampling.n != 1:
            raise ValueError("Engine.submit takes n=1 requests; expand n into separate rids")
        if not request.input_ids:
            raise ValueError(f"request {request.rid}: empty input_ids")
        image = None
        if request.image_data:
            ids, image = images_lib.prepare(self.decode_cfg, self.params, request.input_ids, request.image_data,
                                            self.image_max_pixels, self.weights_epoch)
            request = dataclasses.replace(request, input_ids=ids)
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
                       extras=extras_lib.prepare(request, self.tokenizer, self.cfg.vocab_size), image=image,
                       arrival=self._times["steps"])
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
        images = None
        if seq.image is not None:  # the full VLM over the prompt (padding: segment 0, no placeholders)
            from rlvr.models.vision import image_inputs

            capacity = len(seq.image.features) * self.cfg.vision.merge_unit
            images = image_inputs(self.cfg.vision, [seq.image.patches], [seq.image.grids], tokens[None],
                                  (np.arange(len(tokens)) < n).astype(np.int32)[None], capacity)
        own, top = device_fns.score(self.decode_cfg, extras_lib.top_bucket(request.top_logprobs_num), self.params,
                                    jnp.asarray(tokens), None if ids is None else jnp.asarray(ids), images)
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
        """Runs `requests` to completion; results in request order. Completions of requests
        submitted before (with `submit`) that finish meanwhile are kept for the next `step()`."""
        results, others = run_requests(self, requests)
        self.finished = others + self.finished
        return results

    def snapshot(self, rid: str) -> Completion | None:
        for seq in self._live():
            if seq.request.rid == rid:
                return self._completion(seq, finish=None)
        return None

    def abort(self, rid: str, message: str = "aborted") -> None:
        for seq in list(self.waiting) + self._live():
            if seq.request.rid == rid:
                self._finish(seq, {"type": "abort", "message": message, "status_code": 200})

    def abort_all(self, message: str = "aborted") -> None:
        for seq in list(self.waiting) + self._live():
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
            self.pool = self._new_pool()
        if "weights" in tags and "weights" in self.released:
            host, shardings = self._host_params
            self.params, self._host_params = jax.tree.map(jax.device_put, host, shardings), None
        self.released -= set(tags)

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, params, version: int) -> None:
        """New params (resharded to the current ones' shardings); in-flight sequences keep
        their caches and continue with the new weights; tokens are tagged by version. The prefix
        cache is emptied: its pages hold the old weights' KV."""
        params = jax.tree.map(jax.device_put, params, self._shardings)
        self.install_weights(self._decode_params(params), version)

    def install_weights(self, decode_params, version: int) -> None:
        """`update_weights` with params already in the engine's decode layout (another engine's
        `params`: replicas share one copy, `rlvr.rollout.replicas`)."""
        self._process(keep=0)  # tokens of calls already dispatched belong to the old version
        # Cached pages hold the old weights' KV: a new request must not reuse them (SGLang flushes its
        # cache on a weight update too); sequences placed before now never insert theirs.
        self.prefix.forget()
        self.weights_epoch += 1
        self.params = decode_params
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
        return bool(self.waiting or self._live() or self.finished or self.inflight)

    @property
    def num_running(self) -> int:
        return len(self._live())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "model_type": self.cfg.family, "is_generation": True,
                "vocab_size": self.cfg.vocab_size, "weight_version": str(self.weight_version),
                "max_len": self.max_len, "architectures": [self.cfg.family],
                "features": _features() + (["images"] if self.cfg.vision is not None else []),
                "server_args": self.server_args()}

    def server_args(self) -> dict[str, Any]:
        """The engine's sizes under SGLang's server-arg names (its `/server_info` reports them)."""
        return {"max_running_requests": self.max_slots, "context_length": self.max_len, "page_size": self.page_size,
                "max_total_num_tokens": (self.pages.capacity - 1) * self.page_size,
                "chunked_prefill_size": self.prefill_chunk, "dtype": str(jnp.dtype(self.decode_cfg.dtype)),
                "kv_cache_dtype": str(jnp.dtype(self.kv_dtype)), "schedule_policy": self.schedule_policy,
                "random_seed": self.seed, "dp_size": 1,
                "tp_size": 1 if self._mesh() is None else self._mesh().shape.get("tensor", 1),
                "disable_radix_cache": not self.prefix.enabled, "attention_backend": self.attention_backend()}

    def attention_backend(self) -> str:
        """What decode calls attend with: "window", "native", or the page list's kernel ("pallas" on
        TPU, else "ragged")."""
        if self.decode_window or self.native_decode:
            return "window" if self.decode_window else "native"
        return "pallas" if target_platform() == "tpu" else "ragged"

    def metrics(self) -> dict[str, Any]:
        """Compile counts, prefix-cache hits, host vs device-wait time, calls and tokens so far, and
        the decode loops' steps, row-steps computed and used, and window pages x steps
        (`Dispatch._count_decode`)."""
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
            row_sizes, chunk_sizes = self._prefill_shapes()
            shapes = [(rows, chunk) for rows in row_sizes for chunk in chunk_sizes]
            for rows, chunk in shapes:
                self._dispatch_prefill([], rows, chunk, variant)
            for pages in self.window_buckets():
                reach = np.full(self.max_slots, pages * self.page_size - 1) if self.decode_window else None
                self._dispatch_decode([None] * self.max_slots, reach, filters=variant)
        self._process(keep=0)

    def _eos_id(self) -> int | None:
        return None if self.tokenizer is None else self.tokenizer.eos_id

    # --- finishing -----------------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        if seq.finish is not None:
            return
        seq.finish = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release_slot(seq, cache=reason["type"] != "abort")
        self.finished.append(self._completion(seq, reason))

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


def _features() -> list[str]:
    """What this engine implements beyond plain sampling (server_protocol.ENGINE_FEATURES)."""
    features = ["penalties", "stop_regex", "prompt_logprobs", "top_logprobs"]
    try:
        import outlines_core  # noqa: F401  (the structured extra)
        features.append("constraints")
    except ImportError:
        pass
    return features


def run_requests(engine, requests: list[Request]) -> tuple[list[Completion], list[Completion]]:
    """Submits `requests` to `engine` (an Engine or ReplicatedEngine) and steps it until they are
    done: (their completions in request order, the other completions that came meanwhile)."""
    for request in requests:
        engine.submit(request)
    wanted, results, others = {r.rid for r in requests}, {}, []
    while len(results) < len(wanted):
        if engine.paused:
            raise RuntimeError("engine is paused; resume() before generate()")
        for completion in engine.step():
            if completion.rid in wanted:
                results[completion.rid] = completion
            else:
                others.append(completion)
    return [results[r.rid] for r in requests], others
