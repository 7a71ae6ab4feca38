"""What `rl.trim_columns` saves: the RL loss's forward + backward on a batch of short rollouts, its
rows rl.seq_len wide (before) against the longest row's power-of-two width (after).

    .venv/bin/python benchmarks/rl_trim.py [--seq_len 1024] [--rows 32] [--repeats 5]

The bench preset (4.46M params, fp32); `--rows` samples of prompts 60-200 and outputs 20-200
tokens (uniform), unpacked (rl.pack's default), PPO-clip with token_mean. Both widths run in the
same process, alternating (ABBA), each call blocking. Prints one JSON line: the widths, the median
seconds of each, the speed-up, the loss of both (equal: the padding columns weigh nothing), and
the roofline: the rows' real tokens at `flops.train_flops_per_token` of their own length over the
machine's fp32 matmul peak (measured in the run), with each width's fraction of it.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import PRESETS, ModelConfig
from rlvr.rl.batching import Sample, build_batch
from rlvr.rl.objective import Objective, rl_loss
from rlvr.train import flops
from rlvr.train.step import accumulate_gradients


def _samples(rows: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        p, o = int(rng.integers(60, 201)), int(rng.integers(20, 201))
        out.append(Sample(group=i // 8, task_index=i, prompt_ids=rng.integers(1, vocab, p).tolist(),
                          output_ids=rng.integers(1, vocab, o).tolist(), behaviour_logp=(-rng.random(o) * 7).tolist(),
                          versions=[0] * o, truncated=False, rewards={"reward": 0.0}, advantage=float(rng.normal())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = ModelConfig(**PRESETS["bench"])
    params = params_lib.init_params(cfg, jax.random.key(0), sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    objective = Objective("ppo_clip", 0.2, 0.28, num_seqs=args.rows)
    step = jax.jit(lambda p, b: accumulate_gradients(functools.partial(rl_loss, cfg, objective), p, b,
                                                     jax.random.key(0), None, 1))
    samples = _samples(args.rows, cfg.vocab_size)
    batches = {trim: {k: jnp.asarray(v) for k, v in build_batch(samples, args.seq_len, 0, trim=trim).items()}
               for trim in (False, True)}
    losses, times = {}, {False: [], True: []}
    for trim, batch in batches.items():  # compile, and the loss
        _, sums = jax.block_until_ready(step(params, batch))
        losses[trim] = float(sums["loss"])
    for r in range(args.repeats):
        for trim in (False, True) if r % 2 == 0 else (True, False):
            start = time.perf_counter()
            jax.block_until_ready(step(params, batches[trim]))
            times[trim].append(time.perf_counter() - start)
    full, trimmed = (statistics.median(times[t]) for t in (False, True))
    peak = flops.measure_matmul_peak()
    lengths = [len(s.prompt_ids) + len(s.output_ids) for s in samples]
    roofline_s = sum(n * flops.train_flops_per_token(cfg, n) for n in lengths) / peak
    print(json.dumps({"benchmark": "rl_trim", "rows": args.rows, "seq_len": args.seq_len,
                      "longest_row": max(lengths), "width_full": batches[False]["tokens"].shape[1],
                      "width_trimmed": batches[True]["tokens"].shape[1],
                      "loss_full": losses[False], "loss_trimmed": losses[True],
                      "median_s_full": round(full, 4), "median_s_trimmed": round(trimmed, 4),
                      "speedup": round(full / trimmed, 2), "matmul_peak_gflops": round(peak / 1e9, 1),
                      "roofline_s": round(roofline_s, 4), "full_vs_roofline": round(roofline_s / full, 3),
                      "trimmed_vs_roofline": round(roofline_s / trimmed, 3),
                      "all_s": {"full": [round(t, 4) for t in times[False]],
                                "trimmed": [round(t, 4) for t in times[True]]}}))


if __name__ == "__main__":
    main()
