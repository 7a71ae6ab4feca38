"""The walk a job's config takes through rlvr's modules, read statically from the source (`ast`).

Starting at one function (default `rlvr.trainers.rl.train`, parameter `config`), every call that
passes the config (the name itself or one of its sections, `config.rl`) to an rlvr function is
followed into that function, depth first in source order: every such call is a step (a function
called from two places is walked twice), except a call back into a function already on the walk's
stack. The rooms visited, in order, are the modules of those functions. Reported:

- moves: consecutive functions of the walk in different modules;
- returns: per module, how many times the walk enters it again after leaving it;
- climbs: moves from module A to module B where B imports A (directly or not, counting lazy
  imports): the config travelling back up the dependency order (`tools/import_graph.py`).

Followed: `module.function(...)` through an imported rlvr module, `function(...)` defined in the
same module or imported from an rlvr module, and `Class(...)` (its `__init__`). Not followed:
methods called on objects (`self.x(config)`) and calls through variables: a lower bound.

    python tools/config_walk.py [--start rlvr.trainers.rl.train] [--param config] [--root CHECKOUT]
    python tools/config_walk.py --record after --out benchmarks/results/import_graph.json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import import_graph  # noqa: E402


def _names(module: str, is_package: bool, tree: ast.Module, modules: set[str]) -> dict[str, tuple[str, str | None]]:
    """Every name an import binds anywhere in the file: alias -> (rlvr module, attribute or None)."""
    out: dict[str, tuple[str, str | None]] = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    out[a.asname or a.name.split(".")[0]] = (a.name, None) if a.asname else (a.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    out[a.asname or a.name] = (sub, None)
                elif base in modules:
                    out[a.asname or a.name] = (base, a.name)
    return out


class Source:
    """Functions (module-level, and classes' `__init__` under the class name) of every rlvr module."""

    def __init__(self, root: Path = import_graph.ROOT):
        self.files = import_graph.module_files(root)
        self.modules = set(self.files)
        self.trees = {m: ast.parse(p.read_text(), str(p)) for m, p in self.files.items()}
        self.imports = {m: _names(m, self.files[m].name == "__init__.py", t, self.modules)
                        for m, t in self.trees.items()}
        self.functions: dict[tuple[str, str], ast.FunctionDef] = {}
        for m, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.functions[(m, node.name)] = node
                elif isinstance(node, ast.ClassDef):
                    init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
                    if init is not None:
                        self.functions[(m, node.name)] = init

    def resolve(self, module: str, func: ast.expr) -> tuple[str, str] | None:
        """The (module, function) a call's callee names, when it is a followed rlvr function."""
        names = self.imports[module]
        if isinstance(func, ast.Name):
            if (module, func.id) in self.functions:
                return module, func.id
            target = names.get(func.id)
            if target and target[1] and (target[0], target[1]) in self.functions:
                return target[0], target[1]
            return None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = names.get(func.value.id)
            if target and target[1] is None:
                key = (target[0], func.attr)
                return key if key in self.functions else None
        return None


def _carries(expr: ast.expr, tracked: set[str]) -> bool:
    """`expr` is a tracked name or an attribute chain rooted at one (`config.rl.engine`)."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, ast.Name) and expr.id in tracked


def _receiving(fn: ast.FunctionDef, call: ast.Call, tracked: set[str]) -> set[str]:
    """The callee's parameters that receive the tracked config in `call`."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if params and params[0] in ("self", "cls"):
        params = params[1:]
    out = {params[i] for i, arg in enumerate(call.args) if i < len(params) and _carries(arg, tracked)}
    return out | {k.arg for k in call.keywords if k.arg and _carries(k.value, tracked)}


def walk(source: Source, start: tuple[str, str], param: str) -> list[tuple[str, str]]:
    """The (module, function) sequence, depth first in source order, one entry per call."""
    stack: list[tuple[str, str]] = []
    order: list[tuple[str, str]] = []

    def visit(key: tuple[str, str], tracked: set[str]) -> None:
        stack.append(key)
        order.append(key)
        fn = source.functions[key]
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        for call in calls:
            callee = source.resolve(key[0], call.func)
            if callee is None or callee in stack:
                continue
            receiving = _receiving(source.functions[callee], call, tracked)
            if receiving:
                visit(callee, receiving)
        stack.pop()

    visit(start, {param})
    return order


def above(graph: dict[str, dict[str, list[int]]]) -> dict[str, set[str]]:
    """Per module, the modules it reaches by imports (transitively)."""
    reach: dict[str, set[str]] = {}
    for m in graph:
        seen, todo = set(), list(graph[m])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(graph.get(n, ()))
        reach[m] = seen
    return reach


def summary(start: str = "rlvr.trainers.rl.train", param: str = "config", root: Path = import_graph.ROOT) -> dict:
    """The walk from `start` (its parameter `param`) with its moves, climbs and returns per module."""
    source = Source(root)
    module, _, name = start.rpartition(".")
    order = walk(source, (module, name), param)
    rooms = [m for m, _ in order]
    every, _ = import_graph.import_edges(root)
    reach = above(every)
    moves = [(a, b) for a, b in zip(rooms, rooms[1:], strict=False) if a != b]
    entries: dict[str, int] = {}
    for i, room in enumerate(rooms):
        if i == 0 or rooms[i - 1] != room:
            entries[room] = entries.get(room, 0) + 1
    climbs = [(a, b) for a, b in moves if a in reach.get(b, set())]
    return {"start": start, "functions": len(order), "moves": len(moves), "climbs": len(climbs),
            "returns": {r: n - 1 for r, n in sorted(entries.items(), key=lambda kv: -kv[1]) if n > 1},
            "most_returns": max((n - 1 for n in entries.values()), default=0),
            "walk": [f"{m}.{f}" for m, f in order]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", default="rlvr.trainers.rl.train")
    parser.add_argument("--param", default="config")
    parser.add_argument("--root", default=str(import_graph.ROOT), help="the checkout to read (e.g. an older one)")
    parser.add_argument("--record", default="", help="store the walk as `config_walk` under this key of --out")
    parser.add_argument("--out", default="", help="the results JSON --record writes into (tools/import_graph.py's)")
    args = parser.parse_args()
    result = summary(args.start, args.param, Path(args.root))
    print(json.dumps({k: v for k, v in result.items() if k != "walk"}))
    for step in result["walk"]:
        print("  " + step)
    if args.record:
        if not args.out:
            parser.error("--record needs --out")
        path = Path(args.out)
        stored = json.loads(path.read_text()) if path.exists() else {}
        stored.setdefault(args.record, {})["config_walk"] = {"command": "python tools/config_walk.py " +
                                                             " ".join(sys.argv[1:]), "root": args.root, **result}
        path.write_text(json.dumps(stored, indent=2) + "\n")


if __name__ == "__main__":
    main()
