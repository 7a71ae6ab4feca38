"""Target options from `--key=value` strings, accelerators, and the checks every target runs first.

Each target declares its options as a dataclass; `parse_options` turns the launch command's
string flags into it, refusing an unknown key (with the nearest valid one) or a value of the
wrong type, naming the option and the fix. `Accelerator` describes what one job gets: a TPU slice
(`--tpu=v5p-32`) or GPU nodes (`--gpu=h100 --gpus_per_node=8 --nodes=2`), its hosts, chips per host,
HBM per chip and, for GKE, the node labels.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from rlvr.launch import fit

T = TypeVar("T")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


class OptionError(ValueError):
    """A bad target option; the message names the option and how to fix it."""


def _field_type(cls, field: dataclasses.Field) -> type:
    hints = typing.get_type_hints(cls)
    hint = hints[field.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _convert(name: str, text: str, kind: type, target: str) -> Any:
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise OptionError(f"--{name}={text!r} ({target}): must be true or false.")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise OptionError(f"--{name}={text!r} ({target}): must be a{'n integer' if kind is int else ' number'}, "
                              f"e.g. --{name}={kind(1)}.") from None
    return text


def parse_options(cls: type[T], raw: Mapping[str, str], target: str) -> T:
    """`cls` (a dataclass) from string options; an unknown key or bad value raises OptionError."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name, text in raw.items():
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f" Did you mean --{close[0]}?" if close else ""
            raise OptionError(f"--{name} is not a --target={target} option.{hint} Options: "
                              f"{', '.join('--' + f for f in sorted(fields))}.")
        values[name] = _convert(name, str(text), _field_type(cls, fields[name]), target)
    options = cls(**values)
    check = getattr(options, "check", None)
    if check is not None:
        check()
    return options


def positive(name: str, value: float, target: str) -> None:
    if value <= 0:
        raise OptionError(f"--{name}={value} ({target}): must be positive.")


# --- accelerators --------------------------------------------------------------------------------

# TPU generations: (GKE node label value, topology dimensions, does the type's number count
# TensorCores (2 per chip, v4/v5p) rather than chips). Labels: GKE "Plan TPUs" / TPU docs.
TPU_GENERATIONS = {
    "v4": ("tpu-v4-podslice", 3, True),
    "v5p": ("tpu-v5p-slice", 3, True),
    "v5e": ("tpu-v5-lite-podslice", 2, False),
    "v6e": ("tpu-v6e-slice", 2, False),
}
TPU_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e"}
# Default slice shapes by chip count (cloud.google.com/tpu/docs/v5p and /v6e tables).
TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
                 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
GPU_NAMES = ("a100", "a100-40gb", "h100", "h200")


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """What one job runs on: `hosts` processes (pods/nodes), each with `chips_per_host` devices."""

    kind: str  # "tpu" | "gpu"
    name: str  # HBM_GIB key: "v5p", "h100", ...
    hosts: int
    chips_per_host: int
    topology: str = ""  # TPU slice shape, e.g. "2x2x4"
    gke_accelerator: str = ""  # TPU: cloud.google.com/gke-tpu-accelerator value
    spec: str = ""  # as given, for messages: "v5p-32", "2 x 8 h100"

    @property
    def devices(self) -> int:
        return self.hosts * self.chips_per_host

    @property
    def hbm_gib(self) -> float:
        return fit.hbm_gib(self.name)


def tpu_accelerator(spec: str, topology: str = "", option: str = "tpu") -> Accelerator:
    """`v5p-32` (TensorCores for v4/v5p), `v5e-16` / `v5litepod-16` / `v6e-16` (chips) -> an Accelerator.
    `topology` overrides the default slice shape for that chip count."""
    match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", spec.strip().lower())
    generation = match and TPU_ALIASES.get(match.group(1), match.group(1))
    if not match or generation not in TPU_GENERATIONS:
        raise OptionError(f"--{option}={spec!r}: use VERSION-SIZE with a version of {sorted(TPU_GENERATIONS)}, "
                          "e.g. --tpu=v5p-32 (TensorCores) or --tpu=v6e-16 (chips).")
    label, dims, counts_cores = TPU_GENERATIONS[generation]
    size = int(match.group(2))
    chips = size // 2 if counts_cores else size
    if chips < 1 or (counts_cores and size % 2):
        raise OptionError(f"--{option}={spec!r}: {generation} sizes count TensorCores (2 per chip): use an even size.")
    shapes = TOPOLOGIES_3D if dims == 3 else TOPOLOGIES_2D
    topology = topology or shapes.get(chips, "")
    if not topology:
        raise OptionError(f"--{option}={spec!r}: no default slice shape for {chips} {generation} chips; give "
                          f"--tpu_topology=AxB{'xC' if dims == 3 else ''} (known: {sorted(shapes)} chips).")
    sides = [int(x) for x in topology.split("x")] if re.fullmatch(r"\d+(x\d+)+", topology) else []
    if len(sides) != dims or math.prod(sides) != chips:
        raise OptionError(f"--tpu_topology={topology!r}: {generation} slices are {dims}-D and {spec} has {chips} "
                          f"chips; give a shape whose sides multiply to {chips}, e.g. {shapes.get(chips, '')!r}.")
    per_host = chips if dims == 2 and chips <= 8 else min(chips, 4)  # GKE: 4-chip hosts, one 8-chip v5e/v6e host
    return Accelerator("tpu", generation, chips // per_host, per_host, topology, label, spec)


def gpu_accelerator(name: str, gpus_per_node: int, nodes: int) -> Accelerator:
    key = name.strip().lower()
    if key not in GPU_NAMES:
        raise OptionError(f"--gpu={name!r}: use one of {list(GPU_NAMES)} (its HBM size is needed for the fit check).")
    if gpus_per_node < 1 or nodes < 1:
        raise OptionError(f"--gpus_per_node={gpus_per_node}, --nodes={nodes}: both must be >= 1.")
    return Accelerator("gpu", key, nodes, gpus_per_node, spec=f"{nodes} x {gpus_per_node} {key}")


def accelerator_from(tpu: str, tpu_topology: str, gpu: str, gpus_per_node: int, nodes: int,
                     target: str) -> Accelerator:
    """Exactly one of --tpu / --gpu (the shared options of the k8s and xm targets)."""
    if bool(tpu) == bool(gpu):
        raise OptionError(f"--target={target}: give exactly one of --tpu=v5p-32 or --gpu=h100 "
                          "(with --gpus_per_node and --nodes).")
    if tpu:
        if nodes != 1:
            raise OptionError("--nodes is for GPUs; a TPU slice's host count follows from --tpu.")
        return tpu_accelerator(tpu, tpu_topology)
    if tpu_topology:
        raise OptionError("--tpu_topology is for TPUs; remove it or use --tpu.")
    return gpu_accelerator(gpu, gpus_per_node, nodes)
