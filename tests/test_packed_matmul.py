"""The native packed matmul (kernels/packed_matmul) against a float64 numpy product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rlvr.kernels import packed_matmul as pm


@pytest.mark.parametrize("lead, k, n", [((0,), 4, 8), ((1,), 1, 1), ((5,), 7, 33), ((8,), 64, 32), ((9,), 64, 100),
                                        ((64,), 130, 300), ((2, 17), 3, 64), ((3, 1), 520, 31)])
def test_packed_matmul_equals_a_float64_product(lead, k, n):
    """Rows in and past whole blocks of 8, columns in and past whole panels of 32 (the last panel's
    zero padding never written out), any leading dims; the packing round-trips exactly."""
    rng = np.random.default_rng(k * n)
    x, w = rng.standard_normal((*lead, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    packed = pm.pack_weight(jnp.asarray(w))
    assert packed.shape == (-(-n // 32), k, 32)
    np.testing.assert_array_equal(pm.unpack_weight(packed, n), w)
    got = jax.jit(pm.packed_matmul, static_argnums=2)(jnp.asarray(x), packed, n)
    assert got.shape == (*lead, n) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_packed_matmul_runs_the_native_kernel_and_checks_its_shapes():
    """Here (CPU, g++ installed by `make install`) the product is the custom call, not the plain-XLA
    fallback; a packed weight of the wrong width or depth is an error naming the expected layout."""
    assert pm.native_unavailable_reason() is None
    x, packed = jnp.ones((4, 16)), pm.pack_weight(jnp.ones((16, 40)))
    assert "rlvr_packed_matmul" in jax.jit(pm.packed_matmul, static_argnums=2).lower(x, packed, 40).as_text()
    with pytest.raises(ValueError, match=r"expected packed \[ceil\(n/32\), x.shape\[-1\], 32\]"):
        pm.packed_matmul(x, packed, 80)
    with pytest.raises(ValueError, match="expected packed"):
        pm.packed_matmul(jnp.ones((4, 8)), packed, 40)


@pytest.mark.parametrize("lead, k, i", [((0,), 4, 32), ((1,), 1, 32), ((13,), 64, 64), ((2, 9), 100, 96),
                                        ((64,), 256, 1024)])
def test_packed_swiglu_equals_a_float64_swiglu(lead, k, i):
    """silu(x @ gate) * up from one packed [K, 2i] weight (the engine's gate_up_proj): rows in and
    past whole blocks of 8, gates of 1-32 panels, pre-activations of both signs and large ones
    (exp's clamp); the custom call runs (not the fallback); bad widths are an error."""
    rng = np.random.default_rng(k * i)
    x = (4 * rng.standard_normal((*lead, k))).astype(np.float32)
    w = rng.standard_normal((k, 2 * i)).astype(np.float32)
    packed = pm.pack_weight(jnp.asarray(w))
    call = jax.jit(pm.packed_swiglu, static_argnums=2)
    assert pm.swiglu_unavailable_reason() is None and "rlvr_packed_swiglu" in call.lower(x, packed, i).as_text()
    got = call(jnp.asarray(x), packed, i)
    gate, up = x.astype(np.float64) @ w[:, :i].astype(np.float64), x.astype(np.float64) @ w[:, i:].astype(np.float64)
    want = gate / (1 + np.exp(-gate)) * up
    assert got.shape == (*lead, i) and got.dtype == jnp.float32
    scale = 1e-5 * np.sqrt(k) * (1 + np.abs(gate)) * (1 + np.abs(up))  # float32 products of 4-sigma inputs
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= scale)
    with pytest.raises(ValueError, match=r"expected i a multiple of 32 and packed \[2i/32"):
        pm.packed_swiglu(jnp.asarray(x), packed, i // 2 if i > 32 else 16)
