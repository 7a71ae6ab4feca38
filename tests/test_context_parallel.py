"""Context parallelism: ring and Ulysses attention over the `sequence` mesh axis (8 fake CPU devices).

Kernels against the float32 reference (forward and each gradient, packed segments, causal),
the model with model.attention = ring / ulysses against the dense "xla" model (loss and
gradients), per-device memory from the AOT compile (unsharded vs sequence-sharded), and the
SFT and RL configs of configs/long_context.py end to end.
"""

import functools
import json
import logging
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec
from rlvr.kernels import context_parallel as cp
from rlvr.kernels.context_parallel import layout, reference
from rlvr.kernels.context_parallel.ring import merge

from rlvr import config_lib, sharding
from rlvr.aot import analyze
from rlvr.main import run
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.transformer import forward
from rlvr.trainers.sft import sft_loss

SMALL = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
             vocab_size=97, rope_theta=10_000.0)


def _packed(batch, length, seed, pad=3):
    """Segment ids 1.. of random lengths (positions restart per segment), `pad` padding tokens at the end."""
    rng = np.random.default_rng(seed)
    seg, pos = np.zeros((batch, length), np.int32), np.zeros((batch, length), np.int32)
    for row in range(batch):
        cuts = sorted(rng.choice(np.arange(1, length - pad), 2, replace=False))
        bounds = [0, *cuts, length - pad]
        for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            seg[row, a:b], pos[row, a:b] = s + 1, np.arange(b - a)
    return jnp.asarray(seg), jnp.asarray(pos)


def _qkv(batch=2, length=32, heads=4, kv_heads=2, dim=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (batch, length, heads, dim)),
            jax.random.normal(keys[1], (batch, length, kv_heads, dim)),
            jax.random.normal(keys[2], (batch, length, kv_heads, dim)))


def _check_against_reference(fn, mesh, *, kv_heads=2, causal=True, sliding_window=0, seed=0, **options):
    """fn's output and d/dq, d/dk, d/dv of a weighted sum equal the float32 reference's (real rows)."""
    q, k, v = _qkv(kv_heads=kv_heads, seed=seed)
    seg, pos = _packed(q.shape[0], q.shape[1], seed)
    real = (seg != 0)[..., None, None]
    weights = jax.random.normal(jax.random.key(seed + 1), q.shape)
    kwargs = dict(causal=causal, sliding_window=sliding_window)

    def loss(attention, q, k, v):
        out = attention(q, k, v, seg, seg, pos, pos, **kwargs)
        return jnp.sum(jnp.where(real, out, 0.0) * weights), out

    (_, want), want_grads = jax.value_and_grad(functools.partial(loss, cp.reference_attention), (0, 1, 2),
                                               has_aux=True)(q, k, v)
    sharded = functools.partial(fn, mesh=mesh, **options)
    (_, got), grads = jax.jit(jax.value_and_grad(functools.partial(loss, sharded), (0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_allclose(np.where(real, got, 0.0), np.where(real, want, 0.0), atol=2e-5)
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=5e-5, err_msg=f"d{name}")


# --- kernels ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_attention_equals_reference(n):
    _check_against_reference(cp.ring_attention, sharding.make_mesh({"data": 8 // n, "sequence": n}), seed=n)


@pytest.mark.parametrize("n", [2, 4])
def test_ulysses_attention_equals_reference(n):
    # 2 KV heads over n = 4: each KV head is repeated twice (GQA kept exact).
    _check_against_reference(cp.ulysses_attention, sharding.make_mesh({"data": 8 // n, "sequence": n}), seed=n)


def test_ring_without_causal_mask_and_with_sliding_window():
    mesh = sharding.make_mesh({"data": 2, "sequence": 4})
    _check_against_reference(cp.ring_attention, mesh, causal=False)
    # the plain-jnp block (used when the flash kernel is not installed) as the local attention
    _check_against_reference(cp.ring_attention, mesh, sliding_window=5, implementation="reference")


def test_context_parallel_with_tensor_and_replicated_heads():
    # 1 KV head does not divide over tensor = 2: heads stay replicated on that axis.
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "sequence": 2})
    _check_against_reference(cp.ring_attention, mesh, kv_heads=1)
    _check_against_reference(cp.ulysses_attention, mesh, kv_heads=2)


def test_clear_errors_for_heads_and_missing_mesh():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="4 heads .* not divisible by its size 8"):
        cp.ulysses_attention(q, k, v, mesh=sharding.make_mesh({"sequence": 8}))
    assert [cp.kv_head_repeats(8, kv, 4) for kv in (1, 2, 4, 8)] == [4, 2, 1, 1]
    with pytest.raises(ValueError, match="needs a mesh with a 'sequence' axis of size > 1"):
        cp.ring_attention(q, k, v)


def test_zigzag_layout_balances_causal_work():
    n, chunk = 4, 8
    length = 2 * n * chunk
    visible = np.tril(np.ones((length, length), bool))  # one causal segment
    per_device = lambda order: [int(visible[order[r * 2 * chunk:(r + 1) * 2 * chunk]].sum()) for r in range(n)]
    contiguous, zigzag = per_device(np.arange(length)), per_device(layout.zigzag_order(length, n))
    assert len(set(zigzag)) == 1 and sum(zigzag) == sum(contiguous)
    assert max(contiguous) > 3 * min(contiguous)
    np.testing.assert_array_equal(np.sort(layout.zigzag_order(length, n)), np.arange(length))


@settings(max_examples=5, deadline=None, derandomize=True)
@given(length=st.sampled_from([6, 16, 24]), split=st.integers(1, 23), kv_heads=st.sampled_from([1, 2]),
       seed=st.integers(0, 99))
def test_block_merge_equals_whole(length, split, kv_heads, seed):
    """The online-softmax merge of two key blocks' (out, lse) is attention over both (fully masked
    rows: out 0), the identity ring attention is built on."""
    split = min(split, length - 1)
    q, k, v = _qkv(1, length, 2, kv_heads, 8, seed)
    seg, pos = _packed(1, length, seed, pad=2)

    @jax.jit
    def merged(q, k, v, seg, pos):
        block = functools.partial(cp.block_attention, q, q_segment_ids=seg, q_positions=pos)
        a = block(k=k[:, :split], v=v[:, :split], kv_segment_ids=seg[:, :split], kv_positions=pos[:, :split])
        b = block(k=k[:, split:], v=v[:, split:], kv_segment_ids=seg[:, split:], kv_positions=pos[:, split:])
        return merge(*a, *b)[0], cp.reference_attention(q, k, v, seg, seg, pos, pos)

    np.testing.assert_allclose(*merged(q, k, v, seg, pos), atol=2e-5)


# --- the model -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batch_and_params():
    rng = np.random.default_rng(0)
    seg, pos = _packed(4, 40, 0)
    tokens = jnp.asarray(rng.integers(1, 97, (4, 40)), jnp.int32) * (seg != 0)
    loss_mask = jnp.asarray(rng.integers(0, 2, (4, 40)), jnp.int32)
    batch = {"tokens": tokens, "positions": pos, "segment_ids": seg, "loss_mask": loss_mask}
    one = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return batch, params_lib.init_params(ModelConfig(**SMALL), jax.random.key(0), one)


def _loss_and_grads(cfg, mesh, batch, params):
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))

    def fn(p, b):
        with sharding.activation_sharding(mesh):
            return jax.value_and_grad(lambda p: sft_loss(cfg, p, b, None, None)[0])(p)
    return jax.jit(fn)(params, batch)


@pytest.mark.parametrize("attention,mesh_shape", [("ring", {"sequence": 8}),  # 40 positions: padded to 48
                                                  ("ulysses", {"data": 2, "sequence": 4})])
def test_model_with_context_parallelism_equals_dense(batch_and_params, attention, mesh_shape):
    batch, params = batch_and_params
    want_loss, want = _loss_and_grads(ModelConfig(**SMALL), sharding.make_mesh({"data": 8}), batch, params)
    loss, grads = _loss_and_grads(ModelConfig(**SMALL, attention=attention), sharding.make_mesh(mesh_shape),
                                  batch, params)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for path, g, w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads), jax.tree.leaves(want),
                          strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, err_msg=str(path[0]))


def test_model_without_sequence_mesh_falls_back_to_flash_and_says_so(batch_and_params, caplog, monkeypatch):
    monkeypatch.setattr(reference, "_WARNED", set())  # logged once per process
    batch, params = batch_and_params
    args = (params, batch["tokens"], batch["positions"], batch["segment_ids"])
    want = forward(ModelConfig(**SMALL), *args)[0]
    with caplog.at_level(logging.WARNING):
        got = forward(ModelConfig(**SMALL, attention="ring"), *args)[0]
    real = np.asarray(batch["segment_ids"] != 0)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)
    assert caplog.text.count("model.attention='ring' without a mesh 'sequence' axis > 1") == 1


def test_config_validation_names_field_and_fix():
    with pytest.raises(ValueError, match=r"model\.attention: 'splash' is not one of"):
        ModelConfig(attention="splash")
    config = config_lib.load_config("configs/long_context.py:ring", {"mesh.sequence": 1, "mesh.data": 8})
    with pytest.raises(config_lib.ConfigError, match=r"mesh\.sequence, which is 1.*model\.attention='flash'"):
        config_lib.validate(config, 8)
    config = config_lib.load_config("configs/long_context.py:ulysses", {"mesh.sequence": 8, "mesh.data": 1})
    with pytest.raises(config_lib.ConfigError, match=r"model\.attention='ulysses' with mesh\.sequence=8"):
        config_lib.validate(config, 8)
    config_lib.validate(config_lib.load_config("configs/long_context.py:ring"), 8)
    assert config_lib.load_config("configs/long_context.py:ulysses").model.attention == "ulysses"


# --- memory and end to end -------------------------------------------------------------------------

LONG = 4096  # positions of one row: the dense unsharded step needs ~1.1 GiB per device, ring ~50 MiB
BUDGET = 256 * 2**20


def _env(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")
    return env


def _main(python, repo_root, tmp_path, spec, *flags):
    workdir = tmp_path / spec.split(":")[-1]
    cmd = [python, "-m", "rlvr.main", f"--config=configs/long_context.py:{spec}", f"--workdir={workdir}", *flags]
    done = subprocess.run(cmd, cwd=repo_root, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(workdir / "summary.json") as f:
        return json.load(f), done.stderr


def test_long_sequence_fits_the_budget_only_when_sequence_sharded(python, repo_root, tmp_path):
    """AOT per-device memory of one train step on a 4096-token row: over a 256 MiB budget with dense
    unsharded attention, under it with ring attention over mesh.sequence = 8 — and that step runs."""
    base = {"data.seq_len": LONG, "data.batch_size": 1}
    dense = analyze(config_lib.load_config("configs/long_context.py:ring", {
        **base, "model.attention": "xla", "mesh.sequence": 1, "mesh.data": 8}))  # the row replicated: unsharded
    ring = analyze(config_lib.load_config("configs/long_context.py:ring", base))
    assert dense["mesh"]["sequence"] == 1 and ring["mesh"]["sequence"] == 8
    assert dense["per_device_total_bytes"] > BUDGET > ring["per_device_total_bytes"], (dense, ring)
    summary, stderr = _main(python, repo_root, tmp_path, "ring", f"--config.data.seq_len={LONG}",
                            "--config.data.batch_size=1")
    assert summary["final_step"] == 2 and np.isfinite(summary["final_loss"])
    assert "flash path" not in stderr  # the train step ran ring attention, no fallback


def test_rl_trains_with_ring_attention(python, repo_root, tmp_path):
    summary, stderr = _main(python, repo_root, tmp_path, "rl_ring")
    assert summary["job"] == "rl" and summary["final_step"] == 2
    assert "heldout_accuracy_after" in summary and "flash path" not in stderr


@pytest.mark.parametrize("variant", ["ulysses", "flash"])
def test_sft_variants_train_as_plain_attention_does(tmp_path, variant):
    """The :ulysses and :flash SFT jobs end to end against the same job with plain attention
    (model.attention="xla", same mesh, data and seed): the loss logged at step 2, which follows step 1's
    update at the full learning rate (no warm-up) and so depends on the forward and the gradients, is the
    plain job's."""
    def logged_losses(attention):
        overrides = {"optimizer.warmup_steps": 0, **({"model.attention": "xla"} if attention == "xla" else {})}
        workdir = tmp_path / attention
        summary = run(config_lib.load_config(f"configs/long_context.py:{variant}", overrides), str(workdir))
        assert summary["final_step"] == 2
        with open(workdir / "metrics.jsonl") as f:
            return [(m["step"], m["loss"]) for m in map(json.loads, f) if "loss" in m]

    got, want = logged_losses(variant), logged_losses("xla")
    assert [s for s, _ in got] == [s for s, _ in want] == [2]
    assert got[0][1] == pytest.approx(want[0][1], rel=1e-4), (got, want)
