"""Episodes: several steps over one workspace (write a bug, run the failing tests, fix, run them again), a
snapshot of the scene that replays exactly later, also after the original workspace and template are gone."""

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from rlvr.sandbox import Episode, Limits, trace
from rlvr.sandbox.episode import load, replay_episode
from rlvr.sandbox.workspace import tree_digest

pytestmark = pytest.mark.sandbox

LIMITS = Limits(wall_s=5.0, cpu_s=4)
TESTS = ("import unittest\nfrom calc import add\n\n"
         "class T(unittest.TestCase):\n"
         "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
# unittest's own runner prints "Ran 1 test in 0.001s": a timing, which no replay reproduces. A task repo's
# test command for replayable episodes reports results without timings:
RUNNER = ("import sys, unittest\n"
          "result = unittest.TestResult()\n"
          "unittest.defaultTestLoader.loadTestsFromName('test_calc').run(result)\n"
          "for test, tb in result.failures + result.errors:\n"
          "    print('FAIL', test.id(), tb.strip().splitlines()[-1])\n"
          "print('passed' if result.wasSuccessful() else 'failed', result.testsRun)\n"
          "sys.exit(0 if result.wasSuccessful() else 1)\n")
UNITTEST = ["/usr/bin/python3", "run_tests.py"]


@pytest.fixture
def repo(tmp_path):
    top = tmp_path / "repo"
    top.mkdir()
    (top / "test_calc.py").write_text(TESTS)
    (top / "README").write_text("a task repo\n")
    (top / "run_tests.py").write_text(RUNNER)
    return str(top)


def _bug_fix_episode(ep):
    ep.write({"calc.py": "def add(a, b):\n    return a - b\n"})
    failing = ep.run(UNITTEST)
    ep.write({"calc.py": "def add(a, b):\n    return a + b\n"})
    passing = ep.run(UNITTEST)
    return failing, passing


def test_episode_steps_snapshot_and_exact_replay(repo, tmp_path):
    pristine = tree_digest(repo)
    trace_path = str(tmp_path / "episode.jsonl")
    with Episode(LIMITS, template=repo, trace_path=trace_path) as ep:
        failing, passing = _bug_fix_episode(ep)
        notes = ep.run(python="open('notes.txt', 'w').write('fixed'); print(sorted(__import__('os').listdir()))")
        assert ep.read("notes.txt") == b"fixed"
        snap = ep.snapshot(str(tmp_path / "ep.tar.gz"))
        workspace = ep.ws.path
    assert failing.exit_code == 1 and failing.text() == ("FAIL test_calc.T.test_add AssertionError: -1 != 5\n"
                                                         "failed 1\n"), failing.stderr
    assert passing.ok and passing.text() == "passed 1\n"
    assert passing.digest_before != failing.digest_before  # the fix is in the workspace the next step sees
    assert notes.text() == "['README', 'calc.py', 'main.py', 'notes.txt', 'run_tests.py', 'test_calc.py']\n"
    assert tree_digest(repo) == pristine and not os.path.exists(workspace)  # template untouched, ws discarded
    records = trace.read(trace_path)
    assert [r["argv"] == UNITTEST for r in records] == [True, True, False]
    assert all(r["episode"] == records[0]["episode"] for r in records)

    meta = load(snap)
    assert [s["kind"] for s in meta["steps"]] == ["write", "run", "write", "run", "run"]
    assert meta["steps"][1]["exit_code"] == 1 and meta["template"]["digest"] == pristine
    assert meta["changes"] == {"written": ["calc.py", "main.py", "notes.txt"], "deleted": []}
    with tarfile.open(snap) as tar:
        names = set(tar.getnames())
    assert {"episode.json", "initial/test_calc.py", "final/calc.py", "final/notes.txt"} <= names
    assert "initial/calc.py" not in names

    report = replay_episode(snap)
    assert report["replayed_exactly"], json.dumps(report, indent=1)
    assert [s["match"] for s in report["steps"]] == [True] * 5
    print(f"episode replay: 5 steps (3 sandboxes) in {report['replay_s']:.2f} s")


def test_failing_episode_snapshot_is_self_contained(repo, tmp_path):
    """The scene of a failure replays in a new process after the template and the workspace are gone."""
    with Episode(LIMITS, template=repo, trace_path=False) as ep:
        ep.write({"calc.py": "def add(a, b):\n    return a - b\n"})
        r = ep.run(UNITTEST)
        assert not r.ok
        snap = ep.snapshot(str(tmp_path / "failure.tar.gz"))
    shutil.rmtree(repo)
    done = subprocess.run([sys.executable, "-m", "rlvr.sandbox.replay", "--episode", snap], capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["replayed_exactly"] and report["steps"][1]["exit_code"] == 1


def test_replay_reports_the_step_that_differs(tmp_path):
    with Episode(LIMITS, trace_path=False) as ep:  # no template: starts empty
        ep.run(python="open('a.txt', 'w').write('1')")
        ep.run(python="import random; print(random.random())")
        snap = ep.snapshot(str(tmp_path / "random.tar.gz"))
    report = replay_episode(snap)
    assert not report["replayed_exactly"]
    assert [s["match"] for s in report["steps"]] == [True, False]
    assert set(report["steps"][1]["differences"]) == {"stdout"}


def test_episode_host_access_never_follows_links(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    with Episode(LIMITS, trace_path=False) as ep:
        r = ep.run(python=f"import os; os.symlink({str(secret)!r}, 'leak'); os.symlink('/etc', 'etc')")
        assert r.ok, r.stderr
        with pytest.raises(OSError):
            ep.read("leak")
        with pytest.raises(OSError):
            ep.write({"etc/owned": "x"})
        assert not os.path.exists("/etc/owned")
    with pytest.raises(Exception, match="closed"):
        ep.run(python="print(1)")
