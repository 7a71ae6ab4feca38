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
    """-Wall -Wextra: an unused variable in a source is reported (logged); the two kernels' sources
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
        for name in ("paged_attention", "packed_matmul"):
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
