"""Golden sharding tests: the PartitionSpec of every parameter for (model, mesh) pairs.

Regenerate after an intended change with `RLVR_UPDATE_GOLDEN=1 pytest tests/test_sharding.py`
and review the JSON diff.
"""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")

CASES = {
    "qwen3_fsdp2_tensor4": (
        ModelConfig(),  # the fixed tiny benchmark model: 4 heads, 2 KV heads
        {"data": 1, "fsdp": 2, "tensor": 4, "sequence": 1},
    ),
    "llama_tied_bias_data2_fsdp4": (
        ModelConfig(family="llama", tie_word_embeddings=True, qkv_bias=True, o_bias=True,
                    qk_norm=False, num_kv_heads=4, mlp_bias=True),
        {"data": 2, "fsdp": 4, "tensor": 1, "sequence": 1},
    ),
    "qwen2_mqa_value_tensor8": (
        ModelConfig(family="qwen2", num_kv_heads=1, qkv_bias=True, qk_norm=False, value_head=True),
        {"data": 1, "fsdp": 1, "tensor": 8, "sequence": 1},
    ),
    "qwen3_sequence2_fsdp2_tensor2": (
        ModelConfig(),
        {"data": 1, "fsdp": 2, "tensor": 2, "sequence": 2},
    ),
}


def _specs_json(cfg, mesh_shape):
    mesh = sharding.make_mesh(mesh_shape)
    return {path: sharding.spec_to_json(spec) for path, spec in params_lib.param_specs(cfg, mesh).items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_param_specs_match_golden(name):
    cfg, mesh_shape = CASES[name]
    got = _specs_json(cfg, mesh_shape)
    path = os.path.join(GOLDEN, f"sharding_{name}.json")
    if os.environ.get("RLVR_UPDATE_GOLDEN"):
        with open(path, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
    with open(path) as f:
        want = json.load(f)
    assert got == want, f"sharding changed for {name}; diff the JSON or regenerate deliberately"


def test_mesh_axis_used_once_and_non_dividing_axes_dropped():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4, "sequence": 1})
    # Activations: batch takes fsdp, so embed cannot take it again.
    spec = sharding.logical_to_spec(("batch", "length", "embed"), (8, 16, 256), mesh)
    assert spec == PartitionSpec("fsdp")
    # 2 KV heads cannot split over tensor=4: replicated along that dim.
    spec = sharding.logical_to_spec(("embed", "kv_heads", "head_dim"), (256, 2, 64), mesh)
    assert spec == PartitionSpec("fsdp")
    spec = sharding.logical_to_spec(("embed", "heads", "head_dim"), (256, 4, 64), mesh)
    assert spec == PartitionSpec("fsdp", "tensor")


def test_mesh_shape_errors_name_the_problem():
    with pytest.raises(ValueError, match="does not divide"):
        sharding.mesh_shape_from_config({"data": -1, "tensor": 3}, 8)
    with pytest.raises(ValueError, match="unknown axes"):
        sharding.mesh_shape_from_config({"model": 2}, 8)
    with pytest.raises(ValueError, match="multiply to 4"):
        sharding.mesh_shape_from_config({"data": 2, "tensor": 2}, 8)
    assert sharding.mesh_shape_from_config({"data": -1, "tensor": 2}, 8)["data"] == 4


def test_init_params_are_created_sharded_and_match_single_device():
    cfg = ModelConfig(num_layers=2, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=128)
    mesh8 = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4, "sequence": 1})
    mesh1 = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    sharded = params_lib.init_params(cfg, jax.random.key(3), mesh8)
    single = params_lib.init_params(cfg, jax.random.key(3), mesh1)
    expected = params_lib.param_shardings(cfg, mesh8)
    for got, want, ref in zip(jax.tree.leaves(sharded), jax.tree.leaves(expected),
                              jax.tree.leaves(single), strict=True):
        assert got.sharding == want
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    q = sharded["layers"]["self_attn"]["q_proj"]["kernel"]
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 32, 1, 16)
