"""Bring your own model: the tutorial's commands, as subprocesses, on random HF checkpoints.

A random Qwen3 checkpoint (built and saved by transformers, with a trained BPE tokenizer and the
ChatML template) goes through the commands of docs/tutorials/bring-your-own-model.md: preview, SFT from the
HF directory, RL from the SFT workdir (chat prompts; ASDiv and CHAMP datasets and the procedural
algebra family), evaluation of the RL workdir, export with `--verify` (transformers reloads the
export: same chat-template ids, greedy tokens equal to the engine's). A random Llama checkpoint
takes the shorter SFT -> DPO -> export path. The recipes run with their `,smoke` variant; no command
after the first job sets a `model.*` or `tokenizer.*` key.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
from hf_fixtures import REPO, write_random_hf

pytestmark = [pytest.mark.slow, pytest.mark.hf]
TIMEOUT = 600


TUTORIAL = os.path.join(REPO, "docs", "tutorials", "bring-your-own-model.md")


def tutorial_blocks() -> list[list[str]]:
    """The commands of the bash blocks of the "Bring your own model" tutorial."""
    with open(TUTORIAL) as f:
        text = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    return [[line for line in block.splitlines() if line.strip() and not line.startswith(("#", "MODEL="))]
            for block in blocks]


def run(command: str, model: str, run_dir: str) -> str:
    """One tutorial command with the recipes' smoke variant; returns its output (fails on exit != 0)."""
    command = re.sub(r"(--config=configs/recipes/\S+)", r"\1,smoke", command)
    command = command.replace(".venv/bin/python", sys.executable)
    env = {**os.environ, "MODEL": model, "RUN": run_dir, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")) + \
        " --xla_force_host_platform_device_count=8"
    t0 = time.perf_counter()
    result = subprocess.run(command, shell=True, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    print(f"[byo] {time.perf_counter() - t0:5.1f} s  {command.split(' -m ')[1][:90]}")
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_tutorial_commands_take_a_qwen3_checkpoint_through_sft_rl_eval_export(tmp_path):
    main, _ = tutorial_blocks()
    assert not [c for c in main[2:] if "--config.model" in c or "--config.tokenizer" in c]
    model = write_random_hf(str(tmp_path / "qwen3"), "qwen3")
    run_dir = str(tmp_path / "run")
    outputs = [run(c, model, run_dir) for c in main]

    preview, sft_out = outputs[0], outputs[1]
    assert "asdiv" in preview and "tokens ---" in preview and "rl.seq_len=" in preview
    with open(os.path.join(model, "config.json")) as f:
        hf_config = json.load(f)
    with open(os.path.join(run_dir, "sft", "config.json")) as f:
        recorded = json.load(f)["model"]
    assert (recorded["family"], recorded["hidden_size"], recorded["vocab_size"], recorded["head_dim"]) == (
        "qwen3", hf_config["hidden_size"], hf_config["vocab_size"], hf_config["head_dim"])
    assert "summary:" in sft_out
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert os.path.exists(os.path.join(run_dir, "sft", "tokenizer", name))

    with open(os.path.join(run_dir, "rl", "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    train = [s for s in samples if s["tag"] == "train"]
    assert train and {"reward", "correct", "format"} <= set(train[0]["rewards"])
    assert train[0]["prompt"].startswith("<|im_start|>user\n")  # chat prompts through the template
    assert {s["family"] for s in samples} >= {"asdiv", "champ", "algebra_linear"}
    with open(os.path.join(run_dir, "eval", "config.json")) as f:
        eval_rl = json.load(f)["rl"]
    with open(os.path.join(run_dir, "rl", "config.json")) as f:
        rl = json.load(f)["rl"]
    assert (eval_rl["max_new_tokens"], eval_rl["prompt_format"]) == (rl["max_new_tokens"], "chat")  # inherited
    with open(os.path.join(run_dir, "eval", "eval.json")) as f:
        assert set(json.load(f)["by_family"]) == {"asdiv", "champ", "algebra_linear"}
    assert "greedy tokens equal (transformers vs engine, 3 prompts): True" in outputs[-1]


def test_tutorial_preference_path_takes_a_llama_checkpoint_through_sft_dpo_export(tmp_path):
    main, preference = tutorial_blocks()
    model = write_random_hf(str(tmp_path / "llama"), "llama", num_kv_heads=1)
    run_dir = str(tmp_path / "run")
    run(main[1], model, run_dir)  # SFT from the HF directory
    outputs = [run(c, model, run_dir) for c in preference]
    with open(os.path.join(run_dir, "dpo", "summary.json")) as f:
        assert json.load(f)["job"] == "dpo"
    with open(os.path.join(run_dir, "hf_dpo", "config.json")) as f:
        exported = json.load(f)
    assert (exported["model_type"], exported["num_key_value_heads"]) == ("llama", 1)
    assert "greedy tokens equal (transformers vs engine, 3 prompts): True" in outputs[-1]
