"""'Has a pulse': the real trainers, 2 steps, tiny model; resume and reference-mode invariances."""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest

from rlvr import config_lib
from rlvr.main import run


def _run(spec, workdir, **overrides):
    config = config_lib.load_config(spec, overrides)
    return run(config, str(workdir))


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _assert_pulse(workdir, summary):
    assert np.isfinite(summary["final_step"])
    records = [m for m in _metrics(workdir) if "loss" in m]
    assert records and all(np.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in records)
    assert {"tokens_per_s", "mfu", "step_time_s", "learning_rate"} <= set(records[-1])
    assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
    assert os.path.exists(os.path.join(workdir, "config.json"))
    assert os.path.exists(os.path.join(workdir, "versions.json"))


def test_sft_chat_has_a_pulse(tmp_path):
    summary = _run("configs/sft_tiny.py:smoke", tmp_path, **{"data.seq_len": 256, "data.batch_size": 8})
    _assert_pulse(tmp_path, summary)
    assert np.isfinite(summary["heldout_loss"])


@pytest.mark.parametrize("loss", ["dpo", "cdpo", "ipo", "simpo", "orpo"])
def test_preference_losses_have_a_pulse(tmp_path, loss):
    summary = _run(f"configs/dpo_tiny.py:{loss},smoke", tmp_path)
    _assert_pulse(tmp_path, summary)
    assert summary["loss_type"] == loss and 0.0 <= summary["heldout_accuracy"] <= 1.0


def test_reward_model_has_a_pulse(tmp_path):
    summary = _run("configs/rm_tiny.py:smoke", tmp_path)
    _assert_pulse(tmp_path, summary)
    assert 0.0 <= summary["heldout_ece"] <= 1.0


def test_online_and_precomputed_reference_agree(tmp_path):
    a = _run("configs/dpo_tiny.py:smoke", tmp_path / "pre")
    b = _run("configs/dpo_tiny.py:online,smoke", tmp_path / "online")
    first_a, first_b = (next(m for m in _metrics(w) if "loss" in m) for w in (tmp_path / "pre", tmp_path / "online"))
    assert first_a["loss"] == pytest.approx(first_b["loss"], rel=1e-5)  # policy == reference at step 0
    assert first_a["loss"] == pytest.approx(np.log(2), rel=1e-5)
    assert a["heldout_accuracy"] == pytest.approx(b["heldout_accuracy"])


def test_dpo_resume_matches_straight_run(tmp_path):
    """Resume from the step-2 checkpoint of a 4-step run (as after a crash right after that
    save): the reference table is rebuilt and the run ends exactly where the straight one did."""
    overrides = {"train.num_steps": 4, "checkpoint.every_steps": 2}
    straight = tmp_path / "straight"
    _run("configs/dpo_tiny.py:smoke", straight, **overrides)
    split = tmp_path / "split"
    shutil.copytree(straight / "checkpoints", split / "checkpoints")
    shutil.rmtree(split / "checkpoints" / "4")
    _run("configs/dpo_tiny.py:smoke", split, **overrides)
    want = [m for m in _metrics(straight) if "loss" in m][-1]
    got = [m for m in _metrics(split) if "loss" in m][-1]
    assert got["step"] == want["step"] == 4
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]


def test_bad_job_settings_are_reported(tmp_path):
    with pytest.raises(config_lib.ConfigError, match="value_head"):
        _run("configs/rm_tiny.py:smoke", tmp_path, **{"model.value_head": False})
    assert jax.device_count() == 8
