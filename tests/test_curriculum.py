"""The curriculum (rlvr.tasks.curriculum) on simulated policies whose skill is known: difficulty
tracks a growing skill and the sampled pass rate stays in the band; floors and mixtures hold;
state resumes exactly."""

import json

import numpy as np
import pytest

from rlvr.tasks.curriculum import Curriculum

LEVELS = list(range(10))


def pass_probability(skill: float, level: int) -> float:
    """A simulated policy: sure on levels well below its skill, hopeless well above."""
    return float(1.0 / (1.0 + np.exp(-2.0 * (skill - level))))


def simulate(curriculum, skill_at, steps, tasks_per_step=16, group=8, seed=0):
    """Runs the sample -> roll out (Bernoulli passes) -> update loop; returns per-step records."""
    rng = np.random.default_rng(seed)
    records = []
    for step in range(steps):
        skill = skill_at(step)
        draws = curriculum.sample(tasks_per_step)
        passes = []
        for family, level in draws:
            group_passes = (rng.random(group) < pass_probability(skill[family], level)).astype(float).tolist()
            curriculum.update(family, level, group_passes)
            passes.append(np.mean(group_passes))
        records.append({"levels": [lv for _, lv in draws], "families": [f for f, _ in draws],
                        "pass_rate": float(np.mean(passes))})
    return records


def test_difficulty_rises_with_skill_and_pass_rate_stays_in_band():
    curriculum = Curriculum({"arith": LEVELS}, band=(0.2, 0.8), seed=0)
    steps = 400
    records = simulate(curriculum, lambda t: {"arith": 8.0 * t / steps}, steps)
    mean_level = [np.mean(r["levels"]) for r in records]
    assert np.mean(mean_level[-50:]) > np.mean(mean_level[:50]) + 4, (mean_level[:5], mean_level[-5:])
    # after the first promotions, every 40-step window's sampled pass rate is inside the band
    windows = [np.mean([r["pass_rate"] for r in records[i:i + 40]]) for i in range(40, steps, 40)]
    assert all(0.2 <= w <= 0.8 for w in windows), windows
    # a fixed-difficulty baseline is not: level 0 ends up trivially easy for this policy
    assert pass_probability(8.0, 0) > 0.99


def test_demotion_when_skill_falls():
    curriculum = Curriculum({"arith": LEVELS}, seed=1)
    simulate(curriculum, lambda t: {"arith": 6.0}, 200)
    high = curriculum.current["arith"]
    simulate(curriculum, lambda t: {"arith": 1.0}, 200)
    assert high >= 4 and curriculum.current["arith"] <= 2, (high, curriculum.current)


def test_floor_keeps_a_starved_domain_sampled_and_mixture_ratios_hold():
    mixture = {"easy": 10.0, "medium": 5.0, "hopeless": 0.0}
    curriculum = Curriculum({f: LEVELS for f in mixture}, mixture=mixture, floor=0.1, seed=2)
    weights = curriculum.family_weights()
    assert weights["hopeless"] == pytest.approx(0.1)
    assert weights["easy"] / weights["medium"] == pytest.approx(2.0)
    assert sum(weights.values()) == pytest.approx(1.0)
    records = simulate(curriculum, lambda t: {"easy": 9.0, "medium": 4.0, "hopeless": -20.0}, 150)
    families = [f for r in records for f in r["families"]]
    share = families.count("hopeless") / len(families)
    assert 0.07 < share < 0.13, share
    assert curriculum.current["hopeless"] == 0  # demoted to (and kept at) its easiest level
    report = {(row["family"], row["level"]): row for row in curriculum.report()}
    assert report[("hopeless", 0)]["zero_variance_groups"] > 0  # all-fail groups are counted


def test_state_round_trips_through_json_and_resumes_exactly():
    def fresh():
        return Curriculum({"a": LEVELS, "b": [1, 3, 5]}, mixture={"a": 2, "b": 1}, seed=3)

    skill = lambda t: {"a": 3.0 + t / 50, "b": 2.0}  # noqa: E731
    uninterrupted = fresh()
    simulate(uninterrupted, skill, 60, seed=7)
    saved = json.loads(json.dumps(uninterrupted.state()))
    expected = simulate(uninterrupted, skill, 30, seed=8)

    resumed = fresh()
    resumed.load_state(saved)
    assert simulate(resumed, skill, 30, seed=8) == expected


@pytest.mark.parametrize("kwargs, field", [({"band": (0.9, 0.1)}, "band"), ({"floor": 1.5}, "floor"),
                                           ({"mixture": {"nope": 1.0}}, "mixture")])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Curriculum({"a": LEVELS, "b": LEVELS}, **kwargs)


def test_arithmetic_levels_fix_operand_digits():
    from rlvr.tasks.arithmetic import ArithmeticFamily

    family = ArithmeticFamily("add", min_digits=1, max_digits=3, seed=0)
    assert family.levels() == [1, 2, 3]
    for level in family.levels():
        for i in range(20):
            task = family.task(i, level=level)
            a, b = task.prompt[:-1].split("+")
            assert len(a) == len(b) == level and task.level == level
            assert int(task.answer) == int(a) + int(b)
    assert family.task(5) == family.task(5)  # no level: the family's own digit range, unchanged
    with pytest.raises(ValueError, match="levels"):
        family.task(0, level=4)


def test_composite_is_locked_until_its_prerequisites_are_mastered():
    """Task graph gating: the composite is never drawn while its prerequisite's pass rate is
    below the threshold, and is drawn (and stays available) once it clears it."""
    curriculum = Curriculum({"atom": LEVELS, "composite": LEVELS}, prerequisites={"composite": ["atom"]},
                            threshold=0.6, min_samples=8, seed=3)
    drawn = {f for f, _ in curriculum.sample(200)}
    assert drawn == {"atom"}
    for _ in range(4):  # mastery 0.5 < 0.6: still locked
        curriculum.update("atom", 0, [1, 0, 1, 0, 1, 0, 1, 0])
    assert {f for f, _ in curriculum.sample(200)} == {"atom"}
    for _ in range(20):
        curriculum.update("atom", 0, [1] * 8)
    assert curriculum.mastery("atom") >= 0.6
    assert "composite" in {f for f, _ in curriculum.sample(200)}
    saved = curriculum.state()
    assert saved["unlocked"] == ["composite"]
    assert any(r["family"] == "atom" and not r["locked"] for r in curriculum.report())


def test_task_graph_rejects_cycles():
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        Curriculum({"a": LEVELS, "b": LEVELS, "c": LEVELS}, prerequisites={"a": ["b"], "b": ["a"]})
