"""The import graph of rlvr has no circles where issue 48 asked for none (tools/import_graph.py).

A circle is a set of modules each reachable from the others by imports, counting imports inside
functions (a lazy import is still a dependency). The graph's reader is checked first on a small tree
whose circle it must find, so the real-tree test cannot pass by reading nothing.
"""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)

# the packages the issue names; rlvr/*.py top-level modules are in scope too
SCOPED_PACKAGES = ("rlvr.rl", "rlvr.tasks", "rlvr.models", "rlvr.domains")


def _in_scope(module: str, top_level: set[str]) -> bool:
    return module in top_level or any(module == p or module.startswith(p + ".") for p in SCOPED_PACKAGES)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_reader_finds_a_circle_tied_by_a_lazy_import(tmp_path):
    _write(tmp_path, {
        "rlvr/__init__.py": "",
        "rlvr/a.py": "from rlvr.pkg import b\n",
        "rlvr/pkg/__init__.py": "",
        "rlvr/pkg/b.py": "import json\n\ndef f():\n    from .. import a\n    return a\n",
        "rlvr/pkg/c.py": "from rlvr.pkg.b import f\n",
    })
    every, top = import_graph.import_edges(tmp_path)
    assert every["rlvr.a"] == {"rlvr.pkg.b": [1]}
    assert every["rlvr.pkg.b"] == {"rlvr.a": [4]}  # the relative import inside f
    assert import_graph.circles(every) == [["rlvr.a", "rlvr.pkg.b"]]
    assert import_graph.circles(top) == []  # the top-level view does not see the lazy import


def test_no_circles_in_rlvr_rl_tasks_models_domains_and_top_level_modules():
    every, _ = import_graph.import_edges(ROOT)
    top_level = {"rlvr." + p.stem for p in (ROOT / "rlvr").glob("*.py") if p.stem != "__init__"}
    tied = [component for component in import_graph.circles(every)
            if any(_in_scope(m, top_level) for m in component)]
    described = ["  " + " <-> ".join(c) + "\n" + "\n".join("    " + e for e in import_graph.circle_edges(every, c))
                 for c in tied]
    assert not tied, "import circles (move code so one side stops importing the other):\n" + "\n".join(described)
