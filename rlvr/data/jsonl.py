"""Plain-text documents from JSONL (`{"text": ...}` or `{"prompt": ..., "completion": ...}`).

One document per row (truncated or padded to `seq_len`), shuffled per epoch with the run's
seed; batch `i` is a pure function of `(seed, i)` so the data position is the batch index.
"""

from __future__ import annotations

import json

import numpy as np

from rlvr.data.packing import pack_examples


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}).") from None
    if not rows:
        raise ValueError(f"{path}: no records.")
    return rows


class JsonlTextData:
    def __init__(self, path: str, tokenizer, batch_size: int, seq_len: int, seed: int):
        self.examples = [self._encode(row, tokenizer, path, i) for i, row in enumerate(read_jsonl(path))]
        self.tokenizer, self.batch_size, self.seq_len, self.seed = tokenizer, batch_size, seq_len, seed
        self.next_batch = 0

    @staticmethod
    def _encode(row: dict, tokenizer, path: str, index: int) -> tuple[list[int], list[int]]:
        if "text" in row:
            ids = tokenizer.encode(row["text"]) + [tokenizer.eos_id]
            return ids, [1] * len(ids)
        if "prompt" in row and "completion" in row:
            p = tokenizer.encode(row["prompt"])
            c = tokenizer.encode(row["completion"]) + [tokenizer.eos_id]
            return p + c, [0] * len(p) + [1] * len(c)
        raise ValueError(f"{path} record {index}: needs a 'text' field or 'prompt' and 'completion'.")

    def batch(self, index: int) -> dict[str, np.ndarray]:
        n = len(self.examples)
        picks = []
        for k in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, offset = divmod(k, n)
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
            picks.append(self.examples[order[offset]])
        # One example per row: pack with a row length that cannot hold two.
        rows = [pack_examples([ex], 1, self.seq_len, self.tokenizer.pad_id) for ex in picks]
        return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.batch(self.next_batch)
        self.next_batch += 1
        return batch

    def get_state(self) -> dict[str, int]:
        return {"next_batch": self.next_batch}

    def set_state(self, state: dict[str, int]) -> None:
        self.next_batch = int(state["next_batch"])
