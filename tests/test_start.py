"""Starting points and budgets (rlvr.start, rlvr.budgets): what a job takes from an HF directory or
a workdir, the budgets it derives, and the one-line errors for mismatched overrides, missing
tokenizer files, a template that cannot render tool calls and prompts that cannot fit."""

import json
import math
import os
import shutil
import subprocess

import jax
import pytest
from hf_fixtures import write_random_hf

from rlvr import config_lib, start
from rlvr.main import TRAINERS

pytestmark = pytest.mark.hf
NO_TOOLS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_random_hf(str(tmp_path_factory.mktemp("hf") / "qwen3"), "qwen3", max_position_embeddings=512)


def rl_config(hf_dir=None, **overrides):
    """An RL config as a user's file would give it: a preset for random init, a chat task mixture."""
    c = config_lib.load_config("configs/quickstart.py:smoke")
    c.rl.task, c.rl.prompt_format, c.rl.max_new_tokens, c.rl.seq_len, c.rl.sft_steps = "asdiv", "chat", 24, 0, 0
    c.rl.engine.max_len = 0
    if hf_dir:
        c.init.hf_checkpoint = hf_dir
    for key, value in overrides.items():
        *head, last = key.split(".")
        node = c
        for part in head:
            node = node[part]
        node[last] = value
    return c


def test_an_hf_start_takes_the_checkpoints_architecture_and_tokenizer(hf_dir):
    config = start.resolve(rl_config(hf_dir, **{"model.remat_policy": "full", "model.hidden_size": 64}))
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf = json.load(f)
    model = config.model
    assert (model.family, model.hidden_size, model.num_layers, model.vocab_size, model.head_dim,
            model.num_kv_heads, model.rope_theta) == ("qwen3", hf["hidden_size"], hf["num_hidden_layers"],
                                                      hf["vocab_size"], hf["head_dim"], hf["num_key_value_heads"],
                                                      hf["rope_parameters"]["rope_theta"])
    assert model.remat_policy == "full"  # a runtime field: the config's
    assert config.tokenizer.path == hf_dir


def test_contradicting_model_overrides_name_every_field(hf_dir):
    with pytest.raises(config_lib.ConfigError) as error:
        start.resolve(rl_config(hf_dir, **{"model.hidden_size": 128, "model.num_layers": 3}))
    message = str(error.value)
    assert "model.hidden_size=128 (checkpoint: 64)" in message and "model.num_layers=3 (checkpoint: 2)" in message
    assert "drop these overrides" in message and "\n" not in message


def test_a_checkpoint_without_tokenizer_files_is_an_error_not_a_byte_level_fallback(hf_dir, tmp_path):
    bare = str(tmp_path / "bare")
    os.makedirs(bare)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(hf_dir, name), bare)
    with pytest.raises(config_lib.ConfigError, match=r"init\.hf_checkpoint=.*has no tokenizer\.json.*set "
                                                      r"tokenizer\.path"):
        start.resolve(rl_config(bare))
    assert start.resolve(rl_config(bare, **{"tokenizer.path": hf_dir})).tokenizer.path == hf_dir
    other = str(tmp_path / "other")
    start.build_tokenizer({"path": "", "chat_template": ""}).save(other)  # the byte-level tokenizer
    with pytest.raises(config_lib.ConfigError, match=r"tokenizer\.path=.*differs from the tokenizer of init"):
        start.resolve(rl_config(hf_dir, **{"tokenizer.path": other}))


def _workdir(config, path):
    """A workdir as a finished job leaves it: the resolved config.json and its tokenizer."""
    resolved = start.resolve(config)
    start.write_workdir(resolved, path)
    return resolved


def test_a_workdir_start_inherits_architecture_tokenizer_system_prompt_and_budgets(hf_dir, tmp_path):
    run = str(tmp_path / "rl")
    trained = _workdir(rl_config(hf_dir, **{"tokenizer.system_prompt": "Answer briefly."}), run)
    evaluation = rl_config(None, job="eval", **{"init.workdir": run, "rl.max_new_tokens": 0, "rl.prompt_format": ""})
    config = start.resolve(evaluation)
    assert config.model.to_dict() == trained.model.to_dict()
    assert config.tokenizer.path == os.path.join(run, "tokenizer")
    assert (config.tokenizer.system_prompt, config.rl.max_new_tokens, config.rl.prompt_format) == (
        "Answer briefly.", 24, "chat")
    tokenizer = start.build_tokenizer(config.tokenizer)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith(
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n")
    with pytest.raises(config_lib.ConfigError, match=r"tokenizer\.system_prompt='Be verbose\.' \(the workdir's: "
                                                      r"'Answer briefly\.'\).*drop it"):
        start.resolve(rl_config(None, job="eval", **{"init.workdir": run, "tokenizer.system_prompt": "Be verbose."}))
    with pytest.raises(config_lib.ConfigError, match=r"model\.vocab_size=264 \(checkpoint: 1024\)"):
        start.resolve(rl_config(None, **{"init.workdir": run, "model.vocab_size": 264}))


def test_budgets_are_derived_from_the_measured_prompts(hf_dir):
    import transformers

    from rlvr.tasks import build_tasks
    from rlvr.tasks.base import HELD_OUT, TRAIN

    config = start.resolve(rl_config(hf_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(hf_dir)
    family = build_tasks(config.rl, 0).families["asdiv"]
    longest = max(len(theirs.apply_chat_template(t.chat(), add_generation_prompt=True, return_dict=False))
                  for t in family.split_tasks(TRAIN) + family.split_tasks(HELD_OUT))
    seq_len = math.ceil((longest + 24) / 8) * 8
    assert (config.rl.seq_len, config.rl.max_prompt_len) == (seq_len, seq_len - 24)
    assert config.rl.engine.max_len == math.ceil(seq_len / config.rl.engine.page_size) * config.rl.engine.page_size


def test_prompts_that_cannot_fit_name_the_longest(hf_dir, capsys):
    with pytest.raises(config_lib.ConfigError) as error:
        start.resolve(rl_config(hf_dir, **{"rl.max_new_tokens": 400}))  # the context is 512
    message = str(error.value)
    assert "model.max_position_embeddings=512" in message and "rl.max_new_tokens=400" in message
    assert "longest prompts: asdiv level" in message and "rl.max_prompt_len" in message
    config = start.resolve(rl_config(hf_dir, **{"rl.max_new_tokens": 400, "rl.max_prompt_len": 100}))
    assert config.rl.seq_len == 504
    assert "measured prompts of rl.task are longer than 104 tokens and will be skipped" in capsys.readouterr().out
    with pytest.raises(config_lib.ConfigError, match=r"no prompt of rl\.task='asdiv' fits.*longest"):
        start.resolve(rl_config(hf_dir, **{"rl.max_prompt_len": 5}))


def test_a_template_that_cannot_render_tool_calls_is_refused_when_tools_are_used(hf_dir, tmp_path):
    from rlvr.trainers import sft

    tools = rl_config(hf_dir, **{"rl.task": "tool_calc", "rl.seq_len": 512})
    start.resolve(tools)  # the checkpoint's ChatML template renders tool calls
    with pytest.raises(config_lib.ConfigError, match=r"tokenizer\.chat_template cannot render tool calls.*rl\.task "
                                                      r"\(tool_calc\) uses tools.*'chatml'"):
        start.resolve(rl_config(hf_dir, **{"rl.task": "tool_calc", "rl.seq_len": 512,
                                           "tokenizer.chat_template": NO_TOOLS}))
    config = config_lib.load_config("configs/sft_tiny.py:smoke", {"tokenizer.chat_template": NO_TOOLS})
    with pytest.raises(config_lib.ConfigError, match=r"tokenizer\.chat_template cannot render tool calls.*the data"):
        sft.build_data(config, start.build_tokenizer(start.tokenizer_settings(config)))


def test_a_warm_start_on_a_checkpoint_must_be_asked_for(hf_dir):
    config = rl_config(hf_dir, **{"rl.sft_steps": 10})
    with pytest.raises(config_lib.ConfigError, match=r"rl\.sft_steps=10 would run an SFT warm start.*"
                                                      r"rl\.sft_steps=0.*rl\.sft_on_checkpoint=True"):
        start.validate(config, jax.device_count(), TRAINERS)
    start.validate(rl_config(hf_dir, **{"rl.sft_steps": 10, "rl.sft_on_checkpoint": True}), jax.device_count(),
                   TRAINERS)
    with pytest.raises(config_lib.ConfigError, match=r"rl\.max_new_tokens is not set"):
        start.resolve(rl_config(hf_dir, **{"rl.max_new_tokens": 0}))


def test_the_cli_reports_an_override_contradicting_the_checkpoint_in_one_line(hf_dir, tmp_path, repo_root, python):
    cmd = [python, "-m", "rlvr.main", f"--config=configs/recipes/grpo_math.py:{hf_dir},smoke",
           f"--workdir={tmp_path}", "--config.model.num_heads=8"]
    # JAX_PLATFORMS=cpu: libtpu (the tpu extra) otherwise writes its own start-up warnings to stderr when
    # it finds no TPU, depending on whether another process holds its lock; the test is about rlvr's line
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"config error: model.num_heads=8 (checkpoint: 4) contradicts the architecture of init.hf_checkpoint={hf_dir}: "
        "drop this override (the checkpoint's architecture is used)."]


def test_export_verify_compares_against_transformers(hf_dir, tmp_path):
    """The export check is not vacuous: another model's weights give other greedy tokens."""
    from rlvr import api
    from rlvr.export import verify

    config = config_lib.load_config("configs/recipes/grpo_math.py:" + hf_dir + ",smoke")
    model = api.build_model(config)
    model.tokenizer = api.build_tokenizer(config)
    other = write_random_hf(str(tmp_path / "other"), "qwen3", max_position_embeddings=512, seed=1)
    assert verify(model, hf_dir)["same_tokens"]
    report = verify(model, other)
    assert report["same_prompt_ids"] and not report["same_tokens"]


def test_explicit_budgets_sample_a_slow_family_for_seconds_not_minutes():
    """With rl.seq_len given, the prompt measurement only warns, so a slow procedural family is drawn
    for at most `seconds` after one task of each level and split; with derived budgets, all of them."""
    import time
    import types

    from rlvr.budgets import sample_tasks
    from rlvr.tasks.base import HELD_OUT, TRAIN

    class Slow:  # a procedural family whose generator takes 50 ms a task
        def levels(self):
            return [1, 2, 3]

        def task(self, index, stream, level):
            time.sleep(0.05)
            return index, stream, level

    mixture = types.SimpleNamespace(families={"slow": Slow()})
    cut = sample_tasks(mixture, per_level=16, seconds=0.2)
    assert {(stream, level) for _, stream, level in cut[:6]} == {(s, lv) for s in (TRAIN, HELD_OUT) for lv in (1, 2, 3)}
    assert 6 <= len(cut) <= 12  # the first round (0.3 s), then nothing: past 0.2 s already
    every = sample_tasks(mixture, per_level=2)
    assert sorted(every) == sorted((i, s, lv) for i in range(2) for s in (TRAIN, HELD_OUT) for lv in (1, 2, 3))
