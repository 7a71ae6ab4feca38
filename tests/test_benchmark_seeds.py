"""benchmarks/quickstart_seeds.py shares one SFT warm start per seed across RL variants: only when
the variant's overrides leave the warm start unchanged."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import quickstart_seeds  # noqa: E402


def test_a_variant_reuses_the_warm_start_only_when_its_sft_is_the_same(tmp_path):
    """The RL learning rate is RL's alone (SFT uses rl.sft_learning_rate): the variant gets the shared
    warm start. Adam's eps (or the warmup, clipping, data) is SFT's too (rlvr.trainers.rl.warm_start
    copies config.optimizer): such a variant must train its own, not reuse one trained otherwise."""
    spec, root = "configs/vlm.py", str(tmp_path)
    shared = quickstart_seeds.run_dir(root, 0, None, spec).replace("_full_s", "_sft_s")
    os.makedirs(shared)
    open(os.path.join(shared, "summary.json"), "w").close()
    for overrides, reused in (({"optimizer.learning_rate": 1e-3, "rl.prompts_per_step": 16}, True),
                              ({"optimizer.eps": 1e-8}, False), ({"optimizer.warmup_steps": 0}, False),
                              ({"rl.sft_learning_rate": 1e-3}, False), ({"data.image_patches": 64}, False)):
        workdir = quickstart_seeds.run_dir(root, 0, overrides, spec)
        quickstart_seeds._share_warm_start(root, 0, overrides, workdir, spec)
        assert os.path.exists(os.path.join(workdir, "sft", "summary.json")) == reused, overrides


def test_step_figures_read_a_kept_run(tmp_path):
    """The largest log-prob mismatch and the first/last 10 steps' means, from metrics.jsonl (hand-computed)."""
    import json

    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "heldout": 0.5}) + "\n")  # an evaluation record: not a step
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "logprob_mismatch": 1e-7 * (step == 7), "reward": float(step > 10),
                                "entropy": 0.5, "zero_variance_groups": 0.25 * (step > 10)}) + "\n")
    figures = quickstart_seeds.step_figures(str(tmp_path))
    assert figures == {"logprob_mismatch_max": 1e-7, "reward_first10_last10": [0.0, 1.0],
                       "entropy_first10_last10": [0.5, 0.5], "zero_variance_groups_first10_last10": [0.0, 0.25]}
    assert quickstart_seeds.step_figures("") == {}


def test_paired_gain_is_the_mean_difference_with_its_standard_error():
    """RL's gain on the same charts (benchmarks/vlm_answer_probe.py): 1 of 4 charts turns right ->
    +25 points; per-chart differences (100, 0, 0, 0) have sample std 50, so SE 50 / sqrt(4) = 25."""
    import vlm_answer_probe

    assert vlm_answer_probe.paired_gain([0, 1, 0, 1], [1, 1, 0, 1]) == [25.0, 25.0]
    assert vlm_answer_probe.paired_gain([0.2, 0.5], [0.3, 0.6]) == [10.0, 0.0]
