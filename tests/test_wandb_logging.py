"""Optional Weights & Biases logging (`train.wandb=offline`): the metrics a job writes to metrics.jsonl
also go to an offline W&B run under the workdir, with no network."""

from __future__ import annotations

import glob
import json
import os
import time

from rlvr import observe


def test_metrics_writer_logs_to_an_offline_wandb_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = observe.MetricsWriter(str(tmp_path), tensorboard=False, wandb="offline", wandb_project="rlvr-test")
    writer.write(1, {"flywheel_probe_loss": 1.875, "note": "text is not a scalar"})
    writer.write(2, {"flywheel_probe_loss": 0.4375})
    writer.close()
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "metrics.jsonl"))]
    assert [r["flywheel_probe_loss"] for r in rows] == [1.875, 0.4375]
    (run_file,) = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
    deadline = time.monotonic() + 30
    while True:  # W&B's service process may still be flushing its record log after finish()
        data = open(run_file, "rb").read()  # protobuf history items with JSON values
        if b"0.4375" in data or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert data.count(b"flywheel_probe_loss") >= 2 and b"1.875" in data and b"0.4375" in data
    assert b"text is not a scalar" not in data
