"""Task mixtures, the task graph, experience replay and pass@k evaluation (rlvr.tasks.mixture,
rlvr.tasks.graph, rlvr.rl.replay, rlvr.evaluation), each against a brute-force or hand-checked
reference."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from rlvr import config_lib, evaluation
from rlvr.rl.batching import Sample
from rlvr.rl.replay import ReplayBuffer
from rlvr.tasks import graph
from rlvr.tasks.arithmetic import ArithmeticFamily
from rlvr.tasks.mixture import TaskMixture, build_tasks, expand, parse_task_spec

# ------------------------------------------------------------------------------- mixtures


def test_parse_task_spec_weights_and_errors():
    assert parse_task_spec("add:2, sub ,mul:0.5") == {"add": 2.0, "sub": 1.0, "mul": 0.5}
    with pytest.raises(ValueError, match="weight 'x' of 'add'"):
        parse_task_spec("add:x")


def test_expand_patterns_and_unknown_names():
    assert expand("add,sub") == {"add": 1.0, "sub": 1.0}
    assert set(expand("[as]*")) >= {"add", "sub"}
    with pytest.raises(ValueError, match="'nope' matches no task family"):
        expand("add,nope")


def _mixture(weights, seed=0):
    families = {op: ArithmeticFamily(op, 1, 2, seed=seed) for op in weights}
    return TaskMixture(families, weights, seed)


def test_mixture_draws_families_in_ratio_and_deterministically():
    mixture = _mixture({"add": 3.0, "mul": 1.0})
    tasks = mixture.tasks(0, 4000)
    share = np.mean([t.family == "add" for t in tasks])
    assert abs(share - 0.75) < 0.03
    assert mixture.tasks(100, 5) == tasks[100:105]  # a pure function of the index
    assert all(mixture.score(t, t.answer, False)["correct"] == 1.0 for t in tasks[:50])
    # a task is reproducible from (family, index, stream, level) alone
    t = tasks[7]
    assert mixture.task(t.index, family=t.family, level=t.level) == t


def test_single_family_mixture_is_the_family_itself():
    """The quickstart's determinism: one family means no extra draws."""
    family = ArithmeticFamily("add", 1, 2, seed=4)
    mixture = TaskMixture({"add": family}, seed=4)
    assert mixture.tasks(0, 20) == family.tasks(0, 20)
    assert mixture.held_out(10) == family.tasks(0, 10, stream=1)


def test_held_out_is_stratified_and_disjoint_from_training():
    mixture = _mixture({"add": 5.0, "sub": 1.0, "mul": 1.0})
    held = mixture.held_out(30)
    assert [sum(t.family == f for t in held) for f in ("add", "sub", "mul")] == [10, 10, 10]
    assert all(t.stream == 1 for t in held)


def test_build_tasks_from_config():
    rl = config_lib.rl_config()
    rl.task, rl.format_weight = "add:1,mul:1", 0.0
    mixture = build_tasks(rl, seed=1)
    assert mixture.names == ["add", "mul"] and mixture.domains() == {"add": "arithmetic", "mul": "arithmetic"}


# ------------------------------------------------------------------------------- task graph


def test_graph_restriction_render_and_dot():
    restricted = graph.prerequisites(["arith_expr", "add", "mul", "algebra_linear"])
    assert restricted == {"arith_expr": ("add", "mul"), "algebra_linear": ("arith_expr",)}
    text = graph.render(["arith_expr", "add"], mastery={"add": 0.7}, threshold=0.5)
    assert "arith_expr\n  <- add  pass 0.70 >= 0.5\n  <- sub  (not in this run: ignored)" in text
    assert '"add" -> "arith_expr";' in graph.dot()
    graph.check_acyclic(graph.PREREQUISITES)


def test_every_graph_family_exists():
    from rlvr.tasks.mixture import available_families

    known = set(available_families())
    named = set(graph.PREREQUISITES) | {p for ps in graph.PREREQUISITES.values() for p in ps}
    assert named <= known, sorted(named - known)


# ------------------------------------------------------------------------------- replay


def _sample(group, reward, tokens=(5, 6)):
    return Sample(group, 3, [1, 2], list(tokens), [-0.5] * len(tokens), [0] * len(tokens), False,
                  {"reward": reward, "correct": reward})


def test_replay_keeps_rare_successes_only_and_injects_into_failed_groups():
    task = ArithmeticFamily().task(3)
    buffer = ReplayBuffer(capacity=2, max_pass_rate=0.25, max_uses=2, seed=0)
    buffer.offer(task, [_sample(0, 0.0)] * 4, [0, 0, 0, 0])  # never solved: nothing to replay
    buffer.offer(task, [_sample(0, 1.0)] * 4, [1, 1, 1, 1])  # easy: not kept
    buffer.offer(task, [_sample(0, 0.0), _sample(0, 1.0, (9, 9)), _sample(0, 0.0), _sample(0, 0.0)], [0, 1, 0, 0])
    assert len(buffer.entries) == 1 and buffer.entries[0].success.output_ids == [9, 9]
    (entry,) = buffer.draw(3)
    failed = [_sample(4, 0.0) for _ in range(4)]
    injected = buffer.inject(entry, failed, [0, 0, 0, 0])
    assert injected[:3] == failed[:3] and injected[3].output_ids == [9, 9] and injected[3].group == 4
    assert buffer.inject(entry, failed, [0, 1, 0, 0]) == failed  # a group with a success is left alone
    buffer.draw(1)
    assert not buffer.entries  # used max_uses times
    assert buffer.stats() == {"replay_size": 0.0, "replay_added": 1.0, "replay_reposed": 2.0,
                              "replay_injected": 1.0}


def test_replay_is_bounded_and_state_round_trips():
    family = ArithmeticFamily()
    buffer = ReplayBuffer(capacity=3, seed=1)
    for i in range(5):
        buffer.offer(family.task(i), [_sample(0, 1.0), *[_sample(0, 0.0)] * 7], [1] + [0] * 7)
    assert [e.task.index for e in buffer.entries] == [2, 3, 4]
    copy = ReplayBuffer(capacity=3, seed=99)
    copy.load_state(json.loads(json.dumps(buffer.state())))
    assert [e.task for e in copy.draw(2)] == [e.task for e in buffer.draw(2)]


# ------------------------------------------------------------------------------- pass@k


def _brute_pass_at_k(outcomes, k):
    """Mean over all k-subsets of the samples of 'some sample in the subset passes'."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 1), (8, 3), (8, 0), (8, 8), (10, 2)])
def test_pass_at_k_matches_brute_force(n, c):
    outcomes = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        assert evaluation.pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(outcomes, k), abs=1e-12)
    assert evaluation.pass_at_k(n, c, 1) == pytest.approx(c / n)
    if c < n:
        assert evaluation.pass_at_k(n, c, 1) <= evaluation.pass_at_k(n, c, n)
    with pytest.raises(ValueError, match="pass@"):
        evaluation.pass_at_k(n, c, n + 1)


def test_summarize_and_table():
    rows = [{"family": "add", "level": 1, "n": 4, "c": 4, "reward": 1.0},
            {"family": "add", "level": 2, "n": 4, "c": 1, "reward": 0.25},
            {"family": "mul", "level": 1, "n": 4, "c": 0, "reward": 0.0}]
    result = evaluation.summarize(rows, [1, 4], {"add": "arith", "mul": "arith"})
    assert result["by_level"]["add@2"]["pass@1"] == 0.25 and result["by_level"]["add@2"]["pass@4"] == 1.0
    assert result["by_family"]["add"]["pass@1"] == pytest.approx(0.625)
    assert result["by_domain"]["arith"]["tasks"] == 3.0
    assert result["overall"]["pass@4"] == pytest.approx(2 / 3)
    assert "| add@1 | 1 | 1.000 | 1.000 | 1.000 |" in evaluation.table(result)
    assert evaluation.default_ks(8) == [1, 2, 4, 8] and evaluation.default_ks(6) == [1, 2, 4, 6]


def test_balance_report_flags_a_crowded_out_domain():
    evals = [(0, {"math": 0.2, "code": 0.5}), (10, {"math": 0.6, "code": 0.55}), (20, {"math": 0.8, "code": 0.3})]
    report = evaluation.balance_report(evals)
    assert report["crowded_out"] == ["code"]
    assert report["domains"]["math"] == [[0, 0.2], [10, 0.6], [20, 0.8]]
    assert evaluation.balance_report(evals[:2])["crowded_out"] == []
    assert math.isclose(report["domains"]["code"][1][1], 0.55)


# ------------------------------------------------------------------------------- evaluation pipeline


class ScriptedBackend:
    """Answers sample k of a task correctly iff k < task.index % 4 (the rid carries both)."""

    def __init__(self, tokenizer, mixture):
        self.tokenizer, self.mixture = tokenizer, mixture

    def generate(self, requests):
        from rlvr.rollout.types import Completion

        out = []
        for r in requests:
            _, family, level, index, k = r.rid.rsplit("-", 4)
            task = self.mixture.task(int(index), stream=1, level=int(level), family=family)
            text = task.answer if int(k[1:]) < task.index % 4 else "0"
            ids = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
            out.append(Completion(r.rid, list(r.input_ids), ids, [0.0] * len(ids), [0] * len(ids),
                                  {"type": "stop", "matched": self.tokenizer.eos_id}))
        return out


def test_evaluate_tasks_pass_at_k_per_family_and_level():
    from rlvr.models.tokenizer import byte_level_tokenizer
    from rlvr.trainers.evaluate import eval_task_list

    tokenizer = byte_level_tokenizer()
    mixture = _mixture({"add": 1.0, "mul": 1.0})
    eval_config = config_lib.base_config().eval
    eval_config.levels, eval_config.examples_per_level = "all", 8
    task_list = eval_task_list(mixture, eval_config)
    assert len(task_list) == 2 * 2 * 8  # families × levels × examples
    result = evaluation.evaluate_tasks(ScriptedBackend(tokenizer, mixture), tokenizer, mixture, task_list,
                                       evaluation.EvalSettings(max_new_tokens=8, samples=4), tag="t")
    for key, agg in result["by_level"].items():
        family, level = key.split("@")
        counts = [t.index % 4 for t in task_list if t.family == family and t.level == int(level)]
        for k in (1, 2, 4):
            expected = np.mean([_brute_pass_at_k([True] * c + [False] * (4 - c), k) for c in counts])
            assert agg[f"pass@{k}"] == pytest.approx(expected), (key, k)
    assert result["overall"]["tasks"] == 32.0 and set(result["by_family"]) == {"add", "mul"}


def test_eval_job_writes_tables(tmp_path):
    """`job = "eval"` end to end on a random-init tiny model: per-level pass@k JSON and markdown."""
    from rlvr import main

    config = config_lib.load_config("configs/eval_tasks.py:smoke", {"init.workdir": "", "rl.task": "add,sub",
                                                                    "rl.max_new_tokens": 6})  # no run to inherit from
    result = main.run(config, str(tmp_path))
    with open(tmp_path / "eval.json") as f:
        written = json.load(f)
    assert written["by_level"] == result["by_level"]
    assert set(written["by_level"]) == {"add@1", "add@2", "sub@1", "sub@2"}
    for agg in written["by_level"].values():
        assert agg["tasks"] == 4.0 and agg["pass@1"] <= agg["pass@2"] <= agg["pass@4"]
    assert "| add@1 | 4 |" in (tmp_path / "eval.md").read_text()
    bad = config_lib.load_config("configs/eval_tasks.py:smoke", {"eval.levels": "hard", "init.workdir": ""})
    with pytest.raises(config_lib.ConfigError, match="eval.levels='hard'"):
        config_lib.validate(bad, 1, main.TRAINERS)


def test_eval_job_writes_a_policys_samples_as_sft_data(tmp_path):
    """Off-policy distillation data: the eval job on the training stream writes each completion as a
    `{"prompt", "completion"}` SFT record (the teacher here: a random-init tiny model)."""
    from rlvr import main
    from rlvr.tasks import build_tasks
    from rlvr.tasks.base import HELD_OUT, TRAIN

    out = tmp_path / "teacher.jsonl"
    config = config_lib.load_config("configs/eval_tasks.py:smoke", {
        "init.workdir": "", "rl.task": "add", "rl.max_new_tokens": 6, "eval.levels": "1", "eval.examples_per_level": 3,
        "eval.samples": 2, "eval.split": "train", "eval.sft_out": str(out), "eval.sft_passed_only": False})
    result = main.run(config, str(tmp_path / "eval"))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    family = build_tasks(config.rl, config.seed).families["add"]
    train = [family.task(i, TRAIN, 1).prompt for i in range(3)]
    assert [r["prompt"] for r in rows] == [p for p in train for _ in range(2)] and result["sft_records"] == 6
    assert not set(train) & {family.task(i, HELD_OUT, 1).prompt for i in range(3)}
    logged = [json.loads(line) for line in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [r["completion"] for r in rows] == [s["completion"].removesuffix("<|im_end|>") for s in logged]


def test_reward_model_moments_survive_a_checkpoint_round_trip():
    """The RM term's running normalisation is producer state, so a resumed run scores alike."""
    import types

    import jax.numpy as jnp

    from rlvr.losses import preference as pref
    from rlvr.rl.producer import _moments_state, load_moments

    rm = types.SimpleNamespace(moments=pref.update_moments(pref.init_moments(), jnp.array([1.0, 2.0, 4.0])))
    saved = json.loads(json.dumps(_moments_state(rm)))
    fresh = types.SimpleNamespace(moments=pref.init_moments())
    load_moments(fresh, saved)
    assert saved == {"count": 3.0, "mean": pytest.approx(7 / 3), "m2": pytest.approx(14 / 3)}
    assert all(float(a) == float(b) for a, b in zip(fresh.moments, rm.moments, strict=True))


def test_evaluation_leaves_out_prompts_that_do_not_fit():
    from rlvr.models.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    mixture = _mixture({"add": 1.0})
    task_list = [mixture.task(i, stream=1, level=lv, family="add") for lv in (1, 2) for i in range(4)]
    fits = evaluation.EvalSettings(max_new_tokens=8, samples=2, max_len=8 + 4)  # "9+9=" fits only
    result = evaluation.evaluate_tasks(ScriptedBackend(tokenizer, mixture), tokenizer, mixture, task_list, fits,
                                       tag="t")
    assert result["skipped_too_long"] == 4 and set(result["by_level"]) == {"add@1"}
    with pytest.raises(ValueError, match=r"all 8 prompts are longer.*rl\.seq_len=0 and rl\.max_prompt_len=0"):
        evaluation.evaluate_tasks(ScriptedBackend(tokenizer, mixture), tokenizer, mixture, task_list,
                                  evaluation.EvalSettings(max_new_tokens=8, samples=2, max_len=8), tag="t")
