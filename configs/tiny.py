"""A tiny model learns two-digit addition on CPU in about a minute.

    python -m rlvr.main --config=configs/tiny.py --workdir=/tmp/rlvr_tiny

Expected: the loss falls from ~2.5 to below 0.3 and `summary.json` reports a held-out
greedy accuracy on "a+b=" problems well above zero (≈0.9 at 300 steps). Variants:
`configs/tiny.py:smoke` runs 4 steps (used by tests).
"""

import ml_collections

from rlvr import config_lib


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    c = config_lib.base_config()
    c.job = "lm"
    c.model = config_lib.model_config_dict(
        family="qwen3", vocab_size=264, hidden_size=128, intermediate_size=384, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0, max_position_embeddings=512,
    )
    c.data.batch_size = 16
    c.data.seq_len = 96
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 20
    c.train.num_steps = 300
    c.train.log_every = 20
    c.checkpoint.every_steps = 100
    if arg == "smoke":
        c.train.num_steps = 4
        c.train.log_every = 2
        c.checkpoint.every_steps = 2
        c.train.eval_examples = 4
    elif arg:
        raise ValueError(f"configs/tiny.py: unknown variant {arg!r}; use '' or 'smoke'.")
    return c
