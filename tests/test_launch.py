"""rlvr.launch: sweep expansion, the local launcher (real jobs as subprocesses) and the results registry."""

import csv
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from rlvr.launch import __main__ as cli
from rlvr.launch import records, results, sweep
from rlvr.launch.sweep import LaunchError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_TINY = os.path.join(REPO, "configs", "sft_tiny.py")
# every job: 2 steps on 128-token rows, no held-out pass, no TensorBoard (seconds each)
FAST = ["--config.data.seq_len=128", "--config.data.eval_path=", "--config.train.tensorboard=false"]

WRAPPER = """
import importlib.util

_spec = importlib.util.spec_from_file_location("sft_tiny", {sft_tiny!r})
_sft_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sft_tiny)
get_config = _sft_tiny.get_config


def get_sweep():
    return {sweep}
"""


def _config_with_sweep(folder, entries) -> str:
    """A config file: sft_tiny's get_config with the given get_sweep() entries."""
    path = os.path.join(folder, "swept.py")
    with open(path, "w") as f:
        f.write(WRAPPER.format(sft_tiny=SFT_TINY, sweep=repr(entries)))
    return path


@pytest.fixture(scope="module")
def job_env(tmp_path_factory):
    """Jobs see one CPU device and share a compilation cache (identical programs compile once)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _launch(args, env, cwd=REPO, timeout=600):
    return subprocess.run([sys.executable, "-m", "rlvr.launch", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _job(exp_dir, name):
    with open(os.path.join(exp_dir, "jobs", name, "job.json")) as f:
        return json.load(f)


# --- expansion -----------------------------------------------------------------------------------

def test_expand_sft_tiny_sweep(tmp_path):
    experiment = sweep.expand(f"{SFT_TINY}:smoke", {"data.seq_len": 128}, True, str(tmp_path), "e", num_devices=1)
    expected = [(0.001, 0), (0.001, 1), (0.003, 0), (0.003, 1)]
    assert [job.name for job in experiment.jobs] == [
        "00-learning_rate=0.001,seed=0", "01-learning_rate=0.001,seed=1",
        "02-learning_rate=0.003,seed=0", "03-learning_rate=0.003,seed=1"]
    assert experiment.directory == str(tmp_path / "e")
    for job, (lr, seed) in zip(experiment.jobs, expected, strict=True):
        assert job.overrides == {"data.seq_len": 128, "optimizer.learning_rate": lr, "seed": seed}
        assert (job.config["optimizer"]["learning_rate"], job.config["seed"]) == (lr, seed)
        assert job.config["data"]["seq_len"] == 128 and job.config["train"]["num_steps"] == 2  # :smoke
        assert job.workdir == str(tmp_path / "e" / "jobs" / job.name)
        assert job.command == [sys.executable, "-m", "rlvr.main", f"--config={SFT_TINY}:smoke",
                               f"--workdir={job.workdir}", "--config.data.seq_len=128",
                               f"--config.optimizer.learning_rate={lr}", f"--config.seed={seed}"]
    single = sweep.expand(f"{SFT_TINY}:smoke", {}, False, str(tmp_path), "one", num_devices=1)
    assert [(job.name, job.overrides) for job in single.jobs] == [("00", {})]


def test_quickstart_sweep_expands_and_validates(tmp_path):
    experiment = sweep.expand(os.path.join(REPO, "configs", "quickstart.py"), {}, True, str(tmp_path), "q",
                              num_devices=8)
    assert [job.name for job in experiment.jobs] == [
        "00-mode=sync,seed=0", "01-mode=sync,seed=1", "02-mode=async,seed=0", "03-mode=async,seed=1"]
    assert [job.config["rl"]["mode"] for job in experiment.jobs] == ["sync", "sync", "async", "async"]


def test_job_names_use_differing_keys_only():
    entries = [{"optimizer.learning_rate": 0.1, "seed": 1, "rl.task": "add"},
               {"optimizer.learning_rate": 0.2, "seed": 1, "rl.task": "add"}]
    assert sweep.job_names(entries) == ["00-learning_rate=0.1", "01-learning_rate=0.2"]
    # two differing keys ending alike keep their full names; a key missing from an entry differs
    clash = [{"data.seq_len": 64, "rl.seq_len": 32}, {"data.seq_len": 96, "rl.seq_len": 16, "rl.pack": True}]
    assert sweep.job_names(clash) == ["00-data.seq_len=64,rl.seq_len=32",
                                      "01-data.seq_len=96,rl.seq_len=16,pack=true"]
    assert sweep.job_names([{"rl.task": "a b/c"}, {"rl.task": "d"}]) == ["00-task=a_b_c", "01-task=d"]
    assert sweep.job_names([{"seed": i} for i in range(101)])[100] == "100-seed=100"
    assert sweep.job_names([{"seed": i} for i in range(101)])[7] == "007-seed=7"


def test_typo_in_sweep_key_names_the_nearest_key(tmp_path):
    spec = _config_with_sweep(tmp_path, [{"seed": 0}, {"optimizer.learnig_rate": 0.1}])
    with pytest.raises(LaunchError, match='sweep entry 1 key "optimizer.learnig_rate".*"optimizer.learning_rate"'):
        sweep.expand(spec, {}, True, str(tmp_path), "e", num_devices=1)
    base = sweep.load_base_config(SFT_TINY)
    with pytest.raises(LaunchError, match='--config."optimzer.learning_rate".*"optimizer.learning_rate"'):
        sweep.parse_value(base, "optimzer.learning_rate", "0.1")


def test_missing_get_sweep_and_conflicts_are_refused(tmp_path):
    tiny = os.path.join(REPO, "configs", "tiny.py")
    with pytest.raises(LaunchError, match="tiny.py has no get_sweep"):
        sweep.expand(tiny, {}, True, str(tmp_path), "e", num_devices=1)
    with pytest.raises(LaunchError, match="--config.seed is also set by sweep entry 0"):
        sweep.expand(SFT_TINY, {"seed": 3}, True, str(tmp_path), "e", num_devices=1)


def test_bad_job_config_refused_before_anything_is_written(tmp_path, capsys):
    spec = _config_with_sweep(tmp_path, [{"seed": 0}, {"seed": 1, "optimizer.schedule": "cosin"}])
    code = cli.main([f"{spec}:smoke", "--sweep", f"--root={tmp_path}", "--exp=bad", "--config.data.batch_size=8"])
    assert code == 2
    err = capsys.readouterr().err
    assert "job 01-seed=1,schedule=cosin" in err and "optimizer.schedule='cosin'" in err and '"cosine"' in err
    assert not os.path.exists(tmp_path / "bad")
    with pytest.raises(LaunchError, match=r"job 00-num_steps=1.5.*train.num_steps"):
        sweep.expand(_config_with_sweep(tmp_path, [{"train.num_steps": 1.5}, {"train.num_steps": 2}]), {}, True,
                     str(tmp_path), "e", num_devices=1)


def test_command_line_values_take_the_field_type():
    base = sweep.load_base_config(SFT_TINY)
    assert sweep.parse_value(base, "train.tensorboard", "false") is False
    assert sweep.parse_value(base, "data.pack", "True") is True
    assert sweep.parse_value(base, "train.num_steps", "12") == 12
    value = sweep.parse_value(base, "optimizer.learning_rate", "2")
    assert value == 2.0 and isinstance(value, float)
    assert sweep.parse_value(base, "data.path", "12") == "12"
    with pytest.raises(LaunchError, match=r"--config.train.num_steps='1.5': not a valid int"):
        sweep.parse_value(base, "train.num_steps", "1.5")
    with pytest.raises(LaunchError, match="not a valid bool"):
        sweep.parse_value(base, "train.tensorboard", "maybe")
    # a value written into a job's argv reads back as the same value
    for key, value in [("optimizer.learning_rate", 3e-5), ("train.tensorboard", True), ("rl.task", "add,mul")]:
        assert sweep.parse_value(base, key, sweep.format_value(value)) == value


def test_launcher_flags_are_checked(tmp_path, capsys):
    assert cli.main([SFT_TINY, "--bogus=1", f"--root={tmp_path}"]) == 2
    assert "unknown flag --bogus" in capsys.readouterr().err
    assert cli.main([SFT_TINY, "--target=nonesuch", f"--root={tmp_path}"]) == 2
    assert "--target=nonesuch is unknown; choose local or one of" in capsys.readouterr().err
    assert cli.main([SFT_TINY, "--parallel=0", f"--root={tmp_path}"]) == 2
    assert "--parallel=0: must be a positive integer" in capsys.readouterr().err
    assert cli.main([SFT_TINY, "--exp", f"--root={tmp_path}"]) == 2
    assert "give a value, --exp=VALUE" in capsys.readouterr().err
    assert not os.listdir(tmp_path)


def test_cluster_target_gets_the_experiment_and_its_options(tmp_path, monkeypatch, capsys):
    from rlvr.launch import targets

    calls = []

    def fake_writer(experiment, options):
        calls.append((experiment, options))
        return [os.path.join(experiment.directory, "manifest.yaml")]

    monkeypatch.setitem(targets.TARGETS, "fake", fake_writer)
    args = [SFT_TINY, "--sweep", "--target=fake", f"--root={tmp_path}", "--exp=c", "--image=x:1",
            "--config.train.num_steps=7"]
    assert cli.main([*args, "--dry_run"]) == 0 and calls == []  # a dry run writes records, prints commands
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python -m rlvr.main")]
    assert len(printed) == 4 and all("--config.train.num_steps=7" in line for line in printed)
    code = cli.main(args)
    assert code == 0, capsys.readouterr().err
    (experiment, options), = calls
    assert options == {"image": "x:1"} and len(experiment.jobs) == 4
    assert all(job.command[0] == "python" and "--config.train.num_steps=7" in job.command for job in experiment.jobs)
    assert f"wrote {tmp_path / 'c' / 'manifest.yaml'}" in capsys.readouterr().out
    with open(tmp_path / "c" / "experiment.json") as f:
        assert json.load(f)["target"] == "fake"
    assert _job(str(tmp_path / "c"), experiment.jobs[0].name)["status"] == "pending"


def test_final_and_best():
    records = [{"step": 1, "loss": 3.0, "reward": 0.1, "eval_perplexity": 9.0, "note": "x"},
               {"step": 2, "loss": 2.0, "reward": 0.5},
               {"step": 3, "loss": 2.5, "reward": 0.3, "eval_perplexity": 11.0}]
    assert results.final_and_best(records) == {"loss": (2.5, 2.0), "reward": (0.3, 0.5),
                                                "eval_perplexity": (11.0, 9.0)}


def test_running_job_whose_launcher_is_gone_reads_killed():
    gone = subprocess.Popen(["true"])
    gone.wait()
    here = {"status": "running", "host": socket.gethostname()}
    assert records.effective_status({**here, "launcher_pid": os.getpid()}) == "running"
    assert records.effective_status({**here, "launcher_pid": gone.pid}) == "killed"
    assert records.effective_status({**here, "host": "elsewhere", "launcher_pid": gone.pid}) == "running"


# --- real jobs (in this order: the failure test's good job fills the compilation cache the sweep reuses)

def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_sigterm_kills_running_jobs(tmp_path, job_env):
    args = [SFT_TINY, f"--root={tmp_path}", "--exp=stop", *FAST]
    launcher = subprocess.Popen([sys.executable, "-m", "rlvr.launch", *args], env=job_env, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job_json = tmp_path / "stop" / "jobs" / "00" / "job.json"
    deadline = time.monotonic() + 300
    while not (job_json.exists() and json.loads(job_json.read_text())["status"] == "running"):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0]
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 128 + signal.SIGTERM, output
    job = json.loads(job_json.read_text())
    assert job["status"] == "killed" and job["return_code"] is not None and job["end_time"]
    with pytest.raises(ProcessLookupError):
        os.kill(job["pid"], 0)


def test_failed_job_is_recorded_and_rerun_resumes(tmp_path, job_env):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [oops\n')
    spec = _config_with_sweep(tmp_path, [{"seed": 0}, {"seed": 1, "data.path": "bad.jsonl"}])
    args = [f"{spec}:smoke", "--sweep", "--parallel=2", "--root=exps", "--exp=fails", *FAST]
    first = _launch(args, job_env, cwd=str(tmp_path))
    assert first.returncode == 1, first.stdout + first.stderr
    exp_dir = str(tmp_path / "exps" / "fails")
    ok, failed = _job(exp_dir, "00-seed=0"), _job(exp_dir, "01-seed=1,path=bad.jsonl")
    assert (ok["status"], failed["status"], failed["return_code"]) == ("succeeded", "failed", 1)
    assert "not valid JSON" in open(failed["log"]).read()
    assert [row["status"] for row in results.table(exp_dir)] == ["succeeded", "failed"]

    shutil.copy(os.path.join(REPO, "configs", "data", "sft_chat_train.jsonl"), bad)  # the fix
    second = _launch(args, job_env, cwd=str(tmp_path))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "skip 00-seed=0" in second.stdout
    again_ok, again = _job(exp_dir, "00-seed=0"), _job(exp_dir, "01-seed=1,path=bad.jsonl")
    assert again_ok == ok  # untouched
    assert (again["status"], again["attempts"], again["previous"]["status"]) == ("succeeded", 2, "failed")


def test_local_sweep_then_results(tmp_path, job_env):
    start = time.perf_counter()
    launched = _launch([f"{SFT_TINY}:smoke", "--sweep", "--parallel=2", f"--root={tmp_path}", "--exp=lr_seed",
                        *FAST], job_env)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    exp_dir = str(tmp_path / "lr_seed")
    rows = results.table(exp_dir)
    assert [row["status"] for row in rows] == ["succeeded"] * 4
    config_keys = set(sweep.flatten(_job(exp_dir, rows[0]["name"])["config"]))
    assert {key for key in rows[0] if key in config_keys} == {"optimizer.learning_rate", "seed"}
    assert [(row["optimizer.learning_rate"], row["seed"]) for row in rows] == [
        (0.001, 0), (0.001, 1), (0.003, 0), (0.003, 1)]
    for row in rows:
        losses = [m["loss"] for m in _metrics(row["workdir"]) if "loss" in m]
        assert row["final/loss"] == losses[-1] and row["best/loss"] == min(losses)
        with open(os.path.join(row["workdir"], "summary.json")) as f:
            assert row["final_loss"] == json.load(f)["final_loss"]
        assert row["step"] == 2 and 0 < row["wall_s"] < time.perf_counter() - start
        job = _job(exp_dir, row["name"])
        assert job["return_code"] == 0 and job["command"][1:3] == ["-m", "rlvr.main"]
        assert "summary:" in open(job["log"]).read()
    assert rows[0]["final/loss"] != rows[1]["final/loss"]  # seeds differ
    with open(os.path.join(exp_dir, "experiment.json")) as f:
        experiment = json.load(f)
    assert len(experiment["sweep"]) == 4 and len(experiment["git_revision"]) in (40, 7)
    assert "succeeded" in launched.stdout.splitlines()[-1]  # the results table closes the launch

    csv_path, png_path = str(tmp_path / "r.csv"), str(tmp_path / "r.png")
    shown = _launch(["results", "lr_seed", f"--root={tmp_path}", f"--csv={csv_path}", f"--plot={png_path}"],
                    job_env)
    assert shown.returncode == 0, shown.stderr
    table_lines = [line for line in shown.stdout.splitlines() if "succeeded" in line]
    assert len(table_lines) == 4 and "learning_rate" in shown.stdout.splitlines()[0]
    with open(csv_path) as f:
        read_back = list(csv.DictReader(f))
    assert [r["name"] for r in read_back] == [row["name"] for row in rows]
    assert [float(r["final/loss"]) for r in read_back] == [row["final/loss"] for row in rows]
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
