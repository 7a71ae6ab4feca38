"""Workspace templates: a run starts from a template's contents over an overlay; whatever the program does,
the template on the host never changes and the next call sees it pristine."""

import os
import time

import pytest
from rlvr.sandbox import Limits, run, trace
from rlvr.sandbox.replay import compare, replay
from rlvr.sandbox.workspace import Template, Workspace, template_for, tree_digest

pytestmark = pytest.mark.sandbox

FAST = Limits(wall_s=3.0, cpu_s=3)


@pytest.fixture
def template(tmp_path):
    top = tmp_path / "tpl"
    (top / "pkg" / "sub").mkdir(parents=True)
    (top / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (top / "pkg" / "sub" / "data.txt").write_text("data\n")
    (top / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(top / "run.sh", 0o755)
    os.symlink("pkg/mod.py", top / "link")
    return str(top)


VANDAL = """\
import os, shutil
print(sorted(os.listdir('.')), open('pkg/mod.py').read().strip().splitlines()[-1])
open('pkg/mod.py', 'w').write('BROKEN')
os.chmod('run.sh', 0o600)
os.remove('pkg/sub/data.txt')
shutil.rmtree('pkg/sub')
os.rename('pkg', 'moved')
os.unlink('link')
open('new.txt', 'w').write('new')
print('vandalised', sorted(os.listdir('.')))
"""


def test_template_is_seen_changed_in_the_call_and_pristine_after(template, tmp_path):
    before = tree_digest(template)
    stats = {p: os.lstat(os.path.join(template, p)) for p in ("pkg/mod.py", "run.sh")}
    first = run(python=VANDAL, template=template, limits=FAST, trace_path=str(tmp_path / "t.jsonl"))
    assert first.ok, first.stderr
    assert first.text().splitlines() == ["['link', 'main.py', 'pkg', 'run.sh']     return 1",
                                         "vandalised ['main.py', 'moved', 'new.txt', 'run.sh']"]
    assert tree_digest(template) == before  # the host's template never changed
    for p, st in stats.items():
        now = os.lstat(os.path.join(template, p))
        assert (now.st_mode, now.st_uid, now.st_size, now.st_mtime_ns) == (st.st_mode, st.st_uid, st.st_size,
                                                                           st.st_mtime_ns)
    second = run(python=VANDAL, template=template, limits=FAST, trace_path=str(tmp_path / "t.jsonl"))
    assert second.text() == first.text()  # the second call sees the pristine template
    assert second.digest_before == first.digest_before
    entry = trace.read(str(tmp_path / "t.jsonl"))[0]
    assert entry["template"]["digest"] == before
    assert compare(entry, replay(entry)) == {}  # a templated call replays over the same template


def test_template_cache_follows_changes(template):
    a = template_for(template, 1000)
    assert template_for(template, 1000) is a and a.digest == tree_digest(template)
    time.sleep(0.01)
    with open(os.path.join(template, "pkg", "mod.py"), "a") as f:
        f.write("# changed\n")
    b = template_for(template, 1000)
    assert b is not a and b.digest == tree_digest(template)
    r = run(["/usr/bin/tail", "-n1", "pkg/mod.py"], template=template, limits=FAST, trace_path=False)
    assert r.stdout == b"# changed\n"


def test_prepared_template_and_reset_cost(template):
    """A prepared Template is reusable; a workspace over it is a mount, not a copy (measured here)."""
    prepared = Template(template)
    try:
        costs = []
        for _ in range(10):
            t = time.perf_counter()
            ws = Workspace(8 << 20, 1024, template=prepared)
            ws.write({"pkg/mod.py": "changed"})
            ws.close()
            costs.append(time.perf_counter() - t)
        costs.sort()
        print(f"overlay workspace create+dirty+reset: median {costs[5] * 1e3:.1f} ms, max {costs[-1] * 1e3:.1f} ms")
        assert costs[5] < 0.5
        assert tree_digest(prepared.path) == tree_digest(template) == prepared.digest
        r = run(python="print(open('pkg/sub/data.txt').read().strip())", template=prepared, limits=FAST,
                trace_path=False)
        assert r.stdout == b"data\n"
    finally:
        prepared.close()


def test_host_writes_do_not_follow_workspace_symlinks(tmp_path):
    """A symlink the program leaves behind cannot redirect the host's own later writes or reads."""
    outside = tmp_path / "outside"
    outside.mkdir()
    ws = Workspace(1 << 20, 64)
    try:
        os.symlink(str(outside), os.path.join(ws.path, "d"))
        os.symlink(str(outside / "f"), os.path.join(ws.path, "f"))
        for name in ("d/x", "f"):
            with pytest.raises(OSError):
                ws.write({name: "owned"})
        with pytest.raises(OSError):
            ws.read_file("d/x")
        assert os.listdir(outside) == []
        ws.write({"a/b/c.txt": "ok"})
        assert ws.read_file("a/b/c.txt") == b"ok"
    finally:
        ws.close()


def test_without_root_a_template_is_copied_with_a_warning(template, monkeypatch):
    from rlvr.sandbox import workspace

    monkeypatch.setattr(workspace, "_is_root", lambda: False)
    monkeypatch.setattr(workspace, "_copy_warned", [])
    prepared = Template(template)
    try:
        with pytest.warns(RuntimeWarning, match="need root for overlayfs"):
            ws = Workspace(1 << 20, 64, template=prepared)
        try:
            assert not ws.mounted and ws.digest() == prepared.digest == tree_digest(template)
            ws.write({"pkg/mod.py": "changed"})
            assert ws.read_file("pkg/mod.py") == b"changed" and tree_digest(template) == prepared.digest
        finally:
            ws.close()
    finally:
        prepared.close()


def test_digest_over_a_template_reads_only_changed_files_and_stays_exact(template):
    """The digest reuses the template's content hashes for untouched files; a changed file (even with the same
    size and its mtime set back) is read again: the result equals a digest computed from scratch."""
    prepared = Template(template)
    ws = Workspace(1 << 20, 64, template=prepared)
    try:
        assert ws.digest() == prepared.digest == tree_digest(ws.path)
        path = os.path.join(ws.path, "pkg", "mod.py")
        st = os.stat(path)
        with open(path, "r+b") as f:
            f.write(b"X")  # same size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back; ctime cannot be
        assert ws.digest() == tree_digest(ws.path) != prepared.digest
        os.remove(os.path.join(ws.path, "run.sh"))
        assert ws.changes() == {"written": ["pkg/", "pkg/mod.py"], "deleted": ["run.sh"]}
    finally:
        ws.close()
        prepared.close()
