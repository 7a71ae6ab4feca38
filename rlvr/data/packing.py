"""Sequence packing into fixed [batch, seq_len] rows with segment ids."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

Example = tuple[list[int], list[int]]  # (token ids, loss mask)
FIELDS = ("tokens", "positions", "segment_ids", "loss_mask")


def empty_batch(batch_size: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    out = {k: np.zeros((batch_size, seq_len), np.int32) for k in FIELDS}
    out["tokens"][:] = pad_id
    return out


def pack_examples(examples: Iterable[Example], batch_size: int, seq_len: int, pad_id: int,
                  pack: bool = True) -> tuple[dict[str, np.ndarray], int]:
    """Fills rows in order; with `pack`, several examples share a row (segment ids 1, 2, …;
    0 = padding; positions restart per example), else one example per row. An example that
    does not fit the current row starts the next; longer than a row, it is truncated.

    Returns the int32 [batch_size, seq_len] arrays and how many examples were consumed.
    """
    out = empty_batch(batch_size, seq_len, pad_id)
    row, col, segment, consumed = 0, 0, 0, 0
    for tokens, mask in examples:
        tokens, mask = tokens[:seq_len], mask[:seq_len]
        if col and (not pack or col + len(tokens) > seq_len):
            row, col, segment = row + 1, 0, 0
        if row >= batch_size:
            break
        segment += 1
        end = col + len(tokens)
        out["tokens"][row, col:end] = tokens
        out["positions"][row, col:end] = np.arange(len(tokens))
        out["segment_ids"][row, col:end] = segment
        out["loss_mask"][row, col:end] = mask
        col = end
        consumed += 1
    return out, consumed
