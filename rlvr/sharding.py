"""Logical axes, the one rules table, meshes and shardings.

Every parameter and activation is named with logical axes from one vocabulary
(`batch, length, embed, mlp, heads, kv_heads, head_dim, vocab, layers`, and `lora_rank` for
adapters). One rules table maps each logical axis to mesh axes (`data, fsdp, tensor, sequence`). A mesh
axis is used at most once per array (the first logical axis that claims it wins,
so activations shard `batch` over `fsdp` while parameters shard `embed` over it),
and a mesh axis that does not divide a dimension is dropped for that dimension
(e.g. 2 KV heads on a tensor axis of 4 stay replicated) instead of failing.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "sequence")

LogicalAxes = tuple[str | None, ...]
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Order matters: earlier rules claim mesh axes first.
LOGICAL_AXIS_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", "sequence"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("embed", "fsdp"),
    ("head_dim", None),
    ("layers", None),
    ("lora_rank", None),  # adapters: lora_a [in axes..., rank], lora_b [rank, out axes...] shard like their kernel
)


def mesh_shape_from_config(shape: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Resolves a `{axis: size}` mapping where one size may be -1 (take the rest).

    Raises ValueError naming `mesh.<axis>` when the sizes cannot tile `num_devices`.
    """
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axes {sorted(unknown)}; valid axes are {MESH_AXES}.")
    sizes = {axis: int(shape.get(axis, 1)) for axis in MESH_AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free}.")
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{axis}={size}: sizes must be positive or -1 (fill).")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh: fixed axes multiply to {fixed}, which does not divide the "
                f"{num_devices} devices; change the sizes in config.mesh."
            )
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"mesh: sizes {sizes} multiply to {fixed} but there are {num_devices} devices; "
            "set one axis to -1 or make the product equal the device count."
        )
    return sizes


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a mesh over all (or the given) devices with the four rlvr axes (Auto types)."""
    devices = list(devices) if devices is not None else jax.devices()
    sizes = mesh_shape_from_config(shape, len(devices))
    dims = tuple(sizes[axis] for axis in MESH_AXES)
    return jax.make_mesh(
        dims, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def _mesh_axes_for(logical: str | None, rules: Rules) -> tuple[str, ...]:
    if logical is None:
        return ()
    for name, target in rules:
        if name == logical:
            if target is None:
                return ()
            return (target,) if isinstance(target, str) else tuple(target)
    raise KeyError(f"logical axis {logical!r} has no rule; known: {[n for n, _ in rules]}")


def logical_to_spec(
    logical_axes: LogicalAxes,
    shape: Sequence[int],
    mesh: Mesh,
    rules: Rules = LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """Maps logical axis names of an array of `shape` to a PartitionSpec on `mesh`."""
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {logical_axes} do not match shape {tuple(shape)}")
    rule_order = {name: i for i, (name, _) in enumerate(rules)}
    # Assign mesh axes to dimensions in rule order so earlier rules win.
    order = sorted(
        range(len(shape)),
        key=lambda d: rule_order.get(logical_axes[d], len(rules)) if logical_axes[d] else len(rules),
    )
    used: set[str] = set()
    assigned: list[tuple[str, ...]] = [()] * len(shape)
    for dim in order:
        chosen: list[str] = []
        for axis in _mesh_axes_for(logical_axes[dim], rules):
            size = mesh.shape[axis]
            if axis in used or size == 1:
                continue
            if shape[dim] % (math.prod(mesh.shape[a] for a in chosen) * size):
                continue
            chosen.append(axis)
        used.update(chosen)
        assigned[dim] = tuple(chosen)
    entries = [None if not a else (a[0] if len(a) == 1 else a) for a in assigned]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def logical_to_sharding(
    logical_axes: LogicalAxes, shape: Sequence[int], mesh: Mesh, rules: Rules = LOGICAL_AXIS_RULES
) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def spec_to_json(spec: PartitionSpec) -> list:
    """A JSON-friendly form of a PartitionSpec (for golden files)."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


# --- activation constraints -------------------------------------------------------------

_ACTIVE = threading.local()


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Rules = LOGICAL_AXIS_RULES) -> Iterator[None]:
    """Within this context (at trace time), `constrain` pins activations to the mesh."""
    previous = getattr(_ACTIVE, "value", None)
    _ACTIVE.value = (mesh, rules) if mesh is not None else None
    try:
        yield
    finally:
        _ACTIVE.value = previous


def active_mesh() -> Mesh | None:
    """The mesh of the enclosing `activation_sharding` context (at trace time), else None."""
    active = getattr(_ACTIVE, "value", None)
    return None if active is None else active[0]


def constrain(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op outside `activation_sharding`."""
    active = getattr(_ACTIVE, "value", None)
    if active is None:
        return x
    mesh, rules = active
    if np.prod(list(mesh.shape.values())) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_sharding(logical_axes, x.shape, mesh, rules))
