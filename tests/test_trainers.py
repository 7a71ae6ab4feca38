"""'Has a pulse': the real trainers, 2 steps, tiny model; resume and reference-mode invariances."""

import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
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


def _heldout_scores(workdir, config):
    """Independent reference for the held-out pair metrics: each held-out pair's score recomputed
    here from the saved policy (and the initial weights, the DPO reference) with a plain forward
    pass and NumPy: DPO-family log π/π_ref summed over the response, SimPO/ORPO the length-averaged
    log-prob, the reward model its value at the last response token."""
    from rlvr import api
    from rlvr.data.pairs import PairStream
    from rlvr.data.sources import load_records
    from rlvr.models.transformer import forward, forward_with_values

    trained, initial, tokenizer = api.load_trained(str(workdir)), api.build_model(config), api.build_tokenizer(config)
    records = load_records(config.data, "eval")
    stream = PairStream(records, tokenizer, config.data.batch_size, config.data.seq_len, config.seed, False)

    def side(model, rows):
        args = [jnp.asarray(rows[k]) for k in ("tokens", "positions", "segment_ids")]
        mask = rows["loss_mask"][:, 1:] * (rows["segment_ids"][:, 1:] == rows["segment_ids"][:, :-1])
        if config.job == "rm":
            values = np.asarray(forward_with_values(model.cfg, model.params, *args)[1])
            last = np.array([np.nonzero(m)[0].max() for m in rows["loss_mask"]])
            return values[np.arange(len(last)), last]
        logits = np.asarray(forward(model.cfg, model.params, *args)[0], np.float64)[:, :-1]
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        logp = np.take_along_axis(logp, rows["tokens"][:, 1:, None], -1)[..., 0]
        total = (logp * mask).sum(1)
        return total / mask.sum(1) if config.preference.loss in ("simpo", "orpo") else total

    scores = {"chosen": [], "rejected": []}
    for start in range(0, len(records), stream.pairs_per_batch):
        batch, take = stream.batch_at(start), min(stream.pairs_per_batch, len(records) - start)
        for name in scores:
            rows = {k: batch[f"{name}_{k}"] for k in ("tokens", "positions", "segment_ids", "loss_mask")}
            score = side(trained, rows)
            if config.job == "dpo" and config.preference.loss in ("dpo", "cdpo", "ipo"):
                score = score - side(initial, rows)
            scores[name].append(score[:take])
    return np.concatenate(scores["chosen"]), np.concatenate(scores["rejected"])


def test_sft_chat_has_a_pulse(tmp_path):
    summary = _run("configs/sft_tiny.py:smoke", tmp_path, **{"data.seq_len": 256, "data.batch_size": 8})
    _assert_pulse(tmp_path, summary)
    assert np.isfinite(summary["heldout_loss"])


# One job per way the trainer scores a pair: against the reference (dpo; cdpo and ipo only change the
# loss of the same log-ratios) and reference-free, length-averaged (orpo, like simpo). Every loss is
# checked on hand examples in tests/test_preference_losses.py.
@pytest.mark.parametrize("loss", ["dpo", "orpo"])
def test_preference_losses_have_a_pulse(tmp_path, loss):
    summary = _run(f"configs/dpo_tiny.py:{loss},smoke", tmp_path)
    _assert_pulse(tmp_path, summary)
    assert summary["loss_type"] == loss
    chosen, rejected = _heldout_scores(tmp_path, config_lib.load_config(f"configs/dpo_tiny.py:{loss},smoke"))
    assert summary["heldout_accuracy"] == pytest.approx(np.mean((chosen > rejected) + 0.5 * (chosen == rejected)))
    assert summary["heldout_margin"] == pytest.approx(np.mean(chosen - rejected), rel=1e-4, abs=1e-5)


def test_reward_model_has_a_pulse(tmp_path):
    summary = _run("configs/rm_tiny.py:smoke", tmp_path)
    _assert_pulse(tmp_path, summary)
    chosen, rejected = _heldout_scores(tmp_path, config_lib.load_config("configs/rm_tiny.py:smoke"))
    assert summary["heldout_accuracy"] == pytest.approx(np.mean((chosen > rejected) + 0.5 * (chosen == rejected)))
    p = 1.0 / (1.0 + np.exp(-(chosen - rejected)))  # ECE over both orders of each pair, 10 equal bins
    probs, labels = np.concatenate([p, 1 - p]), np.concatenate([np.ones_like(p), np.zeros_like(p)])
    bins = np.minimum((probs * 10).astype(int), 9)
    ece = sum(abs(labels[bins == b].mean() - probs[bins == b].mean()) * (bins == b).sum() for b in set(bins))
    assert summary["heldout_ece"] == pytest.approx(ece / len(probs), abs=1e-5)


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
