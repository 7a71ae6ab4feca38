"""Preference pairs {"prompt", "chosen", "rejected"} as padded token batches.

Each pair becomes two rows (chosen, rejected) of `prompt + response<eos>`, with the loss
mask on the response. Batch `i` holds pairs `order[i·P : (i+1)·P]`; the state is a cursor.
Optional per-pair reference log-probs (precomputed once) ride along by record index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from rlvr.data.chat import render_completion, render_prompt
from rlvr.data.packing import FIELDS, empty_batch, pack_examples
from rlvr.data.stream import RecordOrder
from rlvr.models.tokenizer import Tokenizer

PairExample = tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]


def encode_pair(tokenizer: Tokenizer, record: dict[str, Any]) -> PairExample:
    missing = {"prompt", "chosen", "rejected"} - set(record)
    if missing:
        raise ValueError(f"preference record is missing {sorted(missing)}; it needs prompt, chosen, rejected")
    prompt = render_prompt(tokenizer, record["prompt"])

    def side(response) -> tuple[list[int], list[int]]:
        ids = render_completion(tokenizer, response)
        return prompt + ids, [0] * len(prompt) + [1] * len(ids)

    return side(record["chosen"]), side(record["rejected"])


def pair_batch(pairs: Sequence[PairExample], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """{chosen_*, rejected_*} arrays [P, seq_len]; responses cut to fit are truncated."""
    batch = {}
    for side, name in ((0, "chosen"), (1, "rejected")):
        rows = empty_batch(len(pairs), seq_len, pad_id)
        for i, pair in enumerate(pairs):
            one, _ = pack_examples([pair[side]], 1, seq_len, pad_id, pack=False)
            for k in rows:
                rows[k][i] = one[k][0]
        batch.update({f"{name}_{k}": v for k, v in rows.items()})
    return batch


class PairStream:
    def __init__(self, records: Sequence[dict[str, Any]], tokenizer: Tokenizer, pairs_per_batch: int,
                 seq_len: int, seed: int, shuffle: bool = True):
        self.records, self.tokenizer = records, tokenizer
        self.pairs_per_batch, self.seq_len = pairs_per_batch, seq_len
        self.order = RecordOrder(len(records), seed, shuffle)
        self.cursor = 0
        self.records_read = 0  # pairs this stream has read (rows of batches it built)
        self.reference: np.ndarray | None = None  # [num_records, 2] (chosen, rejected) log-probs

    def batch_at(self, cursor: int, rows: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """The batch of pairs `order[cursor : cursor + P]` (only its `rows`, when given)."""
        rows = range(self.pairs_per_batch) if rows is None else rows
        indices = [self.order[cursor + r] for r in rows]
        batch = pair_batch([encode_pair(self.tokenizer, self.records[i]) for i in indices], self.seq_len,
                           self.tokenizer.pad_id)
        if self.reference is not None:
            batch["ref_chosen"] = self.reference[indices, 0].astype(np.float32)
            batch["ref_rejected"] = self.reference[indices, 1].astype(np.float32)
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return self.next_rows(range(self.pairs_per_batch))

    def next_rows(self, rows: Sequence[int]) -> dict[str, np.ndarray]:
        """Pairs `rows` of the next batch (rlvr.data.shards: a process reads only its rows' pairs)."""
        batch = self.batch_at(self.cursor, rows)
        self.cursor += self.pairs_per_batch
        self.records_read += len(rows)
        return batch

    def shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        rows = jax.ShapeDtypeStruct((self.pairs_per_batch, self.seq_len), np.int32)
        out = {f"{side}_{k}": rows for side in ("chosen", "rejected") for k in FIELDS}
        if self.reference is not None:
            out.update({k: jax.ShapeDtypeStruct((self.pairs_per_batch,), np.float32)
                        for k in ("ref_chosen", "ref_rejected")})
        return out

    def get_state(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def set_state(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])
        self.records_read = 0
