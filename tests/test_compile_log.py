"""rlvr.compile_log: the persistent compilation cache serves a program compiled before (a cache hit
after the in-memory caches are cleared, as in a second process), and the compile log records every
program with its seconds and cache outcome; an RL job writes compile.jsonl and per-step compile_s."""

import json
import os

import jax
import jax.numpy as jnp
import pytest

from rlvr import compile_log, config_lib, main

NAMES = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def restore_jax_cache_settings():
    from jax._src import compilation_cache

    saved = {name: getattr(jax.config, name) for name in NAMES}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def _scaled_sine(x):
    return jnp.sin(x) * 3.0 + x @ x.T


def test_second_compile_is_a_cache_hit_and_logged(tmp_path, restore_jax_cache_settings):
    cache = tmp_path / "cache"
    assert compile_log.enable_cache(str(cache), min_compile_s=0.0) == str(cache)
    x = jnp.arange(64.0).reshape(8, 8)  # compiled before the log opens: not in it
    with compile_log.CompileLog(str(tmp_path / "work"), print_min_s=0.0) as log:
        first = jax.jit(_scaled_sine)(x)
        jax.clear_caches()  # what a new process starts with: only the disk cache
        second = jax.jit(_scaled_sine)(x)
    mine = [r for r in log.records if r["program"] == "jit(_scaled_sine)"]
    assert [r["cache"] for r in mine] == ["miss", "hit"]
    assert all(r["compile_s"] >= 0 and r["lower_s"] > 0 for r in mine)
    assert any(name.startswith("jit__scaled_sine") for name in os.listdir(cache))
    with open(tmp_path / "work" / "compile.jsonl") as f:
        assert [json.loads(line) for line in f] == log.records
    assert log.summary()["compile/cache_hits"] >= 1
    assert float(jnp.max(jnp.abs(first - second))) == 0.0


def test_empty_cache_dir_turns_the_cache_off(tmp_path, restore_jax_cache_settings):
    assert compile_log.enable_cache("", 0.0) is None
    with compile_log.CompileLog(None, print_min_s=0.0) as log:
        jax.jit(lambda v: v * 7.0 - 1.0)(jnp.ones(3))
    assert log.records and all(r["cache"] == "off" for r in log.records)


def test_default_cache_dir_gives_way_to_the_jax_environment_variable(tmp_path, monkeypatch,
                                                                     restore_jax_cache_settings):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert compile_log.enable_cache(compile_log.DEFAULT_CACHE_DIR) == str(tmp_path / "env")
    assert compile_log.enable_cache(str(tmp_path / "mine")) == str(tmp_path / "mine")


def test_negative_print_threshold_is_a_config_error():
    config = config_lib.load_config("configs/quickstart.py:smoke", {"compile.print_min_s": -1.0})
    with pytest.raises(config_lib.ConfigError, match="compile.print_min_s"):
        config_lib.validate(config, jax.device_count())


@pytest.mark.slow
def test_rl_job_logs_every_program_and_each_steps_compile_seconds(tmp_path, restore_jax_cache_settings):
    overrides = {"train.num_steps": 2, "train.tensorboard": False, "rl.sft_steps": 0, "rl.eval_examples": 2,
                 "compile.cache_dir": str(tmp_path / "cache"), "compile.print_min_s": 0.0}
    main.run(config_lib.load_config("configs/quickstart.py:smoke", overrides), str(tmp_path / "run"))
    with open(tmp_path / "run" / "compile.jsonl") as f:
        records = [json.loads(line) for line in f]
    programs = {r["program"] for r in records}
    assert "jit(step)" in programs, programs  # the train step (rlvr.train.step.build_train_step)
    assert len(programs) >= 4, programs  # and the engine's prefill/decode programs
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        steps = [json.loads(line) for line in f]
    assert steps[0]["compile_s"] > 0  # the first step compiles the train step
    with open(tmp_path / "run" / "summary.json") as f:
        assert json.load(f)["compile/programs"] == len(records)
