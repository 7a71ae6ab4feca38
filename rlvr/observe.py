"""Run records: the resolved config and versions, JSONL metrics, a live progress line."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from importlib import metadata
from typing import Any

import ml_collections

_PACKAGES = ("rlvr", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "ml-collections",
             "numpy", "tokenizers", "safetensors")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def write_run_info(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes config.json (the resolved config) and versions.json to the workdir (process 0 of a
    multi-host job; the others share the workdir)."""
    import jax

    if jax.process_index() != 0:
        return
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2, sort_keys=True))
    info = {"versions": package_versions(), "devices": [str(d) for d in jax.devices()],
            "argv": sys.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(os.path.join(workdir, "versions.json"), "w") as f:
        json.dump(info, f, indent=2)


def writes_shared_files() -> bool:
    """Whether this process writes the workdir's logs and summaries: process 0 of a multi-host job
    (the others hold the same records and share the workdir; two writers would duplicate lines, or
    race on a rewrite)."""
    import jax

    return jax.process_index() == 0


def open_log(path: str, mode: str = "a"):
    """`open(path, mode)` on the process that writes shared files; os.devnull on the others."""
    return open(path if writes_shared_files() else os.devnull, mode)


class MetricsWriter:
    """Appends one JSON object per record to `workdir/metrics.jsonl`, and scalars to
    TensorBoard event files under `workdir/tensorboard` (tensorboardX: no TensorFlow). In a
    multi-host job only process 0 writes (the others' records go nowhere), so the shared
    workdir holds each step once."""

    def __init__(self, workdir: str, filename: str = "metrics.jsonl", tensorboard: bool = True, wandb: str = "",
                 wandb_project: str = "rlvr"):
        import jax

        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, filename)
        self._file = open_log(self.path)
        self._tb = self._wandb = None
        if tensorboard and jax.process_index() == 0:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        if wandb and jax.process_index() == 0:
            self._wandb = wandb_run(workdir, wandb, wandb_project)

    @classmethod
    def for_config(cls, workdir: str, train) -> MetricsWriter:
        """The writer a job's `train.*` settings ask for (tensorboard, wandb)."""
        return cls(workdir, tensorboard=train.tensorboard, wandb=train.wandb, wandb_project=train.wandb_project)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        values = {k: _to_python(v) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": int(step), **values}) + "\n")
        self._file.flush()
        scalars = {name: value for name, value in values.items() if isinstance(value, float)}
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, int(step))
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_run(workdir: str, mode: str, project: str) -> Any:
    """A W&B run logging under workdir/wandb (`mode` offline: no network), its id derived from the workdir
    so a resumed job continues the same run; the resolved config.json as its config when present."""
    try:
        import wandb
    except ImportError:
        raise ImportError("train.wandb is set but wandb is not installed: pip install -e '.[wandb]'") from None
    path = os.path.join(workdir, "config.json")
    config = None
    if os.path.exists(path):
        with open(path) as f:
            config = json.load(f)
    run_id = hashlib.sha256(os.path.abspath(workdir).encode()).hexdigest()[:16]
    return wandb.init(project=project, dir=workdir, mode=mode, id=run_id, name=os.path.basename(workdir.rstrip("/")),
                      config=config, resume="allow")


def read_metrics(workdir: str, filename: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """The records MetricsWriter wrote to `workdir` ([] if none); a half-written last line (a job
    still running, or killed mid-write) is skipped."""
    path = os.path.join(workdir, filename)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


class SampleLog:
    """`workdir/samples.jsonl`: sampled completions with their reward components (a few per RL step,
    every completion of an evaluation), each `{"step", "tag", "family", "level", "task_index",
    "prompt", "completion", "response_tokens", "truncated", "rewards"}`; `show` prints a few, so a
    run says what the model writes. Train samples also carry their per-token record (`token_fields`):
    each output token's text, behaviour log-prob, weight version and loss mask, and the sample's
    advantage, which the run explorer (`rlvr.explore`) colours tokens by. Process 0 of a multi-host
    job writes."""

    def __init__(self, workdir: str, tokenizer, filename: str = "samples.jsonl"):

        self.tokenizer = tokenizer
        self._file = open_log(os.path.join(workdir, filename))

    def records(self, step: int, tag: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`samples` ({family, level, task_index, prompt_ids, output_ids, rewards, truncated}) as records."""
        decode = self.tokenizer.decode
        return [{"step": int(step), "tag": tag, "family": s["family"], "level": int(s["level"]),
                 "task_index": int(s["task_index"]), "prompt": decode(s["prompt_ids"]),
                 "completion": decode(s["output_ids"]), "response_tokens": len(s["output_ids"]),
                 "truncated": bool(s["truncated"]), "rewards": {k: _to_python(v) for k, v in s["rewards"].items()},
                 **token_fields(self.tokenizer, s)}
                for s in samples]

    def write(self, step: int, tag: str, samples: list[dict[str, Any]], show: int = 0) -> None:
        records = self.records(step, tag, samples)
        for record in records:
            self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for record in records[:show]:
            print(describe_sample(record))

    def close(self) -> None:
        self._file.close()


def token_fields(tokenizer, sample: dict[str, Any]) -> dict[str, Any]:
    """The per-token record of a sample that has one (train samples: `behaviour_logp`, `versions`,
    optional `loss_mask`, `advantage`): `tokens` (each output token decoded alone), `logprobs`
    (3 decimals), `versions`, `loss_mask` (multi-turn: 0 marks observation tokens) and `advantage`
    (when the sample has one: not with GAE). Empty for samples without (evaluation records)."""
    if "behaviour_logp" not in sample:
        return {}
    out = {"tokens": [tokenizer.decode([t]) for t in sample["output_ids"]],
           "logprobs": [round(float(v), 3) for v in sample["behaviour_logp"]],
           "versions": [int(v) for v in sample["versions"]]}
    if sample.get("advantage") is not None:
        out["advantage"] = round(float(sample["advantage"]), 4)
    if sample.get("loss_mask") is not None:
        out["loss_mask"] = [int(v) for v in sample["loss_mask"]]
    return out


def describe_sample(record: dict[str, Any], width: int = 300) -> str:
    """Two lines: where the sample is from and its rewards, then the completion (repr, cut at `width`)."""
    rewards = record["rewards"]
    parts = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(rewards.items()) if k != "reward")
    cut = " (truncated)" if record["truncated"] else ""
    completion = record["completion"]
    shown = repr(completion[:width]) + ("..." if len(completion) > width else "")
    where = f"{record['family']} level {record['level']} #{record['task_index']}"
    return (f"[{record['tag']} step {record['step']}] {where}: reward={_fmt(rewards.get('reward'))} ({parts}), "
            f"{record['response_tokens']} tokens{cut}\n    {shown}")


def drop_metrics_after(workdir: str, step: int, filename: str = "metrics.jsonl") -> None:
    """On resume from checkpoint `step`: removes records of later steps, which a killed run wrote
    after its last checkpoint and the resumed run is about to write again. Process 0 only."""
    path = os.path.join(workdir, filename)
    if not writes_shared_files() or not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= step]
    if len(kept) != len(lines):
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)


def _to_python(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


class Progress:
    """A one-line progress display: `step 40/100 [####----] loss=1.23 2.1 it/s`."""

    def __init__(self, total: int, start: int = 0, stream=None, width: int = 24):
        # sys.stderr looked up per bar, not bound at import: a replaced stderr (pytest's capture, a
        # notebook's) may be closed by the next bar's time.
        stream = sys.stderr if stream is None else stream
        self.total, self.start, self.stream, self.width = total, start, stream, width
        self.t0 = time.perf_counter()
        self.tty = stream.isatty()

    def update(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        done = int(self.width * step / max(self.total, 1))
        rate = (step - self.start) / max(time.perf_counter() - self.t0, 1e-9)
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in (metrics or {}).items())
        line = f"step {step}/{self.total} [{'#' * done}{'-' * (self.width - done)}] {shown} {rate:.2f} it/s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _fmt(value: Any) -> str:
    value = _to_python(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)
