"""GRPO on math word problems with your chat model: ASDiv + CHAMP + procedural linear equations.

    python -m rlvr.main --config=configs/recipes/grpo_math.py:MODEL --workdir=workdirs/grpo_math
    python -m rlvr.main --config=configs/recipes/grpo_math.py:workdirs/grpo_math,eval --workdir=workdirs/grpo_math_eval

MODEL is a Hugging Face directory (config.json, *.safetensors, tokenizer files with a chat template)
or an rlvr workdir (e.g. after `configs/recipes/chat_sft_dpo.py:MODEL,sft`); the architecture and
tokenizer come from it. Prompts are chat messages through the model's chat template; answers go in
<answer></answer> and are checked by math-verify (CHAMP, algebra_linear) or numerically (ASDiv).
Budgets: 1,024 new tokens per answer, prompts up to 512 tokens (longer ones are skipped and
reported); rows and the engine cache are derived from them (rlvr.budgets).

Target: Qwen3-1.7B on a v5p-8 (4 chips, mesh fsdp=4) or 8xH100 (fsdp=8): 64 prompts x 8 samples per
step, bf16 compute over fp32 master weights, full remat, 16 micro-batches, chunked log-probs; the
embedded engine holds 128 sequences. The ahead-of-time fit check passes for both
(`benchmarks/recipes_fit.py`, results in benchmarks/results/recipes_fit.json); before booking:

    python -m rlvr.launch configs/recipes/grpo_math.py:MODEL --target=k8s --tpu=v5p-8 --image=IMAGE --pvc=PVC

Variants (after the directory, comma-separated): `eval` (held-out pass@1 and pass@4 per family and
level of the run in MODEL, its budgets and prompt format inherited), `smoke` (a few steps on a CPU
with a small model: tests).
"""

import ml_collections

from rlvr import config_lib, start


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    path, *variants = arg.split(",")
    unknown = set(variants) - {"eval", "smoke"}
    if not path or unknown:
        raise ValueError("use configs/recipes/grpo_math.py:MODEL_DIR[,eval][,smoke] (MODEL_DIR: a Hugging Face "
                         f"directory or an rlvr workdir){f'; unknown variants {sorted(unknown)}' if unknown else ''}")
    c = config_lib.base_config()
    c.job = "rl"
    for key, value in start.init_overrides(path).items():
        c.init[key.split(".")[1]] = value
    c.rl.task = "asdiv:2,champ,algebra_linear"
    c.rl.prompt_format = "chat"
    c.rl.max_new_tokens, c.rl.max_prompt_len = 1024, 512
    c.rl.prompts_per_step, c.rl.group_size, c.rl.temperature = 64, 8, 1.0
    c.rl.advantage, c.rl.clip_low, c.rl.clip_high, c.rl.kl_coef = "grpo", 0.2, 0.28, 0.0
    c.rl.proximal = "behaviour"  # one update per batch: clip against the sampler's log-probs, so the clip acts
    c.rl.engine.max_slots, c.rl.engine.page_size, c.rl.engine.decode_steps = 128, 64, 16
    c.rl.engine.prefill_rows, c.rl.engine.prefill_chunk = 16, 512
    c.rl.eval_examples, c.rl.eval_every = 300, 50
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.model.dtype, c.model.remat_policy = "bfloat16", "full"
    c.train.micro_batches, c.train.logprob_chunk_size = 16, 1024
    c.train.num_steps, c.train.log_every = 300, 5
    c.optimizer.learning_rate, c.optimizer.warmup_steps, c.optimizer.schedule = 1e-6, 10, "constant"
    c.optimizer.weight_decay = 0.0
    c.checkpoint.every_steps = 25
    if "eval" in variants:
        c.job = "eval"
        c.rl.max_new_tokens, c.rl.prompt_format = 0, ""  # the evaluated run's
        c.eval.levels, c.eval.examples_per_level, c.eval.samples, c.eval.temperature = "all", 64, 4, 1.0
    if "smoke" in variants:
        c.mesh.data, c.mesh.fsdp = -1, 1
        c.model.dtype, c.model.remat_policy = "float32", "none"
        c.train.micro_batches, c.train.logprob_chunk_size = 1, 0
        c.rl.max_new_tokens = 0 if "eval" in variants else 16
        c.rl.max_prompt_len, c.rl.prompts_per_step, c.rl.group_size = 0, 2, 4
        c.rl.engine.max_slots, c.rl.engine.page_size, c.rl.engine.decode_steps = 16, 16, 8
        c.rl.engine.prefill_chunk = 64
        c.rl.eval_examples, c.rl.eval_every, c.rl.print_samples_every = 3, 0, 1
        c.eval.examples_per_level, c.eval.samples = 1, 1
        c.train.num_steps, c.checkpoint.every_steps, c.train.tensorboard = 2, 2, False
    return c
