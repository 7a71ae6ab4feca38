"""Test set-up: 8 fake CPU devices (set before jax is imported) and shared helpers."""

import gc
import os
import sys

# 8 fake devices share 2 cores: a busy machine can keep one device's thread off the CPU for longer than
# XLA's default 40 s collective timeout, which aborts the process; allow 10 minutes instead.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_timeout_seconds=600"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def repo_root() -> str:
    return REPO


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture
def sglang_server():
    """Factory: (config, model) -> the URL of an Engine + EngineDriver + HTTP server in this process,
    with config.rl.engine's sizes and `model`'s params; stopped at teardown (tests/test_rl_loop.py,
    tests/test_rollout_fleet.py)."""
    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.rollout.driver import EngineDriver
    from rlvr.rollout.engine import Engine
    from rlvr.rollout.server import serve

    started = []

    def start(config, model):
        e = config.rl.engine
        engine = Engine(model.cfg, model.params, byte_level_tokenizer(), max_slots=e.max_slots, max_len=e.max_len,
                        page_size=e.page_size, decode_steps=e.decode_steps, prefill_rows=e.prefill_rows,
                        prefill_chunk=e.prefill_chunk, seed=config.seed)
        driver = EngineDriver(engine)
        server, _ = serve(driver, port=0)
        started.append((server, driver))
        return server.url

    yield start
    for server, driver in started:
        server.stop(hard=True)
        driver.close()


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_after_each_module():
    """Drop JAX's compiled programs and dead buffers when a test file ends: a test process runs many
    files (make test: 2 processes), and without this each keeps every file's executables alive."""
    yield
    jax.clear_caches()
    gc.collect()


def pytest_configure(config):
    assert jax.device_count() == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set too late?)"


def _sandbox_module(request) -> bool:
    return request.module.__name__.rsplit(".", 1)[-1].startswith("test_sandbox")


@pytest.fixture(autouse=True)
def _sandbox_trace_in_tmp(request, tmp_path, monkeypatch):
    """Sandbox modules: calls without an explicit trace path write to the default trace file; keep it
    in the test's tmp dir."""
    if _sandbox_module(request):
        monkeypatch.setenv("RLVR_SANDBOX_TRACE", str(tmp_path / "default-trace.jsonl"))


@pytest.fixture(scope="module", autouse=True)
def _sandbox_no_leftovers(request):
    """Sandbox modules: afterwards every sandbox is deleted, and no cgroup directory or workspace mount
    of this process is left."""
    yield
    if not _sandbox_module(request):
        return
    from rlvr.sandbox import runsc
    from rlvr.sandbox.workspace import MOUNTED_HERE

    runsc.REAPER.drain()
    assert runsc.list_containers() == []
    assert runsc.leftover_cgroups(f"rlvr-{os.getpid()}-") == []
    mounted = {line.split()[1] for line in open("/proc/mounts").read().splitlines()}
    assert not mounted & MOUNTED_HERE
