"""Sweeps: one config file plus its `get_sweep()` expanded into jobs, each validated before any runs.

A config module may define `get_sweep()` (or `get_sweep(arg)`, given the `:arg` of the spec) returning
a list of dicts `{"dotted.key": value}` (the big_vision style). Each dict is one job, applied on top of
the overrides common to all jobs (the command line's `--config.a.b=v`). A key set both on the command
line and by the sweep is refused: the sweep would silently be overruled.

`expand` loads and validates every job's config (`rlvr.config_lib.load_config` + `validate`) and
returns an `Experiment` of `Job`s; the local launcher and the cluster target writers
(`rlvr.launch.targets`) both consume that interface. Nothing is written here (see `records`).
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import ml_collections

from rlvr import config_lib


class LaunchError(ValueError):
    """Bad launch input; the message names the flag, job or key and how to fix it."""


@dataclasses.dataclass
class Job:
    """One run of `rlvr.main`: its sweep entry plus the common overrides, resolved config and argv."""

    index: int
    name: str
    overrides: dict[str, Any]  # dotted key -> value (the command line's, then the sweep entry's)
    config: dict[str, Any]  # the resolved config, config.to_dict()
    command: list[str]  # argv: python -m rlvr.main --config=SPEC --workdir=W --config.k=v ...
    workdir: str


@dataclasses.dataclass
class Experiment:
    """All jobs of one launch; `directory` is ROOT/EXP, each job's workdir is ROOT/EXP/jobs/NAME."""

    name: str
    directory: str
    config_spec: str  # "configs/X.py:arg"
    git_revision: str
    jobs: list[Job]
    git_dirty: bool = False
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # common to all jobs
    sweep: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # one entry per job


def expand(config_spec: str, overrides: dict[str, Any], sweep: bool, root: str, name: str | None, *,
           num_devices: int | None = None, python: str = sys.executable) -> Experiment:
    """Builds (does not write) the experiment: one job per sweep entry, or one job without `sweep`.

    Every job's config is loaded and validated first; the first bad one raises LaunchError naming
    the job and the key. `num_devices` is the device count the jobs will see (None: the smallest
    count `config.mesh` allows, for targets whose size is not known here). `python` is argv[0].
    """
    base = load_base_config(config_spec)
    _check_keys(base, overrides, "--config.")
    entries = load_sweep(config_spec) if sweep else [{}]
    for index, entry in enumerate(entries):
        _check_keys(base, entry, f"sweep entry {index} key ")
        both = sorted(set(entry) & set(overrides))
        if both:
            raise LaunchError(f"--config.{both[0]} is also set by sweep entry {index} ({entry}); drop it from "
                              "the command line or from get_sweep().")
    names = job_names(entries)
    directory = os.path.abspath(os.path.join(root, name or default_name(config_spec)))
    jobs = []
    for index, entry in enumerate(entries):
        merged = {**overrides, **entry}
        config = resolve(config_spec, merged, names[index], num_devices)
        workdir = os.path.join(directory, "jobs", names[index])
        jobs.append(Job(index, names[index], merged, config.to_dict(),
                        job_argv(config_spec, merged, workdir, python), workdir))
    revision, dirty = git_state()
    return Experiment(os.path.basename(directory), directory, config_spec, revision, jobs, dirty,
                      dict(overrides), [dict(e) for e in entries])


def job_argv(config_spec: str, overrides: Mapping[str, Any], workdir: str, python: str = "python") -> list[str]:
    """The command running one job; `rlvr.main` parses each `--config.k=v` with the field's type."""
    flags = [f"--config.{key}={format_value(value)}" for key, value in overrides.items()]
    return [python, "-m", "rlvr.main", f"--config={config_spec}", f"--workdir={workdir}", *flags]


def format_value(value: Any) -> str:
    """A value as ml_collections' command-line parsers read it back (bools as true/false)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value) if not isinstance(value, float) else repr(value)
    return repr(value)  # tuples, dicts, None: Python literals


def parse_value(config: ml_collections.ConfigDict, key: str, text: str) -> Any:
    """Parses a command-line `--config.KEY=TEXT` with the existing field's type, as ml_collections does:
    bool (true/false/1/0), int, float, str as given, tuples/dicts/None as Python literals."""
    from absl import flags

    _check_keys(config, {key: text}, "--config.")
    current = _get(config, key)
    parsers = {bool: flags.BooleanParser().parse, int: flags.IntegerParser().parse,
               float: flags.FloatParser().parse, str: str}
    parse = parsers.get(type(current), _literal)
    try:
        value = parse(text)
    except (ValueError, SyntaxError, TypeError) as e:
        raise LaunchError(f"--config.{key}={text!r}: not a valid {type(current).__name__} ({e}).") from None
    if isinstance(current, (tuple, list, dict, ml_collections.ConfigDict)) and not isinstance(
            value, (tuple, list, dict)):
        raise LaunchError(f"--config.{key}={text!r}: expected a {type(current).__name__} literal, e.g. "
                          f"--config.{key}={format_value(current)!r}.")
    return value


def _literal(text: str) -> Any:
    import ast

    try:
        return ast.literal_eval(text)
    except (SyntaxError, ValueError):
        return text


def load_sweep(config_spec: str) -> list[dict[str, Any]]:
    """The config module's `get_sweep()` / `get_sweep(arg)`: a non-empty list of `{dotted key: value}`."""
    path, _, arg = config_spec.partition(":")
    module = _load_module(config_spec)
    get_sweep = getattr(module, "get_sweep", None)
    if get_sweep is None:
        raise LaunchError(f"--sweep: {path} has no get_sweep(); add one returning a list of "
                          '{"dotted.key": value} dicts, or launch without --sweep.')
    entries = get_sweep(arg) if inspect.signature(get_sweep).parameters else get_sweep()
    if not isinstance(entries, list) or not entries:
        raise LaunchError(f"{path}: get_sweep() must return a non-empty list of dicts, got {entries!r}.")
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not all(isinstance(k, str) for k in entry):
            raise LaunchError(f"{path}: get_sweep() entry {index} must be a dict of dotted keys, got {entry!r}.")
    return entries


def resolve(config_spec: str, overrides: Mapping[str, Any], label: str,
            num_devices: int | None = None) -> ml_collections.ConfigDict:
    """Loads the config with `overrides` and validates it; errors name the job `label`."""
    try:
        config = config_lib.load_config(config_spec, dict(overrides))
    except (TypeError, ValueError, AttributeError) as e:
        for key, value in overrides.items():  # name the override that does not fit its field
            try:
                config_lib.load_config(config_spec, {key: value})
            except (TypeError, ValueError, AttributeError) as single:
                raise LaunchError(f"job {label}: {key}={value!r}: {single}") from None
        raise LaunchError(f"job {label}: overrides {dict(overrides)}: {e}") from None
    from rlvr import start  # local: reading a checkpoint's architecture pulls in the tokenizer libraries

    devices = num_devices if num_devices is not None else smallest_mesh(config.mesh)
    try:
        start.validate(config, devices, trainer_names())
    except config_lib.ConfigError as e:
        raise LaunchError(f"job {label}: {e}") from None
    return config


def smallest_mesh(mesh: Mapping[str, int]) -> int:
    """The fewest devices `mesh` tiles: the product of its fixed sizes (a -1 axis takes 1)."""
    return math.prod(size for size in mesh.values() if size != -1)


def job_names(entries: list[dict[str, Any]]) -> list[str]:
    """Short, filesystem-safe, unique names: the index, then the keys whose values differ between
    entries, e.g. `00-learning_rate=0.001,seed=1`."""
    keys = differing_keys(entries)
    short = short_names(keys)
    width = max(2, len(str(len(entries) - 1)))
    names = []
    for index, entry in enumerate(entries):
        parts = [f"{short[k]}={_name_value(entry[k])}" for k in keys if k in entry]
        name = f"{index:0{width}d}" + ("-" + ",".join(parts) if parts else "")
        names.append(re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)[:120])
    return names


def differing_keys(entries: Iterable[Mapping[str, Any]]) -> list[str]:
    """Keys whose values are not the same in every entry (a missing key counts as a value)."""
    entries = list(entries)
    missing = object()
    keys = list(dict.fromkeys(k for entry in entries for k in entry))
    return [k for k in keys if len({_canonical(e.get(k, missing)) for e in entries}) > 1]


def short_names(keys: Iterable[str]) -> dict[str, str]:
    """The last component of each dotted key, or the whole key where two keys share that component."""
    keys = list(keys)
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last, strict=True)}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`; an empty dict stays a leaf."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def default_name(config_spec: str) -> str:
    """`configs/sft_tiny.py:smoke` -> `sft_tiny-smoke-20250101-120000`."""
    path, _, arg = config_spec.partition(":")
    stem = os.path.splitext(os.path.basename(path))[0]
    tag = re.sub(r"[^A-Za-z0-9._-]", "_", arg)
    return "-".join(filter(None, [stem, tag, datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]))


def git_state(path: str | None = None) -> tuple[str, bool]:
    """(revision, dirty) of the git checkout holding `path` (default: the rlvr code that jobs run);
    dirty = tracked files modified. ("unknown", False) outside a checkout."""
    import rlvr

    where = path or os.path.dirname(os.path.dirname(os.path.abspath(rlvr.__file__)))
    try:
        revision = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=30, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    return revision, bool(status.strip())


def _check_keys(config: ml_collections.ConfigDict, overrides: Mapping[str, Any], what: str) -> None:
    valid = _valid_keys(config.to_dict())
    for key in overrides:
        if key not in valid:
            close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
            hint = f' Did you mean "{close[0]}"?' if close else ""
            raise LaunchError(f'{what}"{key}" is not a config field.{hint}')


def _valid_keys(tree: Mapping[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        keys.add(prefix + key)
        if isinstance(value, Mapping):
            keys |= _valid_keys(value, f"{prefix}{key}.")
    return keys


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = node[part]
    return node


def _load_module(config_spec: str):
    path = config_spec.partition(":")[0]
    spec = importlib.util.spec_from_file_location("rlvr_user_config", path)
    if spec is None or not os.path.exists(path):
        raise LaunchError(f"config {config_spec!r}: no config file at {path!r}.")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_base_config(config_spec: str) -> ml_collections.ConfigDict:
    """The config as its file returns it (locked, no overrides)."""
    if not os.path.exists(config_spec.partition(":")[0]):
        raise LaunchError(f"config {config_spec!r}: no config file at {config_spec.partition(':')[0]!r}.")
    try:
        return config_lib.load_config(config_spec)
    except ValueError as e:  # get_config's own refusal, e.g. an unknown variant
        raise LaunchError(f"config {config_spec!r}: {e}") from None


def trainer_names() -> list[str]:
    """The job names `rlvr.main` runs (config.job)."""
    from rlvr.main import TRAINERS  # local: importing trainers pulls in jax (no backend is started)

    return sorted(TRAINERS)


def _name_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=repr)
