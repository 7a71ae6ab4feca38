"""What the explorer shows, as JSON-ready dicts: one `RunDir` per workdir, and the views over them.

A workdir holds (each optional): config.json, metrics.jsonl, samples.jsonl (RL and eval
completions; train samples with per-token log-probs, versions, loss mask and advantage),
episodes.jsonl (multi-turn episodes with their tool calls and sandbox runs), failures.jsonl
(verifier errors, aborted rollouts, environment errors), summary.json (RL: held-out evaluations,
capability balance, curriculum) and eval.json (the evaluate job). The JSONL files are indexed
lazily (`rlvr.explore.jsonl`); the small ones (config, metrics, summaries) are read on request.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from rlvr.explore.jsonl import JsonlIndex
from rlvr.launch.sweep import flatten

PAGE = 50  # rows per page unless asked otherwise


def _reward(record: Mapping[str, Any]) -> dict[str, Any]:
    rewards = record.get("rewards") or {}
    return {"reward": rewards.get("reward"), "correct": rewards.get("correct")}


def sample_summary(r: dict[str, Any]) -> dict[str, Any]:
    return {"step": r["step"], "tag": r["tag"], "family": r["family"], "level": r["level"],
            "task_index": r["task_index"], "truncated": r.get("truncated", False),
            "response_tokens": r.get("response_tokens"), **_reward(r)}


def limit_hits(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The episode's sandbox runs stopped by a limit: [{index, what, limit_hit}]."""
    runs = ((record.get("trace") or {}).get("env") or {}).get("sandbox") or []
    return [{"index": i, "what": s.get("what"), "limit_hit": s["limit_hit"]}
            for i, s in enumerate(runs) if isinstance(s, dict) and s.get("limit_hit")]


def episode_summary(r: dict[str, Any]) -> dict[str, Any]:
    task, trace = r.get("task") or {}, r.get("trace") or {}
    calls = sum(len(t.get("info", {}).get("calls", [])) for t in trace.get("turns", []))
    return {"step": r.get("step"), "family": task.get("family"), "level": task.get("level"),
            "task_index": task.get("index"), "turns": r.get("turns"), "tool_calls": calls,
            "stop": trace.get("stop"), "rid": trace.get("rid"), "error": trace.get("error"),
            "limit_hits": limit_hits(r), **_reward(r)}


def failure_summary(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in ("step", "task_index", "family", "rid", "error")}


def _read_json(path: str) -> Any:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


class RunDir:
    """One workdir: its small files read on request, its JSONL files indexed lazily."""

    def __init__(self, path: str, name: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path!r} is not a directory; give rlvr workdirs (python -m rlvr.explore WORKDIR)")
        self.path, self.name = path, name
        self.samples = JsonlIndex(os.path.join(path, "samples.jsonl"), sample_summary)
        self.episodes = JsonlIndex(os.path.join(path, "episodes.jsonl"), episode_summary)
        self.failures = JsonlIndex(os.path.join(path, "failures.jsonl"), failure_summary)
        self.metrics_index = JsonlIndex(os.path.join(path, "metrics.jsonl"), dict)

    def file(self, name: str) -> Any:
        return _read_json(os.path.join(self.path, name))

    def metrics(self) -> list[dict[str, Any]]:
        return self.metrics_index.summaries()

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "path": os.path.abspath(self.path), "samples": self.samples.refresh(),
                "episodes": self.episodes.refresh(), "failures": self.failures.refresh(),
                "job": (self.file("config.json") or {}).get("job")}


def config_diff(runs: list[RunDir]) -> list[dict[str, Any]]:
    """The config keys whose values differ between the runs (all keys for a single run)."""
    flat = [flatten(r.file("config.json") or {}) for r in runs]
    keys = sorted(set().union(*flat))
    rows = [{"key": k, "values": [f.get(k) for f in flat]} for k in keys]
    if len(runs) > 1:
        rows = [row for row in rows if len({json.dumps(v, sort_keys=True) for v in row["values"]}) > 1]
    return rows


def curves(run: RunDir) -> dict[str, list[list[float]]]:
    """Every numeric metric as [[step, value], ...], plus the held-out evaluations of an RL
    summary.json (metrics.jsonl has the periodic ones only, not those before and after RL)."""
    out: dict[str, list[list[float]]] = {}
    for record in run.metrics():
        step = record.get("step")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(key, []).append([step, value])
    summary = run.file("summary.json") or {}
    evaluations = {"heldout_accuracy": [e[:2] for e in summary.get("evals", [])],
                   **{f"heldout/{d}": c for d, c in ((summary.get("balance") or {}).get("domains") or {}).items()}}
    for key, points in evaluations.items():
        merged = {step: value for step, value in out.get(key, [])} | {step: value for step, value in points}
        if merged:
            out[key] = sorted([step, value] for step, value in merged.items())
    return out


def capability_table(run: RunDir) -> dict[str, Any]:
    """Held-out pass@1 per domain at the first and last evaluation (RL summary.json) or per family
    (eval.json), with the domains the run crowded out."""
    summary = run.file("summary.json")
    if summary and summary.get("balance"):
        balance = summary["balance"]
        final = (summary.get("eval_final") or {}).get("by_domain", {})
        rows = [{"key": d, "first": c[0][1], "last": c[-1][1], "first_step": c[0][0], "last_step": c[-1][0],
                 "tasks": final.get(d, {}).get("tasks"), "crowded_out": d in balance.get("crowded_out", [])}
                for d, c in sorted(balance["domains"].items()) if c]
        return {"by": "domain", "rows": rows, "curriculum": summary.get("curriculum"),
                "before": summary.get("heldout_accuracy_before"), "after": summary.get("heldout_accuracy_after")}
    result = run.file("eval.json")
    if result:
        rows = [{"key": f, "first": None, "last": agg.get("pass@1"), "tasks": agg.get("tasks"), "crowded_out": False}
                for f, agg in sorted(result.get("by_family", {}).items())]
        return {"by": "family", "rows": rows, "after": result.get("overall", {}).get("pass@1")}
    return {"by": None, "rows": []}


def overview(runs: list[RunDir]) -> dict[str, Any]:
    return {"runs": [r.info() for r in runs], "config_diff": config_diff(runs),
            "curves": [curves(r) for r in runs], "capability": [capability_table(r) for r in runs]}


def _number(query: Mapping[str, str], key: str) -> float | None:
    value = query.get(key, "")
    return float(value) if value != "" else None


def _matches(row: Mapping[str, Any], query: Mapping[str, str]) -> bool:
    for key in ("tag", "family", "stop"):
        if query.get(key) and str(row.get(key)) != query[key]:
            return False
    for key in ("level", "task_index"):
        if query.get(key, "") != "" and row.get(key) != int(query[key]):
            return False
    for key, bound in (("step", "step_min"), ("reward", "reward_min")):
        low = _number(query, bound)
        if low is not None and (row.get(key) is None or row[key] < low):
            return False
    for key, bound in (("step", "step_max"), ("reward", "reward_max")):
        high = _number(query, bound)
        if high is not None and (row.get(key) is None or row[key] > high):
            return False
    if query.get("failed") == "1" and not (row.get("error") or row.get("limit_hits")):
        return False
    return True


def facets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
    return {"tags": sorted({r["tag"] for r in rows if r.get("tag")}),
            "families": sorted({r["family"] for r in rows if r.get("family")}),
            "levels": sorted({r["level"] for r in rows if isinstance(r.get("level"), int)}),
            "steps": [min(steps), max(steps)] if steps else []}


def page(index: JsonlIndex, query: Mapping[str, str]) -> dict[str, Any]:
    """A page of an index's rows (summaries, with their line `i`), filtered by `query`; without a
    filter only the page's lines are read (the index alone), so a large file opens at once."""
    offset, limit = int(query.get("offset", 0) or 0), int(query.get("limit", PAGE) or PAGE)
    filtered = any(query.get(k, "") != "" for k in ("tag", "family", "stop", "level", "task_index", "step_min",
                                                    "step_max", "reward_min", "reward_max", "failed"))
    if not filtered:
        total = index.refresh()
        chosen = list(range(offset, min(offset + limit, total)))
        rows = [{"i": i, **index.summarize(index.read(i))} for i in chosen]
        return {"total": total, "offset": offset, "rows": rows, "facets": None}
    summaries = index.summaries()
    hits = [i for i, row in enumerate(summaries) if _matches(row, query)]
    return {"total": len(hits), "offset": offset, "facets": None,
            "rows": [{"i": i, **summaries[i]} for i in hits[offset:offset + limit]]}


def index_facets(index: JsonlIndex) -> dict[str, Any]:
    return facets(index.summaries())


def compare(runs: list[RunDir], a: tuple[int, str], b: tuple[int, str]) -> dict[str, Any]:
    """Two evaluations (run, eval tag) on the same held-out prompts, joined on (family, level,
    task index, prompt): each side's mean reward and pass rate, and their difference."""
    sides = [_eval_rows(runs[run], tag) for run, tag in (a, b)]
    keys = [k for k in sides[0] if k in sides[1]]
    rows = []
    for key in keys:
        left, right = sides[0][key], sides[1][key]
        rows.append({"family": key[0], "level": key[1], "task_index": key[2], "prompt": key[3],
                     "a": left, "b": right, "diff": _round(right["reward"] - left["reward"])})
    rows.sort(key=lambda r: (-abs(r["diff"]), r["family"], r["level"], r["task_index"]))
    return {"rows": rows, "only_a": len(sides[0]) - len(keys), "only_b": len(sides[1]) - len(keys),
            "mean_a": _mean([r["a"]["reward"] for r in rows]), "mean_b": _mean([r["b"]["reward"] for r in rows])}


def _eval_rows(run: RunDir, tag: str) -> dict[tuple, dict[str, Any]]:
    """An evaluation's samples grouped by prompt: {key: {reward, correct, n, completions, lines}}."""
    summaries = run.samples.summaries()
    grouped: dict[tuple, dict[str, Any]] = {}
    for i, row in enumerate(summaries):
        if row.get("tag") != tag:
            continue
        record = run.samples.read(i)
        key = (row["family"], row["level"], row["task_index"], record["prompt"])
        g = grouped.setdefault(key, {"rewards": [], "correct": [], "completions": [], "lines": []})
        g["rewards"].append(row["reward"] or 0.0)
        g["correct"].append(row["correct"] or 0.0)
        g["completions"].append(record["completion"])
        g["lines"].append(i)
    return {k: {"reward": _mean(g["rewards"]), "correct": _mean(g["correct"]), "n": len(g["rewards"]),
                "completions": g["completions"][:4], "lines": g["lines"]} for k, g in grouped.items()}


def failures(run: RunDir) -> dict[str, Any]:
    """Recorded failures (failures.jsonl: verifier errors, aborted rollouts, environment errors)
    and episodes whose environment errored or whose sandbox hit a limit, each with where to look."""
    recorded = []
    episode_of = {row.get("rid"): i for i, row in enumerate(run.episodes.summaries()) if row.get("rid")}
    for i, row in enumerate(run.failures.summaries()):
        episode = episode_of.get(row.get("rid"))
        kind = ("aborted rollout" if "rollout aborted" in str(row.get("error"))
                else "environment error" if episode is not None else "verifier error")
        recorded.append({"i": i, "kind": kind, **row, "episode": episode})
    episodes = [{"i": i, **row} for i, row in enumerate(run.episodes.summaries())
                if row.get("error") or row.get("limit_hits")]
    return {"recorded": recorded, "episodes": episodes}


def replay_episode(run: RunDir, i: int, replay: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict:
    """The existing replay check (`rlvr.envs.episodes.replay`) on episode line `i`."""
    if replay is None:
        from rlvr.envs.episodes import replay
    try:
        return replay(run.episodes.read(i))
    except Exception as e:  # shown to the user, not swallowed
        return {"identical": False, "error": f"{type(e).__name__}: {e}"}


def _mean(values: list[float]) -> float:
    return _round(sum(values) / len(values)) if values else 0.0


def _round(value: float) -> float:
    return round(float(value), 4)
