"""The native XLA:CPU kernels' build and FFI boundary (rlvr.kernels.native_build, paged_attention/native.cc;
issue 47, item 6): a failed build is logged once with the compiler's message; the sources build with
-Wall -Wextra and no warning; the paged-attention handler refuses inconsistent buffers with an error
naming the problem (called directly, past `paged_attention`'s own checks), instead of reading out of
bounds."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rlvr.kernels import native_build
from rlvr.kernels.paged_attention import native as paged_native


def test_a_failed_build_is_logged_once_with_the_compilers_message(tmp_path, monkeypatch, caplog):
    """With "auto", a kernel that does not build falls back quietly to the slower path; the reason (here
    the compiler's error, a missing header) is logged once per process, not per call."""
    monkeypatch.setenv("RLVR_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "broken" / "native.cc"
    source.parent.mkdir()
    source.write_text('#include "no_such_header.h"\n')
    monkeypatch.setattr(native_build, "_built", {})
    with caplog.at_level(logging.WARNING, logger="rlvr.kernels.native_build"):
        reasons = [native_build.unavailable_reason(source, "Nothing", "rlvr_test_broken", "the broken kernel")
                   for _ in range(3)]
    assert reasons[0] and reasons == [reasons[0]] * 3 and "no_such_header.h" in reasons[0]
    (record,) = [r for r in caplog.records if r.name == "rlvr.kernels.native_build"]
    assert "the broken kernel" in record.getMessage() and "no_such_header.h" in record.getMessage()


def test_the_kernels_build_with_warnings_on_and_report_none(tmp_path, monkeypatch, caplog):
    """-Wall -Wextra: an unused variable in a source is reported (logged); the kernels' sources
    build without a warning (jaxlib's headers are system headers: their warnings are not ours)."""
    monkeypatch.setenv("RLVR_KERNEL_CACHE", str(tmp_path / "cache"))
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    warned = tmp_path / "warned" / "native.cc"
    warned.parent.mkdir()
    warned.write_text("int Twice(int x) { int unused = 0; return 2 * x; }\n")
    with caplog.at_level(logging.WARNING, logger="rlvr.kernels.native_build"):
        native_build._library(compiler, warned)
    assert "-Wunused-variable" in caplog.text
    caplog.clear()
    kernels = os.path.dirname(native_build.__file__)
    with caplog.at_level(logging.WARNING, logger="rlvr.kernels.native_build"):
        for name in ("paged_attention", "packed_matmul", "causal_attention"):
            native_build._library(compiler, Path(kernels) / name / "native.cc")
    assert caplog.text == ""


def _arrays(**change):
    """A valid call of the paged-attention target (2 rows of 1 query, 4 heads over 2 kv heads, 3 pages
    of 4 slots), with `change` applied."""
    rng = np.random.default_rng(0)
    args = {"q": rng.standard_normal((2, 1, 4, 8)).astype(np.float32),
            "k": rng.standard_normal((1, 3, 4, 2, 8)).astype(np.float32),
            "v": rng.standard_normal((1, 3, 4, 2, 8)).astype(np.float32),
            "table": np.array([[0, 1], [2, 0]], np.int32), "lengths": np.array([3, 5], np.int32),
            "layer": np.zeros(1, np.int32)}
    return args | change


def _raw_call(q, k, v, table, lengths, layer):
    """The FFI target itself, past `native_paged_attention`'s shape handling (what any caller can pass)."""
    assert paged_native.native_unavailable_reason() is None
    call = jax.ffi.ffi_call(paged_native.TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return np.asarray(call(q, k, v, table, lengths, layer, sliding_window=np.int64(0), softcap=np.float32(0.0),
                           scale=np.float32(1.0)))


def test_the_raw_call_of_valid_buffers_runs():
    out = _raw_call(**_arrays())
    assert out.shape == (2, 1, 4, 8) and np.isfinite(out).all() and np.abs(out).sum() > 0


BF16 = np.zeros((1, 3, 4, 2, 8), jnp.bfloat16)


@pytest.mark.parametrize("change, message", [
    (dict(v=np.zeros((1, 2, 4, 2, 8), np.float32)), "v_pages must have k_pages' shape"),
    (dict(v=np.zeros((1, 3, 4, 2, 8, 1), np.float32)), "v_pages must have k_pages' shape"),
    (dict(v=BF16), "v_pages must have k_pages' dtype"),
    (dict(table=np.zeros((1, 2), np.int32)), "page_table must have one row per query row"),
    (dict(table=np.zeros((3, 2), np.int32)), "page_table must have one row per query row"),
    (dict(k=np.zeros((1, 0, 4, 2, 8), np.float32), v=np.zeros((1, 0, 4, 2, 8), np.float32)), "no pages"),
    (dict(k=np.zeros((0, 3, 4, 2, 8), np.float32), v=np.zeros((0, 3, 4, 2, 8), np.float32)), "no layers"),
    (dict(k=np.zeros((1, 3, 0, 2, 8), np.float32), v=np.zeros((1, 3, 0, 2, 8), np.float32)), "page size 0"),
    (dict(layer=np.zeros(0, np.int32)), "layer must be one int32"),
    (dict(lengths=np.array([3], np.int32)), "lengths must be"),
    (dict(q=np.zeros((2, 1, 3, 8), np.float32)), "multiple of"),
    (dict(q=np.zeros((2, 1, 4, 4), np.float32)), "head dim"),
])
def test_the_native_kernel_rejects_inconsistent_buffers(change, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _raw_call(**_arrays(**change))


def _attention_case(rng, b, t, h, kvh, d):
    """q, k, v, a packed mask in token order (row 0: two segments; row 1: short segments of 1-40
    tokens, so passes of queries start past the row's first keys; the last row ends in 5 padding
    tokens), RoPE tables at offset positions, and the live-query mask."""
    from rlvr.models.transformer import attention_mask, in_token_order

    q, k, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, kvh, kvh))
    seg, pos = np.ones((b, t), np.int32), np.tile(np.arange(t, dtype=np.int32), (b, 1)) + 7
    seg[0, t // 3:], pos[0, t // 3:] = 2, pos[0, t // 3:] - t // 3
    if b > 1:
        starts = np.cumsum(rng.integers(1, 41, size=t))
        seg[1] = np.searchsorted(starts, np.arange(t), side="right") + 1
        pos[1] = np.arange(t) - np.concatenate([[0], starts])[seg[1] - 1]
    seg[-1, t - 5:] = 0
    mask = in_token_order(attention_mask(*(jnp.asarray(a) for a in (pos, seg, pos, seg))))
    angles = jnp.asarray(pos, jnp.float32)[..., None] * (1e4 ** (-np.arange(d // 2) / (d // 2)))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return q, k, v, mask, jnp.cos(angles), jnp.sin(angles), jnp.asarray(seg != 0)[:, :, None, None]


@pytest.mark.parametrize("shape", [(2, 256, 4, 2, 64), (3, 37, 4, 1, 16), (2, 130, 8, 2, 128)])
@pytest.mark.parametrize("rope", [False, True])
def test_native_causal_attention_matches_plain_attention_and_its_gradients(shape, rope):
    """The training path's native attention (rlvr.kernels.causal_attention, fwd and bwd kernels) against
    plain-XLA attention (`dot_product_attention` over the full mask, after `apply_rope` when the kernel
    is given the tables): output and dq, dk, dv of a weighted sum over the live queries, with GQA,
    packed segments, padding, lengths that are not multiples of the kernels' tiles and head dims 16-128."""
    from rlvr.kernels.causal_attention import native_causal_attention

    from rlvr.models.layers import apply_rope, dot_product_attention

    q, k, v, mask, cos, sin, live = _attention_case(np.random.default_rng(0), *shape)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32)

    def reference(q, k, v):
        if rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return jnp.sum(jnp.where(live, dot_product_attention(q, k, v, mask), 0.0) * weights)

    def native(q, k, v):
        tables = (cos, sin) if rope else (None, None)
        return jnp.sum(jnp.where(live, native_causal_attention(q, k, v, mask, *tables), 0.0) * weights)

    want = jax.value_and_grad(reference, argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.value_and_grad(native, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-4)
    for name, g, w in zip(("dq", "dk", "dv"), got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("prompt, branch, branches", [(20, 24, 4), (50, 9, 6)])
def test_native_causal_attention_of_shared_prompt_branches_matches_plain_attention(prompt, branch, branches):
    """A shared-prompt row (`rl.share_prompts`: one prompt, then its completions side by side, each
    seeing the prompt and itself, not its siblings) against plain-XLA attention over the same mask: the
    kernels skip the key tiles no query of a pass sees, which here lie in the middle of the row."""
    from rlvr.kernels.causal_attention import native_causal_attention

    from rlvr.models.layers import dot_product_attention

    t = prompt + branch * branches
    owner = np.concatenate([np.full(prompt, -1), np.repeat(np.arange(branches), branch)])
    idx = np.arange(t)
    visible = (idx[None, :] <= idx[:, None]) & ((owner[None, :] == -1) | (owner[None, :] == owner[:, None]))
    mask = jnp.asarray(visible[None, None, None])
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, n, 32)), jnp.float32) for n in (4, 2, 2))
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
    want = jax.value_and_grad(lambda *a: jnp.sum(dot_product_attention(*a, mask) * weights), argnums=(0, 1, 2))(q, k, v)
    got = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(native_causal_attention(*a, mask) * weights),
                                     argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-4)
    for name, g, w in zip(("dq", "dk", "dv"), got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=2e-5, err_msg=name)


def test_native_causal_attention_gives_padding_queries_zeros():
    """A row of padding only (segment 0: no key visible) gets a zero output and zero gradients, not the
    uninitialised memory a skipped row would leave."""
    from rlvr.kernels.causal_attention import native_causal_attention

    q, k, v, mask, *_ = _attention_case(np.random.default_rng(2), 1, 5, 2, 2, 8)  # all 5 tokens are padding
    out, grads = jax.value_and_grad(lambda q, k, v: jnp.sum(native_causal_attention(q, k, v, mask) ** 2),
                                    argnums=(0, 1, 2))(q, k, v)
    assert float(out) == 0.0 and all(float(jnp.abs(g).max()) == 0.0 for g in grads)


def test_the_native_causal_attention_rejects_inconsistent_buffers():
    """Called directly past the Python wrapper, the forward target refuses a mask of the wrong shape
    and RoPE tables of the wrong shape with errors naming them."""
    from rlvr.kernels import causal_attention

    assert causal_attention.native_unavailable_reason() is None
    q = np.zeros((1, 4, 2, 8), np.float32)
    k = np.zeros((1, 4, 1, 8), np.float32)
    call = jax.ffi.ffi_call(causal_attention.FORWARD, (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                                       jax.ShapeDtypeStruct((1, 2, 4), jnp.float32)))
    ok = np.ones((1, 4, 4), np.uint8)
    tables = np.ones((1, 4, 8), np.float32)
    call(q, k, k, ok, tables, tables, scale=np.float32(1.0), rope=np.bool_(True))[0].block_until_ready()
    with pytest.raises(Exception, match="mask must be"):
        call(q, k, k, np.ones((1, 4, 3), np.uint8), tables, tables, scale=np.float32(1.0), rope=np.bool_(False))
    with pytest.raises(Exception, match="cos and sin must be"):
        call(q, k, k, ok, tables[:, :3], tables[:, :3], scale=np.float32(1.0), rope=np.bool_(True))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_matmul_has_the_products_gradients_from_a_transposed_copy(out_dtype):
    """`rlvr.models.layers.cpu_matmul`: value and both gradients are those of x @ w; in the compiled
    gradient no product contracts its left operand over the major axis (the slow form XLA:CPU picks for
    the plain transpose rule's xᵀ·dy), the reason the function exists."""
    from rlvr.models.layers import _product, cpu_matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32)
    dy = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    if out_dtype == jnp.bfloat16:
        x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * dy)

    want = jax.value_and_grad(loss(lambda x, w: _product(x, w, out_dtype)), argnums=(0, 1))(x, w)
    fast = jax.jit(jax.value_and_grad(loss(lambda x, w: cpu_matmul(x, w, jnp.dtype(out_dtype))), argnums=(0, 1)))
    got = fast(x, w)
    tolerance = 1e-5 if out_dtype == jnp.float32 else 2e-2
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=tolerance, atol=tolerance)
    hlo = fast.lower(x, w).compile().as_text()
    assert "lhs_contracting_dims={1}" in hlo and "lhs_contracting_dims={0}" not in hlo


def test_the_cpu_train_step_runs_the_native_attention_with_the_plain_paths_loss_and_gradients(monkeypatch):
    """The model's training forward on CPU (one device, float32): attention and RoPE run in the native
    kernels and every projection's weight gradient through `cpu_matmul`. SFT loss and gradients of a
    tiny Qwen3-style model (qk-norm, GQA) over packed rows equal those of the plain-XLA path (the
    kernels switched off), and the compiled step does call the kernels."""
    from rlvr.models import transformer
    from rlvr.models.config import ModelConfig
    from rlvr.models.params import init_params
    from rlvr.trainers.sft import sft_loss

    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    from rlvr import sharding

    params = init_params(cfg, jax.random.key(0), sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))
    rng = np.random.default_rng(0)
    seg = np.ones((2, 24), np.int32)
    seg[0, 10:], seg[1, 20:] = 2, 0
    pos = np.where(seg[0] == 2, np.arange(24) - 10, np.arange(24))[None].repeat(2, 0).astype(np.int32)
    batch = {"tokens": jnp.asarray(rng.integers(0, 64, (2, 24)), jnp.int32), "positions": jnp.asarray(pos),
             "segment_ids": jnp.asarray(seg), "loss_mask": jnp.asarray(seg != 0, jnp.int32)}
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])

    def compiled():  # as the train step traces it: under its (one-device) mesh
        with sharding.activation_sharding(mesh):
            step = jax.jit(jax.value_and_grad(lambda p: sft_loss(cfg, p, batch, None, None)[0]))
            return step, step.lower(params).as_text()

    step, text = compiled()
    assert "rlvr_causal_attention_bwd" in text
    native = step(params)
    monkeypatch.setattr(transformer, "native_training_attention", lambda q, k: False)
    plain, text = compiled()
    assert "rlvr_causal_attention" not in text
    want = plain(params)
    np.testing.assert_allclose(native[0], want[0], rtol=1e-5)
    for g, w in zip(jax.tree.leaves(native[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
