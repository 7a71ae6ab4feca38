"""The rollout engine's programs built by the real TPU compiler (libtpu, deviceless; nothing runs).

`rlvr.rollout.compile_check.engine_programs` compiles the engine's prefill and decode for v5e and v5p
topologies on a tensor-parallel mesh at a small model shape: the decode's paged attention must be the
Mosaic kernel (a Pallas call on a multi-device mesh only compiles inside a shard_map; no silent XLA
fallback), the pool sharded over KV heads, and the decode's temporary memory small against the pool
(the KV write updates pages in place: no pool-sized copy per layer). libtpu missing is a failure,
not a skip: `make test` installs it (the `tpu` extra).
"""

from __future__ import annotations

import jax
import pytest
from rlvr.kernels.target import TOPOLOGIES, compile_for, compiled_report, tpu_compiler_unavailable_reason

from rlvr import sharding
from rlvr.models import params as params_lib
from rlvr.models.config import ModelConfig
from rlvr.rollout import compile_check

# 2 layers, 8 KV heads of 128 (Qwen3's head layout at a small width), a pool of 16 slots x 512 tokens
CFG = ModelConfig(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=16, num_kv_heads=8, head_dim=128,
                  vocab_size=1024, tie_word_embeddings=True)
ENGINE = dict(max_slots=16, max_len=512, page_size=64, decode_steps=4, prefill_rows=2, prefill_chunk=32,
              dtype="bfloat16")
MESH = {"data": 2, "tensor": 2}
# The decode's temp per chip over the pool per chip. With the KV written through a uint16 view of the
# pool (kernels/bits.py's CPU-only workaround, then also on TPU), v5p's compiler copied the pool around
# each layer's write: 1.59x at this shape (prefill 0.61x; 2.03x at Qwen3-1.7B's recipe shape,
# benchmarks/results/engine_tpu_compile.json); written in place, 0.05x (prefill 0.11x). v5e's compiler
# avoided the copy even then (0.07x). 0.25 leaves room for compiler changes and catches a pool-sized temp.
TEMP_OVER_POOL = 0.25


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES[g] for g in ("v5e", "v5p")))
def compiled(request):
    """(topology, {program: compiled}, per-chip sizes) of the engine on MESH."""
    reason = tpu_compiler_unavailable_reason()
    if reason:
        pytest.fail(f"cannot compile for TPU: {reason}. These tests check the engine's TPU programs with the real "
                    f"TPU compiler (no TPU needed); install it with `pip install -e '.[tpu]'`.")
    shapes = params_lib.abstract_params(CFG)  # before compile_for: tracing the init makes a key on the host
    with compile_for(request.param) as topo:
        mesh = sharding.make_mesh(MESH, topo.devices)
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                              params_lib.param_shardings(CFG, mesh))
        programs = compile_check.engine_programs(CFG, params, mesh, **ENGINE)
    return request.param, programs, compile_check.engine_sizes(CFG, params, mesh, **ENGINE)


def test_decode_runs_the_mosaic_kernel(compiled):
    topology, programs, _ = compiled
    assert compiled_report(programs["decode"])["mosaic_kernels"] > 0, \
        f"{topology}: the decode's paged attention is not the Pallas (Mosaic) kernel"


def test_decode_writes_the_pool_in_place(compiled):
    """Temp well under the pool, and the donated pool aliased to the output (not copied out)."""
    topology, programs, sizes = compiled
    memory = compiled_report(programs["decode"])["per_device_bytes"]
    assert memory["temp"] <= TEMP_OVER_POOL * sizes["pool"], \
        f"{topology}: decode temp {memory['temp']} B > {TEMP_OVER_POOL} x the pool's {sizes['pool']} B per chip"
    assert memory["alias"] >= sizes["pool"], f"{topology}: the pool is not updated in place: {memory}"


def test_pool_is_sharded_over_kv_heads(compiled):
    """Per chip: the pool's KV heads split over tensor=2 (half of k and v, all layers and pages)."""
    _, _, sizes = compiled
    full = 2 * CFG.num_layers * (16 * 512 // 64 + 1) * 64 * CFG.num_kv_heads * CFG.head_dim * 2
    assert sizes["pool"] == full // MESH["tensor"]


def test_prefill_compiles_and_writes_the_pool_in_place(compiled):
    topology, programs, sizes = compiled
    memory = compiled_report(programs["prefill"])["per_device_bytes"]
    assert memory["alias"] >= sizes["pool"], f"{topology}: the prefill's pool is not donated: {memory}"
    assert memory["temp"] <= TEMP_OVER_POOL * sizes["pool"], f"{topology}: prefill temp {memory}"

