"""When does a JAX array on CPU still share memory with the NumPy array it was made from?

    .venv/bin/python benchmarks/host_aliasing_probe.py [--trials 100] \
        [--out benchmarks/results/host_aliasing_probe.json]

For each way host data reaches JAX (device_put with and without a sharding, make_array_from_callback,
make_array_from_process_local_data, jnp.asarray / jnp.array, a jitted call's argument) and three kinds
of source buffer (16 KiB at a 64-byte boundary, 16 KiB off it, 4 MiB off it), the probe overwrites the
NumPy array right after the call and counts the trials in which the JAX array (or the jitted call's
result) then holds the new values; then again with `block_until_ready()` before the overwrite. Prints
one JSON line. Measured with JAX 0.10.2 on CPU (8 fake devices): an aligned buffer is zero-copied
(aliased for good: every trial, even after block_until_ready), an unaligned large one is copied in the
background (some trials, none after block_until_ready), jnp.asarray(x) and jnp.array(x) copy (a large
buffer in the background too) while jnp.asarray(x, x.dtype) is device_put, and a
zero-copied array donated to a jitted call is never written in place (nor is the read-only NumPy view
np.asarray gives of a JAX array, when that array is donated). Hence the rule in this repo: a host
array the host edits again is handed to JAX as a NumPy copy (`x.copy()`), as rlvr.rollout.dispatch does.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

BUFFERS = {"aligned_16k": (4096, 0), "unaligned_16k": (4096, 16), "unaligned_4m": (1 << 20, 16)}


def host_buffer(size: int, offset: int) -> np.ndarray:
    """float32 zeros starting `offset` bytes past a 64-byte boundary."""
    raw = np.zeros(size * 4 + 128, np.uint8)
    start = -raw.ctypes.data % 64 + offset
    return raw[start:start + size * 4].view(np.float32)


def handovers() -> dict:
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    replicated, sharded = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))
    slow = jax.jit(lambda x: jnp.cumsum(jnp.sort(x)[::-1])[-1:])  # a call that runs a while after dispatch
    return {
        "device_put": jax.device_put,
        "device_put_replicated": lambda a: jax.device_put(a, replicated),
        "device_put_sharded": lambda a: jax.device_put(a, sharded),
        "make_array_from_callback": lambda a: jax.make_array_from_callback(a.shape, sharded, lambda i: a[i]),
        "make_array_from_process_local_data": lambda a: jax.make_array_from_process_local_data(sharded, a),
        "jnp_asarray": jnp.asarray,
        "jnp_asarray_same_dtype": lambda a: jnp.asarray(a, a.dtype),
        "jnp_array": jnp.array,
        "jit_argument": slow,
        "numpy_copy_then_device_put": lambda a: jax.device_put(a.copy()),
    }


def changed(make, size: int, offset: int, trials: int, block: bool) -> int:
    """Trials in which overwriting the source after the handover changed the JAX side."""
    hits = 0
    for _ in range(trials):
        source = host_buffer(size, offset)
        out = make(source)
        if block:
            out.block_until_ready()
        source[:] = 5.0
        hits += bool(np.asarray(out).ravel()[0] != 0)
    return hits


def donated_in_place(trials: int) -> int:
    """Trials in which donating a zero-copied array to a jitted call wrote into the NumPy buffer."""
    step = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    hits = 0
    for _ in range(trials):
        source = host_buffer(4096, 0)
        step(jax.device_put(source)).block_until_ready()
        hits += bool(source[0] != 0)
    return hits


def view_changed_by_donation(trials: int) -> int:
    """Trials in which np.asarray of a JAX array (a read-only view of its buffer on CPU) changed when
    the array was then donated to a jitted call."""
    step = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    hits = 0
    for _ in range(trials):
        array = jnp.zeros((4096,), jnp.float32) + 0.0
        view = np.asarray(array)
        step(array).block_until_ready()
        hits += bool(view[0] != 0)
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    for make in handovers().values():  # compile and warm up outside the counts
        make(host_buffer(4096, 0))
        make(host_buffer(1 << 20, 16))
    changes = {}
    for name, make in handovers().items():
        for buffer, (size, offset) in BUFFERS.items():
            trials = args.trials if size < 1 << 20 else max(args.trials // 4, 1)
            changes[f"{name}/{buffer}"] = {"changed": changed(make, size, offset, trials, False),
                                           "changed_after_block": changed(make, size, offset, trials, True),
                                           "trials": trials}
    emit({"benchmark": "host_aliasing_probe", "date": datetime.date.today().isoformat(),
          "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "jax": jax.__version__,
          "devices": jax.device_count(), "command": " ".join(["benchmarks/host_aliasing_probe.py", *sys.argv[1:]]),
          "changed_after_overwrite": changes, "donation_wrote_numpy_buffer": donated_in_place(args.trials),
          "numpy_view_changed_by_donation": view_changed_by_donation(args.trials), "donation_trials": args.trials},
         args.out)


if __name__ == "__main__":
    main()
