"""Checkpoints with orbax: the train-state pytree plus a JSON dict (data position, etc.).

Saves are asynchronous (the step loop goes on while arrays are written), the last N are
kept, and a save is atomic: orbax writes into a temporary directory and renames it when
complete, so a kill mid-save leaves no checkpoint that loads half. `latest_step` only
sees finalised checkpoints.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

# Orbax splits a replicated array across its replicas to save it in parallel, slicing it with one
# compiled program per shape: ~0.3 s each on a CPU, 14 s for the first save of a tiny VLM's state
# (then cached). Slices under 1 MiB gain nothing from it: those arrays are written from one replica.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def _register_array_handler() -> None:
    """Replace orbax's jax.Array handler by one with the replica-parallel floor above, without the
    warning orbax logs on every override (it would land on stderr of every command)."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
            array_metadata_store=ocp.type_handlers.get_type_handler(jax.Array)._array_metadata_store), override=True)
    finally:
        absl_logger.setLevel(level)


_register_array_handler()


class Checkpointer:
    """Save/restore `(state pytree, extra JSON dict)` at integer steps under `directory`."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "extra")
        )

    def save(self, step: int, state: Any, extra: dict[str, Any], force: bool = False) -> bool:
        """Starts saving (asynchronously); returns whether a save was started."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra))
        return self._manager.save(step, args=args, force=force)

    def save_now(self, step: int, state: Any, extra: dict[str, Any]) -> None:
        """Saves `step` unless it is already saved, and waits until it is on disk (preemption)."""
        self.wait()
        if self.latest_step() != step:
            self.save(step, state, extra, force=True)
        self.wait()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restores into the shapes, dtypes and shardings of `abstract_state` (arrays or
        ShapeDtypeStructs with `.sharding`)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.directory}")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), abstract_state
        )
        try:
            restored = self._restore(step, target)
        except (ValueError, KeyError) as error:  # saved in the other layer layout (model.scan_layers)?
            other = _other_layout(target)
            if other is None:
                raise
            try:
                restored = self._restore(step, other)
            except (ValueError, KeyError):
                raise error from None
            restored["state"] = jax.tree.map(_relayout, restored["state"], is_leaf=_holds_layers)
        return restored["state"], dict(restored["extra"])

    def _restore(self, step: int, target: Any) -> dict[str, Any]:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore())
        return dict(self._manager.restore(step, args=args))

    def wait(self) -> None:
        """Blocks until any in-flight asynchronous save is complete."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


# A state saved with `model.scan_layers` one way restores into a job that runs it the other way: the
# params and every optimizer state shaped like them (Adam's moments) hold their decoder layers either
# stacked (`layers/...`, axis 0) or per layer (`layers_0/...`); such dicts are converted as a whole.


def _holds_layers(x: Any) -> bool:
    return isinstance(x, dict) and ("layers" in x or "layers_0" in x)


def _relayout(x: Any) -> Any:
    """A dict holding decoder layers in the other layout (arrays): stacked <-> per layer."""
    from rlvr.models.transformer import stack_layers, unstack_layers

    if not _holds_layers(x):
        return x
    return unstack_layers(x) if "layers" in x else stack_layers(x)


def _other_layout(target: Any) -> Any:
    """The abstract state (ShapeDtypeStructs with NamedShardings) in the other layer layout, or None
    when nothing in it holds decoder layers."""
    found = False

    def convert(x):
        nonlocal found
        if not _holds_layers(x):
            return x
        found = True
        x = dict(x)
        if "layers" in x:
            stacked = x.pop("layers")
            count = jax.tree.leaves(stacked)[0].shape[0]
            for i in range(count):
                x[f"layers_{i}"] = jax.tree.map(lambda a: _abstract(a.shape[1:], a, drop=True), stacked)
            return x
        count = sum(1 for name in x if name.startswith("layers_"))
        layers = [x.pop(f"layers_{i}") for i in range(count)]
        x["layers"] = jax.tree.map(lambda a: _abstract((count, *a.shape), a, drop=False), layers[0])
        return x

    converted = jax.tree.map(convert, target, is_leaf=_holds_layers)
    return converted if found else None


def _abstract(shape: tuple[int, ...], like: jax.ShapeDtypeStruct, drop: bool) -> jax.ShapeDtypeStruct:
    """`like` with `shape`: its sharding's spec without (drop) or with a new (unsharded) leading axis."""
    sharding = like.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)
        spec = spec[1:] if drop else (None, *spec)
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return jax.ShapeDtypeStruct(shape, like.dtype, sharding=sharding)
