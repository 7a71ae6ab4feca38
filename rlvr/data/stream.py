"""Deterministic, checkpointable batches over a random-access source of records.

A source is anything with `len()` and `[i]` (a list of JSONL rows, a `tfds.data_source`,
a grain `MapDataset`). Records are visited in a fresh permutation per epoch drawn from the
run's seed; the only state is a cursor per batch row (records that row consumed so far), so a
resumed run continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from rlvr.data.packing import FIELDS, Example, empty_batch, pack_examples


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
    """Packed (or one-per-row) token batches: tokens, positions, segment_ids, loss_mask.

    Row r of every batch is filled from its own share of the record order (visits r, r + B, r + 2B,
    ... for B rows), with its own cursor: a process builds its rows without reading another row's
    records (rlvr.data.shards), and the batches are the same whichever rows a process builds. One
    record per row (`pack=False`) is batch i = records `order[i·B : (i+1)·B]`.

    `one_epoch` (evaluation): a row stops at the end of the first epoch and the rest of it is padding
    (loss weight 0), so every record counts exactly once; training streams wrap into the next epoch."""

    def __init__(self, source: Sequence[Any], encode: Callable[[Any], Example], batch_size: int,
                 seq_len: int, pad_id: int, seed: int, pack: bool = True, shuffle: bool = True,
                 one_epoch: bool = False):
        self.source, self.encode = source, encode
        self.batch_size, self.seq_len, self.pad_id, self.pack = batch_size, seq_len, pad_id, pack
        self.one_epoch = one_epoch
        self.order = RecordOrder(len(source), seed, shuffle)
        self.cursors = [0] * batch_size  # records consumed by each row
        self._read: dict[int, list[int]] = {}  # row -> [first, end) of the visits it read in this process

    def _row_examples(self, row: int):
        visit = self.cursors[row]
        while not (self.one_epoch and row + self.batch_size * visit >= len(self.source)):
            span = self._read.setdefault(row, [visit, visit])
            span[0], span[1] = min(span[0], visit), max(span[1], visit + 1)
            yield self.encode(self.source[self.order[row + self.batch_size * visit]])
            visit += 1

    @property
    def records_read(self) -> int:
        """Distinct records this stream has read (encoded) since it was built or its state was set."""
        return sum(end - first for first, end in self._read.values())

    def next_rows(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """Rows `rows` of the next batch ([len(rows), seq_len] each), advancing only their cursors."""
        out = empty_batch(len(rows), self.seq_len, self.pad_id)
        for i, row in enumerate(rows):
            one, consumed = pack_examples(self._row_examples(row), 1, self.seq_len, self.pad_id, self.pack)
            for key in out:
                out[key][i] = one[key][0]
            self.cursors[row] += consumed
        return out

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next_rows(range(self.batch_size))

    def shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct((self.batch_size, self.seq_len), np.int32) for k in FIELDS}

    def exhausted(self) -> bool:
        """Every row has passed the end of the first epoch (every record visited once)."""
        return all(r + self.batch_size * c >= len(self.source) for r, c in enumerate(self.cursors))

    def get_state(self) -> dict[str, Any]:
        return {"cursors": list(self.cursors)}

    def set_cursors(self, cursors: Sequence[int]) -> None:
        self.cursors = [int(c) for c in cursors]

    def set_state(self, state: dict[str, Any]) -> None:
        if "cursors" in state:
            if len(state["cursors"]) != self.batch_size:
                raise ValueError(f"the checkpoint's data position has {len(state['cursors'])} rows; data.batch_size="
                                 f"{self.batch_size}: resume with the batch size it was written with")
            self.set_cursors(state["cursors"])
        else:  # a checkpoint from before per-row cursors: n records consumed, spread over the rows
            n = int(state["cursor"])
            self.set_cursors([n // self.batch_size + (r < n % self.batch_size) for r in range(self.batch_size)])
        self._read = {}
