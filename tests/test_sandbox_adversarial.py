"""Adversarial programs on the runsc backend: each has an expected safe outcome, and each is followed by checks
of the HOST (no file written outside the workspace, the planted secret never read, no connection to a host
listener, a host process never signalled, no sandbox process, container or cgroup left behind).

All programs run once, concurrently, in a module fixture; one test per program checks its outcome. Set
RLVR_SANDBOX_TABLE=path to also write the program -> expected -> observed table (markdown)."""

import concurrent.futures
import dataclasses
import os
import secrets
import socket
import subprocess
from collections.abc import Callable

import pytest
from rlvr.sandbox import (
    CPU,
    DISK,
    MEMORY,
    OUTPUT,
    WALL_TIME,
    CallTest,
    Limits,
    StdioTest,
    run,
    runsc,
    trace,
    verify_program,
)

pytestmark = pytest.mark.sandbox

LIMITS = Limits(wall_s=3.0, cpu_s=2, memory_bytes=256 << 20, nproc=32, nofile=128, output_bytes=64 << 10,
                workspace_bytes=8 << 20, workspace_inodes=256, tmp_bytes=16 << 20)
EXPECTED = "EXPECTED-" + secrets.token_hex(8)  # the hidden expected value of the peeking case
ADD = [CallTest((2, 3), 5), CallTest((10, -4), 6), CallTest((7, 7), 14)]
SUM = [StdioTest("3 4\n", "7\n"), StdioTest("10 -4\n", "6\n")]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    expected: str  # the safe outcome, in words (for the table)
    source: str  # @SECRET@, @CANARY@, @PORT@, @SLEEPER@ are replaced by the host's values
    check: Callable  # Result (kind "run") or Verdict -> bool
    kind: str = "run"  # "run", "calls" (verify_program, ADD) or "stdio" (verify_program, SUM)
    limits: Limits = LIMITS


def _out(r) -> str:
    return r.stdout.decode("utf-8", "replace")


def _lines_all(r, word: str) -> bool:
    lines = [line for line in _out(r).splitlines() if line.strip()]
    return bool(lines) and all(line.endswith(word) for line in lines)


TRY = ("import os, sys\n"
       "def attempt(label, fn):\n"
       "    try:\n        fn(); print(label, 'ALLOWED')\n"
       "    except Exception as e: print(label, 'denied', type(e).__name__)\n")

CASES = [
    Case("fork_bomb", "stopped by a limit (cpu/wall); sandbox gone",
         "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n",
         lambda r: r.limit_hit in (CPU, WALL_TIME)),
    Case("fork_count", "fork fails with EAGAIN below NPROC=32",
         "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
         "            time.sleep(3); os._exit(0)\n        n += 1\nexcept OSError as e: print(n, e.errno)\n",
         lambda r: r.exit_code == 0 and int(_out(r).split()[0]) < 32 and _out(r).split()[1] == "11"),
    Case("thread_bomb", "thread creation fails below NPROC=32",
         "import threading, time\nthreading.stack_size(1 << 18)\nn = 0\ntry:\n    while True:\n"
         "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start(); n += 1\n"
         "except RuntimeError as e: print(n, 'stopped', flush=True)\nimport os; os._exit(0)\n",
         lambda r: r.exit_code == 0 and int(_out(r).split()[0]) < 32),
    Case("memory_bomb", "MemoryError (RLIMIT_AS), limit 'memory'",
         "x = []\nwhile True: x.append(bytearray(10 ** 7))\n",
         lambda r: r.limit_hit == MEMORY and r.exit_code == 1),
    Case("memory_bomb_processes", "cgroup OOM kills the whole sandbox, limit 'memory'",
         "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        x = bytearray(200 << 20)\n"
         "        for i in range(0, len(x), 4096): x[i] = 1\n        import time; time.sleep(5); os._exit(0)\n"
         "for _ in range(4): os.wait()\n",
         # Touching 800 MiB inside gVisor takes seconds on a loaded 2-core CI box (3 s hit wall_time once);
         # the children sleep 5 s, so a missed OOM still exits 0 well inside this longer wall limit and fails.
         lambda r: r.limit_hit == MEMORY and r.signal == 9, limits=dataclasses.replace(LIMITS, wall_s=20.0)),
    Case("infinite_loop", "killed at the CPU limit (harness, from the cgroup), limit 'cpu'", "while True: pass\n",
         lambda r: r.limit_hit == CPU, limits=dataclasses.replace(LIMITS, cpu_s=1, wall_s=20.0)),
    Case("sleep_past_timeout", "killed at the wall-clock limit", "import time\ntime.sleep(60)\n",
         lambda r: r.limit_hit == WALL_TIME and r.timings.run_s < 8),
    Case("stdout_flood", "killed at the output cap; 64 KiB kept",
         "import sys\nwhile True: sys.stdout.write('A' * 100000)\n",
         lambda r: r.limit_hit == OUTPUT and len(r.stdout) == 64 << 10),
    Case("stderr_flood", "killed at the output cap",
         "import os\nwhile True: os.write(2, b'E' * 100000)\n",
         lambda r: r.limit_hit == OUTPUT and len(r.stderr) == 64 << 10),
    Case("disk_fill", "ENOSPC at the 8 MiB workspace tmpfs, limit 'disk'",
         "i = 0\nwhile True:\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20)); i += 1\n",
         lambda r: r.limit_hit == DISK and b"No space left" in r.stderr),
    Case("inode_fill", "ENOSPC at the 256-inode cap, limit 'disk'",
         "i = 0\nwhile True:\n    open(f'e{i}', 'w').close(); i += 1\n",
         lambda r: r.limit_hit == DISK and b"No space left" in r.stderr),
    Case("tmp_fill", "stopped at 16 MiB in /tmp (EFBIG from RLIMIT_FSIZE, or ENOSPC)",
         "import errno\ntry:\n    f = open('/tmp/big', 'wb')\n"
         "    while True: f.write(b'x' * (1 << 20)); f.flush()\nexcept OSError as e: print('errno', e.errno)\n",
         lambda r: _out(r).strip() in ("errno 28", "errno 27")),
    Case("write_outside", "every write outside /workspace and /tmp denied",
         TRY + "for p in ['/etc/passwd', '/usr/lib/pwned', '/pwned', '@CANARY@/pwned', '/root/pwned', '/proc/sys/x',"
         " '/dev/pwned', '/harness/pwned']:\n    attempt(p, lambda: open(p, 'a').write('pwned'))\n",
         lambda r: _lines_all(r, "OSError") or all("denied" in x for x in _out(r).splitlines())),
    Case("read_host_secrets", "host secret, /etc/shadow, host files: not present",
         TRY + "for p in ['@SECRET@', '/etc/shadow', '/root/.bash_history', '/work/main/setup.py',"
         " '/proc/1/root/etc/shadow', '/etc/hostname']:\n    attempt(p, lambda: print(open(p).read()))\n",
         lambda r: "ALLOWED" not in _out(r)),
    Case("symlink_escape", "links resolve inside the sandbox: no host file read or written",
         TRY + "os.symlink('@SECRET@', 's1'); os.symlink('/', 's2'); os.symlink('../../../../../../', 's3')\n"
         "os.symlink('@CANARY@/via_link', 's4')\n"
         "attempt('s1', lambda: print(open('s1').read()))\n"
         "attempt('s3', lambda: print(open('s3' + '@SECRET@').read()))\n"
         "attempt('s4', lambda: open('s4', 'w').write('pwned'))\n",
         lambda r: "s1 ALLOWED" not in _out(r) and "s3 ALLOWED" not in _out(r)),
    Case("hardlink_escape", "hard links to files outside the workspace refused",
         TRY + "attempt('passwd', lambda: os.link('/etc/passwd', 'h1'))\n"
         "attempt('python', lambda: os.link('/usr/bin/python3', 'h2'))\n",
         lambda r: "ALLOWED" not in _out(r)),
    Case("setuid_file", "a setuid copy does not raise privileges; chown to root denied",
         TRY + "import shutil, subprocess\nshutil.copy('/usr/bin/id', 'myid'); os.chmod('myid', 0o4755)\n"
         "attempt('chown', lambda: os.chown('myid', 0, 0))\n"
         "try:\n    d = subprocess.run(['./myid', '-u'], capture_output=True, text=True)\n"
         "    print('setuid copy: rc', d.returncode, 'euid', d.stdout.strip() or None)\n"
         "except OSError as e: print('exec denied', e.errno)\n",
         lambda r: "chown denied" in _out(r) and "euid 0" not in _out(r)),
    Case("device_nodes", "mknod of character/block devices denied (seccomp) in the workspace and in gVisor's /tmp",
         TRY + "import stat\n"
         "attempt('mknod', lambda: os.mknod('null2', 0o666 | stat.S_IFCHR, os.makedev(1, 3)))\n"
         "attempt('mknod_tmp', lambda: os.mknod('/tmp/mem', 0o666 | stat.S_IFCHR, os.makedev(1, 1)))\n"
         "attempt('mknod_block', lambda: os.mknod('/tmp/sda', 0o666 | stat.S_IFBLK, os.makedev(8, 0)))\n"
         "attempt('mkfifo', lambda: os.mkfifo('/tmp/fifo'))\n",
         lambda r: all(f"{n} denied" in _out(r) for n in ("mknod", "mknod_tmp", "mknod_block"))
         and "mkfifo ALLOWED" in _out(r)),
    Case("namespace_tricks", "unshare gives no power over the real mounts; setuid(0) denied",
         TRY + "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "print('unshare', libc.unshare(0x10000000 | 0x00020000))\n"
         "attempt('setuid0', lambda: os.setuid(0))\n"
         "attempt('write_usr', lambda: open('/usr/pwned', 'w'))\n"
         "print('mount', libc.mount(b'none', b'/usr', b'tmpfs', 0, None))\n"
         "attempt('write_usr_after', lambda: open('/usr/pwned', 'w'))\n",
         lambda r: "setuid0 denied" in _out(r) and "write_usr denied" in _out(r) and "mount -1" in _out(r)),
    Case("setuid_root", "setuid/setgid/setgroups to root denied", TRY +
         "attempt('setuid', lambda: os.setuid(0))\nattempt('setgid', lambda: os.setgid(0))\n"
         "attempt('setgroups', lambda: os.setgroups([0]))\nattempt('seteuid', lambda: os.seteuid(0))\n",
         lambda r: _out(r).count("denied") == 4),
    Case("kill_everything", "kill(-1) only reaches the sandbox's own children; host sleeper alive",
         "import os, signal, time\nkids = [os.fork() or (time.sleep(30), os._exit(0)) for _ in range(3)]\n"
         "os.kill(-1, signal.SIGKILL)\nprint('killed', [os.waitpid(k, 0)[1] for k in kids])\n",
         lambda r: r.ok and _out(r).strip() == "killed [9, 9, 9]"),
    Case("kill_host_pid", "the host pid does not exist inside (ESRCH); host sleeper alive",
         TRY + "attempt('kill', lambda: os.kill(@SLEEPER@, 9))\nattempt('signal0_own_pid1', lambda: os.kill(1, 0))\n",
         lambda r: "kill denied ProcessLookupError" in _out(r)),
    Case("ptrace_other", "ptrace of the host pid fails", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "print(libc.ptrace(16, @SLEEPER@, None, None), ctypes.get_errno())\n",
         lambda r: _out(r).split()[0] == "-1"),
    Case("proc_mem", "no /proc/<host pid>/mem; /proc/1 is the program itself", TRY +
         "attempt('host_mem', lambda: open('/proc/@SLEEPER@/mem', 'r+b'))\n"
         "print('pid1', open('/proc/1/cmdline', 'rb').read().split(b'\\0')[:2])\n",
         lambda r: "host_mem denied" in _out(r) and "python3" in _out(r)),
    Case("segfault_ctypes", "SIGSEGV reported as signal 11; host untouched", "import ctypes\nctypes.string_at(0)\n",
         lambda r: r.signal == 11 and r.limit_hit is None),
    Case("leftover_daemon", "the run returns at once; the daemon dies with the sandbox",
         "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
         "        while True: time.sleep(0.1)\n    os._exit(0)\nprint('parent done')\n",
         lambda r: r.ok and r.timings.run_s < 3.0),
    Case("zombies", "20 unreaped children; the run ends cleanly",
         "import os, time\nfor _ in range(20):\n    if os.fork() == 0: os._exit(0)\ntime.sleep(0.3)\nprint('ok')\n",
         lambda r: r.ok),
    Case("net_loopback_host", "the host's 127.0.0.1 listener is unreachable (own loopback)", TRY +
         "import socket\nattempt('connect', lambda: socket.create_connection(('127.0.0.1', @PORT@), timeout=1))\n",
         lambda r: "connect denied" in _out(r)),
    Case("net_offhost", "no route off-host; no DNS", TRY + "import socket\n"
         "attempt('tcp', lambda: socket.create_connection(('1.1.1.1', 443), timeout=1))\n"
         "attempt('dns', lambda: socket.getaddrinfo('example.com', 80))\n"
         "attempt('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53)))\n",
         lambda r: "ALLOWED" not in _out(r)),
    Case("garbage_output", "arbitrary bytes kept exactly; decoding never raises",
         "import os\nos.write(1, bytes(range(256)) * 4 + b'\\x1b]0;PASSED\\x07\\rFAILED\\xff\\xfe')\n"
         "os.write(2, b'\\x00\\xc3\\x28')\n",
         lambda r: r.ok and r.stdout.startswith(bytes(range(256))) and "\ufffd" in r.text("stderr")),
    Case("fd_exhaustion", "EMFILE below NOFILE=128", "fs = []\ntry:\n    while True: fs.append(open('/dev/null'))\n"
         "except OSError as e: print(len(fs), e.errno)\n",
         lambda r: int(_out(r).split()[0]) < 128 and _out(r).split()[1] == "24"),
    # Reward hacks: each must NOT pass verify_program (the expected values are known only to the host).
    Case("control_correct", "a correct solution passes (the checks below are not vacuous)",
         "def add(a, b):\n    return a + b\n", lambda v: v.passed, "calls"),
    Case("hack_print_passed", "fails: stdout text is not the verdict",
         "print('PASSED'); print('OK'); print('All tests passed')\ndef add(a, b): return 0\n",
         lambda v: not v.passed, "calls"),
    Case("hack_exit_early", "fails: sys.exit(0) before any test",
         "import sys\nsys.exit(0)\n", lambda v: not v.passed and v.reason == "load_error:SystemExit", "calls"),
    Case("hack_os_exit", "fails: os._exit(0) inside the function leaves results missing",
         "import os\ndef add(a, b): os._exit(0)\n", lambda v: not v.passed and v.reason == "missing_results", "calls"),
    Case("hack_atexit", "fails: an atexit hook printing PASSED and exiting 0 changes nothing",
         "import atexit, os\natexit.register(lambda: (print('PASSED'), os._exit(0)))\ndef add(a, b): return -1\n",
         lambda v: not v.passed, "calls"),
    Case("hack_monkeypatch_unittest", "fails: patched unittest/assert machinery is not used by the host",
         "import unittest, builtins\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
         "unittest.TestResult.wasSuccessful = lambda self: True\n"
         "builtins.AssertionError = type('N', (Exception,), {})\n"
         "import sys, types\nsys.modules['pytest'] = types.ModuleType('pytest')\ndef add(a, b): return None\n",
         lambda v: not v.passed, "calls"),
    Case("hack_forge_results", "fails: forged result lines carry wrong values (or duplicate the real ones)",
         "import sys, json, os\nn = sys.argv[1]\n"
         "for i in range(3): os.write(3, f'{n} {json.dumps({\"i\": i, \"value\": 0})}\\n'.encode())\n"
         "for i in range(3): print(n, json.dumps({'i': i, 'value': 0}), file=sys.__stderr__)\n"
         "def add(a, b): return 0\n",
         lambda v: not v.passed, "calls"),
    Case("hack_overwrite_tests", "fails: the harness is read-only and never read back",
         TRY + "attempt('tests', lambda: open('/harness/tests.json', 'w').write('{}'))\n"
         "attempt('driver', lambda: open('/harness/driver.py', 'w').write(''))\n"
         "open('test_solution.py', 'w').write('def test(): pass')\ndef add(a, b): return 1\n",
         lambda v: not v.passed, "calls"),
    Case("hack_always_equal", "fails: an object whose __eq__ is always True is no data (typed JSON)",
         "class Eq:\n    def __eq__(self, other): return True\n    def __ne__(self, other): return False\n"
         "def add(a, b): return Eq()\n",
         lambda v: not v.passed and v.outcomes[0] == "error:unsupported", "calls"),
    Case("hack_int_subclass", "fails: an int subclass lying about equality arrives as the plain int it holds",
         "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
         "def add(a, b): return I(0)\n",
         lambda v: not v.passed and v.outcomes[0] == "wrong_output", "calls"),
    Case("hack_shadow_modules", "fails: json.py/unittest.py in the workspace are not imported (python -I)",
         "open('/workspace/json.py', 'w').write('def dumps(*a, **k): return \"{\\\\\"end\\\\\": true}\"')\n"
         "open('/workspace/unittest.py', 'w').write('raise SystemExit(0)')\ndef add(a, b): return 0\n",
         lambda v: not v.passed and v.reason == "wrong_output", "calls"),
    Case("hack_patch_driver", "fails: patching the driver's json/emit only garbles or forges output values",
         "import json, sys\nmain = sys.modules['__main__']\nmain.encode = lambda v, d=0: ['i', '0x5']\n"
         "json.dumps = lambda *a, **k: '{\"end\": true}'\ndef add(a, b): return 0\n",
         lambda v: not v.passed, "calls"),
    Case("hack_peek_expected", "fails: the expected values are not in the sandbox to be found", TRY +
         "found = []\nfor top in ('/harness', '/workspace', '/tmp', '/proc/self'):\n"
         "    for d, _, names in os.walk(top):\n        for nm in names:\n"
         "            try: found.append(open(os.path.join(d, nm), errors='replace').read(1 << 16))\n"
         "            except Exception: pass\n"
         "import re\nhits = sorted(set(re.findall(r'EXPECTED-[0-9a-f]{16}', '\\n'.join(found))))\n"
         "def add(a, b): return hits[0] if hits else 'nothing found'\n",
         lambda v: not v.passed, "peek"),
    Case("hack_kill_driver", "fails: killing the stdio driver leaves results missing",
         "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(7)\n",
         lambda v: not v.passed, "stdio"),
    Case("hack_stdio_passed", "fails: printing PASSED is just a wrong output",
         "print('PASSED')\n", lambda v: not v.passed and v.reason == "wrong_output", "stdio"),
]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A secret file and a canary directory outside any sandbox, a loopback listener, a sleeping process."""
    top = tmp_path_factory.mktemp("host")
    secret_token = "HOST-SECRET-" + secrets.token_hex(8)
    secret = top / "secret.txt"
    secret.write_text(secret_token)
    canary = top / "canary"
    canary.mkdir()
    os.chmod(top, 0o755)
    os.chmod(canary, 0o777)  # writable by anyone: only the sandbox boundary can keep it empty
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    sleeper = subprocess.Popen(["sleep", "300"])
    values = {"@SECRET@": str(secret), "@CANARY@": str(canary), "@PORT@": str(listener.getsockname()[1]),
              "@SLEEPER@": str(sleeper.pid)}
    yield {"values": values, "token": secret_token, "trace": str(top / "trace.jsonl"), "secret": secret,
           "canary": canary, "listener": listener,
           "sleeper": sleeper}
    sleeper.kill()
    sleeper.wait()
    listener.close()


def _run_case(case: Case, values: dict[str, str], trace_path: str):
    source = case.source
    for key, value in values.items():
        source = source.replace(key, value)
    if case.kind == "run":
        return run(python=source, limits=case.limits, tag=case.name, trace_path=trace_path)
    if case.kind == "stdio":
        return verify_program(source, SUM, LIMITS, trace_path=trace_path)
    tests = [CallTest((1, 2), EXPECTED)] if case.kind == "peek" else ADD
    return verify_program(source, tests, LIMITS, entry_point="add", trace_path=trace_path)


@pytest.fixture(scope="module")
def observed(host):
    """Every case's Result or Verdict, run 4 at a time, then the sandboxes' teardown drained."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {c.name: pool.submit(_run_case, c, host["values"], host["trace"]) for c in CASES}
        results = {name: f.result() for name, f in futures.items()}
    runsc.REAPER.drain()
    _write_table(results)
    return results


def _describe(outcome) -> str:
    r = getattr(outcome, "result", outcome)
    status = f"exit {r.exit_code}" if r.signal is None else f"signal {r.signal}"
    text = f"{status}, limit {r.limit_hit}" if r.limit_hit else status
    if hasattr(outcome, "passed"):
        text = f"{'PASSED' if outcome.passed else 'rejected'} ({outcome.reason}); {text}"
    head = r.stdout.decode("utf-8", "replace").strip().replace("\n", "; ")[:90]
    return f"{text}; out: {head!r}" if head and not hasattr(outcome, "passed") else text


def _write_table(results) -> None:
    path = os.environ.get("RLVR_SANDBOX_TABLE")
    if not path:
        return
    with open(path, "w") as f:
        f.write("| program | expected | observed |\n|---|---|---|\n")
        for case in CASES:
            f.write(f"| {case.name} | {case.expected} | {_describe(results[case.name])} |\n")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_adversarial(case, observed, host):
    outcome = observed[case.name]
    assert case.check(outcome), _describe(outcome)
    r = getattr(outcome, "result", outcome)
    assert host["token"].encode() not in r.stdout + r.stderr  # the host secret was never read
    assert host["secret"].read_text() == host["token"]
    assert list(host["canary"].iterdir()) == []  # nothing written outside the workspace
    with pytest.raises(BlockingIOError):
        host["listener"].accept()  # no connection ever reached the host's loopback listener
    assert host["sleeper"].poll() is None  # the host process was neither killed nor stopped


def test_every_call_is_traced(observed, host):
    """One JSON line per call, even for floods and garbage bytes; expected values of verdicts never in it."""
    records = trace.read(host["trace"])
    assert len(records) == len(CASES)
    by_tag = {r["tag"]: r for r in records}
    assert by_tag["stdout_flood"]["limit_hit"] == OUTPUT and by_tag["infinite_loop"]["limit_hit"] == CPU
    assert all(set(r["timings"]) == {"queue_s", "start_s", "run_s"} and r["digest_before"] for r in records)
    assert EXPECTED not in open(host["trace"]).read()


def test_host_clean_afterwards(observed):
    """No container, cgroup or host process of ours survives the whole adversarial batch."""
    runsc.REAPER.drain()
    assert runsc.list_containers() == []
    assert runsc.leftover_cgroups(f"rlvr-{os.getpid()}-") == []
    assert runsc.leftover_processes() == []
    from rlvr.sandbox.workspace import MOUNTED_HERE

    assert MOUNTED_HERE  # (runs as root in CI: workspaces are tmpfs mounts)
    mounted = {line.split()[1] for line in open("/proc/mounts").read().splitlines()}
    assert not mounted & MOUNTED_HERE  # ours only: other processes may have live workspaces
