"""Agentic RL on code repair: edit, run the tests, read the errors, fix, in a gVisor sandbox.

    python -m rlvr.main --config=configs/agentic_code.py --workdir=workdirs/agentic_code

Each task (`code_repair`, rlvr.envs.code_repair) is a small repository with one injected bug and
failing tests in a sandboxed workspace. The policy works through tools declared in the chat
template (read_file, list_files, write_file, str_replace, run_tests, python):

    <tool_call>{"name": "read_file", "arguments": {"path": "mathutil.py"}}</tool_call>
    <tool_call>{"name": "str_replace", "arguments": {"path": ..., "old": ..., "new": ...}}</tool_call>
    <tool_call>{"name": "run_tests", "arguments": {}}</tool_call>
    <answer>done</answer>

until the tests pass or the turn limit hits. The terminal reward is the host-judged verdict of the
final sources on visible and hidden tests; process rewards (the code compiles, the faulty file was
edited, tests were run after an edit, fewer failing tests) and format/safety penalties are logged
per component. Every episode's trace (turns, tool calls, sandbox commands, outputs, timings) goes
to `episodes.jsonl`; `python -m rlvr.envs.episodes export ... --only=correct` turns the repaired
runs into SFT data.

The default model is the tiny byte-level one (a plumbing run on a CPU: the loop, the sandbox pool
and the rewards work; a tiny random model repairs nothing). For a real run set `init.hf_checkpoint`
and `tokenizer.path` to a chat model (e.g. a Qwen2.5-Coder), `rl.backend="sglang"` with
`rl.sglang_urls`, and raise `rl.prompts_per_step` and `rl.env.sandbox_workers`.
Variants: `:smoke` (a few steps, for tests), `:humaneval` (repairs of HumanEval solutions).
"""

import ml_collections

from rlvr import config_lib


def get_config(arg: str = "") -> ml_collections.ConfigDict:
    c = config_lib.base_config()
    c.job = "rl"
    c.model = config_lib.model_config_dict(preset="tiny")
    c.rl.task = "code_repair"
    c.rl.prompt_format = "chat"
    c.rl.prompts_per_step, c.rl.group_size = 4, 4
    c.rl.max_new_tokens, c.rl.seq_len, c.rl.max_turns = 96, 3584, 6  # per turn; the episode (bytes)
    c.rl.engine.max_len, c.rl.engine.page_size, c.rl.engine.max_slots = 3584, 64, 32
    c.rl.engine.prefill_chunk = 512
    c.rl.env.sandbox_workers = 2
    c.rl.eval_examples, c.rl.eval_every = 8, 0
    c.rl.sft_steps, c.rl.sft_demos, c.rl.sft_batch_size = 0, 16, 2
    c.rl.sft_seq_len = 4096
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 2
    c.train.num_steps = 20
    c.train.log_every = 2
    c.checkpoint.every_steps = 10
    variants = set(filter(None, arg.split(",")))
    unknown = variants - {"smoke", "humaneval"}
    if unknown:
        raise ValueError(f"configs/agentic_code.py: unknown variant(s) {sorted(unknown)}; use smoke, humaneval")
    if "humaneval" in variants:
        c.rl.task = "code_repair_humaneval"
    if "smoke" in variants:
        c.rl.prompts_per_step, c.rl.group_size, c.rl.eval_examples = 2, 4, 2  # 8 rows: 8 fake devices
        c.rl.max_new_tokens, c.rl.max_turns = 32, 3
        c.train.num_steps, c.checkpoint.every_steps = 2, 2
    return c
