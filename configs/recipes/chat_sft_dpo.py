"""SFT, then DPO, of your chat model: instruction following (tool calls included), then preferences.

    python -m rlvr.main --config=configs/recipes/chat_sft_dpo.py:MODEL,sft --workdir=workdirs/chat_sft
    python -m rlvr.main --config=configs/recipes/chat_sft_dpo.py:workdirs/chat_sft,dpo --workdir=workdirs/chat_dpo

MODEL is a Hugging Face directory (config.json, *.safetensors, tokenizer files with a chat template)
or an rlvr workdir; the architecture and tokenizer come from it, and the SFT run records them for the
DPO run (no `model.*` or tokenizer setting is repeated). SFT trains on chat JSONL
(`{"messages": [...], "tools"?}`, loss on assistant turns, packed); DPO on `{"prompt", "chosen",
"rejected"}` pairs against the SFT policy as the reference. The defaults are the small synthetic sets
in configs/data; give yours with `--config.data.path=... --config.data.eval_path=...`. A system prompt
(`--config.tokenizer.system_prompt=...`) set on the SFT run is recorded and used by every later job.

Target: Qwen3-1.7B on a v5p-8 (4 chips, mesh fsdp=4) or 8xH100 (fsdp=8): SFT 64 x 2,048-token packed
rows per step, DPO 32 pairs x 1,024 tokens, bf16 compute over fp32 master weights, remat, chunked
log-probs. The ahead-of-time fit check passes for both stages on both targets
(`benchmarks/recipes_fit.py`, results in benchmarks/results/recipes_fit.json); before booking:

    python -m rlvr.launch configs/recipes/chat_sft_dpo.py:MODEL,sft --target=k8s --tpu=v5p-8 --image=IMAGE --pvc=PVC

Variants (after the directory, comma-separated): `sft` or `dpo` (the stage; one is required),
`smoke` (a few steps on a CPU with a small model: tests).
"""

import os

import ml_collections

from rlvr import config_lib, start

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    path, *variants = arg.split(",")
    stages = {"sft", "dpo"} & set(variants)
    unknown = set(variants) - {"sft", "dpo", "smoke"}
    if not path or len(stages) != 1 or unknown:
        raise ValueError("use configs/recipes/chat_sft_dpo.py:MODEL_DIR,sft|dpo[,smoke] (MODEL_DIR: a Hugging Face "
                         "directory or an rlvr workdir)")
    c = config_lib.base_config()
    c.job = stages.pop()
    for key, value in start.init_overrides(path).items():
        c.init[key.split(".")[1]] = value
    c.data.source = "jsonl"
    c.mesh.data, c.mesh.fsdp = 1, -1
    c.model.dtype, c.model.remat_policy = "bfloat16", "full"
    c.train.logprob_chunk_size, c.train.log_every = 1024, 10
    c.optimizer.warmup_steps, c.optimizer.schedule, c.optimizer.weight_decay = 50, "cosine", 0.0
    c.checkpoint.every_steps = 200
    if c.job == "sft":
        c.data.path = os.path.join(DATA, "sft_chat_train.jsonl")
        c.data.eval_path = os.path.join(DATA, "sft_chat_eval.jsonl")
        c.data.batch_size, c.data.seq_len, c.data.pack = 64, 2048, True
        c.train.micro_batches, c.train.num_steps, c.optimizer.learning_rate = 4, 1000, 1e-5
    else:
        c.data.path, c.data.eval_path = os.path.join(DATA, "pref_train.jsonl"), os.path.join(DATA, "pref_eval.jsonl")
        c.data.batch_size, c.data.seq_len = 32, 1024
        c.train.micro_batches, c.train.num_steps, c.optimizer.learning_rate = 4, 500, 5e-7
        c.preference.loss, c.preference.beta, c.preference.reference = "dpo", 0.1, "precompute"
    if "smoke" in variants:
        c.mesh.data, c.mesh.fsdp = -1, 1
        c.model.dtype, c.model.remat_policy = "float32", "none"
        c.train.logprob_chunk_size, c.train.micro_batches, c.train.tensorboard = 0, 1, False
        c.data.batch_size, c.data.seq_len = 8, 256
        c.train.num_steps, c.train.log_every, c.checkpoint.every_steps = 2, 1, 2
        c.optimizer.warmup_steps = 0
        c.preference.reference = "online"  # two steps: no pass over all pairs for reference log-probs
    return c
