"""Packed RL train rows (rlvr.rl.batching): first-fit decreasing fills fewer rows than packing in
sample order, and the row buckets (4, 5, 6 or 7 × 2^k) leave under a fifth of the rows empty. Both cut
the train step's work at the realistic shape (benchmarks/rl_step_realistic.py: 4 chat prompts ×
8, 128 new tokens, 1,024-token rows), where the step costs what its rows hold, padding included."""

import numpy as np

from rlvr.rl.batching import Sample, _bucket_rows, build_batch, pack_rows


def _samples(prompt_lengths, group=8, new_tokens=128):
    out = []
    for g, length in enumerate(prompt_lengths):
        for _ in range(group):
            out.append(Sample(g, g, [5] * length, [6] * new_tokens, [-1.0] * new_tokens, [0] * new_tokens, False,
                              {"reward": 0.0}, 1.0))
    return out


def test_first_fit_decreasing_packs_the_realistic_groups_into_16_rows():
    # rollouts of 428, 478, 528, 478 tokens: in sample order the 528s pair with nothing (20 rows);
    # longest first, each 528 shares a row with a 478 and the 428s pair up: 16 rows of <= 1,024
    lengths = [p + 128 for p in (300, 350, 400, 350) for _ in range(8)]
    rows, used = pack_rows(lengths, 1024)
    assert len(rows) == 16
    assert sorted(i for row in rows for i in row) == list(range(32))
    assert used == [sum(lengths[i] for i in row) for row in rows] and max(used) <= 1024
    batch = build_batch(_samples([300, 350, 400, 350]), 1024, 0, pack=True, row_multiple=8, min_rows=32)
    assert batch["tokens"].shape == (16, 1024)  # was (32, 1024): 20 rows rounded up to a power of two
    np.testing.assert_array_equal(np.sort(np.unique(batch["seq_index"]))[:-1], np.arange(32))  # all, once
    assert int(batch["loss_mask"].sum()) == 32 * 128


def test_row_buckets_are_eighths_of_the_next_power_of_two():
    assert [_bucket_rows(n, 1, 64) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13, 17, 18, 20, 25, 33)] == \
        [1, 2, 3, 4, 5, 6, 7, 10, 14, 20, 20, 20, 28, 40]
    for needed in range(1, 200):  # under a fifth of the rows empty, and at most 4 shapes per doubling
        assert (_bucket_rows(needed, 1, 10**6) - needed) / _bucket_rows(needed, 1, 10**6) < 0.2
    assert len({_bucket_rows(n, 1, 10**6) for n in range(65, 129)}) == 4
    assert _bucket_rows(20, 8, 32) == 24  # a multiple of data shards × micro-batches
    assert _bucket_rows(17, 8, 16) == 24  # never fewer rows than needed, even above the limit
