"""A rollout fleet on one machine: N engine servers, one per device group, behind SGLang's router.

    python -m rlvr.rollout.fleet --hf_dir=DIR --workers=4 --router [--devices_per_worker=2] \\
        [--server=rlvr|sglang] [--policy=cache_aware] [--port=30100] [--ready_file=FLEET.json] \\
        [-- SERVER FLAGS ...]

starts `--workers` servers (`python -m rlvr.rollout.server`, or with `--server=sglang` SGLang's own
`python -m sglang.launch_server`; flags after `--` go to each), worker i seeing devices
[i*K, (i+1)*K) through `--device_env` (CUDA_VISIBLE_DEVICES by default; K = `--devices_per_worker`,
0 = leave the devices alone), waits until each answers `GET /health`, then (with `--router`) starts
the sglang-router (`sglang-router` package) on `--port` in front of them and waits until its
`/readiness` counts every worker healthy. It then prints one JSON line
`{"router": URL, "workers": [URL, ...], "logs": DIR}` (also written to `--ready_file`) and runs
until SIGINT/SIGTERM or until any of its processes exits, then stops them all (SIGTERM, then SIGKILL
after `--stop_timeout`). Every child also gets SIGTERM if the fleet process dies (PR_SET_PDEATHSIG,
`orphan_safe`).

The RL job then uses it with `rl.backend=sglang rl.sglang_router=URL` (its workers read from the
router's `GET /workers`, or listed in `rl.sglang_urls`): see docs/how-to/rollout-fleet.md.

The router is started through `python -m rlvr.rollout.fleet router ARGS`, which runs the package's Rust
router exactly as `python -m sglang_router.launch_router ARGS` does, minus that launcher's import of
its Python debugging balancer (which imports all of SGLang: ~8 s on a CPU box).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from rlvr import storage

logger = logging.getLogger(__name__)

SERVER_MODULES = {"rlvr": ("rlvr.rollout.server", "--hf_dir"), "sglang": ("sglang.launch_server", "--model-path")}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it before it is used: rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def advertised(host: str) -> str:
    """The name others reach a process listening on `host` by (this machine's name for 0.0.0.0 / ::)."""
    return socket.getfqdn() if host in ("0.0.0.0", "::") else host


def _die_with_parent() -> None:
    """SIGTERM to this process when its parent dies (Linux prctl PR_SET_PDEATHSIG; kept across exec)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def orphan_safe(argv: Sequence[str]) -> list[str]:
    """`argv` run through `python -m rlvr.rollout.fleet exec`, which sets PR_SET_PDEATHSIG and then execs
    it: the child stops when the process (strictly: the thread) that started it dies, with no
    preexec_fn (a fork of a multithreaded parent must not run Python code before exec)."""
    return [sys.executable, "-m", "rlvr.rollout.fleet", "exec", *argv]


def router_argv(worker_urls: Sequence[str], host: str, port: int, policy: str = "cache_aware",
                extra: Sequence[str] = ()) -> list[str]:
    """sglang-router's flags for a router on host:port in front of `worker_urls` (Prometheus on the
    same host: the router's default is 0.0.0.0)."""
    return ["--host", host, "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", host, "--prometheus-port", str(free_port(host)), "--log-level", "warn", *extra]


def run_router(argv: Sequence[str]) -> None:
    """The Rust router from sglang-router's own argument parser (what its launch_router runs)."""
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="python -m rlvr.rollout.fleet router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(list(argv)), use_router_prefix=False)
    args._validate_router_args()
    Router.from_args(args).start()


def launch_router(worker_urls: Sequence[str], log_path: str, *, host: str = "127.0.0.1", port: int = 0,
                  policy: str = "cache_aware", extra: Sequence[str] = (), env: dict[str, str] | None = None,
                  timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """(process, URL) of an sglang-router in front of `worker_urls`, once its /readiness counts every
    worker healthy; its output goes to `log_path`. Raises (and stops it) if it is not ready in `timeout` s."""
    port = port or free_port(host)
    argv = [sys.executable, "-m", "rlvr.rollout.fleet", "router", *router_argv(worker_urls, host, port, policy, extra)]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://{advertised(host)}:{port}"

    def ready(http: httpx.Client) -> bool:
        resp = http.get(url + "/readiness")
        return resp.status_code == 200 and resp.json().get("healthy_workers", 0) >= len(worker_urls)
    try:
        wait_ready(proc, ready, timeout, log_path)
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise
    return proc, url


def wait_ready(proc: subprocess.Popen, ready, timeout: float, log_path: str) -> None:
    """Polls `ready(http_client)` every 0.1 s until true; raises with the log's tail if `proc` exits
    first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as http:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if ready(http):
                    return
            time.sleep(0.1)
    with open(log_path, errors="replace") as f:
        log = f.read()[-3000:]
    raise RuntimeError(f"{' '.join(proc.args[:4])} ... did not become ready (exit code {proc.poll()}); "
                       f"{log_path} ends:\n{log}")


class Fleet:
    """N servers (+ the router) as child processes; a context manager that stops them all."""

    def __init__(self, hf_dir: str, workers: int = 2, router: bool = True, *, server: str = "rlvr",
                 server_module: str = "",
                 host: str = "127.0.0.1", port: int = 0, policy: str = "cache_aware",
                 server_args: Sequence[str] = (), router_args: Sequence[str] = (), devices_per_worker: int = 0,
                 device_env: str = "CUDA_VISIBLE_DEVICES", env: dict[str, str] | None = None,
                 log_dir: str | None = None, start_timeout: float = 600.0, stop_timeout: float = 10.0):
        if workers < 1:
            raise ValueError(f"workers={workers}: a fleet needs at least one server")
        if server not in SERVER_MODULES:
            raise ValueError(f"server={server!r}: use one of {sorted(SERVER_MODULES)}")
        self.hf_dir, self.count, self.with_router = hf_dir, workers, router
        module, model_flag = SERVER_MODULES[server]
        self.server_module, self.model_flag = server_module or module, model_flag
        self.host, self.port, self.policy = host, port, policy
        self.server_args, self.router_args = list(server_args), list(router_args)
        self.devices_per_worker, self.device_env = devices_per_worker, device_env
        self.env = dict(os.environ if env is None else env)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="rlvr-fleet-")
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.workers: list[subprocess.Popen] = []
        self.worker_urls: list[str] = []
        self.router: subprocess.Popen | None = None
        self.router_url: str | None = None

    # --- processes ------------------------------------------------------------------------

    def _spawn(self, argv: list[str], name: str, env: dict[str, str]) -> subprocess.Popen:
        with open(os.path.join(self.log_dir, f"{name}.log"), "w") as out:
            return subprocess.Popen(orphan_safe(argv), stdout=out, stderr=subprocess.STDOUT, env=env)

    def worker_argv(self, port: int) -> list[str]:
        return [sys.executable, "-m", self.server_module, self.model_flag, self.hf_dir, "--host", self.host,
                "--port", str(port), *self.server_args]

    def _worker_env(self, index: int) -> dict[str, str]:
        env = dict(self.env)
        if self.devices_per_worker:
            first = index * self.devices_per_worker
            env[self.device_env] = ",".join(str(d) for d in range(first, first + self.devices_per_worker))
        return env

    def start_worker(self, index: int) -> str:
        """Starts worker `index` (again, after a kill) on a fresh port; returns its URL (not yet waited on)."""
        port = free_port(self.host)
        proc = self._spawn(self.worker_argv(port), f"worker-{index}", self._worker_env(index))
        url = f"http://{advertised(self.host)}:{port}"
        if index < len(self.workers):
            self.workers[index], self.worker_urls[index] = proc, url
        else:
            self.workers.append(proc)
            self.worker_urls.append(url)
        return url

    def start(self) -> Fleet:
        """Starts every worker at once, waits for their health, then the router and its readiness."""
        try:
            for i in range(self.count):
                self.start_worker(i)
            for i in range(self.count):
                self.wait_worker(i)
            if self.with_router:
                self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_router(self) -> None:
        self.router, self.router_url = launch_router(
            self.worker_urls, os.path.join(self.log_dir, "router.log"), host=self.host, port=self.port,
            policy=self.policy, extra=self.router_args, env=dict(self.env), timeout=self.start_timeout)

    def wait_worker(self, index: int) -> None:
        url = self.worker_urls[index]
        wait_ready(self.workers[index], lambda http: http.get(url + "/health").status_code == 200,
                   self.start_timeout, os.path.join(self.log_dir, f"worker-{index}.log"))

    def kill_worker(self, index: int) -> None:
        """SIGKILLs worker `index` (fault-injection: the router should route around it)."""
        self.workers[index].kill()
        self.workers[index].wait(timeout=self.stop_timeout)

    def processes(self) -> list[subprocess.Popen]:
        return [*([self.router] if self.router else []), *self.workers]

    def stop(self) -> None:
        """SIGTERM to the router, then the workers; SIGKILL whatever is still up after stop_timeout."""
        procs = [p for p in self.processes() if p.poll() is None]
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + self.stop_timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=self.stop_timeout)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def describe(self) -> dict[str, Any]:
        return {"router": self.router_url, "workers": list(self.worker_urls), "logs": self.log_dir,
                "pids": {"router": self.router.pid if self.router else None,
                         "workers": [p.pid for p in self.workers]}}


# --- command line ----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m rlvr.rollout.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf_dir", "--model-path", dest="hf_dir", required=True, help="the servers' HF checkpoint")
    parser.add_argument("--workers", type=int, default=2, help="engine servers to start")
    parser.add_argument("--router", action=argparse.BooleanOptionalAction, default=True,
                        help="start the sglang-router in front of them (--no-router: the servers only)")
    parser.add_argument("--server", choices=sorted(SERVER_MODULES), default="rlvr",
                        help="rlvr: python -m rlvr.rollout.server; sglang: python -m sglang.launch_server (GPU)")
    parser.add_argument("--server_module", default="",
                        help="another SGLang-compatible server module, run as python -m MODULE with --server's model "
                             "flag, --host and --port")
    parser.add_argument("--host", default="127.0.0.1", help="where every process listens (0.0.0.0: reachable "
                        "from other machines)")
    parser.add_argument("--port", type=int, default=30100, help="the router's port (0: any free one)")
    parser.add_argument("--policy", default="cache_aware",
                        choices=("cache_aware", "round_robin", "power_of_two", "random"), help="the router's policy")
    parser.add_argument("--devices_per_worker", type=int, default=0,
                        help="devices each worker sees through --device_env (0: all of them)")
    parser.add_argument("--device_env", default="CUDA_VISIBLE_DEVICES",
                        help="the variable that picks a worker's devices (TPU_VISIBLE_CHIPS on TPU VMs)")
    parser.add_argument("--router_arg", action="append", default=[], metavar="FLAG",
                        help="another sglang-router flag (repeat), e.g. --router_arg=--retry-max-retries=3")
    parser.add_argument("--ready_file", default="", help="write the fleet's JSON description here when ready")
    parser.add_argument("--log_dir", default="", help="each process's log (default: a fresh temporary folder)")
    parser.add_argument("--start_timeout", type=float, default=900.0)
    parser.add_argument("--stop_timeout", type=float, default=10.0)
    return parser.parse_args(argv), server_args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["exec"]:
        _die_with_parent()
        os.execv(argv[1], argv[1:])
    if argv[:1] == ["router"]:
        _die_with_parent()
        run_router(argv[1:])
        return 0
    args, server_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.workers < 1 or args.devices_per_worker < 0:
        raise SystemExit(f"--workers={args.workers} must be >= 1 and --devices_per_worker >= 0")
    fleet = Fleet(args.hf_dir, args.workers, args.router, server=args.server, server_module=args.server_module,
                  host=args.host, port=args.port,
                  policy=args.policy, server_args=server_args, router_args=args.router_arg,
                  devices_per_worker=args.devices_per_worker, device_env=args.device_env,
                  log_dir=args.log_dir or None, start_timeout=args.start_timeout, stop_timeout=args.stop_timeout)
    stop, started = threading.Event(), threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not started.is_set():
            raise SystemExit(128 + signum)  # interrupts the start-up waits; Fleet.start stops what it started
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    fleet.start()
    started.set()
    try:
        line = json.dumps(fleet.describe())
        if args.ready_file:  # atomically: a watcher polling for the file never reads it half-written
            storage.write_text(args.ready_file, line + "\n")
        print(line, flush=True)
        while not stop.wait(0.5):
            exited = [(p.pid, p.returncode) for p in fleet.processes() if p.poll() is not None]
            if exited:
                logger.error("fleet process(es) exited %s: stopping the fleet (logs in %s)", exited, fleet.log_dir)
                return 1
        return 0
    finally:
        fleet.stop()


if __name__ == "__main__":
    sys.exit(main())
