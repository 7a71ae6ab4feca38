"""The module import graph of rlvr and its circles (strongly connected components).

Rooms are modules (one file each; a package's `__init__.py` is the package's room). An edge
`a -> b` means a file of `a` imports `b`, read with `ast` from the source (nothing is imported):

- "all": every import statement anywhere in the file, including ones inside functions (a lazy
  import is still a dependency) and `importlib.import_module("literal")` calls;
- "top": only statements at module level (what runs when the module is first imported; an
  `if TYPE_CHECKING:` block is module level too, so a typing-only import still shows there).

`from rlvr.pkg import name` is an edge to `rlvr.pkg.name` when that is a module, else to `rlvr.pkg`.
The parent packages a dotted import initialises on the way are not edges (they are not what the
code uses). `kernels/`, `sandbox/` and `launch/` are read as `rlvr.kernels`, `rlvr.sandbox` and
`rlvr.launch`, the names they install under.

    python tools/import_graph.py                      # circles of both views, then a JSON summary
    python tools/import_graph.py --json-only          # the JSON summary alone
    python tools/import_graph.py --record after --out benchmarks/results/import_graph.json
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (folder under ROOT, the dotted name it installs as); see setup.py's NAMESPACED
SOURCES = (("rlvr", "rlvr"), ("kernels", "rlvr.kernels"), ("sandbox", "rlvr.sandbox"), ("launch", "rlvr.launch"))
SKIP_DIRS = {"__pycache__", "static"}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every rlvr module's dotted name -> its file (the namespaced folders under their rlvr names)."""
    files: dict[str, Path] = {}
    for folder, name in SOURCES:
        base = root / folder
        for dirpath, dirnames, filenames in os.walk(base):
            here = Path(dirpath)
            # the rlvr/kernels etc. symlinks point at the top-level folders walked on their own
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not (here / d).is_symlink())
            for filename in sorted(filenames):
                if not filename.endswith(".py"):
                    continue
                parts = list((here / filename).relative_to(base).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                files[".".join([name, *parts])] = here / filename
    return files


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a `from .x import y` (level dots) written in `module`."""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def _known(name: str, modules: set[str]) -> str | None:
    """`name` itself or its longest prefix that is an rlvr module (None outside rlvr)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


class _Imports(ast.NodeVisitor):
    """Collects (target module, at module level?) for every import in one file."""

    def __init__(self, module: str, is_package: bool, modules: set[str]):
        self.module, self.is_package, self.modules = module, is_package, modules
        self.depth = 0  # >0 inside a function (class bodies run at import, so they count as top)
        self.found: list[tuple[str, bool, int]] = []

    def _add(self, name: str | None, line: int) -> None:
        if name and name != self.module:
            self.found.append((name, self.depth == 0, line))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(_known(alias.name, self.modules), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = (_resolve_relative(self.module, self.is_package, node.level, node.module) if node.level
                else node.module or "")
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(sub if sub in self.modules else _known(base, self.modules), node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            self._add(_known(node.args[0].value, self.modules), node.lineno)
        self.generic_visit(node)


def import_edges(root: Path = ROOT) -> tuple[dict[str, dict[str, list[int]]], dict[str, dict[str, list[int]]]]:
    """({module: {imported module: [lines]}} for all imports, the same for module-level imports only)."""
    files = module_files(root)
    names = set(files)
    every: dict[str, dict[str, list[int]]] = {m: {} for m in files}
    top: dict[str, dict[str, list[int]]] = {m: {} for m in files}
    for module, path in files.items():
        visitor = _Imports(module, path.name == "__init__.py", names)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for target, at_top, line in visitor.found:
            for graph in (every, top) if at_top else (every,):
                lines = graph[module].setdefault(target, [])
                if line not in lines:  # `from m import a, b` is one import of m
                    lines.append(line)
    return every, top


def circles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative), each sorted,
    largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def circle_edges(graph: dict[str, dict[str, list[int]]], component: list[str]) -> list[str]:
    """The edges inside one circle, as 'a -> b (lines)', so a reader sees which imports tie it."""
    members = set(component)
    return [f"{a} -> {b} (line {', '.join(map(str, graph[a][b]))})"
            for a in component for b in sorted(graph[a]) if b in members]


def summary(root: Path = ROOT) -> dict:
    """Both views' circles with their tying edges, and the graph's size."""
    every, top = import_edges(root)
    out = {"modules": len(every)}
    for view, graph in (("all_imports", every), ("top_level_only", top)):
        found = circles(graph)
        out[view] = {"edges": sum(len(t) for t in graph.values()), "circles": len(found),
                     "largest": max((len(c) for c in found), default=0),
                     "components": [{"modules": c, "edges": circle_edges(graph, c)} for c in found]}
    return out


def _record_meta() -> dict:
    """Date, command, machine, load and commit, as the results files carry them."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python tools/import_graph.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "load": list(os.getloadavg()), "commit": commit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json-only", action="store_true", help="print only the JSON summary")
    parser.add_argument("--record", default="", help="store the summary under this key (e.g. before, after)")
    parser.add_argument("--out", default="", help="the results JSON file --record writes into")
    args = parser.parse_args()
    result = summary()
    if not args.json_only:
        for view in ("all_imports", "top_level_only"):
            print(f"== {view}: {result[view]['circles']} circles over {result['modules']} modules")
            for component in result[view]["components"]:
                print("  " + " <-> ".join(component["modules"]))
                for edge in component["edges"]:
                    print("      " + edge)
    print(json.dumps({"modules": result["modules"],
                      **{v: {k: result[v][k] for k in ("edges", "circles", "largest")}
                         for v in ("all_imports", "top_level_only")}}))
    if args.record:
        if not args.out:
            parser.error("--record needs --out (the results JSON to write into)")
        path = Path(args.out)
        stored = json.loads(path.read_text()) if path.exists() else {}
        stored[args.record] = {**_record_meta(), **result}
        path.write_text(json.dumps(stored, indent=2) + "\n")


if __name__ == "__main__":
    main()
