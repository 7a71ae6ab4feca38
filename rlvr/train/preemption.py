"""Preemption: SIGTERM (a cluster taking the machine back) -> checkpoint at the next step boundary,
then exit with PREEMPTED_EXIT_CODE; the same command run again resumes from that checkpoint.

Kubernetes, Slurm (`--signal`/preemption) and Cloud TPU maintenance all send SIGTERM and wait a
grace period before SIGKILL. The handler only sets a flag: the training loop checks it after
each step, so the checkpoint is a consistent one (weights, optimizer, data position; for RL also
the producer's completed batches, curriculum and replay buffer). A second SIGTERM while the
checkpoint is being written is ignored (the flag is already set); SIGKILL still loses only the
steps since the last checkpoint. Set the cluster's grace period above one step's time plus a save.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from typing import Any

import numpy as np

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: the job did not finish; orchestrators restart or requeue it
# JAX's preemption service agrees on a step id to stop at (the highest any process has reached, plus
# one), so the ids must be consecutive and the same on every process: we count calls, from 0 right
# after jax.distributed.initialize (`join_jax_preemption_service`), one per training step after that.
_SYNC_POINTS = itertools.count()


def join_jax_preemption_service() -> None:
    """Call right after jax.distributed.initialize (rlvr.launch.distributed does): the first sync
    point, so a SIGTERM arriving during restore or compilation stops the job at its first step."""
    import jax

    if jax.config.jax_enable_preemption_service:
        from jax.experimental import multihost_utils

        multihost_utils.reached_preemption_sync_point(next(_SYNC_POINTS))


class Preempted(SystemExit):
    """Raised by a trainer after it saved a checkpoint because of SIGTERM (exits the process with
    PREEMPTED_EXIT_CODE unless caught, e.g. by a test calling `rlvr.main.run`)."""

    def __init__(self, step: int, checkpoint_dir: str):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.checkpoint_dir = step, checkpoint_dir

    def __str__(self) -> str:
        return (f"preempted (SIGTERM): checkpoint saved at step {self.step} in {self.checkpoint_dir}; "
                "run the same command again to resume")


class PreemptionGuard:
    """`with PreemptionGuard() as guard: ... if guard.should_stop(step): save and raise Preempted`.

    One process: installs a SIGTERM handler while the block runs (only possible in the main thread;
    elsewhere the guard stays inert and `request()` can still be called, e.g. by an embedding program).

    Several processes (jax.distributed): JAX's preemption service already listens for SIGTERM from
    `jax.distributed.initialize` on (so a signal during restore or compilation is not lost either) and
    tells every process; the guard then leaves SIGTERM to it and asks it for the step at which all
    processes stop together. Without the service (jax_enable_preemption_service=False) the processes
    exchange their own flags at every step instead."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self._jax_service = False
        self.received_at: float | None = None

    def request(self, *_: Any) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
        self._event.set()

    @property
    def requested(self) -> bool:
        """Whether this process received the signal (one process, or without JAX's service)."""
        return self._event.is_set()

    def should_stop(self) -> bool:
        """Whether to checkpoint and stop after this step. With several processes every process calls
        this once after every training step, and all of them get True after the same step:
        a cluster may signal one host first, or only one, and that host stopping alone would leave the
        others waiting in the next step's collectives until XLA aborts them all."""
        import jax

        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        if self._jax_service:
            return multihost_utils.reached_preemption_sync_point(next(_SYNC_POINTS))
        return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))

    def __enter__(self) -> PreemptionGuard:
        import jax

        self._jax_service = jax.process_count() > 1 and jax.config.jax_enable_preemption_service
        if threading.current_thread() is threading.main_thread() and not self._jax_service:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self.request)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
