"""Ahead-of-time compile for a target mesh: memory is reported without allocating anything."""

import subprocess

from rlvr import config_lib
from rlvr.aot import analyze


def test_fsdp_divides_parameter_memory_per_device():
    base = {"data.batch_size": 8, "data.seq_len": 64}
    replicated = analyze(config_lib.load_config("configs/sft_tiny.py", {**base, "mesh.data": 8}))
    fsdp = analyze(config_lib.load_config("configs/sft_tiny.py", {**base, "mesh.data": 1, "mesh.fsdp": 8}))
    assert replicated["devices"] == fsdp["devices"] == 8
    # Arguments are params + optimizer state (+ a small batch): about 3x the param bytes.
    param_bytes = replicated["param_bytes_total"]
    assert replicated["per_device_bytes"]["argument"] > 2.9 * param_bytes
    assert fsdp["per_device_bytes"]["argument"] < 0.5 * param_bytes


def test_cli_refuses_a_job_that_does_not_fit(repo_root, python):
    cmd = [python, "-m", "rlvr.aot", "--config=configs/dpo_tiny.py", "--devices=16", "--config.mesh.data=16",
           "--config.data.batch_size=16", "--hbm_gib=0.001"]
    result = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert '"devices": 16' in result.stdout and "will not fit" in result.stderr
