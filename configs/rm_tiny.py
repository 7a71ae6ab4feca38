"""A Bradley–Terry reward model (scalar value head) on a learnable synthetic preference.

    python -m rlvr.main --config=configs/rm_tiny.py --workdir=/tmp/rlvr_rm

Expected: held-out pairwise accuracy ≥ 0.9 with a reported calibration error
(summary.json: heldout_accuracy, heldout_ece). The trained model scores RL rollouts through
`rlvr.rewards.reward_model.RewardModel.from_workdir`. Variant `:smoke` runs 2 steps.
"""

import os

import ml_collections

from rlvr import config_lib

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    c = config_lib.base_config()
    c.job = "rm"
    c.model = config_lib.model_config_dict(preset="tiny", value_head=True)
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
    if arg == "smoke":
        c.train.num_steps, c.train.log_every, c.checkpoint.every_steps = 2, 1, 2
    elif arg:
        raise ValueError(f"configs/rm_tiny.py: unknown variant {arg!r}; use '' or 'smoke'.")
    return c
