"""What ships to TPU pods, built by the real TPU compiler (libtpu, deviceless: nothing runs) on v5e and
v5p topologies: the Pallas kernels forward and backward on multi-chip meshes (flash attention through
its shard_map, ring and Ulysses context parallelism), and a small SFT train step with
`model.attention='flash'` on a 4-chip fsdp mesh through `rlvr.aot`. Each asserts the Mosaic custom
call is in the compiled HLO (a silent XLA fallback fails) and that memory stays under a stated bound.
Kernel numerics are tested in interpret mode against references (tests/test_flash_attention.py);
the shard_map wrapper's numerics on 8 CPU devices are tested here too.

libtpu comes with the `tpu` extra, which `make test` installs: without it these tests fail with the
install command, they do not skip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rlvr.kernels.context_parallel import ring_attention, ulysses_attention
from rlvr.kernels.flash_attention import BlockSizes, flash_attention, reference_attention
from rlvr.kernels.target import (
    compile_for,
    compiled_report,
    target_platform,
    tpu_compiler_unavailable_reason,
    tpu_topology,
)

from rlvr import aot, config_lib, sharding

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1")
MOSAIC = 'custom_call_target="tpu_custom_call"'


@pytest.fixture(scope="module", autouse=True)
def _libtpu():
    reason = tpu_compiler_unavailable_reason()
    assert reason is None, f"the TPU compiler is needed here: {reason} (make test installs it)"


def _mesh(topology: str, shape: dict[str, int]):
    return sharding.make_mesh(shape, tpu_topology(topology).devices)


def _sds(shape, mesh, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile_loss_and_grads(topology, mesh, attend, q, k, v):
    def loss(q, k, v):
        with sharding.activation_sharding(mesh):
            return jnp.sum(attend(q, k, v).astype(jnp.float32))

    with compile_for(topology):
        assert target_platform() == "tpu"
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_flash_attention_forward_and_backward_on_a_data_by_tensor_mesh(topology):
    """Rows over data, heads over tensor: the kernels run inside shard_map, so the compiled program
    has the three Mosaic kernels (forward, dq, dk/dv) and no collective on q/k/v."""
    mesh = _mesh(topology, {"data": 2, "tensor": 2})
    q = _sds((4, 1024, 8, 128), mesh, P("data", None, "tensor", None))
    kv = _sds((4, 1024, 2, 128), mesh, P("data", None, "tensor", None))
    compiled = _compile_loss_and_grads(topology, mesh, lambda q, k, v: flash_attention(q, k, v), q, kv, kv)
    report = compiled_report(compiled)
    assert report["mosaic_kernels"] >= 3, "flash attention fell back to XLA"
    assert report["collectives"]["all-gather"] == 0 and report["collectives"]["all-to-all"] == 0
    per_device_inputs = 3 * 1 * 1024 * 4 * 128 * 2  # q and dq-sized shards in bf16, roughly
    assert report["per_device_bytes"]["temp"] < 8 * per_device_inputs


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_context_parallel_attention_on_a_sequence_mesh(topology, kind):
    """Ring (ppermute of key blocks) and Ulysses (all-to-all) over a 4-chip sequence axis, with the
    flash kernel per device block."""
    mesh = _mesh(topology, {"sequence": 4})
    q = _sds((1, 2048, 4, 128), mesh, P(None, "sequence", None, None))
    kv = _sds((1, 2048, 4, 128), mesh, P(None, "sequence", None, None))
    attend = ring_attention if kind == "ring" else ulysses_attention
    compiled = _compile_loss_and_grads(topology, mesh, lambda q, k, v: attend(q, k, v, mesh=mesh), q, kv, kv)
    report = compiled_report(compiled)
    assert report["mosaic_kernels"] >= 3, f"{kind} attention's blocks fell back to XLA"
    moved = report["collectives"]["collective-permute" if kind == "ring" else "all-to-all"]
    assert moved > 0, f"{kind} attention moves no data between chips"


def test_shared_prompt_attention_compiles_to_two_flash_calls_on_v5e():
    """rl.share_prompts under model.attention='flash' (`shared_prompt_attention`): two flash calls
    (prompt keys, own branch) merged by log-sum-exp, each forward and backward a Mosaic kernel, rows
    over data and heads over tensor."""
    from rlvr.models.transformer import SegmentInfo, shared_prompt_attention

    mesh = _mesh("v5e:2x2", {"data": 2, "tensor": 2})
    q = _sds((4, 1024, 8, 128), mesh, P("data", None, "tensor", None))
    kv = _sds((4, 1024, 2, 128), mesh, P("data", None, "tensor", None))
    ids = _sds((4, 1024), mesh, P("data", None), jnp.int32)

    def loss(q, k, v, positions, segment_ids, branch_ids):
        with sharding.activation_sharding(mesh):
            out = shared_prompt_attention(q, k, v, SegmentInfo(positions, segment_ids, branch_ids), causal=True)
            return jnp.sum(out.astype(jnp.float32))

    with compile_for("v5e:2x2"):
        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, ids, ids, ids).compile()
    report = compiled_report(compiled)
    assert report["mosaic_kernels"] >= 6, "a shared-prompt flash call fell back to XLA"


def test_flash_attention_compiles_at_32k_tokens_per_device_on_v5e():
    """The key sequence is a grid axis (pallas_tpu.py), so VMEM per program does not grow with T:
    forward and backward at 32k tokens compile within v5e's scoped VMEM."""
    with compile_for("v5e:2x2"):
        q = jax.ShapeDtypeStruct((1, 32768, 4, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, 32768, 1, 128), jnp.bfloat16)
        grads = jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
        compiled = jax.jit(grads).lower(q, kv, kv).compile()
    assert compiled_report(compiled)["mosaic_kernels"] >= 3


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_sft_step_with_flash_attention_on_a_4_chip_fsdp_mesh(topology):
    config = config_lib.load_config("configs/sft_tiny.py", {"mesh.data": 1, "mesh.fsdp": 4, "data.seq_len": 256,
                                                            "model.attention": "flash"})
    report = aot.analyze(config, topology)
    assert report["compiler"].startswith("tpu") and report["devices"] == 4
    assert report["mosaic_kernels"] >= 3, "flash attention in the train step fell back to XLA"  # fwd, dq, dkv
    assert report["collectives"]["all-gather"] > 0  # fsdp gathers the sharded weights
    # Params + Adam moments sharded 4 ways, the batch and the activations: well under 64 MiB a chip.
    assert report["per_device_bytes"]["argument"] < 0.5 * (report["param_bytes_total"] +
                                                             report["optimizer_state_bytes"])
    assert report["per_device_total_bytes"] < 64 * 2**20


def test_flash_under_a_mesh_equals_the_reference_in_interpret_mode():
    """The shard_map wrapper's numerics, on the 8 CPU devices: the Pallas kernel (interpreted) under
    a data x tensor mesh gives the reference's output and gradients."""
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "fsdp": 2})
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(4, 16, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(4, 16, 2, 8)), jnp.float32) for _ in range(2))
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def loss(attend):
        def value(q, k, v):
            with sharding.activation_sharding(mesh):
                return jnp.sum(attend(q, k, v) * weights)
        return jax.jit(jax.value_and_grad(value, argnums=(0, 1, 2)))

    sharded = loss(lambda q, k, v: flash_attention(q, k, v, implementation="pallas", block_sizes=BlockSizes(8, 8)))
    text = sharded.lower(q, k, v).as_text()
    assert "shard_map" in text or "sdy.manual_computation" in text, "the Pallas call is not inside shard_map"
    (value, grads), (ref_value, ref_grads) = sharded(q, k, v), loss(lambda q, k, v: reference_attention(
        q, k, v)[0])(q, k, v)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, ref, atol=5e-5, err_msg=name)


def test_a_program_too_large_for_the_chip_is_a_refusal_not_a_crash():
    """The TPU compiler refuses a program whose temporaries exceed a v5e chip's 16 GiB: `hbm_refusal`
    turns that into a report (the size it gave, as a lower bound) and any other error into None."""
    from rlvr.kernels.target import hbm_refusal

    x = jax.ShapeDtypeStruct((46000,), jnp.float32)  # two sorted 46k x 46k outer products: ~24 GiB of temps
    with compile_for("v5e:2x2"), pytest.raises(Exception) as refused:
        jax.jit(lambda x: jnp.sort(jnp.outer(x, x).ravel())[:8] + jnp.sort(jnp.outer(x + 1, x).ravel())[:8]).lower(
            x).compile()
    report = hbm_refusal(refused.value)
    assert report is not None, f"not recognised as a refusal: {refused.value}"
    assert report["per_device_total_bytes"] > report["available_bytes"] > 15 * 2**30
    assert hbm_refusal(ValueError("something else")) is None


def test_rl_job_reports_its_engine_programs_compiled_for_the_slice():
    """`rlvr.aot.analyze_engine`: an RL job's embedded engine, prefill and decode compiled on the job's
    data x tensor mesh: the decode runs the Pallas kernel, and the pool is split over the KV heads."""
    from rlvr import start

    config = start.resolve(config_lib.load_config("configs/quickstart.py", {"mesh.data": 2, "mesh.tensor": 2}))
    engine = aot.analyze_engine(config, "v5e:2x2")
    assert set(engine["programs"]) == {"prefill", "decode"}
    assert engine["programs"]["decode"]["mosaic_kernels"] > 0, "the engine's decode fell back to XLA"
    cfg, spec = aot.model_config_of(config), config.rl.engine
    pages = spec.max_slots * (spec.max_len // spec.page_size) + 1
    whole_pool = 2 * cfg.num_layers * pages * spec.page_size * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    assert engine["engine_pool_bytes"] == whole_pool // 2
    assert 0 < engine["temp_bytes"] < whole_pool
