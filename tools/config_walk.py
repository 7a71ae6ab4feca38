"""The walk a job's config takes through rlvr's modules, read statically from the source (`ast`).

Starting at one function (default `rlvr.trainers.rl.train`, its first parameter: the resolved `job`,
or `config` in older trees), every call that passes the config (the name itself, one of its sections:
`config.rl`, `job.config`, a local name bound to one, or a copy; not a value such as `config.seed`)
to an rlvr function is followed into that function, depth first in source order: every such call is a step (a function
called from two places is walked twice), except a call back into a function already on the walk's
stack. The rooms are the modules of those functions. Reported:

- moves: calls that carry the config from a function in one module to a function in another;
- returns: per module, how many moves enter it beyond the first (a module's calls to its own
  functions are not moves);
- climbs: moves from module A to module B where B imports A (directly or not, counting lazy
  imports): the config travelling back up the dependency order (`tools/import_graph.py`).

Followed: `module.function(...)` through an imported rlvr module, `function(...)` defined in the
same module or imported from an rlvr module, and `Class(...)` (its `__init__`). Not followed:
methods called on objects (`self.x(config)`) and calls through variables: a lower bound.

    python tools/config_walk.py [--start rlvr.trainers.rl.train] [--param job] [--root CHECKOUT]
    python tools/config_walk.py --record after --out benchmarks/results/import_graph.json
"""

from __future__ import annotations

import argparse
import ast
import functools
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
    """`expr` is a tracked name, an attribute chain rooted at one (`config.rl.engine`, `job.config`),
    a copy of one (`config.copy_and_resolve_references()`, `ConfigDict(config.to_dict())`)."""
    if isinstance(expr, ast.Call):
        func = expr.func
        if isinstance(func, ast.Attribute) and func.attr in COPIES:
            return _carries(func.value, tracked)
        named = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return named == "ConfigDict" and any(_carries(a, tracked) for a in expr.args)
    chain = []
    while isinstance(expr, ast.Attribute):
        chain.insert(0, expr.attr)
        expr = expr.value
    if not (isinstance(expr, ast.Name) and expr.id in tracked):
        return False
    if expr.id == "job" and chain:  # a resolved job (rlvr.job.Job): only its config is the config
        return chain[0] == "config" and all(a in sections() for a in chain[1:])
    return all(a in sections() for a in chain)  # not a value such as `config.rl.teacher`


COPIES = ("copy", "copy_and_resolve_references", "to_dict", "unlock", "lock", "derive")


@functools.cache
def sections() -> frozenset[str]:
    """The config's section names (`rl`, `engine`, ...: ConfigDicts in `config_lib.base_config()`),
    and `config` (a resolved job's `job.config`)."""
    import ml_collections

    from rlvr import config_lib

    names = {"config"}

    def collect(d) -> None:
        for key, value in d.items():
            if isinstance(value, ml_collections.ConfigDict):
                names.add(key)
                collect(value)
    collect(config_lib.base_config())
    return frozenset(names)


def _aliases(fn: ast.FunctionDef, tracked: set[str]) -> set[str]:
    """`tracked` with the local names bound to it (`config, rl = job.config, job.config.rl`),
    anywhere in the function (flow-insensitive, to a fixed point)."""
    out = set(tracked)
    while True:
        before = len(out)
        for node in ast.walk(fn):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts, strict=False)
                         if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                         else [(target, node.value)])
                out |= {t.id for t, v in pairs if isinstance(t, ast.Name) and _carries(v, out)}
        if len(out) == before:
            return out


def _receiving(fn: ast.FunctionDef, call: ast.Call, tracked: set[str]) -> set[str]:
    """The callee's parameters that receive the tracked config in `call`."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if params and params[0] in ("self", "cls"):
        params = params[1:]
    out = {params[i] for i, arg in enumerate(call.args) if i < len(params) and _carries(arg, tracked)}
    return out | {k.arg for k in call.keywords if k.arg and _carries(k.value, tracked)}


def walk(source: Source, start: tuple[str, str], param: str) -> list[tuple[tuple[str, str], tuple[str, str] | None]]:
    """The (function, its caller) sequence, depth first in source order, one entry per call; a
    function is (module, name); the start's caller is None."""
    stack: list[tuple[str, str]] = []
    order: list[tuple[tuple[str, str], tuple[str, str] | None]] = []

    def visit(key: tuple[str, str], tracked: set[str]) -> None:
        order.append((key, stack[-1] if stack else None))
        stack.append(key)
        fn = source.functions[key]
        tracked = _aliases(fn, tracked)
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


def summary(start: str = "rlvr.trainers.rl.train", param: str = "", root: Path = import_graph.ROOT) -> dict:
    """The walk from `start` (its parameter `param`, default the first) with its moves, climbs and
    returns per module."""
    source = Source(root)
    module, _, name = start.rpartition(".")
    param = param or source.functions[(module, name)].args.args[0].arg
    order = walk(source, (module, name), param)
    every, _ = import_graph.import_edges(root)
    reach = above(every)
    moves = [(caller[0], key[0]) for key, caller in order if caller is not None and caller[0] != key[0]]
    entries: dict[str, int] = {module: 1}
    for _, room in moves:
        entries[room] = entries.get(room, 0) + 1
    climbs = [(a, b) for a, b in moves if a in reach.get(b, set())]
    return {"start": start, "param": param, "functions": len(order), "moves": len(moves), "climbs": len(climbs),
            "returns": {r: n - 1 for r, n in sorted(entries.items(), key=lambda kv: -kv[1]) if n > 1},
            "most_returns": max((n - 1 for n in entries.values()), default=0),
            "walk": [f"{'  ' * _depth(order, i)}{m}.{f}" for i, ((m, f), _) in enumerate(order)]}


def _depth(order: list, i: int) -> int:
    """How deep the i-th call of the walk is (the start is 0)."""
    depth, caller = 0, order[i][1]
    for key, parent in reversed(order[:i]):
        if caller is not None and key == caller:
            depth, caller = depth + 1, parent
    return depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", default="rlvr.trainers.rl.train")
    parser.add_argument("--param", default="", help="the start function's parameter to follow (default its first)")
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
