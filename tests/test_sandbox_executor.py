"""The Executor protocol: plain runs, the warm pool and a JSON round trip (what a remote worker does) all
implement it, and a Result survives JSON exactly."""

import concurrent.futures
import json
import os

import pytest
from rlvr.sandbox import (
    CallTest,
    Executor,
    JsonExecutor,
    Limits,
    Local,
    Pool,
    Result,
    SandboxError,
    Timings,
    runsc,
    verify_program,
)
from rlvr.sandbox.executor import decode_request, decode_result, encode_request, serve

pytestmark = pytest.mark.sandbox

LIMITS = Limits(wall_s=3.0, cpu_s=2, memory_bytes=256 << 20, nproc=32, output_bytes=64 << 10)
GARBAGE = "import sys; sys.stdout.buffer.write(bytes(range(256))); sys.stderr.write('e\\u00e9'); sys.exit(3)"


@pytest.fixture(scope="module")
def pool():
    p = Pool(1, LIMITS, trace_path=False)
    yield p
    p.close()
    runsc.REAPER.drain()
    assert runsc.list_containers() == []
    assert runsc.leftover_cgroups(f"rlvr-pool-{os.getpid()}-") == []


def test_result_round_trips_through_json():
    r = Result("runsc", None, 9, bytes(range(256)), b"\xff\xfeerr", True, False, "wall_time",
               Timings(0.1, 0.2, 0.3), "a" * 64, "b" * 64, "rlvr-1")
    assert Result.from_json(json.loads(json.dumps(r.to_json()))) == r
    request = encode_request(["/bin/true"], files={"a/b": b"\x00\x01", "t.txt": "text"}, stdin=b"\xff",
                             env={"K": "V"}, limits=LIMITS, tag="t")
    assert decode_request(request) == {
        "command": ["/bin/true"], "python": None, "files": {"a/b": b"\x00\x01", "t.txt": b"text"},
        "stdin": b"\xff", "env": {"K": "V"}, "limits": LIMITS, "tag": "t"}


def test_local_pool_and_json_executors_agree(pool):
    local = Local("runsc", LIMITS, trace_path=False)
    executors = {"local": local, "pool": pool, "json(local)": JsonExecutor(local), "json(pool)": JsonExecutor(pool)}
    assert all(isinstance(e, Executor) for e in executors.values())
    results = {name: e.run(python=GARBAGE, stdin=b"x") for name, e in executors.items()}
    for name, r in results.items():
        assert (r.exit_code, r.stdout, r.stderr) == (3, bytes(range(256)), "eé".encode()), name
    assert results["json(pool)"].backend == "runsc-pool" and results["json(local)"].backend == "runsc"
    assert executors["json(pool)"].bytes_received > 0


def test_verdicts_through_a_remote_style_executor(pool):
    remote = JsonExecutor(pool)
    tests = [CallTest((2, 3), 5), CallTest((10, -4), 6)]
    assert verify_program("def add(a, b): return a + b", tests, LIMITS, entry_point="add", pool=remote).passed
    assert not verify_program("print('PASSED')\ndef add(a, b): return 0", tests, LIMITS, entry_point="add",
                              pool=remote).passed
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda i: remote.run(python=f"print({i})").stdout, range(6)))
    assert outs == [f"{i}\n".encode() for i in range(6)]


def test_worker_errors_cross_as_sandbox_errors():
    class Broken:
        def run(self, command=None, **kwargs):
            raise SandboxError("no sandbox today")

        def close(self):
            pass

    with pytest.raises(SandboxError, match="remote executor: SandboxError: no sandbox today"):
        JsonExecutor(Broken()).run(["/bin/true"])
    with pytest.raises(SandboxError, match="ValueError"):  # a bad request is reported, not a crash of the worker
        decode_result(serve(Local(trace_path=False), encode_request(["/bin/true"], python="1")))
