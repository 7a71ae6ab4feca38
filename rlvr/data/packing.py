"""Greedy sequence packing into fixed [batch, seq_len] rows with segment ids."""

from __future__ import annotations

import numpy as np


def pack_examples(examples: list[tuple[list[int], list[int]]], batch_size: int, seq_len: int,
                  pad_id: int) -> dict[str, np.ndarray]:
    """Packs (tokens, loss_mask) examples in order into rows; an example that does not fit
    the current row starts the next one; examples longer than a row are truncated.

    Returns tokens, positions (restarting per example), segment_ids (1, 2, … per row;
    0 = padding) and loss_mask, each int32 [batch_size, seq_len].
    """
    out = {k: np.zeros((batch_size, seq_len), np.int32)
           for k in ("tokens", "positions", "segment_ids", "loss_mask")}
    out["tokens"][:] = pad_id
    row, col, segment = 0, 0, 0
    for tokens, mask in examples:
        tokens, mask = tokens[:seq_len], mask[:seq_len]
        if col + len(tokens) > seq_len:
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
    return out
