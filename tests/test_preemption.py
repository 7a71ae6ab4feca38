"""SIGTERM (preemption) during a run: the job saves a checkpoint at the next step boundary and
exits with PREEMPTED_EXIT_CODE; the same command resumes it. For async RL the batch being
generated at the signal is finished and saved, and the resumed run trains exactly that batch."""

import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from rlvr import api
from rlvr.train.preemption import PREEMPTED_EXIT_CODE, PreemptionGuard

pytestmark = pytest.mark.slow
TIMEOUT = 300


def _metrics(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _checkpoints(workdir):
    directory = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []


def _extra(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "extra", "metadata")) as f:
        return json.load(f)


def _command(python, spec, workdir, overrides):
    return [python, "-m", "rlvr.main", f"--config={spec}", f"--workdir={workdir}",
            *[f"--config.{k}={v}" for k, v in overrides.items()]]


def _env(tmp_path_factory):
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.getbasetemp() / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _terminate_when(command, repo_root, env, log, ready):
    """Starts `command`, sends SIGTERM once `ready()` holds, returns (exit code, log text)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=repo_root, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.time() + TIMEOUT
        while not ready() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TIMEOUT)
    with open(log) as f:
        return proc.returncode, f.read()


def _run(command, repo_root, env, log):
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=repo_root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    with open(log) as f:
        text = f.read()
    assert done.returncode == 0, text[-3000:]
    return text


def test_guard_sets_the_flag_on_sigterm_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.time() + 5
        while not guard.requested and time.time() < deadline:
            time.sleep(0.01)
        assert guard.requested
    assert signal.getsignal(signal.SIGTERM) == before


def test_sft_sigterm_checkpoints_exits_and_resumes_to_the_same_weights(tmp_path, tmp_path_factory, repo_root,
                                                                       python):
    spec = "configs/sft_tiny.py:smoke"
    overrides = {"train.num_steps": 30, "train.log_every": 1, "checkpoint.every_steps": 1000,
                 "train.tensorboard": False, "data.seq_len": 256, "data.batch_size": 8}
    env = _env(tmp_path_factory)
    reference = tmp_path / "reference"
    _run(_command(python, spec, reference, overrides), repo_root, env, f"{reference}.log")

    workdir = tmp_path / "preempted"
    command = _command(python, spec, workdir, overrides)
    code, log = _terminate_when(command, repo_root, env, f"{workdir}.log", lambda: len(_metrics(workdir)) >= 3)
    saved = _checkpoints(workdir)
    assert code == PREEMPTED_EXIT_CODE, log[-3000:]
    assert len(saved) == 1 and 0 < saved[0] < 30, saved
    assert f"checkpoint saved at step {saved[0]}" in log

    resumed = _run(command, repo_root, env, f"{workdir}.resumed.log")
    assert f"resumed from step {saved[0]}" in resumed
    for a, b in zip(jax.tree.leaves(jax.device_get(api.load_trained(str(workdir)).params)),
                    jax.tree.leaves(jax.device_get(api.load_trained(str(reference)).params)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_async_rl_sigterm_saves_the_in_flight_batch_and_trains_it_after_resume(tmp_path, tmp_path_factory,
                                                                              repo_root, python):
    steps = 6
    overrides = {"train.num_steps": steps, "train.tensorboard": False, "checkpoint.every_steps": 100,
                 "rl.sft_steps": 0, "rl.mode": "async", "rl.max_staleness": 1, "rl.max_new_tokens": 20,
                 "rl.seq_len": 32, "rl.engine.decode_steps": 2, "rl.engine.max_slots": 16,
                 "optimizer.warmup_steps": 0}
    workdir = tmp_path / "rl"
    command = _command(python, "configs/quickstart.py:smoke", workdir, overrides)
    env = _env(tmp_path_factory)
    code, log = _terminate_when(command, repo_root, env, f"{workdir}.log", lambda: len(_metrics(workdir)) >= 2)
    saved = _checkpoints(workdir)
    assert code == PREEMPTED_EXIT_CODE, log[-3000:]
    assert len(saved) == 1 and 2 <= saved[0] < steps, saved
    at = saved[0]
    producer = _extra(workdir, at)["producer"]
    # the batch for the next step was finished before the checkpoint (drained), not dropped
    assert producer["buffered"] and producer["buffered"][0]["step"] == at
    assert producer["cursor"] == producer["buffered"][-1]["cursor_end"]
    batch = producer["buffered"][0]["samples"]

    resumed = _run(command, repo_root, env, f"{workdir}.resumed.log")
    assert f"resumed from step {at}" in resumed
    rows = _metrics(workdir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # every step once
    first = rows[at]
    assert first["reward"] == pytest.approx(float(np.mean([s["rewards"]["reward"] for s in batch])))
    assert first["response_length"] == pytest.approx(float(np.mean([len(s["output_ids"]) for s in batch])))
    assert [h["step"] for h in _extra(workdir, steps)["history"]] == list(range(1, steps + 1))
