"""Checkpoints: a run killed with SIGKILL resumes to bitwise the same params."""

import os
import signal
import subprocess
import time

import jax
import numpy as np

from rlvr import api, config_lib
from rlvr.train import step as step_lib
from rlvr.train.checkpoint import Checkpointer
from rlvr.train.optimizer import build_optimizer

STEPS, EVERY = 60, 10
ARGS = [f"--config.train.num_steps={STEPS}", f"--config.checkpoint.every_steps={EVERY}",
        "--config.train.log_every=5", "--config.train.eval_examples=2"]


def _command(python, workdir):
    return [python, "-m", "rlvr.main", "--config=configs/tiny.py:smoke", f"--workdir={workdir}", *ARGS]


def _final_state(workdir):
    config = config_lib.load_config("configs/tiny.py:smoke")
    mesh = api.build_mesh(config)
    cfg = api.ModelConfig.from_mapping(config.model)
    optimizer = build_optimizer(config.optimizer, STEPS)
    shardings = step_lib.state_shardings(cfg, optimizer, mesh)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    assert ckpt.latest_step() == STEPS
    state, extra = ckpt.restore(step_lib.abstract_state(cfg, optimizer, shardings))
    ckpt.close()
    return jax.device_get(state), extra


def _complete_steps(workdir):
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def test_kill_and_resume_is_bitwise_identical(repo_root, python, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(_command(python, straight), cwd=repo_root, check=True, capture_output=True, timeout=300)

    proc = subprocess.Popen(_command(python, killed), cwd=repo_root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not _complete_steps(killed) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps_at_kill = _complete_steps(killed)
    assert steps_at_kill and max(steps_at_kill) < STEPS, f"kill came too late: {steps_at_kill}"

    resumed = subprocess.run(_command(python, killed), cwd=repo_root, check=True,
                             capture_output=True, text=True, timeout=300)
    assert f"resumed from step {max(steps_at_kill)}" in resumed.stdout

    want, want_extra = _final_state(straight)
    got, got_extra = _final_state(killed)
    assert got_extra == want_extra == {"data": {"next_batch": STEPS}}
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_incomplete_save_is_never_restored(tmp_path):
    """A directory left by a save killed mid-write is ignored; the last complete one loads."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = {"w": jax.device_put(np.arange(4.0, dtype=np.float32), sh)}
    ckpt = Checkpointer(str(tmp_path), keep=2, async_save=True)
    ckpt.save(1, state, {"data": {"next_batch": 1}}, force=True)
    ckpt.wait()
    os.makedirs(tmp_path / "2.orbax-checkpoint-tmp-1234" / "state")  # a torn save
    ckpt.close()
    reopened = Checkpointer(str(tmp_path), keep=2)
    assert reopened.latest_step() == 1
    restored, extra = reopened.restore(state)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4.0))
    assert extra == {"data": {"next_batch": 1}}
    reopened.close()


def test_saving_small_replicated_arrays_compiles_nothing(tmp_path):
    """Orbax split each replicated array across the 8 replicas to save it, compiling a slicing program
    per shape: the first save of a tiny VLM's state took 14 s of compiles. Small arrays are now written
    from one replica; a save of arrays of six new shapes compiles no program, and restores them."""
    from jax._src import dispatch, monitoring

    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    columns = np.ones((1, 8), np.float32)  # a dimension the 8 replicas divide: orbax would split it
    state = {f"w{n}": jax.device_put(np.arange(8.0 * n + 3, dtype=np.float32)[:, None] * columns, replicated)
             for n in range(1, 7)}
    compiles = []

    def listener(event, duration, **_):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles.append(duration)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        ckpt = Checkpointer(str(tmp_path), keep=1)
        ckpt.save(1, state, {}, force=True)
        ckpt.wait()
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    restored, _ = ckpt.restore(state)
    ckpt.close()
    for key, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(value))
