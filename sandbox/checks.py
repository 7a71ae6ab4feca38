"""The host side of check-style verdicts (`verdict.CheckTest`): the harness process and the sandbox rounds.

`judge_check` starts harness.py in its own host process (the test code runs there, never beside the
candidate), then relays: each `{"run": calls}` the harness sends becomes one sandbox run of the verdict
driver (`verdict.run_calls`), whose result lines go back as `{"results": ...}`, until the harness sends
its verdict. Anything irregular fails closed with a reason: a round that hit a limit, a missing or
malformed result line, a call that timed out, a harness that died, stayed silent past `HARNESS_STEP_S`
or broke the protocol, more than `MAX_ROUNDS` rounds.
"""

from __future__ import annotations

import functools
import marshal
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .harness import probing_asserts, write_frame
from .types import Limits, Result
from .verdict import CheckTest, Verdict, calls_spec, parse_results, run_calls

if TYPE_CHECKING:
    from .executor import Executor

MAX_ROUNDS = 8  # sandbox rounds of one check-style verdict (see harness.py); usually 1
PROBE_CALLS = 5000  # calls one probing attempt may record
PROBE_S = 2.0  # seconds one probing attempt may take
HARNESS_STEP_S = 20.0  # wall clock of the harness between two messages (its rlimits bound CPU and memory)
HARNESS_MEMORY = 1 << 30



def judge_check(program: str, test: CheckTest, entry_point: str, executor: Executor, limits: Limits,
                 call_timeout_s: float | None) -> Verdict:
    """Relay between the host harness process (the test code) and sandbox rounds of calls until the harness
    gives its verdict (see harness.py); any failure of a round or of the harness fails closed."""
    setup = {"code": _compiled(test.prelude, test.tests), "entry_point": entry_point,
             "seed": secrets.randbits(62), "max_calls": PROBE_CALLS, "probe_s": PROBE_S,
             "memory_bytes": HARNESS_MEMORY, "cpu_s": int(HARNESS_STEP_S * 2)}
    result, rounds = None, 0
    with HarnessProcess(setup) as harness:
        while True:
            message = harness.receive()
            if message is None:
                return _check_verdict(False, harness.failure(), result, rounds)
            if "verdict" in message:
                found = message["verdict"]
                return _check_verdict(bool(found["passed"]), str(found["reason"]), result, rounds,
                                      calls=found["calls"], mutated=found["mutated"])
            if rounds == MAX_ROUNDS:
                return _check_verdict(False, f"too_many_rounds: the tests needed over {MAX_ROUNDS} sandbox rounds",
                                      result, rounds)
            calls = message["run"]
            result, nonce = run_calls(executor, program, calls_spec(entry_point, calls, limits, call_timeout_s),
                                      limits)
            rounds += 1
            entries, reason = (({}, result.limit_hit) if result.limit_hit
                               else parse_results(result.stdout, nonce, len(calls)))
            failed = reason or next((f"error:{e['error']}" for e in entries.values() if "error" in e), None)
            if failed:
                return _check_verdict(False, failed, result, rounds)
            harness.send({"results": [entries[i] for i in range(len(calls))]})


@functools.lru_cache(maxsize=512)
def _compiled(prelude: str, tests: str) -> dict[str, Any]:
    """The prelude and tests compiled for the harness (asserts rewritten by `harness.probing_asserts`),
    once per test code; a syntax error in the test code raises here (a task bug, not the candidate's)."""
    return {"prelude": probing_asserts(prelude, "prelude.py"), "tests": probing_asserts(tests, "tests.py")}


def _check_verdict(passed: bool, reason: str, result: Result | None, rounds: int, **info: Any) -> Verdict:
    result = result or Result("none", None, None, b"", b"")
    return Verdict(passed, int(passed), 1, reason, ["pass" if passed else reason], result,
                   {"rounds": rounds, **info})


class HarnessProcess:
    """harness.py in its own host process: `python -I -S` (no site, no environment, this directory only),
    its own session (killed as a group), a wall clock per message, rlimits it sets on itself first."""

    def __init__(self, setup: dict):
        here = os.path.dirname(os.path.abspath(__file__))
        boot = ("import importlib.util, sys\n"  # load wire.py and harness.py by path: the stdlib stays first
                f"for name in ('wire', 'harness'):\n"
                f"    spec = importlib.util.spec_from_file_location(name, {here!r} + '/' + name + '.py')\n"
                "    sys.modules[name] = module = importlib.util.module_from_spec(spec)\n"
                "    spec.loader.exec_module(module)\n"
                "sys.modules['harness'].main()\n")
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", boot], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.errors: list[bytes] = []
        self.why = ""
        self._buffer = b""
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        self.send(setup)

    def _drain(self) -> None:
        while chunk := self.proc.stderr.read1(1 << 16):
            self.errors = (self.errors + [chunk])[-4:]

    def send(self, message: dict) -> None:
        try:
            write_frame(self.proc.stdin, message)
        except OSError:
            pass  # it died: the next receive says so

    def receive(self) -> dict | None:
        """The next message, or None (dead, silent past HARNESS_STEP_S, or not speaking the protocol)."""
        deadline = time.monotonic() + HARNESS_STEP_S
        fd = self.proc.stdout.fileno()
        while len(self._buffer) < 4 or len(self._buffer) < 4 + int.from_bytes(self._buffer[:4], "big"):
            left = deadline - time.monotonic()
            if left <= 0:
                self.why = f"harness_timeout: the test code ran over {HARNESS_STEP_S:g} s"
                return None
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.why = "harness_died"
                    return None
                self._buffer += chunk
        size = int.from_bytes(self._buffer[:4], "big")
        try:
            message = marshal.loads(self._buffer[4:4 + size])
        except (ValueError, EOFError, TypeError):
            message = None
        self._buffer = self._buffer[4 + size:]
        if not isinstance(message, dict) or not ({"run", "verdict"} & message.keys()):
            self.why = "harness_protocol"
            return None
        return message

    def failure(self) -> str:
        tail = b"".join(self.errors).decode("utf-8", "replace").strip().splitlines()[-1:]
        return f"{self.why}: {tail[0][:200]}" if tail else self.why

    def __enter__(self) -> HarnessProcess:
        return self

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._drainer.join(timeout=5.0)  # EOF follows the kill
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                pipe.close()
            except OSError:
                pass
