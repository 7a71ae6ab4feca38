"""Results registry: one table of an experiment's jobs, as rows for notebooks, text, CSV or a plot.

    python -m rlvr.launch results EXP_OR_DIR [--root=experiments] [--csv=F] [--plot=F] [--metric=NAME,...]

A row holds the job's `name`, the config keys that differ between the experiment's jobs (computed from
the resolved configs in job.json, not from the sweep dicts), its status, wall time and last step,
the scalar fields of its `summary.json` (RL: heldout_accuracy_before/after, improvement_points,
final_reward_mean_last10; SFT: final_loss, heldout_loss, heldout_accuracy; DPO/RM: heldout_accuracy,
heldout_margin), and for every metric in its `metrics.jsonl` (one JSON object per line with a "step"
key) two columns: `final/NAME`, the last value logged, and `best/NAME`, the minimum for names
containing "loss" or "perplexity" and the maximum for every other name. Jobs still running, failed
or killed show their status and whatever they have written so far.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

from rlvr.launch import records
from rlvr.launch.sweep import LaunchError, differing_keys, flatten, short_names

from rlvr import observe

DEFAULT_METRICS = ("loss", "reward", "heldout_accuracy")
ROW_FIELDS = ("name", "status", "wall_s", "return_code", "step", "workdir", "log")
SUMMARY_COLUMNS = ("heldout_accuracy_before", "heldout_accuracy_after", "improvement_points",
                   "final_reward_mean_last10", "final_loss", "heldout_loss", "heldout_accuracy", "heldout_margin")


def experiment_dir(exp_or_dir: str, root: str = "experiments") -> str:
    """An experiment directory given as a path or as a name under `root`."""
    for candidate in (exp_or_dir, os.path.join(root, exp_or_dir)):
        if os.path.exists(os.path.join(candidate, "experiment.json")):
            return candidate
    raise LaunchError(f"results: no experiment.json in {exp_or_dir!r} or {os.path.join(root, exp_or_dir)!r}; "
                      "give an experiment directory or its name under --root.")


def load_metrics(workdir: str) -> list[dict[str, Any]]:
    """The records of `workdir/metrics.jsonl` (a half-written last line of a running job is skipped)."""
    return observe.read_metrics(workdir)


def lower_is_better(name: str) -> bool:
    return "loss" in name or "perplexity" in name


def final_and_best(metrics: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """{metric: (final, best)} over numeric values; see the module docstring for the rule."""
    series: dict[str, list[float]] = {}
    for record in metrics:
        for name, value in record.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                series.setdefault(name, []).append(float(value))
    return {name: (values[-1], min(values) if lower_is_better(name) else max(values))
            for name, values in series.items()}


def table(exp_dir: str) -> list[dict[str, Any]]:
    """One dict per job, in job order (columns as in the module docstring, plus workdir and log)."""
    return _load(exp_dir)[0]


def _load(exp_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    experiment = records.read_json(os.path.join(exp_dir, "experiment.json"))
    jobs = [records.read_job(os.path.join(exp_dir, "jobs", name)) for name in experiment["jobs"]]
    configs = [flatten(job["config"]) for job in jobs]
    keys = differing_keys(configs)
    return [_row(job, config, keys) for job, config in zip(jobs, configs, strict=True)], keys


def _row(job: dict[str, Any], config: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    status = records.effective_status(job)
    end = job.get("end_time") if status != "running" else None
    if status == "killed" and not end:
        end = job.get("start_time")  # lost with its launcher: the end time is unknown
    metrics = load_metrics(job["workdir"])
    row: dict[str, Any] = {"name": job["name"], **{config_column(k): config.get(k) for k in keys}, "status": status,
                           "wall_s": records.seconds_between(job.get("start_time"), end),
                           "return_code": job.get("return_code"),
                           "step": max((m["step"] for m in metrics if "step" in m), default=None)}
    summary_path = os.path.join(job["workdir"], "summary.json")
    if os.path.exists(summary_path):
        for name, value in records.read_json(summary_path).items():
            if name != "job" and name not in row and (value is None or isinstance(value, (int, float, str))):
                row[name] = value
    for name, (final, best) in sorted(final_and_best(metrics).items()):
        row[f"final/{name}"], row[f"best/{name}"] = final, best
    row["workdir"], row["log"] = job["workdir"], job.get("log")
    return row


def config_column(key: str) -> str:
    """A config key's column: the dotted key, or `config.KEY` where it would clash with a row field."""
    return f"config.{key}" if key in ROW_FIELDS else key


def metric_columns(rows: Sequence[dict[str, Any]], metrics: Sequence[str] | None = None) -> list[str]:
    """The metric columns to show: for each name in `metrics` its final/best pair (metrics.jsonl) or
    its summary column; by default the summary columns and DEFAULT_METRICS present in the rows."""
    present = {key for row in rows for key in row}
    if not metrics:
        chosen = [m for m in DEFAULT_METRICS if f"final/{m}" in present]
        return [c for c in SUMMARY_COLUMNS if c in present] + [f"{k}/{m}" for m in chosen for k in ("final", "best")]
    columns = []
    for name in metrics:
        if f"final/{name}" in present:
            columns += [f"final/{name}", f"best/{name}"]
        elif name in present:
            columns.append(name)
        else:
            available = sorted({k.split("/", 1)[1] for k in present if k.startswith("final/")}
                               | (present & set(SUMMARY_COLUMNS)))
            raise LaunchError(f"--metric={name}: no job has it; available: {available}.")
    return columns


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Plain aligned text: a header line, then one line per row; missing values show as '-'."""
    cells = [list(columns)] + [[_cell(row.get(c), c) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in cells)


def _cell(value: Any, column: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if column == "wall_s" else f"{value:.4g}"
    return str(value)


def write_csv(rows: Sequence[dict[str, Any]], path: str) -> None:
    """Every column of every row (a column a row lacks is empty)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def plot(exp_dir: str, path: str, metrics: Sequence[str]) -> None:
    """A PNG of each metric (from metrics.jsonl) against step, one line per job, labelled by the
    config keys that differ between jobs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, keys = _load(exp_dir)
    short = short_names(keys)
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.6), squeeze=False)
    for ax, name in zip(axes[0], metrics, strict=True):
        for row in rows:
            points = [(m["step"], m[name]) for m in load_metrics(row["workdir"]) if name in m and "step" in m]
            label = ",".join(f"{short[k]}={row[config_column(k)]}" for k in keys) or row["name"]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
        ax.set(xlabel="step", ylabel=name, title=name)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(exp_dir: str, metrics: Sequence[str] | None = None, csv_path: str | None = None,
           plot_path: str | None = None) -> str:
    """The text table (and the CSV / PNG when paths are given) of the `results` command."""
    rows, keys = _load(exp_dir)
    columns = ["name", *map(config_column, keys), "status", "wall_s", "step", *metric_columns(rows, metrics)]
    if csv_path:
        write_csv(rows, csv_path)
    if plot_path:
        names = [c.split("/", 1)[1] for c in columns if c.startswith("final/")]
        if not names:
            raise LaunchError("--plot: no metrics.jsonl metric to plot; choose one with --metric=NAME.")
        plot(exp_dir, plot_path, names)
    return format_table(rows, columns)
