"""The engine's device calls and the reading of their results (a mixin of `rlvr.rollout.engine.Engine`).

Per `Engine.step`: `_prefill` dispatches one chunk of every unfinished prompt, in the smallest
compiled shape that holds them (a chunk that ends its prompt samples the first token and arms the
slot's on-device decode state; a prompt with one token left is armed directly, `_arm`); `_decode`
dispatches `decode_steps` decode steps for every running sequence in one device call
(`device_fns.decode`; fewer when that lets waiting requests take freed slots sooner,
`_refill_steps`), continuing from the state the previous call left; `_process` then reads all
but the newest call's tokens, so the host's bookkeeping overlaps the device's next call. A batch
with a constrained (grammar) request decodes one token per call and waits for the tokens before it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlvr.kernels.paged_attention import NativeDecode, ragged_pages
from rlvr.rollout import device_fns
from rlvr.rollout import extras as extras_lib
from rlvr.rollout.sequence import Sequence

PREFILL_BUCKETS_FROM = 64  # prefill_chunk from which prefill calls also have intermediate shapes
# A decode call is cut short to refill slots when that saves this many steps of every slot: about the
# extra decode call, prefill call and host step it costs (~6 + 3 + 4 ms on the fixed config vs
# ~4-5 ms a step; `Dispatch._refill_steps`).
REFILL_CUT_STEPS = 2


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
    window_pages: int = 0  # decode: the pages of KV each row's attention reads per step (its window or table)


class Dispatch:
    """Prefill and decode dispatch, and the reading of their tokens (see the module docstring)."""

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
        """Whether any of these rows asks for top-k, top-p, min-p or min_new_tokens (compiles the
        filter paths and the stop-token mask; RL's plain sampling runs without either)."""
        table = self._sampling
        return bool(np.any((table["top_k"][slots] > 0) | (table["top_p"][slots] < 1) | (table["min_p"][slots] > 0)
                           | (table["min_new"][slots] > 0)))

    def _prefill_shapes(self) -> tuple[list[int], list[int]]:
        """The compiled prefill shapes: rows 1 and prefill_rows x chunks of a quarter and all of
        prefill_chunk; with a chunk of PREFILL_BUCKETS_FROM tokens or more, also rows 2, 4, ...
        and half chunks (their padding then costs more than the extra programs' compiles). A call
        takes the smallest that holds its prompts (a few rows admitted into freed slots, short
        prompts: little padding)."""
        rows, chunks = {1, self.prefill_rows}, {max(self.prefill_chunk // 4, 1), self.prefill_chunk}
        if self.prefill_chunk >= PREFILL_BUCKETS_FROM:
            rows |= {1 << i for i in range(self.prefill_rows.bit_length()) if 1 << i < self.prefill_rows}
            chunks.add(self.prefill_chunk // 2)
        return sorted(rows), sorted(chunks)

    def _prefill(self) -> None:
        pending = [s for s in self._running() if s.prefilled < len(s.prompt)]
        last_token = [s for s in pending if s.prefilled == len(s.prompt) - 1]
        if last_token:
            self._arm(last_token)
            pending = [s for s in pending if s.prefilled < len(s.prompt)]
        row_sizes, chunk_sizes = self._prefill_shapes()
        for start in range(0, len(pending), self.prefill_rows):
            seqs = pending[start: start + self.prefill_rows]
            longest = max(len(s.prompt) - s.prefilled for s in seqs)
            chunk = next((c for c in chunk_sizes if c >= longest), chunk_sizes[-1])
            self._dispatch_prefill(seqs, next(r for r in row_sizes if r >= len(seqs)), chunk)

    def _dispatch_prefill(self, seqs: list[Sequence], rows: int, chunk: int, filters: bool | None = None) -> None:
        tokens, positions, segments = (np.zeros((rows, chunk), np.int32) for _ in range(3))
        table = np.zeros((rows, self.pages_per_row), np.int32)
        slots, completes = np.zeros(rows, np.int32), np.zeros(rows, bool)
        finishing = [None] * rows
        images = self._image_chunk(seqs, rows, chunk)
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
        start = time.perf_counter()
        with self.mesh_context():
            self.pool, self.state, tok, logprob, more = device_fns.prefill(
                self.decode_cfg, self._filters(host_slots) if filters is None else filters, self.params, self.pool,
                table, tokens, positions, segments, self.state, slots, completes, sampling, self._top(finishing),
                self._masks(finishing, rows), images, NativeDecode() if self.native_decode else None)
        self._times["prefill_calls"] += 1
        self._time_call("prefill", rows * chunk, start, tok)
        self._restore_counts([s for s in finishing if s is not None])
        if any(finishing):
            self.inflight.append(_Inflight("prefill", finishing, tok, logprob, None, self.weight_version, more))

    def _image_chunk(self, seqs: list[Sequence], rows: int, chunk: int) -> tuple | None:
        """A VLM's prefill inputs for the next chunk of each row (before `prefilled` moves): M-RoPE
        ids [R, C, 3] (text: its position thrice) and, when a row has images, the placeholders'
        features [R, C, E] gathered from each prompt's encoded images and where they go [R, C]."""
        if self.cfg.vision is None:
            return None
        rope = np.zeros((rows, chunk, 3), np.int32)
        index, is_image = np.zeros((rows, chunk), np.int32), np.zeros((rows, chunk), bool)
        for i, seq in enumerate(seqs):
            end = min(seq.prefilled + chunk, len(seq.prompt))
            n = end - seq.prefilled
            if seq.image is None:
                rope[i, :n] = np.arange(seq.prefilled, end)[:, None]
                continue
            if seq.image.epoch != self.weights_epoch:  # weights changed since its images were encoded
                seq.image = seq.image.encoded(self.decode_cfg, self.params, self.weights_epoch)
            rope[i, :n], index[i, :n] = seq.image.chunk(seq.prefilled, end)
            is_image[i, :n] = np.asarray(seq.prompt[seq.prefilled:end]) == self.cfg.vision.image_token_id
        width = self.cfg.hidden_size
        features = [jnp.take(seqs[i].image.features, jnp.asarray(index[i]), axis=0)
                    if i < len(seqs) and seqs[i].image is not None and is_image[i].any()
                    else jnp.zeros((chunk, width), self.decode_cfg.dtype) for i in range(rows)]
        return jax.device_put(rope), jnp.stack(features), jax.device_put(is_image)

    def _arm(self, seqs: list[Sequence]) -> None:
        """Prompts with one token left go straight to decoding (`device_fns.arm`)."""
        slots = np.full(self.max_slots, self.max_slots, np.int32)
        tokens, positions = np.zeros(self.max_slots, np.int32), np.zeros(self.max_slots, np.int32)
        for i, seq in enumerate(seqs):
            slots[i], tokens[i], positions[i] = seq.slot, seq.prompt[-1], len(seq.prompt) - 1
            seq.prefilled = seq.device_tokens = len(seq.prompt)
            self.active[seq.slot] = True
        self.state = device_fns.arm(self.state, slots, tokens, positions)
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
            nodes = self.prefix.insert(seq.key[: full * self.page_size], seq.pages[:full])
            self.prefix.lock(nodes[len(seq.nodes):])
            seq.nodes = nodes

    def _decode(self) -> bool:
        """Dispatches the next decode call; with a constrained sequence running, the call is one
        step and waits for the tokens before it (each mask follows from the token before; the same
        program runs, with `device_fns.decode`'s traced `limit`). While requests wait for a slot,
        the call may end early so that slots its rows free take them sooner (`_refill_steps`)."""
        steps = self.decode_steps
        if self._constrained():
            self._process(keep=0)
            steps = 1
        seqs = [s if s is not None and self.active[s.slot] else None for s in self.slots]
        if not any(seqs):
            return False
        if self.waiting and steps > 1:
            steps = self._refill_steps(seqs, steps)
        reach = np.zeros(self.max_slots, np.int64)  # tokens whose KV this call may write, per row
        for i, seq in enumerate(seqs):
            if seq is not None:
                final = len(seq.prompt) + seq.max_new
                reach[i] = min(seq.device_tokens + steps, final, self.max_len + 1) - 1
                self._ensure_pages(seq, reach[i])
                seq.device_tokens = min(seq.device_tokens + steps, final)
        self._dispatch_decode(seqs, reach, steps=steps)
        for seq in seqs:  # rows this call ends (max_new_tokens): their slots take new requests next step
            if seq is not None and seq.device_tokens == len(seq.prompt) + seq.max_new:
                self._detach(seq)
        return True

    def _refill_steps(self, seqs: list, steps: int) -> int:
        """The steps of a decode call while requests wait for a slot: cut short at the step s that
        lets the most row-steps be used (rows whose max_new_tokens ends by s, up to the requests
        waiting, x the steps left after s: their slots take waiting requests instead of idling),
        when that is at least REFILL_CUT_STEPS steps of every slot (what the extra calls cost).
        Cutting at the first row's end whatever the gain made 1.6x the calls and was slower
        (benchmarks/results/rollout_fixed.json, 11:22Z)."""
        left = np.sort([len(s.prompt) + s.max_new - s.device_tokens for s in seqs if s is not None])
        best, best_gain = steps, 0
        for at in np.unique(left[left < steps]):
            gain = min(int(np.sum(left <= at)), len(self.waiting)) * (steps - int(at))
            if gain > best_gain:
                best, best_gain = int(at), gain
        return best if best_gain >= REFILL_CUT_STEPS * self.max_slots else steps

    def _dispatch_decode(self, seqs: list, reach: np.ndarray | None = None, filters: bool | None = None,
                         steps: int | None = None) -> None:
        reach = np.zeros(self.max_slots, np.int64) if reach is None else reach
        ragged = None if self.decode_window else NativeDecode() if self.native_decode else \
            ragged_pages(self.page_table, reach, self.page_size)
        active = np.array([s is not None for s in seqs]) & self.active
        # NumPy arrays go to the jitted call as they are (its C++ path transfers them: ~5x less host time
        # than a Python device_put), as copies: on CPU an aligned host array may be aliased and a large
        # one copied in the background (benchmarks/results/host_aliasing_probe.json), and the host
        # edits these tables.
        if self._sampling_device is None:
            self._sampling_device = jax.device_put({k: v.copy() for k, v in self._sampling.items()})
        pages = self._window_pages(reach) if self.decode_window else self.pages_per_row
        table = self.page_table[:, :pages] if self.decode_window else self.page_table
        table = table.copy()
        filters = self._filters(np.flatnonzero(active)) if filters is None else filters
        mask = self._masks(seqs, self.max_slots)
        start = time.perf_counter()
        limit = jnp.int32(1 if mask is not None else steps or self.decode_steps)
        with self.mesh_context():
            self.pool, self.state, toks, logprobs, emitted, more = device_fns.decode(
                self.decode_cfg, self.decode_steps, filters, self.params, self.pool, table, ragged, self.state,
                active, self._sampling_device, self._top(seqs), mask, limit)
        self._times["decode_calls"] += 1
        self._time_call("decode", (int(active.sum()), self.max_slots), start, emitted)
        self.inflight.append(_Inflight("decode", seqs, toks, logprobs, emitted, self.weight_version, more, pages))

    def window_buckets(self) -> list[int]:
        """The page counts a decode call's window may have (one decode program each): the smallest
        powers of two from a quarter and from half a row's pages, and the row's pages. A window
        attends over all of its columns each step, so it is cut to the smallest one that holds what
        the call's rows may reach (the fixed benchmark's 64 + 64 tokens: 8 of 12 pages, a third less
        KV read; varied lengths, where a batch refilled with short outputs often fits a quarter).
        Three lengths, not more: each is a decode program, compiled by `warmup`."""
        if not self.decode_window:
            return [self.pages_per_row]
        cuts = {1 << (-(-self.pages_per_row // part) - 1).bit_length() for part in (4, 2)}
        return sorted({c for c in cuts if c < self.pages_per_row} | {self.pages_per_row})

    def _window_pages(self, reach: np.ndarray) -> int:
        """The smallest window bucket holding positions 0..reach of every row (a reach of max_len,
        a token past the row's capacity, is never written)."""
        needed = -(-(int(reach.max()) + 1) // self.page_size)
        return next((b for b in self.window_buckets() if b >= needed), self.pages_per_row)

    def _time_call(self, kind: str, size: Any, start: float, output: jax.Array) -> None:
        """With `call_times` on, waits for the call and records (kind, size, seconds); a decode
        call's size gains its loop steps and used row-steps (from `output`, its tokens per row)."""
        if self.call_times is not None:
            jax.block_until_ready(output)
            seconds = time.perf_counter() - start
            if kind == "decode":
                emitted = np.asarray(output)
                size = (*size, int(emitted.max(initial=0)), int(emitted.sum()))
            self.call_times.append((kind, size, seconds))

    def _process(self, keep: int) -> None:
        """Reads the tokens of all but the last `keep` dispatched calls, oldest first."""
        while len(self.inflight) > keep:
            call = self.inflight.popleft()
            start = time.perf_counter()
            tokens, logprobs = np.asarray(call.tokens), np.asarray(call.logprobs)
            emitted = None if call.emitted is None else np.asarray(call.emitted)
            more = {k: np.asarray(v) for k, v in call.extras.items()}
            self._times["device_wait_s"] += time.perf_counter() - start
            if emitted is not None:
                self._count_decode(call, emitted)
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

    def _count_decode(self, call: _Inflight, emitted: np.ndarray) -> None:
        """Counts of a read decode call (`Engine.metrics`): the loop's steps (its longest row's
        tokens), the row-steps they computed (every slot runs each step) and used (tokens
        emitted), and the window pages x steps attended (per row; the ragged path: the table's)."""
        steps = int(emitted.max(initial=0))
        self._times["decode_loop_steps"] += steps
        self._times["decode_row_steps_paid"] += steps * len(emitted)
        self._times["decode_row_steps_used"] += int(emitted.sum())
        self._times["decode_window_page_steps"] += steps * call.window_pages

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[float], version: int,
                more: dict[str, np.ndarray]) -> None:
        before = len(seq.output)
        reason = seq.accept(tokens, logprobs, version, more)
        self._times["generated_tokens"] += len(seq.output) - before
        if reason is not None:
            self._finish(seq, reason)
