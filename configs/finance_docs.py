"""RL on financial documents (the finance domain kit, rlvr.domains.finance): every answer checked against raw data.

    python -m rlvr.main --config=configs/finance_docs.py:MODEL --workdir=workdirs/finance_docs
    python -m rlvr.main --config=configs/finance_docs.py:MODEL,tools --workdir=workdirs/finance_tools
    python -m rlvr.main --config=configs/finance_docs.py:tiny --workdir=workdirs/finance_tiny

MODEL is a Hugging Face directory or an rlvr workdir (architecture and tokenizer come from it). The
single-turn variant puts a generated filing (three statements over three years, in Markdown) in the
prompt and asks a question at one of five levels (lookup, ratio, multi-statement ratio, the altered
cell, a conclusion with cited cells), with the band-seeking curriculum moving the levels; `tools` runs
multi-turn episodes instead (`finance_docs_tools`: the filing behind search, PDF-table and calculator
tools; the PDF path needs the `docs` extra). Prompts are up to ~3,600 characters (1,493-2,240 tokens with
the 1,024-id BPE tokenizer of tests/hf_fixtures; measure yours with `python -m rlvr.tasks.preview
--task=finance_docs --tokenizer=MODEL --prompt_format=chat`). `MODEL,smoke` and `MODEL,tools,smoke` ran 2 RL
steps each with a random 2-layer Qwen3 of that fixture (chat template, BPE, tools declared) on the CPU
(405 s and 116 s wall on the shared 2-core machine).

`tiny` is the easiest level in a form a 2-layer byte-level model can read (`finance_lookup_compact`:
"net23=041 net24=060\\nnet24=" -> "060"), trained like the quickstart: an SFT warm start on
demonstrations of which `rl.sft_off_format` end in a "." the verifier rejects, then GRPO. The learning
check over seeds (2-core CPU, 5-7 minutes a seed):

    .venv/bin/python benchmarks/quickstart_seeds.py --config=configs/finance_docs.py:tiny --seeds 0,1,2 \\
        --out=benchmarks/results/finance_learning.json

Measured (benchmarks/results/finance_learning.json): held-out greedy accuracy 0.00 -> 0.56 / 0.51 / 0.14
on seeds 0 / 1 / 2; most of it is the answer format (the "value" accuracy, the right cell in any format,
went 0.09 -> 0.56, 0.39 -> 0.51, 0.15 -> 0.14).

Variants (comma-separated after MODEL or tiny): `tools`, `smoke` (a few steps on a CPU: tests; with
`tiny,tools,smoke` the tiny model plays finance_docs_tools episodes at level 0).
"""

import ml_collections

from rlvr import config_lib, start


def _tiny(c: ml_collections.ConfigDict) -> None:
    c.model = config_lib.model_config_dict(preset="tiny")
    c.rl.task = "finance_lookup_compact"
    c.rl.prompts_per_step, c.rl.group_size = 16, 8
    c.rl.max_new_tokens, c.rl.seq_len = 6, 64
    c.rl.engine.max_len, c.rl.engine.page_size, c.rl.engine.max_slots = 64, 8, 128
    c.rl.eval_examples, c.rl.eval_every = 128, 25
    c.rl.sft_steps, c.rl.sft_demos, c.rl.sft_batch_size, c.rl.sft_learning_rate = 400, 4000, 16, 1e-2
    c.rl.sft_seq_len = 128
    c.rl.sft_off_format = 0.6
    c.optimizer.learning_rate, c.optimizer.warmup_steps, c.optimizer.schedule = 1e-3, 5, "constant"
    c.train.num_steps = 50


def _model(c: ml_collections.ConfigDict, path: str, tools: bool) -> None:
    for key, value in start.init_overrides(path).items():
        c.init[key.split(".")[1]] = value
    c.rl.task = "finance_docs_tools" if tools else "finance_docs"
    c.rl.prompt_format = "chat"
    c.rl.curriculum = True
    c.rl.max_new_tokens, c.rl.max_prompt_len = 768, 0  # prompts: the longest of rl.task (rlvr.budgets)
    c.rl.prompts_per_step, c.rl.group_size, c.rl.temperature = 32, 8, 1.0
    c.rl.eval_examples, c.rl.eval_every = 200, 25
    c.model.dtype, c.model.remat_policy = "bfloat16", "full"
    c.optimizer.learning_rate, c.optimizer.warmup_steps, c.optimizer.schedule = 1e-6, 10, "constant"
    c.train.num_steps = 200


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
    path, *variants = (arg or "tiny").split(",")
    unknown = set(variants) - {"tools", "smoke"}
    if unknown:
        raise ValueError(f"configs/finance_docs.py:{arg}: unknown variant(s) {sorted(unknown)}; use "
                         "MODEL_DIR|tiny[,tools][,smoke]")
    c = config_lib.base_config()
    c.job = "rl"
    if path == "tiny":
        _tiny(c)
    else:
        _model(c, path, "tools" in variants)
    if "tools" in variants:  # per model turn 512 tokens (a level-4 answer is ~300); the whole episode 4,096
        c.rl.max_turns, c.rl.max_new_tokens, c.rl.seq_len = 4, 512, 4096
        c.rl.engine.max_len = 4096
        c.rl.env.python = False  # True: also a python tool in the sandbox (rlvr.domains.finance.env)
    c.train.log_every, c.checkpoint.every_steps = 5, 25
    if "smoke" in variants:
        c.rl.prompts_per_step, c.rl.group_size, c.rl.eval_examples, c.rl.eval_every = 2, 4, 4, 0
        c.rl.sft_steps, c.rl.sft_demos = 0, 0
        c.rl.curriculum = False
        c.train.num_steps, c.checkpoint.every_steps = 2, 2
        if path != "tiny":  # a small HF model on a CPU (the real-shape check: BPE tokenizer, chat template)
            c.model.dtype, c.model.remat_policy = "float32", "none"
            c.rl.max_new_tokens, c.rl.engine.max_slots, c.rl.engine.page_size = 16, 8, 64
            if "tools" in variants:  # 4,096-token rows ran out of host memory on a shared 24 GiB machine
                c.rl.max_turns, c.rl.seq_len, c.rl.engine.max_len = 2, 2048, 2048
        if path == "tiny" and "tools" in variants:  # compact episodes (the question alone, no declarations)
            c.rl.task, c.rl.prompt_format, c.rl.env.compact = "finance_docs_tools", "chat", True
            c.rl.eval_examples = 2
            c.rl.max_turns, c.rl.max_new_tokens, c.rl.seq_len, c.rl.engine.max_len = 2, 24, 1600, 1600
            c.rl.engine.page_size, c.rl.engine.max_slots = 64, 4
    return c
