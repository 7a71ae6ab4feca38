"""Per-host data shards: on a multi-host job each process builds only the batch rows its devices hold.

A train batch is `[rows, ...]`, sharded over the mesh's data x fsdp axes. `local_rows` are the rows
this process's devices hold; a row-addressable stream (`next_rows(rows)`: TokenStream, PairStream)
reads only the records of those rows, and `global_batch` assembles the global jax.Array from every
process's rows (`jax.make_array_from_callback`), so no process reads another's records. Every row
has its own position in the record order (rlvr.data.stream), so the global batch is the same
whatever the process count: N processes train on the batches of one process, and a checkpoint
written on N resumes on M. A stream's state (one cursor per row) is merged across processes before
it is checkpointed (`merged_state`: each process advanced only its own rows' cursors).

Streams that generate their batches (rlvr.data.arithmetic: a pure function of the batch index)
build the whole batch on every process; `global_batch` then keeps the local rows.

`gather_json` exchanges small host-side values (rewards, tasks) between processes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np


def local_rows(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> list[int]:
    """The rows (indices on axis 0) of a `shape` array that this process's devices hold under `sharding`."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
        rows.update(range(*index[0].indices(shape[0])))
    return sorted(rows)


def global_batch(local: dict[str, np.ndarray], rows: Sequence[int], num_rows: int,
                 shardings: dict[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
    """The global `[num_rows, ...]` arrays from this process's `rows` (`local[k][i]` is row `rows[i]`)."""
    position = {r: i for i, r in enumerate(rows)}

    def one(x: np.ndarray, sharding) -> jax.Array:
        shape = (num_rows, *x.shape[1:])

        def block(index):
            wanted = [position[r] for r in range(*index[0].indices(num_rows))]
            return x[wanted][(slice(None), *index[1:])]
        return jax.make_array_from_callback(shape, sharding, block)
    return {k: one(np.asarray(v), shardings[k]) for k, v in local.items()}


class RowReader:
    """The batches of `data` for a train step with input shardings `shardings`: this process's rows
    only when `data` is row-addressable (`next_rows`), else its whole batch cut to those rows."""

    def __init__(self, data, shardings: dict[str, jax.sharding.Sharding]):
        self.data, self.shardings = data, shardings
        shapes = data.shapes()
        self.num_rows = next(iter(shapes.values())).shape[0]
        key = next(iter(shapes))
        self.rows = local_rows(shardings[key], shapes[key].shape)

    def next(self) -> dict[str, jax.Array]:
        if hasattr(self.data, "next_rows"):
            local = self.data.next_rows(self.rows)
        else:
            local = {k: np.asarray(v)[self.rows] for k, v in next(self.data).items()}
        return global_batch(local, self.rows, self.num_rows, self.shardings)

    def describe(self) -> str:
        """One line for the log: which rows this process read and how many records that took."""
        read = getattr(self.data, "records_read", None)
        what = f"read {read} records for" if read is not None else "generated"
        return (f"data: process {jax.process_index()} of {jax.process_count()} {what} batch rows "
                f"{self.rows[0]}-{self.rows[-1]} of {self.num_rows}" if self.rows else "data: no rows here")


def apply_by_rows(fn, params, rows_of, shapes: dict[str, jax.ShapeDtypeStruct], mesh) -> Any:
    """`fn(params, batch)` on the global batch of `shapes` of which this process builds only its rows
    (`rows_of(rows)`), the result gathered to every process as NumPy (an evaluation or reference pass:
    every process reads its rows' records, every process gets every row's result)."""
    from rlvr.train import step as step_lib

    shardings = step_lib.batch_shardings(shapes, mesh)
    key = next(iter(shapes))
    num_rows = shapes[key].shape[0]
    rows = local_rows(shardings[key], shapes[key].shape)
    out = fn(params, global_batch(rows_of(rows), rows, num_rows, shardings))
    if jax.process_count() == 1:
        return jax.device_get(out)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)


def merged_state(data) -> dict[str, Any]:
    """`data.get_state()` with every row's cursor as its owner advanced it (one small all-gather on a
    multi-process job; every process must call it at the same point, as checkpoint saving does)."""
    state = data.get_state()
    if jax.process_count() == 1 or "cursors" not in state:
        return state
    from jax.experimental import multihost_utils

    cursors = np.asarray(multihost_utils.process_allgather(np.asarray(state["cursors"], np.int64)))
    merged = [int(c) for c in cursors.reshape(jax.process_count(), -1).max(axis=0)]
    data.set_cursors(merged)
    return {**state, "cursors": merged}


def gather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable `value`, in process order (a single process: `[value]`).
    Collective: every process calls it at the same point, from the main thread."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(data)))).reshape(-1)
    size = 1 << int(max(lengths.max(), 1) - 1).bit_length()  # few distinct shapes: few compilations
    padded = np.zeros(size, np.uint8)
    padded[: len(data)] = data
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), size)
    return [json.loads(gathered[p, : lengths[p]].tobytes()) for p in range(len(lengths))]
