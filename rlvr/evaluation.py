"""Held-out evaluation per task family, difficulty level and domain, with pass@1 and pass@k.

One function serves the RL loop's periodic evaluation and the standalone eval job
(`job = "eval"`, e.g. `python -m rlvr.main --config=configs/eval_tasks.py --workdir=DIR`):
`evaluate_tasks` generates `samples` completions per task (greedy when `samples == 1`), scores
them with the tasks' verifiers and aggregates. pass@k uses the unbiased estimator of Chen et al.
(2021): with n samples of which c pass, pass@k = 1 - C(n-c, k) / C(n, k), averaged over tasks.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlvr.rl.host_shards import HostShare
from rlvr.rl.producer import completion_text, passed, prompt_ids, sample_seed, task_images
from rlvr.rollout.types import Request, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with `c` of `n` samples passing (k <= n)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def default_ks(samples: int) -> list[int]:
    """1, 2, 4, … up to `samples` (and `samples` itself)."""
    ks = [k for k in (2**i for i in range(16)) if k <= samples]
    return ks + ([samples] if ks[-1] != samples else [])


def _aggregate(rows: list[dict[str, Any]], ks: Sequence[int]) -> dict[str, float]:
    out = {f"pass@{k}": float(np.mean([pass_at_k(r["n"], r["c"], k) for r in rows])) for k in ks}
    out["tasks"] = float(len(rows))
    out["reward"] = float(np.mean([r["reward"] for r in rows]))
    for key in ("value", "tool_use"):  # any-format accuracy; the share of episodes that called a tool
        if all(key in r for r in rows):
            out[key] = float(np.mean([r[key] for r in rows]))
    return out


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How held-out tasks are generated: `samples` completions per task (greedy when 1, else at
    `temperature`), `max_new_tokens` per completion (per turn in episodes), prompts as raw text or
    chat; tasks whose prompt + max_new_tokens exceeds `max_len` (None: no limit) are left out."""

    max_new_tokens: int
    samples: int = 1
    temperature: float = 1.0
    prompt_format: str = "raw"
    max_len: int | None = None
    max_turns: int = 0  # episodes: cap on the environment's turns (0 = its own)
    episode_workers: int = 64
    deterministic: bool = False  # episodes in rounds (rl.deterministic_rollout; rlvr.envs.rollout.TurnRounds)

    @classmethod
    def for_rl(cls, rl) -> EvalSettings:
        """The RL job's held-out evaluation (`rl.eval_samples`, `rl.eval_temperature`, generation as in training)."""
        return cls(rl.max_new_tokens, rl.eval_samples, rl.eval_temperature, rl.prompt_format, rl.seq_len, rl.max_turns,
                   rl.episode_workers, rl.deterministic_rollout)

    @classmethod
    def for_eval_job(cls, config) -> EvalSettings:
        """The eval job (`eval.samples`, `eval.temperature`, generation settings of `rl.*`)."""
        rl = config.rl
        return cls(rl.max_new_tokens, config.eval.samples, config.eval.temperature, rl.prompt_format, rl.seq_len,
                   deterministic=rl.deterministic_rollout)


def evaluate_tasks(backend, tokenizer, tasks, task_list: Sequence, settings: EvalSettings, *, seed: int = 0,
                   tag: str = "eval", make_env=None, records: list | None = None) -> dict[str, Any]:
    """Generates and scores `settings.samples` completions per task of `task_list` (greedy if 1).

    `tasks` scores (a TaskMixture or a Family). Returns {"overall", "by_family", "by_level",
    "by_domain"}, each with pass@k for k in `default_ks(samples)`, mean reward, task counts,
    and "value" when the family reports it (arithmetic: right number, any format). Tasks whose
    prompt + max_new_tokens exceeds `max_len` are left out and counted in "skipped_too_long".
    Multi-turn tasks (`task.metadata["env"]`) are played as episodes of their environment
    (`make_env`, default rlvr.envs.make_env; `max_new_tokens` per turn, `max_len` per episode).
    `records`, when given, receives every single-turn completion with its rewards (for
    `rlvr.observe.SampleLog`)."""
    from rlvr.rl.producer import is_episode_task

    samples, max_new_tokens, max_len = settings.samples, settings.max_new_tokens, settings.max_len
    greedy = samples == 1
    episode_tasks = [t for t in task_list if is_episode_task(t)]
    requests, prompts, kept = [], [], []
    for t in task_list:
        if is_episode_task(t):
            continue
        ids = prompt_ids(tokenizer, t, settings.prompt_format, getattr(backend, "vision", None))
        if max_len is None or len(ids) + max_new_tokens <= max_len:
            prompts.append(ids)
            kept.append(t)
    skipped = len(task_list) - len(kept) - len(episode_tasks)
    if not kept and not episode_tasks:
        raise ValueError(f"evaluation: all {skipped} prompts are longer than {max_len} - {max_new_tokens} tokens; "
                         "set rl.seq_len=0 and rl.max_prompt_len=0 (derived from the prompts, rlvr.budgets)")
    for t, ids in zip(kept, prompts, strict=True):
        for k in range(samples):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0 if greedy else settings.temperature,
                                    sampling_seed=None if greedy else sample_seed(seed, t.index, k, 1 + t.stream))
            requests.append(Request(f"{tag}-{t.family}-{t.level}-{t.index}-k{k}", ids, params,
                                    image_data=task_images(t)))
    completions = backend.generate(requests) if requests else []
    texts = [completion_text(tokenizer, c) for c in completions]
    hosts = HostShare()  # several processes: task i's completions are verified by process i mod N only
    verdicts = hosts.split(len(kept), lambda i: [tasks.score(kept[i], *text)
                                                 for text in texts[i * samples:(i + 1) * samples]])
    if hosts.processes > 1 and completions:
        print(f"{tag}: process {hosts.process} of {hosts.processes} verified "
              f"{samples * len(range(hosts.process, len(kept), hosts.processes))} of {len(completions)} completions")
    rows = [_row(t, samples, scores) for t, scores in zip(kept, verdicts, strict=True)]
    for n, (c, (_, truncated)) in enumerate(zip(completions, texts, strict=True) if records is not None else ()):
        t = kept[n // samples]
        records.append({"family": t.family, "level": t.level, "task_index": t.index, "prompt_ids": c.prompt_ids,
                        "output_ids": c.output_ids, "rewards": verdicts[n // samples][n % samples],
                        "truncated": truncated})
    if episode_tasks:
        rows += _episode_rows(backend, tokenizer, episode_tasks, settings, seed=seed, tag=tag, make_env=make_env)
    result = summarize(rows, default_ks(samples), _domains(tasks))
    result["skipped_too_long"] = skipped
    return result


def _row(task, samples: int, scores: Sequence[dict[str, float]]) -> dict[str, Any]:
    row = {"family": task.family, "level": task.level, "n": samples, "c": int(sum(passed(s) for s in scores)),
           "reward": float(np.mean([s["reward"] for s in scores]))}
    for key in ("value", "tool_use"):
        if all(key in s for s in scores):
            row[key] = float(np.mean([s[key] for s in scores]))
    return row


def _episode_rows(backend, tokenizer, task_list, settings: EvalSettings, *, seed, tag,
                  make_env) -> list[dict[str, Any]]:
    """One row per multi-turn task: `settings.samples` episodes (greedy when 1)."""
    from rlvr.envs import rollout as episodes

    if make_env is None:
        from rlvr.envs import make_env
    samples = settings.samples
    greedy = samples == 1
    jobs = [episodes.EpisodeJob(t, None if greedy else sample_seed(seed, t.index, k, 1 + t.stream),
                                f"{tag}-{t.family}-{t.level}-{t.index}-k{k}")
            for t in task_list for k in range(samples)]
    episode = episodes.EpisodeSettings(max_new_tokens=settings.max_new_tokens, max_tokens=settings.max_len or 4096,
                                       temperature=settings.temperature, max_turns=settings.max_turns,
                                       rounds=settings.deterministic)
    trajectories = episodes.run_episodes(backend, tokenizer, jobs, episode, make_env, workers=settings.episode_workers)
    return [_row(t, samples, [tr.rewards for tr in trajectories[i * samples:(i + 1) * samples]])
            for i, t in enumerate(task_list)]


def _domains(tasks) -> dict[str, str]:
    return tasks.domains() if hasattr(tasks, "domains") else {tasks.name: tasks.domain or tasks.name}


def summarize(rows: list[dict[str, Any]], ks: Sequence[int], domains: dict[str, str]) -> dict[str, Any]:
    groups: dict[str, dict[Any, list]] = {"by_family": collections.defaultdict(list),
                                          "by_level": collections.defaultdict(list),
                                          "by_domain": collections.defaultdict(list)}
    for r in rows:
        groups["by_family"][r["family"]].append(r)
        groups["by_level"][f"{r['family']}@{r['level']}"].append(r)
        groups["by_domain"][domains.get(r["family"], r["family"])].append(r)
    out: dict[str, Any] = {"overall": _aggregate(rows, ks), "ks": list(ks)}
    for name, group in groups.items():
        out[name] = {key: _aggregate(rs, ks) for key, rs in sorted(group.items())}
    return out


def table(result: dict[str, Any], by: str = "by_level") -> str:
    """A markdown table of one breakdown (by_family, by_level or by_domain) plus the overall row."""
    ks = result["ks"]
    header = f"| {by[3:]} | tasks | " + " | ".join(f"pass@{k}" for k in ks) + " | reward |"
    lines = [header, "|" + "---|" * (len(ks) + 3)]
    for key, agg in [*result[by].items(), ("overall", result["overall"])]:
        cells = " | ".join(f"{agg[f'pass@{k}']:.3f}" for k in ks)
        lines.append(f"| {key} | {int(agg['tasks'])} | {cells} | {agg['reward']:.3f} |")
    return "\n".join(lines)


def balance_report(evals: Sequence[tuple[int, dict[str, float]]], drop: float = 0.1) -> dict[str, Any]:
    """Capability balance over training: held-out pass@1 per domain at each evaluation, and the
    domains that were crowded out (final pass rate `drop` or more below their best while some
    other domain improved on its first evaluation)."""
    domains = sorted({d for _, per in evals for d in per})
    curves = {d: [[step, per[d]] for step, per in evals if d in per] for d in domains}
    improved = {d for d, c in curves.items() if len(c) > 1 and c[-1][1] > c[0][1]}
    crowded = [d for d, c in curves.items()
               if len(c) > 1 and max(v for _, v in c) - c[-1][1] >= drop and improved - {d}]
    return {"domains": curves, "crowded_out": crowded}


def write(workdir: str, result: dict[str, Any], name: str = "eval") -> tuple[str, str]:
    """`workdir/NAME.json` and `workdir/NAME.md` (tables by level, family and domain)."""
    os.makedirs(workdir, exist_ok=True)
    json_path, md_path = os.path.join(workdir, f"{name}.json"), os.path.join(workdir, f"{name}.md")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    with open(md_path, "w") as f:
        for by in ("by_level", "by_family", "by_domain"):
            f.write(f"## {by[3:]}\n\n{table(result, by)}\n\n")
    return json_path, md_path
