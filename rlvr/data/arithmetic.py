"""A synthetic, deterministic arithmetic corpus ("37+58=95"), the built-in data for tiny runs.

Batch `i` is a pure function of `(seed, i)`, so the data position is just the next batch
index: checkpointing it resumes exactly where a run stopped.
"""

from __future__ import annotations

import jax
import numpy as np

from rlvr.data.packing import FIELDS, pack_examples


def arithmetic_problem(rng: np.random.Generator, max_operand: int) -> tuple[str, str]:
    a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
    return f"{a}+{b}=", str(a + b)


class ArithmeticData:
    """Packed batches of `prompt answer<eos>` sequences; the loss covers answer and eos."""

    def __init__(self, tokenizer, batch_size: int, seq_len: int, seed: int, max_operand: int = 99):
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.max_operand = max_operand
        self.next_batch = 0

    def problems(self, count: int, stream: int) -> list[tuple[str, str]]:
        """`count` problems from an independent stream (stream 1 is the held-out set)."""
        rng = np.random.default_rng([self.seed, stream, 0])
        return [arithmetic_problem(rng, self.max_operand) for _ in range(count)]

    def batch(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, 0, index])
        examples = []
        # Enough problems to fill every row; leftovers are dropped.
        for _ in range(self.batch_size * max(1, self.seq_len // 6)):
            prompt, answer = arithmetic_problem(rng, self.max_operand)
            p = self.tokenizer.encode(prompt)
            a = self.tokenizer.encode(answer) + [self.tokenizer.eos_id]
            examples.append((p + a, [0] * len(p) + [1] * len(a)))
        return pack_examples(examples, self.batch_size, self.seq_len, self.tokenizer.pad_id)[0]

    def shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct((self.batch_size, self.seq_len), np.int32) for k in FIELDS}

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
