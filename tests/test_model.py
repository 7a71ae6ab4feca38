"""Model invariances that need no reference implementation, and the notebook API."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlvr import api, config_lib, sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.models.transformer import forward, forward_with_values

SMALL = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
             head_dim=16, vocab_size=97, rope_theta=10_000.0)


def _params(cfg, seed=0):
    mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    return params_lib.init_params(cfg, jax.random.key(seed), mesh)


def test_param_count_matches_formula_and_benchmark_model():
    cfg = ModelConfig()  # the fixed tiny benchmark config (Tunix peer: 4,459,264 params)
    shapes = params_lib.abstract_params(cfg)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)) == cfg.num_params() == 4_459_264


def test_packed_equals_unpacked():
    cfg = ModelConfig(**SMALL)
    params = _params(cfg)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 97, 7), rng.integers(0, 97, 5)
    packed = jnp.asarray(np.concatenate([a, b, [0, 0]])[None])
    positions = jnp.asarray(np.concatenate([np.arange(7), np.arange(5), [0, 0]])[None])
    segments = jnp.asarray(np.array([[1] * 7 + [2] * 5 + [0, 0]]))
    logits, _ = forward(cfg, params, packed, positions, segments)
    alone_a, _ = forward(cfg, params, jnp.asarray(a[None]))
    alone_b, _ = forward(cfg, params, jnp.asarray(b[None]))
    np.testing.assert_allclose(logits[0, :7], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(logits[0, 7:12], alone_b[0], atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_changes_memory_not_results(policy):
    cfg = ModelConfig(**SMALL)
    remat = ModelConfig(**SMALL, remat_policy=policy)
    params = _params(cfg)
    tokens = jnp.arange(24).reshape(2, 12) % 97

    def loss(c):
        return lambda p: forward(c, p, tokens)[0].mean()

    np.testing.assert_allclose(loss(cfg)(params), loss(remat)(params), rtol=1e-6)
    g1, g2 = jax.grad(loss(cfg))(params), jax.grad(loss(remat))(params)
    for x, y in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6)


def test_fused_projections_equal_the_separate_ones():
    """The rollout engine's tree (`fuse_projections`: q/k/v and gate/up concatenated) gives the
    separate projections' logits, biases included (qkv_bias); a group holding more than a kernel
    and bias (a LoRA adapter) stays separate."""
    from rlvr.models.transformer import fuse_projections, unstack_layers

    cfg = ModelConfig(**SMALL, qkv_bias=True, scan_layers=False)
    rng = np.random.default_rng(3)  # random weights and non-zero biases, drawn by NumPy (no init program)
    shapes = params_lib.abstract_params(dataclasses.replace(cfg, scan_layers=True))
    params = unstack_layers(jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.1, x.shape), x.dtype), shapes))
    fused = fuse_projections(params)
    assert set(fused["layers_0"]["self_attn"]) == {"qkv_proj", "q_norm", "k_norm", "o_proj"}
    assert set(fused["layers_1"]["mlp"]) == {"gate_up_proj", "down_proj"}
    tokens = jnp.asarray(rng.integers(0, 97, (2, 9)))
    run = jax.jit(forward, static_argnums=0)
    np.testing.assert_allclose(run(cfg, fused, tokens)[0], run(cfg, params, tokens)[0], atol=1e-5)
    adapted = {**params, "layers_0": {**params["layers_0"], "self_attn": {
        **params["layers_0"]["self_attn"], "q_proj": {**params["layers_0"]["self_attn"]["q_proj"],
                                                      "lora_a": jnp.zeros((64, 2))}}}}
    assert {"q_proj", "k_proj", "v_proj"} <= set(fuse_projections(adapted)["layers_0"]["self_attn"])


def test_chunked_paged_prefill_gives_the_full_forwards_last_logits():
    """The engine's prefill (`forward_last` on a paged cache, chunk by chunk; its last layer runs the
    query, output projection and MLP at each row's last position only, and its attention loops over
    key blocks up to the chunk's reach) gives the logits the training forward computes at each row's
    last prompt token, with prompts of different lengths split over two chunks in shuffled pages."""
    from rlvr.models.transformer import forward_last, init_paged_cache, unstack_layers

    cfg = ModelConfig(**SMALL, scan_layers=False)
    rng = np.random.default_rng(4)
    shapes = params_lib.abstract_params(dataclasses.replace(cfg, scan_layers=True))
    params = unstack_layers(jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype), shapes))
    lengths, chunk, page_size, per_row = [13, 6, 9], 8, 4, 8
    tokens = rng.integers(0, 97, (3, 16))
    cache = init_paged_cache(cfg, 3 * per_row + 1, page_size,
                             page_table=jnp.asarray(1 + rng.permutation(3 * per_row).reshape(3, per_row), jnp.int32))
    run = jax.jit(forward_last, static_argnums=0)
    for start in (0, chunk):
        positions = np.arange(start, start + chunk)[None].repeat(3, 0)
        segments = (positions < np.array(lengths)[:, None]).astype(np.int32)
        last = np.maximum(segments.sum(1) - 1, 0)
        logits, cache = run(cfg, params, jnp.asarray(tokens[:, start:start + chunk]), jnp.asarray(positions),
                            jnp.asarray(segments), cache, jnp.asarray(last))
        for row, n in enumerate(lengths):
            if start < n <= start + chunk:  # the row's prompt ends in this chunk
                full, _ = forward(cfg, params, jnp.asarray(tokens[row:row + 1, :n]))
                np.testing.assert_allclose(logits[row], full[0, -1], rtol=1e-5, atol=1e-5)


def test_bf16_compute_tracks_fp32():
    cfg = ModelConfig(**SMALL)
    params = _params(cfg)
    tokens = jnp.arange(16).reshape(1, 16) % 97
    full, _ = forward(cfg, params, tokens)
    half, _ = forward(ModelConfig(**SMALL, dtype="bfloat16"), params, tokens)
    assert half.dtype == jnp.float32  # logits are always float32
    assert float(jnp.abs(full - half).max()) < 0.05


def test_value_head_is_a_linear_map_of_the_final_hidden_states():
    """values[b, t] = h[b, t] · w + b0 in NumPy, h the final-norm hidden states that also give the logits
    (h · lm_head), w and b0 the value head's params (a random, non-zero bias)."""
    from rlvr.models.transformer import Transformer

    cfg = ModelConfig(**SMALL, value_head=True)
    params = _params(cfg)
    rng = np.random.default_rng(0)
    head = {"kernel": jnp.asarray(rng.normal(size=(64, 1)), jnp.float32), "bias": jnp.asarray([0.7], jnp.float32)}
    params = {**params, "value_proj": head}
    tokens = jnp.asarray(rng.integers(0, 97, (2, 5)), jnp.int32)
    logits, values, _ = forward_with_values(cfg, params, tokens)
    hidden, _ = Transformer(cfg).apply({"params": params}, tokens, method=Transformer.hidden_states)
    h = np.asarray(hidden, np.float64)
    np.testing.assert_allclose(np.asarray(logits), h @ np.asarray(params["lm_head"]["kernel"], np.float64),
                               rtol=1e-4, atol=1e-4)  # h is the hidden state the logits come from
    want = h @ np.asarray(head["kernel"], np.float64)[:, 0] + 0.7
    assert values.shape == (2, 5)
    np.testing.assert_allclose(np.asarray(values), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="value_head"):
        forward_with_values(ModelConfig(**SMALL), _params(ModelConfig(**SMALL)), jnp.ones((1, 2), jnp.int32))


def test_sharded_forward_equals_single_device():
    cfg = ModelConfig(**SMALL)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2, "sequence": 1})
    sharded = params_lib.init_params(cfg, jax.random.key(1), mesh)
    single = _params(cfg, seed=1)
    tokens = jnp.arange(64).reshape(4, 16) % 97

    def run(p):
        with sharding.activation_sharding(mesh):
            return forward(cfg, p, tokens)[0]

    np.testing.assert_allclose(jax.jit(run)(sharded), forward(cfg, single, tokens)[0], atol=1e-5)


def test_notebook_api_in_a_few_lines(repo_root):
    config = api.load_config(f"{repo_root}/configs/tiny.py:smoke")
    model = api.build_model(config)
    logits, _ = api.forward(model, [[1, 2, 3, 4]])
    assert logits.shape == (1, 4, 264)  # the tiny preset's vocabulary (configs/tiny.py sets model.preset)
    direct, _ = forward(model.cfg, model.params, jnp.asarray([[1, 2, 3, 4]]))
    np.testing.assert_allclose(logits, direct, atol=1e-6)
    tokenizer = api.build_tokenizer(config)
    assert tokenizer.decode(tokenizer.encode("12+30=42")) == "12+30=42"


def test_unknown_model_field_is_named():
    with pytest.raises(config_lib.ConfigError, match='Did you mean "num_heads"'):
        config_lib.model_config_dict(num_head=4)


def test_bf16_embedding_rows_gathered_as_bits_keep_values_and_gradient():
    """`take_rows` gathers a bf16 table as its uint16 bits (XLA:CPU converts a whole bf16 table to
    f32 to gather from it): the same rows as jnp.take, and the same gradient (repeated ids add up)."""
    from rlvr.kernels.bits import take_rows

    table = jnp.asarray(np.random.default_rng(0).standard_normal((50, 8)), jnp.bfloat16)
    ids = jnp.asarray([[3, 7, 3], [49, 0, 2]])
    assert bool((take_rows(table, ids) == jnp.take(table, ids, axis=0)).all())
    weights = jnp.arange(8.0)
    got = jax.jit(jax.grad(lambda t: jnp.sum(take_rows(t, ids).astype(jnp.float32) * weights)))(table)
    want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0).astype(jnp.float32) * weights))(table)
    assert got.dtype == jnp.bfloat16 and bool((got == want).all()) and float(got[3, 1]) == 2.0


def test_bf16_projections_accumulate_in_float32():
    """A bf16 Linear multiplies with float32 accumulation and rounds once: equal (within one bf16
    rounding) to the product of the operands upcast to float32."""
    from rlvr.models.layers import _matmul

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 16)), jnp.bfloat16)
    got = _matmul(x, w)
    want = x.astype(jnp.float32) @ w.astype(jnp.float32)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2 ** -8, atol=1e-6)
