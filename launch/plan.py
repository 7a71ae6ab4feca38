"""`python -m rlvr.launch plan WORKDIR`: plan a larger RL run from a measured one, by simulation.

    python -m rlvr.launch plan workdirs/quickstart --set.prompts_per_step=256 \\
        --grid.servers=4,8,16 --grid.mode=sync,async [--cost.trainer=8 --cost.server=1 --cost.sandbox=0.01]

The run in WORKDIR (its config.json and metrics.jsonl; calibrate on a synchronous run) fixes the
timings (`rlvr.launch.simulate_calibrate.calibrate`). `--set.FIELD=V` changes the simulated
configuration (`rlvr.launch.simulate.SimulationConfig` fields: prompts_per_step, group_size,
servers, max_slots, sandbox_workers, verifier_workers, mode, max_staleness, ...). Without
`--grid.*` it prints the simulated step time, utilisation and queues as JSON; with them it
simulates every combination and prints one table plus the configuration with the lowest cost
per step (step time x the `--cost.*` rates of the trainer, each server and each sandbox worker).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rlvr.launch import simulate
from rlvr.launch.sweep import LaunchError

COSTS = ("trainer", "server", "sandbox")


def _field_types() -> dict[str, type]:
    return {f.name: type(f.default) for f in dataclasses.fields(simulate.SimulationConfig)
            if isinstance(f.default, (bool, int, float, str))}


def parse_value(field: str, text: str) -> Any:
    """`text` as the type of SimulationConfig.`field` (error names the flag and the choices)."""
    types = _field_types()
    if field not in types:
        raise LaunchError(f"--set/--grid.{field}: not a simulated setting; choose from {sorted(types)}.")
    kind = types[field]
    if kind is bool:
        if text.lower() not in ("true", "false"):
            raise LaunchError(f"--{field}={text}: give true or false.")
        return text.lower() == "true"
    try:
        return kind(text)
    except ValueError:
        raise LaunchError(f"--{field}={text}: must be a {kind.__name__}.") from None


def parse(other: dict[str, str]) -> tuple[dict[str, Any], dict[str, list[Any]], dict[str, float]]:
    """(--set.* changes, --grid.* values, --cost.* rates) from the command line's `--key=value` flags."""
    changes, grid, costs = {}, {}, {}
    for key, text in other.items():
        kind, _, field = key.partition(".")
        if kind == "set" and field:
            changes[field] = parse_value(field, text)
        elif kind == "grid" and field:
            grid[field] = [parse_value(field, part) for part in text.split(",") if part]
        elif kind == "cost" and field in COSTS:
            try:
                costs[field] = float(text)
            except ValueError:
                raise LaunchError(f"--cost.{field}={text}: must be a number.") from None
        else:
            raise LaunchError(f"--{key}: plan takes --set.FIELD=V, --grid.FIELD=a,b,... and "
                              f"--cost.{{{','.join(COSTS)}}}=X.")
    return changes, grid, costs


def run(workdir: str, other: dict[str, str]) -> dict[str, Any]:
    """The plan (or the single simulation) for the run in `workdir`; see the module docstring."""
    from rlvr.launch import simulate_calibrate

    changes, grid, costs = parse(other)
    try:
        base = dataclasses.replace(simulate_calibrate.calibrate(workdir), **changes)
    except (OSError, KeyError) as e:
        raise LaunchError(f"plan: cannot calibrate on {workdir!r} ({type(e).__name__}: {e}); give the workdir "
                          "of a finished rl run (config.json and metrics.jsonl with 3 or more steps).") from None
    except ValueError as e:
        raise LaunchError(f"plan: {e}") from None
    if not grid:
        return {"calibrated_on": workdir, "changes": changes, "simulated": simulate.simulate(base).summary()}
    result = simulate.plan(base, grid, costs)
    return {"calibrated_on": workdir, "changes": changes, "costs": costs, **result}


def report(result: dict[str, Any]) -> str:
    """A table of the plan's rows (or the single simulation as JSON)."""
    if "rows" not in result:
        return json.dumps(result, indent=2)
    columns = list(result["rows"][0])
    lines = ["  ".join(f"{c:>14}" for c in columns)]
    lines += ["  ".join(f"{row[c]!s:>14}" for c in columns) for row in result["rows"]]
    lines.append(f"recommended (lowest cost per step): {json.dumps(result['recommended'])}")
    return "\n".join(lines)
