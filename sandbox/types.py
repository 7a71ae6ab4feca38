"""The sandbox's plain data: `Limits` in, `Result` out, and the errors.

Kept free of any backend so a trace record, a replay and a remote worker can all build them from JSON.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

MiB = 1 << 20

# Names of the limits a run can hit (`Result.limit_hit`).
WALL_TIME, CPU, MEMORY, OUTPUT, FILE_SIZE, DISK = "wall_time", "cpu", "memory", "output", "file_size", "disk"


class SandboxError(RuntimeError):
    """The sandbox itself failed (not: the program inside it failed)."""


class SandboxUnavailable(SandboxError):
    """The backend cannot run here (runsc missing or unable to start a sandbox); the message says what to do."""


class SandboxStalled(SandboxError):
    """A verdict's run hit its time limit having used little CPU, twice: the host was too loaded to judge the
    program (an infrastructure failure, not a wrong answer; `verify.verify_program`)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run; every one is enforced by the backend or by the harness.

    wall_s: harness wall-clock limit of the program (the sandbox's boot gets `start_grace_s` on top).
    cpu_s: RLIMIT_CPU (SIGXCPU at cpu_s, SIGKILL a second later). cpus: cgroup CPU quota in cores (runsc).
    memory_bytes: RLIMIT_AS of each process (a clean MemoryError); the runsc cgroup gets
      `memory_bytes + sandbox_overhead_bytes` as a hard backstop that kills the whole sandbox.
    nproc: RLIMIT_NPROC, processes *and* threads (gVisor enforces it per sandbox).
    nofile: RLIMIT_NOFILE. file_bytes: RLIMIT_FSIZE (largest single file).
    output_bytes: stdout and stderr each kept up to this size; more kills the run ("output").
    workspace_bytes / workspace_inodes: size of the private workspace (a tmpfs); tmp_bytes: size of /tmp.
    """

    wall_s: float = 10.0
    cpu_s: int = 10
    cpus: float = 1.0
    memory_bytes: int = 512 * MiB
    sandbox_overhead_bytes: int = 128 * MiB
    nproc: int = 64
    nofile: int = 256
    file_bytes: int = 16 * MiB
    output_bytes: int = 1 * MiB
    workspace_bytes: int = 32 * MiB
    workspace_inodes: int = 4096
    tmp_bytes: int = 64 * MiB
    start_grace_s: float = 2.0

    def rlimits(self, cpu: bool = True) -> list[tuple[str, int, int]]:
        """(resource name, soft, hard) for every rlimit a backend sets; integers only (a float in an
        OCI spec makes `runsc run` fail). `cpu=False` leaves RLIMIT_CPU to the caller (the pool's
        worker times each task itself)."""
        out = [("RLIMIT_AS", self.memory_bytes, self.memory_bytes), ("RLIMIT_NPROC", self.nproc, self.nproc),
               ("RLIMIT_NOFILE", self.nofile, self.nofile), ("RLIMIT_FSIZE", self.file_bytes, self.file_bytes),
               ("RLIMIT_CORE", 0, 0)]
        if cpu:
            out.append(("RLIMIT_CPU", self.cpu_s, self.cpu_s + 1))
        return [(name, int(soft), int(hard)) for name, soft, hard in out]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Limits:
        return cls(**data)


@dataclasses.dataclass
class Timings:
    """Seconds spent waiting for a slot (queue), preparing and launching (start), and running (run).

    Under runsc `run_s` includes the sandbox's boot (~0.25 s cold); in a warm pool it is the task alone."""

    queue_s: float = 0.0
    start_s: float = 0.0
    run_s: float = 0.0


@dataclasses.dataclass
class Result:
    """What a sandboxed run did. `exit_code` is None when the program died of `signal`. `cpu_s`: CPU seconds
    the run used, measured on the host (the process backend: the program's rusage; runsc: its cgroup), None
    where the backend does not measure it (bwrap: a killed program's CPU is not accounted to the launcher)."""

    backend: str
    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    limit_hit: str | None = None  # WALL_TIME, CPU, MEMORY, OUTPUT, FILE_SIZE, DISK or None
    timings: Timings = dataclasses.field(default_factory=Timings)
    digest_before: str = ""
    digest_after: str = ""
    sandbox_id: str = ""
    cpu_s: float | None = None

    @property
    def ok(self) -> bool:
        """Exited 0 with no limit hit."""
        return self.exit_code == 0 and self.limit_hit is None

    def text(self, stream: str = "stdout") -> str:
        """A stream decoded as UTF-8 with replacement characters (never raises on garbage bytes)."""
        return getattr(self, stream).decode("utf-8", "replace")

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types only (outputs as base64: they may hold any bytes); `from_json` inverts it exactly."""
        data = dataclasses.asdict(self)
        data["stdout"] = base64.b64encode(self.stdout).decode()
        data["stderr"] = base64.b64encode(self.stderr).decode()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        fields = {**data, "stdout": base64.b64decode(data["stdout"]), "stderr": base64.b64decode(data["stderr"]),
                  "timings": Timings(**data["timings"])}
        return cls(**fields)
