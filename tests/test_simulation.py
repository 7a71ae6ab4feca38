"""rlvr.launch.simulate: analytic checks of the discrete-event simulation of the RL loop.

Each check has an independent reference: a hand computation, a closed-form queue, an invariant
of the loop (the staleness bound), or a recorded real run (tests/golden/simulation/).
"""

import dataclasses
import math
import os

import numpy as np
import pytest
from rlvr.launch import simulate as S
from rlvr.launch import simulate_calibrate as C
from rlvr.launch.simulate_loop import Sim
from rlvr.launch.simulate_resources import Request

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "simulation", "quickstart_sync")

ENGINE = S.EngineTiming(decode_a=0.1, decode_b=0.02, prefill_a=0.05, prefill_b=0.001, step_overhead_s=0.005,
                        decode_steps=8, prefill_rows=4, prefill_chunk=64)


def one_sample(**changes) -> S.SimulationConfig:
    """One prompt, one sample: no contention anywhere, every time deterministic."""
    task = S.TaskClass(prompt_tokens=S.Dist.const(16), output_tokens=S.Dist.const(17), verify_s=S.Dist.const(0.3))
    base = dict(prompts_per_step=1, group_size=1, tasks=(task,), servers=1, max_slots=4, engine=ENGINE,
                verifier_workers=1, train_fixed_s=0.2, train_per_token_s=0.01, weight_sync_s=0.04, num_steps=4,
                warmup_steps=1)
    return S.SimulationConfig(**{**base, **changes})


def test_one_sample_matches_the_hand_computation():
    # iteration 1: one prefill call (1 row x the small chunk of 64 // 4 = 16 tokens) emits token 1,
    # then a decode call emits 8 more; iteration 2 decodes the last 8 (17 in all)
    prefill = 0.05 + 0.001 * 1 * 16
    decode = 0.1 + 0.02 * 1 + 0.005
    generation = prefill + 2 * decode
    train = 0.2 + 0.01 * (16 + 17)
    step = generation + 0.3 + train + 0.04
    r = S.simulate(one_sample())
    assert r.step_s == pytest.approx(step, rel=1e-9)
    assert r.generate_s == pytest.approx(generation + 0.3, rel=1e-9)
    assert r.verify_s == pytest.approx(0.3, rel=1e-9)  # the scoring left after the last token
    assert r.train_s == pytest.approx(train, rel=1e-9) and r.sync_s == pytest.approx(0.04, rel=1e-9)
    u = r.utilisation
    assert u["trainer"] == pytest.approx((train + 0.04) / step, rel=1e-9)
    assert u["inference_busy"] == pytest.approx(generation / step, rel=1e-9)
    assert u["inference_slots"] == pytest.approx(generation / step / 4, rel=1e-9)
    assert u["verifier"] == pytest.approx(0.3 / step, rel=1e-9)
    assert r.round["util/inference"] == pytest.approx(generation / (generation + 0.3), rel=1e-9)


def test_sync_step_is_generation_plus_verification_plus_train_plus_sync():
    # 16 samples scored after the round (verify_overlap=False) on 4 threads at 0.1 s each: 0.4 s
    task = S.TaskClass(prompt_tokens=S.Dist.uniform(4, 40), output_tokens=S.Dist.uniform(1, 60),
                       verify_s=S.Dist.const(0.1))
    c = one_sample(prompts_per_step=4, group_size=4, tasks=(task,), verifier_workers=4, verify_overlap=False,
                   max_slots=8)
    r = S.simulate(c)
    assert r.verify_s == pytest.approx(0.4, rel=1e-9)
    for s in r.steps:
        assert s["step_s"] == pytest.approx(s["generate_s"] + s["train_s"] + s["sync_s"], rel=1e-9)
        assert s["wait_for_rollout_s"] == pytest.approx(s["generate_s"], rel=1e-9)
    assert r.step_s == pytest.approx(r.generate_s + r.train_s + r.sync_s, rel=1e-9)


def _overlap_config(train_fixed_s: float, mode: str, staleness: int = 1) -> S.SimulationConfig:
    # 8 x 8 samples of 64 tokens on one server: 1 prefill-and-decode + 7 decode iterations ~ 1.0 s
    task = S.TaskClass(prompt_tokens=S.Dist.const(8), output_tokens=S.Dist.const(64))
    engine = S.EngineTiming(decode_a=0.12, prefill_a=0.01, decode_steps=8, prefill_rows=64, prefill_chunk=64,
                            share_prefix=False)
    return S.SimulationConfig(mode=mode, max_staleness=staleness, prompts_per_step=8, group_size=8, tasks=(task,),
                              max_slots=64, engine=engine, train_fixed_s=train_fixed_s, train_per_token_s=0.0,
                              weight_sync_s=0.01, num_steps=12, warmup_steps=3)


@pytest.mark.parametrize("train_s", [0.4, 2.0])
def test_async_overlaps_generation_and_training(train_s):
    sync = S.simulate(_overlap_config(train_s, "sync"))
    generation = sync.generate_s
    assert sync.step_s == pytest.approx(generation + train_s + 0.01, rel=1e-9)
    r = S.simulate(_overlap_config(train_s, "async"))
    steady = [s["step_s"] for s in r.steps[3:-1]]  # the last step has no next batch to overlap
    # the slower of the two, plus at most a weight sync and the engine iteration it waits for
    assert max(generation, train_s) <= min(steady) + 1e-9
    assert max(steady) <= max(generation, train_s) + 0.01 + 0.12 + 1e-9
    assert r.step_s < 0.75 * sync.step_s


def test_colocation_with_full_processor_sharing_removes_the_async_gain():
    # generation ~1.1 s and training 1.1 s on the same devices at half speed each while both run:
    # async then takes about as long as doing them one after the other
    sync = S.simulate(dataclasses.replace(_overlap_config(1.1, "sync"), colocated=1.0))
    free = S.simulate(_overlap_config(1.1, "async"))
    shared = S.simulate(dataclasses.replace(_overlap_config(1.1, "async"), colocated=1.0))
    assert sync.step_s == pytest.approx(S.simulate(_overlap_config(1.1, "sync")).step_s, rel=1e-9)  # no overlap
    assert free.step_s < 0.6 * sync.step_s
    assert shared.step_s == pytest.approx(sync.step_s, rel=0.1)


def test_verification_in_a_sandbox_waits_for_a_sandbox_worker():
    # 4 samples finish together; 4 verifier threads but 1 sandbox worker: 4 x 0.5 s one after another
    task = S.TaskClass(prompt_tokens=S.Dist.const(16), output_tokens=S.Dist.const(9), verify_s=S.Dist.const(0.5),
                       verify_sandbox=True)
    engine = dataclasses.replace(ENGINE, share_prefix=False)  # the twins would start an iteration late
    r = S.simulate(one_sample(group_size=4, tasks=(task,), verifier_workers=4, sandbox_workers=1, engine=engine))
    assert r.verify_s == pytest.approx(2.0, rel=1e-9)
    assert r.utilisation["sandbox"] == pytest.approx(2.0 / r.step_s, rel=1e-9)
    assert r.queues["sandbox"] == pytest.approx((0.5 * 3 + 0.5 * 2 + 0.5 * 1) / r.step_s, rel=1e-9)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_staleness_never_exceeds_the_bound(k):
    task = S.TaskClass(prompt_tokens=S.Dist.uniform(2, 30), output_tokens=S.Dist.lognormal(30, 0.8))
    for train_s in (0.05, 3.0):  # generation-bound, then training-bound (the producer runs k ahead)
        c = dataclasses.replace(_overlap_config(train_s, "async", k), tasks=(task,), num_steps=14, warmup_steps=2)
        r = S.simulate(c)
        assert 0 <= r.staleness["max"] <= k
        if train_s > 1:
            assert r.staleness["max"] == k and r.staleness["histogram"].get(k, 0) > 0.5


def _poisson_sandbox(rate: float, service_mean: float, workers: int, jobs: int, seed: int = 0):
    """Jobs arriving as a Poisson process at the simulation's sandbox pool, exponential service."""
    config = S.SimulationConfig(sandbox_workers=workers)
    sim = Sim(config, S.POLICIES["fifo"])
    sim.window_start = (0.0, {})
    rng = np.random.default_rng(seed)
    gaps, services = rng.exponential(1 / rate, jobs), rng.exponential(service_mean, jobs)
    t = 0.0
    for gap, service in zip(gaps, services, strict=True):
        t += gap
        sim.loop.at(t, lambda s=service: sim.sandboxes.submit(1.0, lambda release, s=s: sim.loop.at(s, release)))
    sim.loop.run(10 * jobs)
    waits = sim.waits["sandbox@1"]
    area = sim.levels.snapshot()
    return float(np.mean(waits)), area["sandbox/queue"] / sim.loop.now, area["sandbox/busy"] / sim.loop.now


def test_sandbox_queue_matches_mm1_and_mm2_closed_forms():
    lam, mu = 0.7, 1.0
    wait, queue, busy = _poisson_sandbox(lam, 1 / mu, 1, 40_000)
    rho = lam / mu
    assert wait == pytest.approx(rho / (mu - lam), rel=0.1)  # M/M/1: Wq = rho / (mu - lambda)
    assert queue == pytest.approx(rho ** 2 / (1 - rho), rel=0.1)  # Lq = lambda Wq
    assert busy == pytest.approx(rho, rel=0.03)
    lam, c = 1.6, 2  # M/M/2, Erlang C
    a = lam / mu
    p_wait = (a ** c / math.factorial(c) * c / (c - a)) / (
        sum(a ** k / math.factorial(k) for k in range(c)) + a ** c / math.factorial(c) * c / (c - a))
    wait, _, _ = _poisson_sandbox(lam, 1 / mu, c, 40_000, seed=1)
    assert wait == pytest.approx(p_wait / (c * mu - lam), rel=0.1)


def test_pool_serves_highest_priority_first():
    sim = Sim(S.SimulationConfig(verifier_workers=1), S.POLICIES["priority"])
    order = []
    for name, priority in [("busy", 1.0), ("low1", 1.0), ("low2", 1.0), ("high1", 3.0), ("mid", 2.0), ("high2", 3.0)]:
        sim.verifiers.submit(priority, lambda release, name=name: (order.append(name), sim.loop.at(1.0, release)))
    sim.loop.run(100)
    assert order == ["busy", "high1", "high2", "mid", "low1", "low2"]


def _mixed_priorities(policy: str, engine_preempt: bool) -> S.SimulationResult:
    low = S.TaskClass("low", weight=3, priority=1, prompt_tokens=S.Dist.const(8), output_tokens=S.Dist.const(200),
                      episodic=True, turns=S.Dist.const(3), tool_s=S.Dist.exp(0.2))
    high = S.TaskClass("high", weight=1, priority=5, prompt_tokens=S.Dist.const(8), output_tokens=S.Dist.const(24),
                       episodic=True, turns=S.Dist.const(3), tool_s=S.Dist.exp(0.2))
    return S.simulate(S.SimulationConfig(prompts_per_step=8, group_size=4, tasks=(low, high), max_slots=6,
                                         engine=ENGINE, sandbox_workers=64, policy=policy,
                                         engine_preempt=engine_preempt, num_steps=6, warmup_steps=1))


def test_priority_admission_and_preemption_cut_high_priority_waiting():
    fifo, prio, preempt = (_mixed_priorities("fifo", False), _mixed_priorities("priority", False),
                           _mixed_priorities("priority", True))
    assert prio.waits["inference@5"] < 0.5 * fifo.waits["inference@5"]
    assert prio.waits["inference@5"] < prio.waits["inference@1"]
    assert preempt.waits["inference@5"] < 0.5 * prio.waits["inference@5"]
    assert preempt.counts["evictions"] > 0 and "evictions" not in prio.counts
    # eviction for a request FIFO would admit after its victim would thrash forever: none happens
    assert "evictions" not in _mixed_priorities("fifo", True).counts


def _late_high_priority_group(preempt: bool) -> tuple[float, float]:
    """Two low-priority groups fill the scheduler's capacity; a high-priority group joins the
    round's queue at 0.3 s. Returns (its dispatch wait, when the round ended)."""
    from rlvr.launch.simulate_loop import Round

    low = S.TaskClass("low", priority=1, prompt_tokens=S.Dist.const(8), output_tokens=S.Dist.const(200))
    high = S.TaskClass("high", priority=5, prompt_tokens=S.Dist.const(8), output_tokens=S.Dist.const(16))
    config = S.SimulationConfig(group_size=4, max_slots=8, engine=ENGINE, tasks=(low, high), preempt=preempt)
    sim = Sim(config, S.POLICIES["priority"])
    sim.window_start, ended = (0.0, {}), []
    groups = [sim.new_group(0, 0, i) for i in range(2)]
    groups = [dataclasses.replace(g, task=low, priority=1.0, outputs=[200] * 4) for g in groups]
    late = dataclasses.replace(sim.new_group(0, 0, 2), task=high, priority=5.0, outputs=[16] * 4)
    round_ = Round(sim, groups, lambda metrics: ended.append(sim.loop.now))
    round_.run()

    def arrive() -> None:
        round_.start = sim.loop.now  # its dispatch wait counts from here
        round_.waiting.append(late)
        round_._step()
    sim.loop.at(0.3, arrive)
    sim.loop.run(100_000)
    return sim.waits["dispatch@5"][0], ended[0]


def test_group_preemption_dispatches_a_late_high_priority_group_at_once():
    waited, ended = _late_high_priority_group(preempt=False)
    waited_p, ended_p = _late_high_priority_group(preempt=True)
    assert waited > 2.0  # behind 200-token samples at 8 tokens per iteration of 0.265 s
    # iteration 0 (0 - 0.259 s): the 2 leaders' prefill call (4 rows x 16) 0.114 + decode 0.145;
    # iteration 1: the 6 twins' 2 prefill calls 0.228 + a decode of 8 0.265, ends at 0.752: the
    # aborted group leaves its slots there and the high-priority group goes in
    assert waited_p == pytest.approx(0.259 + 0.228 + 0.265 - 0.3, rel=1e-9)
    assert ended_p > ended  # the preempted group starts over: the round as a whole takes longer


def test_overlapping_the_rounds_phases_shortens_generation():
    # the producer runs a round's single-turn groups and its episodes at once; run one after the other
    # (the producer before the scheduler), the sandbox-bound episodes no longer hide the generation
    single = S.TaskClass("single", prompt_tokens=S.Dist.const(8), output_tokens=S.Dist.const(64))
    agent = S.TaskClass("agent", prompt_tokens=S.Dist.const(8), output_tokens=S.Dist.const(4), episodic=True,
                        turns=S.Dist.const(2), tool_s=S.Dist.const(2.0))
    base = S.SimulationConfig(prompts_per_step=8, group_size=4, tasks=(single, agent), engine=ENGINE,
                              sandbox_workers=64, num_steps=4, warmup_steps=1)
    serial, overlap = S.simulate(dataclasses.replace(base, overlap_phases=False)), S.simulate(base)
    assert overlap.generate_s < serial.generate_s - 1.0
    assert overlap.generate_s >= 4.0  # an episode: two tool calls of 2 s


def test_a_request_arriving_mid_cruise_is_admitted_at_the_next_iteration():
    engine = S.EngineTiming(decode_a=0.1, prefill_a=0.0, decode_steps=8, prefill_rows=4, prefill_chunk=64)
    sim = Sim(S.SimulationConfig(engine=engine, max_slots=4), S.POLICIES["fifo"])
    sim.window_start = (0.0, {})
    done = {}
    sim.submit(Request(None, 4, 800, 1.0, lambda r: done.setdefault("long", sim.loop.now)))
    sim.loop.at(0.55, lambda: sim.submit(Request(None, 4, 9, 1.0, lambda r: done.setdefault("short", sim.loop.now))))
    sim.loop.run(1000)
    # iterations of 0.1 s: the short one is admitted at 0.6 and needs 2 iterations (1 + 8 tokens)
    assert sim.waits["inference@1"][1] == pytest.approx(0.05)
    assert done["short"] == pytest.approx(0.7)
    assert done["long"] == pytest.approx(0.1 * math.ceil(799 / 8))


def test_calibration_recovers_the_recorded_runs_step_time():
    m = C.measured(GOLDEN)
    config = C.calibrate(GOLDEN, engine=S.EngineTiming(decode_a=0.019, prefill_a=0.0017, prefill_b=2.6e-5),
                         prompt_tokens=S.Dist.const(6))
    assert config.prompts_per_step == 16 and config.group_size == 8 and config.max_slots == 64
    assert config.mode == "sync" and config.train_padded_len == 32
    r = S.simulate(config)
    median = sorted(s for s in [m["step_s_median"]])[0]
    assert r.step_s == pytest.approx(median, rel=0.15)  # fitted on medians; the run is noisy (cv below)
    assert r.utilisation["trainer"] == pytest.approx(m["util/trainer"], abs=0.1)
    assert r.round["util/inference_slots"] == pytest.approx(m["round/util/inference_slots"], abs=0.1)


def test_transfer_keeps_the_timings_and_takes_the_other_runs_structure(tmp_path):
    import json
    import shutil

    base = C.calibrate(GOLDEN, engine=S.EngineTiming(decode_a=0.019), prompt_tokens=S.Dist.const(6))
    other = tmp_path / "other"
    shutil.copytree(GOLDEN, other)
    config = json.loads((other / "config.json").read_text())
    config["rl"].update(mode="async", group_size=4, prompts_per_step=32)
    config["rl"]["engine"]["max_slots"] = 32
    (other / "config.json").write_text(json.dumps(config))
    moved = C.transfer(base, str(other))
    assert (moved.mode, moved.group_size, moved.prompts_per_step, moved.max_slots) == ("async", 4, 32, 32)
    assert moved.engine == base.engine and moved.tasks == base.tasks
    assert moved.train_per_token_s == base.train_per_token_s and moved.weight_sync_s == base.weight_sync_s


def test_same_seed_same_result_other_seed_other_result():
    task = S.TaskClass(prompt_tokens=S.Dist.uniform(4, 40), output_tokens=S.Dist.lognormal(40, 1.0),
                       verify_s=S.Dist.exp(0.01))
    c = S.SimulationConfig(tasks=(task,), num_steps=5, dynamic_sampling=True, mode="async")
    a, b = S.simulate(c).summary(), S.simulate(c).summary()
    assert a == b
    assert S.simulate(dataclasses.replace(c, seed=1)).summary() != a


def test_plan_recommends_the_cheapest_configuration():
    task = S.TaskClass(output_tokens=S.Dist.const(32))
    base = S.SimulationConfig(tasks=(task,), prompts_per_step=8, group_size=8, max_slots=16, num_steps=4,
                              train_per_token_s=1e-4, engine=ENGINE)
    out = S.plan(base, {"servers": [1, 2, 4]}, {"server": 1.0, "trainer": 1.0})
    assert [row["servers"] for row in out["rows"]] == [1, 2, 4]
    assert out["recommended"] == min(out["rows"], key=lambda row: row["cost_per_step"])
    assert out["fastest"]["step_s"] <= out["rows"][0]["step_s"]


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="mode"):
        S.SimulationConfig(mode="asnyc")
    with pytest.raises(ValueError, match="servers"):
        S.SimulationConfig(servers=0)
    with pytest.raises(ValueError, match="Dist.kind"):
        S.Dist("gamma", 1.0)
    with pytest.raises(ValueError, match="policy"):
        S.SimulationConfig(policy="lifo")
    with pytest.raises(ValueError, match="not SimulationConfig fields"):
        S.plan(S.SimulationConfig(), {"server": [1]})
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        C.calibrate(os.path.dirname(GOLDEN))


def test_plan_command_calibrates_on_a_run_and_sweeps_a_grid(capsys):
    from rlvr.launch import __main__ as cli
    from rlvr.launch import plan

    workdir = GOLDEN
    result = plan.run(workdir, {"set.prompts_per_step": "32", "grid.servers": "1,2", "cost.server": "0.5"})
    assert [row["servers"] for row in result["rows"]] == [1, 2] and result["changes"] == {"prompts_per_step": 32}
    one, two = result["rows"]
    assert two["step_s"] <= one["step_s"]  # a second server never slows a generation-bound step
    for row in (one, two):  # cost per step = step time x (trainer 1 + servers x 0.5 + 4 sandboxes x 0.01)
        assert row["cost_per_step"] == pytest.approx(row["step_s"] * (1 + 0.5 * row["servers"] + 0.04), abs=0.05)
    assert result["recommended"] == min(result["rows"], key=lambda row: row["cost_per_step"])
    assert cli.main(["plan", workdir, "--grid.servers=1"]) == 0
    assert "recommended (lowest cost per step)" in capsys.readouterr().out
    assert cli.main(["plan", workdir, "--set.servres=2"]) == 2
    assert "not a simulated setting" in capsys.readouterr().err
