"""RL on CAD: the policy writes OpenSCAD, gVisor runs it, the host scores the mesh (the CAD kit, rlvr.domains.cad).

    python -m rlvr.main --config=configs/cad.py:MODEL --workdir=workdirs/cad              # single turn
    python -m rlvr.main --config=configs/cad.py:MODEL,tools --workdir=workdirs/cad_tools  # episodes with tools
    python -m rlvr.main --config=configs/cad.py:tiny,smoke --workdir=workdirs/cad_smoke   # CPU pipeline check

MODEL is a Hugging Face directory or an rlvr workdir. The single-turn variant (`cad_openscad`) shows a part
in words and dimensions and takes the whole program in the answer tag; `tools` plays `cad_openscad_tools`
episodes (run_script, render, compare, measure, write_file; the answer is the final program). The
band-seeking curriculum moves the four levels (primitives, CSG, patterned/filleted, assemblies). Each
scored answer costs one OpenSCAD run in a gVisor sandbox: by default one of the RL run's warm pool of
`rl.code_pool` sandboxes (0.84x the time of a fresh sandbox, whose p50 is 0.9 s and p99 2.2 s on a shared 2-core
CPU: benchmarks/results/cad_sandbox.json; `rl.code_pool=0` or RLVR_CAD_POOL=0 runs a fresh one each,
RLVR_CAD_POOL=N a pool of N), so verification runs on `rl.verifier_workers` threads.

`tiny,smoke` plays two RL steps of tool episodes with the 2-layer byte-level model (no tool declarations, two
turns of 24 tokens): a check that the pipeline runs (episodes.jsonl with their images in
WORKDIR/episode_images), not a learning check; the byte model writes no valid OpenSCAD. `MODEL,tools,smoke`
ran with a random 2-layer Qwen3 of tests/hf_fixtures (BPE, chat template, tools declared): 70 s wall on the
shared 2-core CPU, `tiny,smoke` 115 s (benchmarks/results/cad_smoke.json). Prompts of `cad_openscad` are up to
~300 tokens with that fixture's 1,024-id BPE (`python -m rlvr.tasks.preview --task=cad_openscad
--tokenizer=MODEL --prompt_format=chat`).

Variants (comma-separated after MODEL or tiny): `tools`, `smoke`.
"""

import ml_collections

from rlvr import config_lib, start


def _model(c: ml_collections.ConfigDict, path: str, tools: bool) -> None:
    for key, value in start.init_overrides(path).items():
        c.init[key.split(".")[1]] = value
    c.rl.task = "cad_openscad_tools" if tools else "cad_openscad"
    c.rl.prompt_format = "chat"
    c.rl.curriculum = True
    c.rl.max_new_tokens, c.rl.max_prompt_len = 1024, 0  # a level-3 program is ~600 characters
    c.rl.prompts_per_step, c.rl.group_size, c.rl.temperature = 32, 8, 1.0
    c.rl.eval_examples, c.rl.eval_every = 64, 25
    c.model.dtype, c.model.remat_policy = "bfloat16", "full"
    c.optimizer.learning_rate, c.optimizer.warmup_steps, c.optimizer.schedule = 1e-6, 10, "constant"
    c.train.num_steps = 200


def get_config(arg: str = "tiny,smoke") -> ml_collections.ConfigDict:
    path, *variants = (arg or "tiny,smoke").split(",")
    unknown = set(variants) - {"tools", "smoke"}
    if unknown:
        raise ValueError(f"configs/cad.py:{arg}: unknown variant(s) {sorted(unknown)}; use "
                         "MODEL_DIR|tiny[,tools][,smoke]")
    if path == "tiny" and "smoke" not in variants:
        raise ValueError(f"configs/cad.py:{arg}: the tiny byte model writes no OpenSCAD; use tiny,smoke (a pipeline "
                         "check) or a MODEL directory")
    c = config_lib.base_config()
    c.job = "rl"
    if path == "tiny":
        c.model = config_lib.model_config_dict(preset="tiny")
        c.rl.task, c.rl.prompt_format = "cad_openscad_tools", "chat"
    else:
        _model(c, path, "tools" in variants)
    if "tools" in variants or path == "tiny":  # per model turn 1,024 tokens; the whole episode 6,144
        c.rl.max_turns, c.rl.seq_len = 6, 6144
        c.rl.engine.max_len = 6144
    c.train.log_every, c.checkpoint.every_steps = 5, 25
    if "smoke" in variants:
        c.rl.prompts_per_step, c.rl.group_size, c.rl.eval_examples, c.rl.eval_every = 2, 2, 2, 0
        c.rl.sft_steps, c.rl.sft_demos = 0, 0
        c.rl.curriculum = False
        c.train.num_steps, c.checkpoint.every_steps = 2, 2
        if path == "tiny":
            c.rl.env.declare_tools = False
            c.rl.max_turns, c.rl.max_new_tokens, c.rl.seq_len, c.rl.engine.max_len = 2, 24, 1024, 1024
            c.rl.engine.page_size, c.rl.engine.max_slots = 64, 4
        else:
            c.model.dtype, c.model.remat_policy = "float32", "none"
            c.rl.max_new_tokens, c.rl.engine.max_slots, c.rl.engine.page_size = 16, 8, 64
            if "tools" in variants:
                c.rl.max_turns, c.rl.seq_len, c.rl.engine.max_len = 2, 2048, 2048
    return c
