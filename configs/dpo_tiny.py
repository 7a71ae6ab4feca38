"""DPO on a tiny model with a learnable synthetic preference (CPU, ~1 minute).

    python -m rlvr.main --config=configs/dpo_tiny.py --workdir=/tmp/rlvr_dpo
    python -m rlvr.main --config=configs/dpo_tiny.py:simpo --workdir=/tmp/rlvr_simpo

The chosen reply opens "Sure! …", the rejected one "No. …", over random topics
(`configs/data/pref_*.jsonl`). Expected: the chosen–rejected log-prob margin rises and the
implicit-reward accuracy on held-out pairs exceeds 0.9 (summary.json: heldout_accuracy).
Variants: `:<loss>` for loss in dpo, cdpo, ipo, simpo, orpo; `:online` computes the
reference log-probs with frozen params each step instead of one pass up front; `:smoke`.
"""

import os

import ml_collections

from rlvr import config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
LOSSES = ("dpo", "cdpo", "ipo", "simpo", "orpo")


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    c = config_lib.base_config()
    c.job = "dpo"
    c.model = config_lib.model_config_dict(preset="tiny")
    c.data.source = "jsonl"
    c.data.path = os.path.join(DATA, "pref_train.jsonl")
    c.data.eval_path = os.path.join(DATA, "pref_eval.jsonl")
    c.data.batch_size = 16
    c.data.seq_len = 64
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 5
    c.train.num_steps = 60
    c.train.log_every = 10
    c.checkpoint.every_steps = 30
    c.preference.beta = 0.1
    c.preference.label_smoothing = 0.1
    for part in filter(None, arg.split(",")):
        if part in LOSSES:
            c.preference.loss = part
        elif part == "online":
            c.preference.reference = "online"
        elif part == "smoke":
            c.train.num_steps, c.train.log_every, c.checkpoint.every_steps = 2, 1, 2
        else:
            raise ValueError(f"configs/dpo_tiny.py: unknown variant {part!r}; use {LOSSES}, online, smoke.")
    return c
