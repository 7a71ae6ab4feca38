"""Chat SFT of a tiny model on a synthetic instruction + tool-call set (CPU, ~1 minute).

    python -m rlvr.main --config=configs/sft_tiny.py --workdir=/tmp/rlvr_sft

Data: `configs/data/sft_chat_*.jsonl` (OpenAI messages, tool calls included; rewrite with
`python -m rlvr.data.synthetic configs/data`), rendered with the ChatML template, loss on
assistant tokens only, packed with segment ids. Expected: training loss near zero and
greedy replies equal to the training targets (tests/test_learning.py checks both).
Variant `:smoke` runs 2 steps.

Sweep (`get_sweep`): learning rate x seed, 4 jobs, 2 at a time, then their results table:

    python -m rlvr.launch configs/sft_tiny.py --sweep --parallel=2 --exp=sft_lr_seed
    python -m rlvr.launch results sft_lr_seed --plot=experiments/sft_lr_seed/loss.png
"""

import os

import ml_collections

from rlvr import config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    c = config_lib.base_config()
    c.job = "sft"
    c.model = config_lib.model_config_dict(preset="tiny")
    c.data.source = "jsonl"
    c.data.path = os.path.join(DATA, "sft_chat_train.jsonl")
    c.data.eval_path = os.path.join(DATA, "sft_chat_eval.jsonl")
    c.data.batch_size = 4
    c.data.seq_len = 1024
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 10
    c.train.num_steps = 100
    c.train.log_every = 10
    c.checkpoint.every_steps = 50
    if arg == "smoke":
        c.train.num_steps, c.train.log_every, c.checkpoint.every_steps = 2, 1, 2
    elif arg:
        raise ValueError(f"configs/sft_tiny.py: unknown variant {arg!r}; use '' or 'smoke'.")
    return c


def get_sweep(arg: str = "") -> list[dict]:
    """Learning rate x seed (4 jobs); each dict's keys override the config of one job."""
    del arg  # the same sweep for every variant
    return [{"optimizer.learning_rate": lr, "seed": seed} for lr in (1e-3, 3e-3) for seed in (0, 1)]
