"""The task graph: composite families and the atomic families they build on.

`PREREQUISITES[composite]` lists the families whose skills a composite combines. In an RL run
with a curriculum, a composite is drawn only after each prerequisite that is part of the run has
reached `rl.prerequisite_threshold` pass rate (see `Curriculum`); prerequisites outside the run
are ignored (shown as such by `render`). Inspect it:

    python -m rlvr.tasks.graph                 # the whole graph as an indented tree
    python -m rlvr.tasks.graph --task='rg/*'   # restricted to a run's families
    python -m rlvr.tasks.graph --dot > g.dot   # Graphviz
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence

PREREQUISITES: dict[str, tuple[str, ...]] = {
    # procedural families (rlvr.tasks.procedural) and the raw arithmetic of the quickstart
    "arith_expr": ("add", "sub", "mul"),
    "algebra_linear": ("arith_expr",),
    "fraction_sum": ("arith_expr",),
    "list_max_k": ("list_sort",),
    "code_function": ("list_sort", "arith_expr"),
    # reasoning-gym (rlvr.tasks.reasoning_gym)
    "rg/chain_sum": ("rg/basic_arithmetic",),
    "rg/decimal_arithmetic": ("rg/basic_arithmetic",),
    "rg/decimal_chain_sum": ("rg/chain_sum", "rg/decimal_arithmetic"),
    "rg/complex_arithmetic": ("rg/basic_arithmetic",),
    "rg/products": ("rg/basic_arithmetic",),
    "rg/fraction_simplification": ("rg/gcd",),
    "rg/lcm": ("rg/gcd", "rg/products"),
    "rg/prime_factorization": ("rg/products",),
    "rg/polynomial_equations": ("rg/simple_equations",),
    "rg/polynomial_multiplication": ("rg/products",),
    "rg/puzzle24": ("rg/basic_arithmetic",),
    "rg/countdown": ("rg/puzzle24",),
    "rg/sudoku": ("rg/mini_sudoku",),
    "rg/word_sorting": ("rg/number_sorting",),
    "rg/word_sequence_reversal": ("rg/spell_backward",),
    "rg/shortest_path": ("rg/maze",),
    "rg/largest_island": ("rg/binary_matrix",),
    "rg/spiral_matrix": ("rg/rotate_matrix",),
    "rg/game_of_life_halting": ("rg/game_of_life",),
    "rg/intermediate_integration": ("rg/simple_integration",),
}


def prerequisites(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """The graph restricted to `names`: composite -> its prerequisites that are in `names`."""
    names = set(names)
    return {c: tuple(p for p in ps if p in names) for c, ps in PREREQUISITES.items()
            if c in names and any(p in names for p in ps)}


def check_acyclic(graph: Mapping[str, Sequence[str]]) -> None:
    """Raises ValueError naming a cycle (a composite can never unlock if it needs itself)."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == 1:
            raise ValueError(f"task graph cycle: {' -> '.join([*path, node])}")
        if state.get(node) == 2:
            return
        state[node] = 1
        for p in graph.get(node, ()):
            visit(p, [*path, node])
        state[node] = 2

    for node in graph:
        visit(node, [])


def render(names: Iterable[str] | None = None, mastery: Mapping[str, float] | None = None,
           threshold: float = 0.5) -> str:
    """An indented tree: each composite under a line, its prerequisites below it (with their
    pass rate and whether they clear `threshold` when `mastery` is given)."""
    names = set(names) if names is not None else None
    lines = []
    for composite, prereqs in sorted(PREREQUISITES.items()):
        if names is not None and composite not in names:
            continue
        lines.append(composite)
        for p in prereqs:
            note = ""
            if names is not None and p not in names:
                note = "  (not in this run: ignored)"
            elif mastery is not None and p in mastery:
                note = f"  pass {mastery[p]:.2f} {'>=' if mastery[p] >= threshold else '<'} {threshold}"
            lines.append(f"  <- {p}{note}")
    return "\n".join(lines) if lines else "(no composite families among these)"


def dot(names: Iterable[str] | None = None) -> str:
    names = set(names) if names is not None else None
    edges = [f'  "{p}" -> "{c}";' for c, ps in sorted(PREREQUISITES.items()) for p in ps
             if names is None or (c in names and p in names)]
    return "digraph tasks {\n  rankdir=LR;\n" + "\n".join(edges) + "\n}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the task graph (composite <- prerequisites).")
    parser.add_argument("--task", default=None, help="restrict to a run's rl.task spec, e.g. 'rg/*'")
    parser.add_argument("--dot", action="store_true", help="Graphviz output instead of the tree")
    args = parser.parse_args(argv)
    names = None
    if args.task:
        from rlvr.tasks.mixture import expand

        names = list(expand(args.task))
    print(dot(names) if args.dot else render(names))


if __name__ == "__main__":
    main()
