"""Test set-up: 8 fake CPU devices (set before jax is imported) and shared helpers."""

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


def pytest_configure(config):
    assert jax.device_count() == 8, "tests expect 8 fake CPU devices (XLA_FLAGS set too late?)"
