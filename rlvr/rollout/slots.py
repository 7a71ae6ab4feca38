"""The engine's slot and page bookkeeping (a mixin of `rlvr.rollout.engine.Engine`, which owns the state).

Admission (`_admit`): a waiting request takes a free slot when the pool can hold its worst case
(pages reserved, not yet allocated; the prefix cache gives back least-recently-used pages when
needed). Its prompt's cached full pages are shared (`pages.PrefixCache`), and a request whose
prompt equals a running one's also copies its partly filled last page. Pages are allocated as
the device calls reach them (`_ensure_pages`) and the host page table follows. Each slot's
sampling parameters are one row of the table the device functions read (`sequence.sampling_table`;
penalty arrays and requested log-prob ids join it only while a running request needs them).
"""

from __future__ import annotations

import collections
import math

import jax.numpy as jnp
import numpy as np

from rlvr.rollout import device_fns
from rlvr.rollout.sequence import Sequence, penalty_arrays, write_sampling_row
from rlvr.rollout.types import Request


class Slots:
    """Slot, page and sampling-table bookkeeping of the engine (see the module docstring)."""

    def _running(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None]

    def _live(self) -> list[Sequence]:
        """Running and draining sequences: every one not finished yet."""
        return self._running() + self.draining

    def _admit(self) -> None:
        if self.schedule_policy != "fcfs" and len(self.waiting) > 1 and None in self.slots:
            self.waiting = collections.deque(sorted(self.waiting, key=self._admission_key))  # stable
        deferred = collections.deque()
        while self.waiting and None in self.slots:
            seq = self.waiting.popleft()
            nodes = self.prefix.match(seq.key[:-1])
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

    def _admission_key(self, seq: Sequence) -> tuple[int, int]:
        """The order of `schedule_policy`: "lof" the largest max_new_tokens first; "batch_lof" the
        same within each batch of requests submitted between two steps, batches in arrival order
        (a request never waits for one submitted after it; with equal caps it is fcfs)."""
        return (seq.arrival if self.schedule_policy == "batch_lof" else 0, -seq.max_new)

    def _place(self, seq: Sequence, nodes: list, twin: Sequence | None, budget: int) -> None:
        slot = self.slots.index(None)
        seq.slot, self.slots[slot] = slot, seq
        seq.budget, seq.weights_epoch = budget, self.weights_epoch
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
        for other in self._running() if self.prefix.enabled else ():
            if other.prefilled >= len(other.prompt) or other.weights_epoch != self.weights_epoch:
                continue
            usable = min(_common_prefix(seq.key, other.key), len(seq.prompt) - 1)
            if other.prefilled < usable and (usable == len(seq.prompt) - 1 or usable - cached >= self.page_size):
                return True
        return False

    def _twin(self, seq: Sequence) -> Sequence | None:
        """A running sequence with the same prompt (and images) whose prompt (but the last token) is
        written (none without the prefix cache: its partial page would be shared KV too)."""
        for other in self._running() if self.prefix.enabled else ():
            if (other.key == seq.key and other.prefilled >= len(seq.prompt) - 1
                    and other.weights_epoch == self.weights_epoch):
                return other
        return None

    def _copy_partial_page(self, seq: Sequence, twin: Sequence) -> None:
        """The twin's partly filled prompt page, copied (copy-on-write): only the last prompt
        token is recomputed, its logits giving this sample's own first token."""
        index = len(seq.pages)
        (page,) = self._allocate(seq, 1)
        self.pool = device_fns.copy_pages(self.pool, np.asarray([twin.pages[index]], np.int32),
                                          np.asarray([page], np.int32))  # numpy: no eager device op
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

    def _release_slot(self, seq: Sequence, cache: bool) -> None:
        """Frees a running (or draining, `_detach`) sequence's slot and pages; with `cache`, the
        prefix cache keeps the KV of every token but the last (all of it is written)."""
        if seq in self.draining:
            self.draining.remove(seq)
        elif seq.slot >= 0 and self.slots[seq.slot] is seq:
            self._detach(seq)
            self.draining.remove(seq)
        else:
            return
        if cache and seq.weights_epoch == self.weights_epoch:  # KV of older weights is not cached
            self.prefix.insert(seq.key + seq.output[:-1], seq.pages)
        self.prefix.lock(seq.nodes, -1)
        self.pages.release(seq.pages)
        self._reserved -= seq.budget
        seq.pages, seq.nodes, seq.budget = [], [], 0

    def _detach(self, seq: Sequence) -> None:
        """Gives a running sequence's slot back (the next admission may take it) while the
        sequence keeps its pages until its last tokens are read (`draining`): the device calls
        already dispatched still write them, and the prefix cache takes them only once the
        output is known (`_release_slot`)."""
        self.slots[seq.slot] = None
        self.active[seq.slot] = False
        self.draining.append(seq)

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
            self.state = {**self.state, "counts": self.on_mesh(jnp.zeros((slots, vocab), jnp.int32))}
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


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
