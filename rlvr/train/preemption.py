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

import signal
import threading
import time
from typing import Any

PREEMPTED_EXIT_CODE = 143  # 128 + SIGTERM: the job did not finish; orchestrators restart or requeue it


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
    """`with PreemptionGuard() as guard: ... if guard.requested: save and raise Preempted`.

    Installs a SIGTERM handler while the block runs (only possible in the main thread; elsewhere
    the guard stays inert and `request()` can still be called, e.g. by an embedding program)."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self._event = threading.Event()
        self._previous: dict[int, Any] = {}
        self.received_at: float | None = None

    def request(self, *_: Any) -> None:
        if self.received_at is None:
            self.received_at = time.monotonic()
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def __enter__(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self.request)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
