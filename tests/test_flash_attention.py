"""Flash attention (rlvr.kernels.flash_attention) against the float32 reference, forward (out, lse)
and every gradient (dq, dk, dv; the loss weights both out and lse, so gradients through lse are
checked too), for the Pallas kernels in interpret mode and the blockwise XLA path; the reference
against the model's own mask and attention; lowering of the kernels for TPU (Mosaic) and GPU
(Triton) from CPU; the entry point's error messages and implementation choice.

Hypothesis: 6 Pallas + 5 XLA examples, derandomized (plus 7 named Pallas cases). About 50 s of CPU
time in all (compiling the interpreted kernels dominates); the wall time grows on a loaded machine.
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rlvr.kernels.flash_attention import BlockSizes, api, flash_attention, reference_attention, reference_mask
from rlvr.kernels.flash_attention.common import AttentionSpec
from rlvr.kernels.flash_attention.pallas import flash_attention_pallas

from rlvr.models.transformer import attention_mask, causal_attention, dot_product_attention, in_token_order

# Max abs error allowed, as a fraction of max(1, max |reference|), per output and per gradient.
TOLERANCES = {
    "float32": {"out": 2e-5, "lse": 2e-5, "dq": 5e-5, "dk": 5e-5, "dv": 5e-5},
    "bfloat16": {"out": 2e-2, "lse": 2e-3, "dq": 4e-2, "dk": 4e-2, "dv": 4e-2},
}


def _segments(rng, b: int, n: int, padding: bool) -> np.ndarray:
    """Packed rows: ids 1, 2, ... in runs of random length; optionally trailing padding (id 0)."""
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n + 1), size=min(n, 2), replace=False))
        row = np.searchsorted(cuts, np.arange(n), side="right") + 1
        if padding and n > 1:
            row[n - rng.integers(1, max(2, n // 3)):] = 0
        rows.append(row)
    return np.stack(rows).astype(np.int32)


def _restart_positions(seg: np.ndarray) -> np.ndarray:
    """Positions counted from the start of each segment (how the data pipeline packs rows)."""
    pos = np.zeros_like(seg)
    for r, row in enumerate(seg):
        for i in range(1, len(row)):
            pos[r, i] = 0 if row[i] != row[i - 1] else pos[r, i - 1] + 1
    return pos


def make_case(seed=0, b=1, t=16, s=16, kv_heads=1, groups=1, d=16, dtype="float32", segments=None,
              q_offset=0, causal=True, sliding_window=0, softcap=0.0, blocks=None):
    """Inputs and keyword arguments of one call. segments: None | "packed" | "padded"."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    q, k, v = normal(b, t, kv_heads * groups, d), normal(b, s, kv_heads, d), normal(b, s, kv_heads, d)
    kwargs = {"causal": causal, "sliding_window": sliding_window, "softcap": softcap,
              "block_sizes": blocks or BlockSizes(8, 8)}
    q_pos, kv_pos = np.tile(np.arange(t), (b, 1)) + q_offset, np.tile(np.arange(s), (b, 1))
    if segments:
        if t == s and not q_offset:  # self-attention over packed rows
            q_seg = kv_seg = _segments(rng, b, t, segments == "padded")
            q_pos = kv_pos = _restart_positions(q_seg)
        else:
            q_seg, kv_seg = _segments(rng, b, t, segments == "padded"), _segments(rng, b, s, segments == "padded")
        kwargs.update(q_segment_ids=jnp.asarray(q_seg), kv_segment_ids=jnp.asarray(kv_seg))
    kwargs.update(q_positions=jnp.asarray(q_pos, jnp.int32), kv_positions=jnp.asarray(kv_pos, jnp.int32))
    weights = (normal(b, t, kv_heads * groups, d).astype(jnp.float32),
               jnp.asarray(rng.normal(size=(b, kv_heads * groups, t)), jnp.float32))
    return (q, k, v), kwargs, weights


def _loss_and_grads(fn, qkv, weights):
    """(out, lse), (dq, dk, dv) of a loss that weights both out and the finite lse entries."""

    def loss(q, k, v):
        out, lse = fn(q, k, v)
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights[1])
        return jnp.sum(out.astype(jnp.float32) * weights[0]) + lse_term, (out, lse)

    (_, outputs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*qkv)
    return outputs, grads


def check_against_reference(implementation: str, qkv, kwargs, weights):
    ref_kwargs = {n: x for n, x in kwargs.items() if n != "block_sizes"}
    ref_qkv = [x.astype(jnp.float32) for x in qkv]  # the same (possibly bf16-rounded) values, in f32
    (out, lse), grads = _loss_and_grads(
        lambda q, k, v: flash_attention(q, k, v, implementation=implementation, return_lse=True, **kwargs),
        qkv, weights)
    (ref_out, ref_lse), ref_grads = _loss_and_grads(
        lambda q, k, v: reference_attention(q, k, v, **ref_kwargs), ref_qkv, weights)
    dtype = str(qkv[0].dtype)
    assert out.dtype == qkv[0].dtype and lse.dtype == jnp.float32
    assert lse.shape == (qkv[0].shape[0], qkv[0].shape[2], qkv[0].shape[1])
    empty = np.isneginf(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty, err_msg="lse = -inf exactly where no key")
    np.testing.assert_array_equal(np.asarray(out, np.float32)[np.moveaxis(empty, 1, 2)], 0.0,
                                  err_msg="queries that see no key output 0")
    named = {"out": (out, ref_out), "lse": (jnp.where(empty, 0.0, lse), jnp.where(empty, 0.0, ref_lse)),
             "dq": (grads[0], ref_grads[0]), "dk": (grads[1], ref_grads[1]), "dv": (grads[2], ref_grads[2])}
    for name, (actual, expected) in named.items():
        actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
        assert np.isfinite(actual).all(), f"{name} has non-finite values"
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(actual, expected, rtol=0, atol=TOLERANCES[dtype][name] * scale,
                                   err_msg=f"{implementation}: {name} ({dtype})")


# ----------------------------------------------------------------------------------- the reference


def test_reference_mask_is_the_models_mask():
    rng = np.random.default_rng(1)
    seg = jnp.asarray(_segments(rng, 3, 21, padding=True))
    pos = jnp.asarray(_restart_positions(np.asarray(seg)) + 3)
    for window in (0, 4):
        ours = reference_mask(seg, seg, pos, pos, causal=True, sliding_window=window)
        np.testing.assert_array_equal(ours, attention_mask(pos, seg, pos, seg, window)[:, 0, 0])


def test_reference_matches_model_attention_and_hand_computed_lse():
    (q, k, v), kwargs, _ = make_case(seed=2, b=2, t=12, s=12, kv_heads=2, groups=2, d=8)
    out, lse = reference_attention(q, k, v)
    mask = attention_mask(kwargs["q_positions"], jnp.ones((2, 12), jnp.int32), kwargs["kv_positions"],
                          jnp.ones((2, 12), jnp.int32))
    np.testing.assert_allclose(out, dot_product_attention(q, k, v, mask), atol=1e-5)
    # Query 1 of batch 0, head 3 (KV head 1) sees keys 0 and 1.
    logits = np.asarray(k[0, :2, 1], np.float64) @ np.asarray(q[0, 1, 3], np.float64) / math.sqrt(8)
    np.testing.assert_allclose(lse[0, 3, 1], np.log(np.exp(logits).sum()), atol=1e-6)


def test_causal_attention_in_query_blocks_equals_the_dense_product():
    """The training path's long rows (`causal_attention`: query blocks attending only to the keys
    up to their own end) against the dense product, outputs and all three gradients on every real
    token: packed segments with restarting positions, trailing padding, with and without a sliding
    window; 1,300 tokens are 8 blocks, the last one short. The blocks must also cost fewer
    FLOPs than the dense form (XLA's count of the compiled forward)."""
    rng = np.random.default_rng(5)
    b, t, kv_heads, groups, d = 2, 1300, 2, 2, 16
    seg = jnp.asarray(_segments(rng, b, t, padding=True))
    pos = jnp.asarray(_restart_positions(np.asarray(seg)))
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((b, t, kv_heads * groups, d), (b, t, kv_heads, d), (b, t, kv_heads, d)))
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * (seg > 0)[:, :, None, None]  # real tokens only
    for window in (0, 300):
        mask = in_token_order(attention_mask(pos, seg, pos, seg, window))
        def loss(q, k, v, fn, mask=mask):
            out = fn(q, k, v, mask)
            return jnp.sum(out * weights), jnp.where(seg[:, :, None, None] > 0, out, 0.0)

        results = [jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)(q, k, v, fn)
                   for fn in (causal_attention, dot_product_attention)]
        (ours_grads, ours), (dense_grads, dense) = results
        np.testing.assert_allclose(ours, dense, rtol=0, atol=1e-5, err_msg=f"window {window}: outputs")
        for name, a, e in zip(("dq", "dk", "dv"), ours_grads, dense_grads, strict=True):
            np.testing.assert_allclose(a, e, rtol=0, atol=1e-5 * max(1.0, float(jnp.abs(e).max())),
                                       err_msg=f"window {window}: {name}")

    def flops(fn):  # XLA's count for the compiled forward
        cost = jax.jit(fn).lower(q, k, v, mask).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    # the blocks skip the keys after them: ~9/16 of the dense products here (8 blocks of 163 queries)
    assert flops(causal_attention) < 0.75 * flops(dot_product_attention)


@pytest.mark.parametrize("rows,length", [(2, 256), (4, 128)])
def test_causal_attention_cuts_short_training_rows_into_blocks(rows, length):
    """The benchmarks' training rows (SFT 8 x 256, GRPO 32 x 128) are short: `causal_attention` cuts
    them into query blocks too (fewer FLOPs than the dense product, by XLA's count of the compiled
    forward: 1/2 + 1/2^2 of it at 2 blocks, 5/8 at 4), with the dense product's outputs and
    gradients."""
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in ((rows, length, 4, 16), (rows, length, 2, 16), (rows, length, 2, 16)))
    pos = jnp.broadcast_to(jnp.arange(length), (rows, length))
    seg = jnp.ones((rows, length), jnp.int32)
    mask = in_token_order(attention_mask(pos, seg, pos, seg))
    loss = lambda q, k, v, fn: jnp.sum(jnp.sin(fn(q, k, v, mask)))
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (ours, ours_grads), (dense, dense_grads) = (grad(q, k, v, fn) for fn in (causal_attention, dot_product_attention))
    np.testing.assert_allclose(ours, dense, rtol=1e-5)
    for a, e in zip(ours_grads, dense_grads, strict=True):
        np.testing.assert_allclose(a, e, rtol=0, atol=1e-5)

    def flops(fn):
        cost = jax.jit(fn).lower(q, k, v, mask).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    assert flops(causal_attention) < 0.8 * flops(dot_product_attention)


# ----------------------------------------------------------------------------- Pallas (interpreted)

NAMED_CASES = {
    # Tiles whose position ranges touch (a query tile ending at position 8, a key tile starting at 8;
    # a window reaching exactly the last key of an earlier tile): catches off-by-one block skipping.
    "causal_mha_window_tile_edges": dict(t=16, s=24, kv_heads=2, groups=1, q_offset=1, sliding_window=3),
    "full_gqa2_softcap_ragged": dict(t=20, s=28, kv_heads=2, groups=2, causal=False, softcap=1.5,
                                     blocks=BlockSizes(16, 8, 8, 16)),
    "gqa4_packed_padding": dict(t=32, s=32, kv_heads=1, groups=4, segments="padded", blocks=BlockSizes(16, 16)),
    "mqa_sliding_window": dict(b=2, t=30, s=30, kv_heads=1, groups=4, sliding_window=6),
    "bf16_gqa_packed": dict(b=2, t=24, s=24, kv_heads=2, groups=2, dtype="bfloat16", segments="packed"),
    "ring_offset": dict(t=16, s=40, kv_heads=2, groups=2, q_offset=40, sliding_window=30, blocks=BlockSizes(8, 16)),
    "no_key_visible": dict(t=8, s=16, kv_heads=1, groups=2, q_offset=-20),
}


@pytest.mark.parametrize("name", NAMED_CASES)
def test_pallas_named_cases(name):
    check_against_reference("pallas", *make_case(**NAMED_CASES[name]))


@st.composite
def cases(draw, dtypes=("float32",)):
    t = draw(st.integers(1, 40))
    self_attention = draw(st.booleans())
    s = t if self_attention else draw(st.integers(1, 40))
    return dict(
        seed=draw(st.integers(0, 2**16)), b=draw(st.integers(1, 2)), t=t, s=s,
        kv_heads=draw(st.sampled_from([1, 2])), groups=draw(st.sampled_from([1, 2, 4])),
        d=draw(st.sampled_from([8, 16])), dtype=draw(st.sampled_from(dtypes)),
        segments=draw(st.sampled_from([None, "packed", "padded"])),
        q_offset=0 if self_attention else draw(st.sampled_from([0, 7, s])),
        causal=draw(st.booleans()), sliding_window=draw(st.sampled_from([0, 0, 5])),
        softcap=draw(st.sampled_from([0.0, 0.0, 2.0])),
        blocks=BlockSizes(draw(st.sampled_from([8, 16, 32])), draw(st.sampled_from([8, 16, 32])),
                          draw(st.sampled_from([8, 16])), draw(st.sampled_from([8, 24]))))


@settings(max_examples=6, deadline=None, derandomize=True)
@given(case=cases(dtypes=("float32", "bfloat16")))
def test_pallas_matches_reference(case):
    check_against_reference("pallas", *make_case(**case))


@settings(max_examples=5, deadline=None, derandomize=True)
@given(case=cases(dtypes=("float32", "bfloat16")))
def test_xla_matches_reference(case):
    check_against_reference("xla", *make_case(**case))


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_lse_merges_key_blocks_like_ring_attention(implementation):
    """Two key halves, queries at global positions 24..47 with a 16-token window (so queries >= 40 see
    nothing in the first half: lse = -inf there); the online-softmax merge of the halves must equal
    whole attention, values and gradients (which flow back through both lse's)."""
    (q, k, v), _, (w_out, _) = make_case(seed=3, t=24, s=48, kv_heads=2, groups=2, d=16)
    q_pos, kv_pos = jnp.arange(24, 48)[None], jnp.arange(48)[None]
    kw = dict(causal=True, sliding_window=16)

    def merged(q, k, v):
        parts = [flash_attention(q, k[:, sl], v[:, sl], q_positions=q_pos, kv_positions=kv_pos[:, sl],
                                 implementation=implementation, block_sizes=BlockSizes(8, 8), return_lse=True, **kw)
                 for sl in (slice(0, 24), slice(24, 48))]
        lse = jnp.logaddexp(parts[0][1], parts[1][1])
        weight = lambda part_lse: jnp.moveaxis(jnp.exp(part_lse - lse), 1, 2)[..., None]
        return sum(weight(part_lse) * out for out, part_lse in parts)

    def whole(q, k, v):
        return reference_attention(q, k, v, q_positions=q_pos, kv_positions=kv_pos, **kw)[0]

    def loss(fn):
        def value(*qkv):
            out = fn(*qkv)
            return jnp.sum(out * w_out), out
        return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2), has_aux=True))

    ((value, out), grads), ((ref_value, ref_out), ref_grads) = loss(merged)(q, k, v), loss(whole)(q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=5e-5, err_msg=name)


# -------------------------------------------------------------------- lowering for TPU and GPU


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernels_lower_for_mosaic_and_triton(platform):
    """The compiled (non-interpret) kernels, forward and backward, lower for each accelerator from CPU
    (Mosaic TPU / Triton custom calls). Lowering is not compiling: this catches unsupported ops and
    bad block shapes on the Python side, not everything the device compilers check."""
    b, t, h, kvh, d = 1, 256, 4, 2, 64
    q, kv = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, t, kvh, d), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    blocks = BlockSizes(128, 128) if platform == "tpu" else BlockSizes(64, 32, 32, 64)
    spec = AttentionSpec(causal=True, sliding_window=64, softcap=30.0, scale=0.125)

    def loss(q, k, v, seg, pos):
        out, lse = flash_attention_pallas(q, k, v, seg, seg, pos, pos, spec=spec, blocks=blocks.validate(platform),
                                          platform=platform, interpret=False)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv, ids, ids).lower(
        lowering_platforms=("tpu" if platform == "tpu" else "cuda",)).as_text()
    marker = "tpu_custom_call" if platform == "tpu" else "triton"
    assert text.count(marker) >= 3, f"expected the forward, dq and dkv kernels as {marker} calls"


# ---------------------------------------------------------------- entry point: errors and choice


def _qkv(t=8, h=4, kvh=2, d=16, dtype=jnp.float32):
    return jnp.zeros((1, t, h, d), dtype), jnp.zeros((1, t, kvh, d), dtype), jnp.zeros((1, t, kvh, d), dtype)


@pytest.mark.parametrize("make_call, message", [
    (lambda: flash_attention(*_qkv(h=6, kvh=4)), "q has 6 heads, not a multiple of k's 4 kv heads"),
    (lambda: flash_attention(jnp.zeros((8, 4, 16)), *_qkv()[1:]), "q must be 4-D"),
    (lambda: flash_attention(_qkv()[0], _qkv()[1], _qkv(t=9)[2]), "k (1, 8, 2, 16) and v (1, 9, 2, 16)"),
    (lambda: flash_attention(_qkv(d=8)[0], *_qkv()[1:]), "q has head_dim 8 but k/v have head_dim 16"),
    (lambda: flash_attention(_qkv(dtype=jnp.bfloat16)[0], *_qkv()[1:]), "dtypes differ"),
    (lambda: flash_attention(*_qkv(dtype=jnp.int32)), "q has dtype int32"),
    (lambda: flash_attention(*_qkv(), q_segment_ids=jnp.ones((1, 8), jnp.int32)),
     "q_segment_ids given without kv_segment_ids"),
    (lambda: flash_attention(*_qkv(), q_positions=jnp.ones((1, 9), jnp.int32)), "q_positions must have shape (1, 8)"),
    (lambda: flash_attention(*_qkv(), kv_positions=jnp.ones((1, 8))), "kv_positions must be integers"),
    (lambda: flash_attention(*_qkv(), sliding_window=-1), "sliding_window must be a Python int >= 0"),
    (lambda: flash_attention(*_qkv(), softcap=jnp.float32(2.0)), "softcap must be a Python float"),
    (lambda: flash_attention(*_qkv(), scale=0.0), "scale must be a positive Python float"),
    (lambda: flash_attention(*_qkv(), causal=1), "causal must be a Python bool"),
    (lambda: flash_attention(*_qkv(), block_sizes=(8, 8)), "block_sizes must be"),
    (lambda: flash_attention(*_qkv(), implementation="triton"), "unknown implementation='triton'"),
    (lambda: BlockSizes(block_q=12), r"BlockSizes.block_q=12: must be a positive multiple of 8"),
    (lambda: BlockSizes(block_kv=64).validate("tpu"), r"block_kv=64 must be a multiple of 128 on TPU"),
    (lambda: BlockSizes(block_q=48).validate("gpu"), r"block_q=48 must be a power of two >= 16 on GPU"),
])
def test_errors_name_the_argument_and_the_fix(make_call, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        make_call()


def test_implementation_choice(monkeypatch, caplog):
    monkeypatch.setattr(api, "_LOGGED", set())
    choose = api.choose_implementation
    with caplog.at_level(logging.INFO, logger=api.__name__):
        assert choose(None, "cpu", 64) == "xla"
        assert choose(None, "cpu", 64) == "xla"
        assert choose(None, "tpu", 64) == "pallas"
        assert choose(None, "gpu", 64) == "pallas"
        assert choose(None, "gpu", 80) == "xla"  # Triton cannot tile D=80: automatic fallback
        assert choose("pallas", "cpu", 64) == "pallas"  # explicit: runs in interpret mode
        assert choose("xla", "tpu", 64) == "xla"
    assert sum("'xla' implementation on cpu: default" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="implementation='pallas' cannot run here: Triton needs a power-of-two"):
        choose("pallas", "gpu", 80)
    with pytest.raises(ValueError, match="no Pallas backend for platform 'metal'"):
        choose("pallas", "metal", 64)
    assert choose(None, "metal", 64) == "xla"


def test_default_on_cpu_is_xla_and_explicit_pallas_interprets(monkeypatch, caplog):
    monkeypatch.setattr(api, "_LOGGED", set())
    q, k, v = (jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(_qkv()))
    with caplog.at_level(logging.INFO, logger=api.__name__):
        out = flash_attention(q, k, v, sliding_window=3)
        out_pallas = flash_attention(q, k, v, sliding_window=3, implementation="pallas")  # compiled Pallas would
    messages = [r.getMessage() for r in caplog.records]  # raise on CPU: this ran interpreted
    assert "'xla' implementation on cpu: default" in messages[0]
    assert "'pallas' implementation on cpu: requested (interpret mode" in messages[1]
    want = reference_attention(q, k, v, sliding_window=3)[0]
    assert float(jnp.max(jnp.abs(want))) > 0.1
    np.testing.assert_allclose(out, want, atol=2e-5)
    np.testing.assert_allclose(out_pallas, want, atol=2e-5)
