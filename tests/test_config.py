"""Bad configs stop before any compile, with errors that name the field and the fix."""

import subprocess

import jax
import pytest

from rlvr import config_lib
from rlvr.main import TRAINERS

TINY = "configs/tiny.py"


def _validate(overrides):
    config = config_lib.load_config(TINY, overrides)
    config_lib.validate(config, jax.device_count(), TRAINERS)


def test_tiny_config_is_valid_and_locked(repo_root):
    config = config_lib.load_config(f"{repo_root}/{TINY}:smoke")
    config_lib.validate(config, 8, TRAINERS)
    assert config.train.num_steps == 4
    with pytest.raises(AttributeError, match="Did you mean"):
        config.data.batch_sise = 3


def test_typo_names_nearest_key():
    with pytest.raises(AttributeError, match='Did you mean "learning_rate"'):
        config_lib.load_config(TINY, {"optimizer.learning_rte": 0.1})


def test_wrong_type_is_rejected():
    with pytest.raises(TypeError, match="batch_size"):
        config_lib.load_config(TINY, {"data.batch_size": "eight"})


@pytest.mark.parametrize("overrides, field", [
    ({"data.batch_size": -8}, "data.batch_size"),
    ({"data.batch_size": 12}, "data.batch_size"),  # not a multiple of data×fsdp = 8
    ({"mesh.tensor": 3}, "mesh"),
    ({"init.hf_checkpoint": "/nonexistent/ckpt"}, "init.hf_checkpoint"),
    ({"optimizer.schedule": "cosin"}, 'Did you mean "cosine"'),
    ({"model.num_kv_heads": 3}, "model.num_kv_heads"),
    ({"model.family": "gpt2"}, "model.family"),
    ({"job": "sftt"}, "job"),
    ({"data.source": "jsonl"}, "data.path"),
    ({"job": "rl", "rl.engine.schedule_policy": "longest"}, "rl.engine.schedule_policy='longest': use one of"),
    ({"job": "rl", "rl.engine.dtype": "bf16"}, "rl.engine.dtype='bf16': use one of 'float32', 'bfloat16'"),
    ({"job": "rl", "rl.engine.replicas": 3}, "rl.engine.replicas=3: must be >= 1 and divide rl.engine.max_slots"),
])
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(config_lib.ConfigError, match=field.replace(".", r"\.")):
        _validate(overrides)


def test_validate_needs_the_architecture_of_a_checkpoint_config(tmp_path):
    """config_lib (the schema) does not read checkpoints: for a config starting from one, validate is told
    the architecture (rlvr.start.validate passes the checkpoint's) or says what to call."""
    config = config_lib.load_config(TINY, {"init.hf_checkpoint": str(tmp_path)})
    with pytest.raises(config_lib.ConfigError, match=r"init\.\* names a checkpoint.*rlvr\.start\.validate"):
        config_lib.validate(config, 8, TRAINERS)
    seen = []
    config_lib.validate(config, 8, TRAINERS, lambda c: seen.append(c) or config_lib.recorded_model(c))
    assert seen == [config]


def test_cli_reports_config_errors_before_compiling(repo_root, python, tmp_path):
    cmd = [python, "-m", "rlvr.main", f"--config={TINY}:smoke", f"--workdir={tmp_path}",
           "--config.data.batch_size=-1"]
    result = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "data.batch_size=-1: must be positive" in result.stderr
    assert not (tmp_path / "checkpoints").exists()
    typo = subprocess.run(cmd[:-1] + ["--config.data.batch_sise=4"], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)
    assert typo.returncode != 0 and 'Did you mean "batch_size"' in typo.stderr


def test_every_key_is_listed_with_type_default_and_meaning():
    from absl import flags

    from rlvr import config as config_cli

    rows = {r["key"]: r for r in config_cli.describe(config_lib.base_config())}
    assert not [k for k, r in rows.items() if r["meaning"] == "(undocumented)"]
    leaves = []

    def walk(node, prefix=""):
        for key, value in node.items():
            walk(value, f"{prefix}{key}.") if hasattr(value, "items") else leaves.append(f"{prefix}{key}")
    walk(config_lib.base_config().to_dict())
    assert sorted(rows) == sorted(leaves)  # every key of the schema, nothing else
    quickstart = {r["key"]: r for r in config_cli.describe(config_lib.load_config("configs/quickstart.py"))}
    row = quickstart["rl.max_new_tokens"]
    assert (row["type"], row["value"], row["default"]) == ("int", 6, 0) and "response budget" in row["meaning"]
    assert quickstart["model.hidden_size"]["type"] == "int" and quickstart["model.hidden_size"]["value"] is None
    assert "python -m rlvr.config" in flags.FLAGS["config"].help  # rlvr.main --help points at the listing
