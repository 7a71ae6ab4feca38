"""Entry point: `python -m rlvr.main --config=configs/NAME.py[:arg] --workdir=DIR [--config.a.b=v]`.

Every config key with its type, default and meaning: `python -m rlvr.config configs/NAME.py[:arg]`.

A thin main around importable `run(config, workdir)`, so tests and notebooks call the same
function. The config is checked and resolved once, before anything compiles, into a `rlvr.job.Job`
(the starting checkpoint's architecture and tokenizer, the derived budgets, the mesh: rlvr.start) that
the trainers receive; the resolved config, package versions and the tokenizer are written to the
workdir first, so later jobs can start from it alone.
"""

from __future__ import annotations

import os
import sys

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from rlvr import compile_log, config_lib, start
from rlvr.job import resolve
from rlvr.launch import distributed
from rlvr.train.preemption import PREEMPTED_EXIT_CODE, Preempted
from rlvr.trainers import evaluate, preference, rl, sft

TRAINERS = {"sft": sft.train, "dpo": preference.train, "rm": preference.train, "rl": rl.train,
            "eval": evaluate.train}

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file[:arg]; override any key with --config.a.b=value. Every key with its "
    "type, default and meaning: python -m rlvr.config configs/NAME.py[:arg]", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and logs.")


REMOTE_INPUTS = ("init.workdir", "init.hf_checkpoint", "data.path", "data.eval_path")


def run(config: ml_collections.ConfigDict, workdir: str):
    """Validates and resolves `config` (rlvr.start), records it, and runs its job. Returns the job's summary.

    Object storage (rlvr.storage): a remote `workdir` (s3://, gs://) is run in a local working copy and
    uploaded when the job ends; remote inputs (REMOTE_INPUTS) are read from local copies."""
    from rlvr import storage

    for key in REMOTE_INPUTS:
        section, name = key.split(".")
        value = config[section][name]
        if value and storage.is_remote(value):
            config[section][name] = storage.local_copy(value)
    if storage.is_remote(workdir):
        with storage.staged(workdir) as local:
            return run(config, local)
    start.validate(config, jax.device_count(), TRAINERS)
    if jax.process_count() > 1:  # every process drives the same engine: rollout may not depend on timing
        config.rl.deterministic_rollout = True
    job = resolve(config, workdir)  # once: every trainer takes the resolved values from `job`
    start.write_workdir(job.config, workdir)
    compile_log.enable_cache(job.config.compile.cache_dir, job.config.compile.cache_min_compile_s)  # every job
    return TRAINERS[job.config.job](job)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None or not _WORKDIR.value:
        raise app.UsageError("give --config=configs/NAME.py[:arg] and --workdir=DIR")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    # Multi-host JAX (cluster targets set the environment); before any computation, and here rather
    # than in run() so tests and notebooks calling run() never start a distributed client.
    try:
        distributed.initialize_from_env()
    except distributed.DistributedEnvError as e:
        print(f"multi-host set-up error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        run(_CONFIG.value, os.path.expanduser(_WORKDIR.value))
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    except Preempted as e:
        print(e, file=sys.stderr)
        sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    app.run(main)
