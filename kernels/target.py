"""The platform a program is compiled *for*, which need not be the host's.

Kernel dispatch (flash attention, paged decode, the native CPU kernels) and the engine choose their
path from `target_platform()`, not from the host's `jax.default_backend()`: on a CPU machine,
`with compile_for("v5p:2x2x1"):` makes every choice the TPU one, and `jax.jit(...).lower(...)`
inside it builds the TPU program with the real TPU compiler (libtpu, deviceless: nothing runs).
That is how a pod job is checked from a laptop or CI (`python -m rlvr.aot --topology=...`).

The target is the platform of JAX's default device when one is set (`jax.default_device(d)`, which
Pallas TPU lowering needs anyway to read the chip generation), else the default backend.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from typing import Any

import jax

# Topology names libtpu accepts for deviceless compiles (see shared specs): generation:chips.
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def normalize(platform: str) -> str:
    """'cpu', 'gpu' or 'tpu' (CUDA and ROCm are 'gpu')."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def target_platform() -> str:
    """The platform programs traced now are compiled for: the default device's, else the backend's."""
    device = jax.config.jax_default_device
    if isinstance(device, str):
        return normalize(device)
    if device is not None:
        return normalize(device.platform)
    return normalize(jax.default_backend())


# device_kind of each TPU generation's chips, as libtpu names them.
TPU_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
             "TPU v6 lite": "v6e", "TPU v6e": "v6e"}


def tpu_generation() -> str | None:
    """The target TPU's generation ('v5e', 'v5p', ...), or None (not a TPU, or a kind not in TPU_KINDS)."""
    if target_platform() != "tpu":
        return None
    device = jax.config.jax_default_device
    device = device if device is not None and not isinstance(device, str) else jax.devices()[0]
    return TPU_KINDS.get(device.device_kind)


@functools.cache
def tpu_topology(name: str):
    """The TPU topology `name` ('v5e:2x2', 'v5p:2x2x1', 'v6e:2x2', 'v4:2x2x1', or a bare generation
    from TOPOLOGIES) as a deviceless `TopologyDescription`; needs libtpu (`pip install -e '.[tpu]'`)."""
    from jax.experimental import topologies

    name = TOPOLOGIES.get(name, name)
    missing = tpu_compiler_unavailable_reason()
    if missing:
        raise ValueError(f"cannot compile for TPU topology {name!r}: {missing}.")
    # Deviceless compiles touch no chip, so several processes (pytest-xdist workers) may load libtpu;
    # without this the second one fails on libtpu's single-process lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as error:  # a name this libtpu does not know
        raise ValueError(f"cannot compile for TPU topology {name!r}: {error}. Known to work: "
                         f"{sorted(TOPOLOGIES.values())}.") from error


def tpu_compiler_unavailable_reason() -> str | None:
    """Why TPU programs cannot be compiled here (None when libtpu is installed)."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu is not installed (pip install -e '.[tpu]')"
    return None


@contextlib.contextmanager
def compile_for(topology: str) -> Iterator:
    """Within: the target is the TPU `topology` (its devices, for meshes, come with the yielded
    description: `topo.devices`). Lower and compile inside; arrays cannot be created on it."""
    topo = tpu_topology(topology)
    with jax.default_device(topo.devices[0]):
        yield topo


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
MOSAIC_CALL = 'custom_call_target="tpu_custom_call"'  # what a Pallas TPU kernel compiles to


def compiled_report(compiled) -> dict[str, Any]:
    """What a compiled program needs and holds, per device: argument/output/temp/alias/code bytes
    (`memory_analysis`) and their resident total (argument + output + temp - alias), FLOPs and bytes
    accessed (`cost_analysis`), the collectives by kind and the Mosaic (Pallas TPU) kernel calls in
    its HLO (0 on TPU means the kernels fell back to XLA)."""
    memory = compiled.memory_analysis()
    per_device = {name: int(getattr(memory, f"{name}_size_in_bytes"))
                  for name in ("argument", "output", "temp", "alias", "generated_code")}
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text()
    return {"per_device_bytes": per_device,
            "per_device_total_bytes": per_device["argument"] + per_device["output"] + per_device["temp"]
            - per_device["alias"],
            "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "collectives": {kind: len(re.findall(rf"\s{kind}(?:-start)?\(", text)) for kind in COLLECTIVES},
            "mosaic_kernels": text.count(MOSAIC_CALL)}


_HBM_REFUSAL = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                          r"\(([\d.]+)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_refusal(error: Exception) -> dict[str, Any] | None:
    """The TPU compiler's refusal of a program too large for a chip ("Ran out of memory on HBM"), as a
    report: the bytes it said the program's temporaries need (a lower bound on the total) and the
    chip's available HBM; None for any other error. A refusal is a verdict (does not fit), not a crash."""
    found = _HBM_REFUSAL.search(str(error))
    if found is None:
        return None
    needed, available = (float(found.group(i)) * _UNITS[found.group(i + 1)] for i in (1, 3))
    return {"refused": str(error).strip().splitlines()[0][:300], "per_device_total_bytes": int(needed),
            "available_bytes": int(available), "per_device_bytes": None}
