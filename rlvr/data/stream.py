"""Deterministic, checkpointable batches over a random-access source of records.

A source is anything with `len()` and `[i]` (a list of JSONL rows, a `tfds.data_source`,
a grain `MapDataset`). Records are visited in a fresh permutation per epoch drawn from the
run's seed; the only state is a cursor (records consumed so far), so a resumed run
continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlvr.data.packing import Example, pack_examples


class RecordOrder:
    """Record index for the k-th visit: epoch e = k // n uses permutation(seed, e)."""

    def __init__(self, size: int, seed: int, shuffle: bool = True):
        if size <= 0:
            raise ValueError("the data source is empty")
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self._cache: tuple[int, np.ndarray] | None = None

    def __getitem__(self, k: int) -> int:
        epoch, offset = divmod(k, self.size)
        if not self.shuffle:
            return offset
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size))
        return int(self._cache[1][offset])


class TokenStream:
    """Packed (or one-per-row) token batches: tokens, positions, segment_ids, loss_mask."""

    def __init__(self, source: Sequence[Any], encode: Callable[[Any], Example], batch_size: int,
                 seq_len: int, pad_id: int, seed: int, pack: bool = True, shuffle: bool = True):
        self.source, self.encode = source, encode
        self.batch_size, self.seq_len, self.pad_id, self.pack = batch_size, seq_len, pad_id, pack
        self.order = RecordOrder(len(source), seed, shuffle)
        self.cursor = 0

    def _examples(self, start: int):
        k = start
        while True:
            yield self.encode(self.source[self.order[k]])
            k += 1

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch, consumed = pack_examples(self._examples(self.cursor), self.batch_size, self.seq_len,
                                        self.pad_id, self.pack)
        self.cursor += consumed
        return batch

    def peek(self) -> dict[str, np.ndarray]:
        """The next batch without advancing (used to build shardings)."""
        return pack_examples(self._examples(self.cursor), self.batch_size, self.seq_len,
                             self.pad_id, self.pack)[0]

    def get_state(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def set_state(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])
