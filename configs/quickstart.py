"""The quickstart that learns: SFT warm start, then GRPO on verifiable arithmetic, on a CPU.

    python -m rlvr.main --config=configs/quickstart.py --workdir=workdirs/quickstart

A tiny model (2 layers, byte-level vocabulary) is first fine-tuned on a small set of
demonstrations ("482+59=" -> "541<|im_end|>"), which leaves it right on some held-out problems
and wrong on many. GRPO then samples groups of answers per problem from the embedded engine,
rewards exact answers (the verifier: exact match, answer then end token), and updates the
policy. The run prints held-out greedy accuracy before and after RL and writes summary.json
and rl_curve.png to the workdir.

Variants: `:async` (one-step off-policy with partial rollouts), `:smoke` (a few steps, for tests),
`:lora` (GRPO trains rank-16 adapters, alpha 32, on all projections at learning rate 3e-3, 3x the full
run's: 1e-2 collapsed and 5e-3 gained less; benchmarks/results/lora_quickstart_sweep.json).

Sweep (`get_sweep`): rl.mode sync/async x seed, 4 jobs, 2 at a time, then their results table:

    python -m rlvr.launch configs/quickstart.py --sweep --parallel=2 --exp=quickstart_modes
    python -m rlvr.launch results quickstart_modes --metric=heldout_accuracy_after,reward
"""

import ml_collections

from rlvr import config_lib


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    c = config_lib.base_config()
    c.job = "rl"
    c.model = config_lib.model_config_dict(preset="tiny")
    c.rl.task, c.rl.min_digits, c.rl.max_digits = "add", 1, 2
    c.rl.prompts_per_step, c.rl.group_size = 32, 8
    c.rl.max_new_tokens, c.rl.seq_len = 6, 16
    c.rl.engine.max_len, c.rl.engine.page_size, c.rl.engine.max_slots = 32, 8, 256
    c.rl.eval_examples, c.rl.eval_every = 256, 25
    c.rl.sft_steps, c.rl.sft_demos, c.rl.sft_batch_size, c.rl.sft_learning_rate = 400, 4000, 16, 1e-2
    c.rl.sft_off_format = 0.6
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 5
    c.optimizer.schedule = "constant"
    c.train.num_steps = 100
    c.train.log_every = 5
    c.checkpoint.every_steps = 25
    variants = set(filter(None, arg.split(",")))
    unknown = variants - {"async", "smoke", "lora"}
    if unknown:
        raise ValueError(f"configs/quickstart.py: unknown variant(s) {sorted(unknown)}; use async, smoke and/or lora")
    if "async" in variants:
        c.rl.mode, c.rl.max_staleness = "async", 1
    if "lora" in variants:  # the SFT warm start still trains every weight (a random base)
        c.lora.rank, c.lora.alpha, c.optimizer.learning_rate = 16, 32.0, 3e-3
    if "smoke" in variants:
        c.rl.prompts_per_step, c.rl.group_size, c.rl.eval_examples, c.rl.eval_every = 4, 4, 8, 0
        c.rl.sft_steps, c.rl.sft_demos = 4, 16
        c.train.num_steps, c.checkpoint.every_steps = 4, 2
    return c


def get_sweep(arg: str = "") -> list[dict]:
    """Synchronous vs one-step-off-policy asynchronous RL, two seeds each (4 jobs)."""
    del arg  # the same sweep for every variant
    return [{"rl.mode": mode, "seed": seed} for mode in ("sync", "async") for seed in (0, 1)]
