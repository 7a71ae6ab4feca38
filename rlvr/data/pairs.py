"""Preference pairs {"prompt", "chosen", "rejected"} as padded token batches.

Each pair becomes two rows (chosen, rejected) of `prompt + response<eos>`, with the loss
mask on the response. Batch `i` holds pairs `order[i·P : (i+1)·P]`; the state is a cursor.
Optional per-pair reference log-probs (precomputed once) ride along by record index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlvr.data.chat import render_completion, render_prompt
from rlvr.data.packing import empty_batch, pack_examples
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
        self.reference: np.ndarray | None = None  # [num_records, 2] (chosen, rejected) log-probs

    def batch_at(self, cursor: int) -> dict[str, np.ndarray]:
        indices = [self.order[k] for k in range(cursor, cursor + self.pairs_per_batch)]
        batch = pair_batch([encode_pair(self.tokenizer, self.records[i]) for i in indices], self.seq_len,
                           self.tokenizer.pad_id)
        if self.reference is not None:
            batch["ref_chosen"] = self.reference[indices, 0].astype(np.float32)
            batch["ref_rejected"] = self.reference[indices, 1].astype(np.float32)
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch_at(self.cursor)
        self.cursor += self.pairs_per_batch
        return batch

    def peek(self) -> dict[str, np.ndarray]:
        return self.batch_at(self.cursor)

    def get_state(self) -> dict[str, int]:
        return {"cursor": self.cursor}

    def set_state(self, state: dict[str, int]) -> None:
        self.cursor = int(state["cursor"])
