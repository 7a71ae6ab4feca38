"""rlvr.sandbox core: run() under gVisor (layout, limits, results, traces, replay, teardown) and the weaker
development backends. Needs runsc (installed by `make`); CI runs these, it does not skip them."""

import json
import subprocess
import sys
import warnings

import pytest
from rlvr.sandbox import CPU, DISK, FILE_SIZE, MEMORY, OUTPUT, WALL_TIME, Limits, SandboxUnavailable, run, runsc, trace
from rlvr.sandbox.replay import compare, replay

pytestmark = pytest.mark.sandbox


FAST = Limits(wall_s=3.0, cpu_s=3)


def test_hello_layout_and_identity(tmp_path):
    src = ("import os, json\n"
           "status = open('/proc/self/status').read()\n"
           "print(json.dumps({'uid': os.getuid(), 'gid': os.getgid(), 'cwd': os.getcwd(),\n"
           "  'root': sorted(os.listdir('/')), 'data': open('data/in.txt').read(),\n"
           "  'caps': status.split('CapEff:')[1].split()[0]}))")
    r = run(python=src, files={"data/in.txt": b"hello"}, limits=FAST, trace_path=str(tmp_path / "t.jsonl"))
    assert r.ok, r.stderr
    got = json.loads(r.stdout)
    assert got["uid"] == 1000 and got["gid"] == 1000 and got["cwd"] == "/workspace"
    assert got["data"] == "hello" and int(got["caps"], 16) == 0
    assert "root" not in got["root"] and "home" not in got["root"] and "work" not in got["root"]
    assert r.backend == "runsc" and r.sandbox_id.startswith("rlvr-")
    assert r.timings.run_s > 0 and r.digest_before == r.digest_after


def test_read_only_root_writable_workspace_and_tmp():
    src = ("import os\n"
           "for p in ['/etc/x', '/usr/x', '/x', '/workspace/x', '/tmp/x']:\n"
           "    try:\n"
           "        open(p, 'w').write('1'); print(p, 'ok')\n"
           "    except OSError as e: print(p, 'err')\n")
    r = run(python=src, limits=FAST, trace_path=False)
    assert r.ok, r.stderr
    assert r.text().split("\n")[:5] == ["/etc/x err", "/usr/x err", "/x err", "/workspace/x ok", "/tmp/x ok"]
    assert r.digest_after != r.digest_before  # the workspace changed, the digest shows it


def test_no_network():
    src = ("import socket\n"
           "print(sorted(n for _, n in socket.if_nameindex()))\n"
           "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
           "try:\n    s.connect(('192.0.2.1', 53)); print('route')\nexcept OSError as e: print('errno', e.errno)\n")
    r = run(python=src, limits=FAST, trace_path=False)
    assert r.ok, r.stderr
    lines = r.text().splitlines()
    assert lines[0] == "['lo']" and lines[1] in ("errno 101", "errno 113")  # ENETUNREACH / EHOSTUNREACH


@pytest.mark.parametrize("src, limit", [
    ("import time; time.sleep(30)", WALL_TIME),
    ("while True: pass", CPU),
    ("x = bytearray(1 << 31)", MEMORY),
    ("import sys\nwhile True: sys.stdout.write('x' * 65536)", OUTPUT),
    ("open('big', 'wb').write(b'x' * (6 << 20))", FILE_SIZE),
    ("i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20)); i += 1", DISK),
])
def test_limit_hit_is_named(src, limit):
    limits = Limits(wall_s=2.0, cpu_s=1, file_bytes=4 << 20, workspace_bytes=8 << 20, output_bytes=1 << 16)
    r = run(python=src, limits=limits, trace_path=False)
    assert r.limit_hit == limit, (r.exit_code, r.signal, r.stderr[-500:])
    assert not r.ok
    assert len(r.stdout) <= limits.output_bytes and len(r.stderr) <= limits.output_bytes


def test_nproc_caps_forks_and_the_sandbox_survives():
    src = ("import os\nn = 0\n"
           "try:\n    while True:\n        if os.fork() == 0:\n            import time; time.sleep(5); os._exit(0)\n"
           "        n += 1\nexcept OSError as e: print(n, e.errno)\n")
    r = run(python=src, limits=Limits(wall_s=4.0, nproc=20), trace_path=False)
    assert r.exit_code == 0, r.stderr
    n, errno = map(int, r.text().split())
    assert n < 20 and errno == 11


def test_signal_and_exit_code():
    assert run(python="import sys; sys.exit(7)", limits=FAST, trace_path=False).exit_code == 7
    r = run(python="import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", limits=FAST, trace_path=False)
    assert r.exit_code is None and r.signal == 11 and r.limit_hit is None


def test_command_argv_and_stdin():
    r = run(["/usr/bin/python3", "-c", "import sys; print(sys.stdin.read().upper())"], stdin=b"abc", limits=FAST,
            trace_path=False)
    assert r.stdout == b"ABC\n"


def test_bad_arguments():
    with pytest.raises(ValueError):
        run(python="1", command=["true"], trace_path=False)
    with pytest.raises(ValueError):
        run(python="1", files={"../x": b""}, trace_path=False)
    with pytest.raises(ValueError):
        run(python="1", backend="docker", trace_path=False)


def test_missing_runsc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(runsc.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y runsc"):
        run(python="print(1)", trace_path=False)


def test_broken_runsc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(runsc, "_probed", False)
    monkeypatch.setattr(runsc, "PLATFORM", "no-such-platform")
    with pytest.raises(SandboxUnavailable, match="could not start a sandbox .*tried"):
        run(python="print(1)", trace_path=False)


def test_trace_record_and_replay(tmp_path):
    path = str(tmp_path / "trace.jsonl")
    run(python="print('one')", limits=FAST, trace_path=path, tag="first")
    run(python="open('out.txt', 'w').write(open('in.txt').read() * 2); print('two')", files={"in.txt": "ab"},
        limits=FAST, trace_path=path)
    records = trace.read(path)
    assert [r["tag"] for r in records] == ["first", None]
    entry = records[1]
    assert entry["stdout"] == "two\n" and entry["exit_code"] == 0 and entry["limit_hit"] is None
    assert entry["digest_before"] != entry["digest_after"] and set(entry["timings"]) == {"queue_s", "start_s", "run_s"}
    assert compare(entry, replay(entry)) == {}
    done = subprocess.run([sys.executable, "-m", "rlvr.sandbox.replay", path, "--index", "1"], capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reproduced"] is True


def test_replay_reports_differences(tmp_path):
    path = str(tmp_path / "trace.jsonl")
    run(python="import random; print(random.random())", limits=FAST, trace_path=path)
    diff = compare(trace.read(path)[0], replay(trace.read(path)[0]))
    assert set(diff) == {"stdout"}


@pytest.mark.parametrize("backend", ["process", "bwrap"])
def test_weak_backends_warn_and_run(backend):
    if backend == "bwrap" and not runsc.shutil.which("bwrap"):
        pytest.fail("bubblewrap not installed: apt-get install -y bubblewrap (make installs it)")
    from rlvr.sandbox import api
    api._warned.discard(backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = run(python="print(6 * 7)", backend=backend, limits=FAST, trace_path=False)
    assert r.ok and r.stdout == b"42\n" and r.backend == backend
    assert any("development only" in str(w.message) for w in caught)
    slow = run(python="while True: pass", backend=backend, limits=Limits(wall_s=3.0, cpu_s=1), trace_path=False)
    assert slow.limit_hit == CPU
