"""Multi-turn episodes through a rollout backend, as token-in/token-out trajectories.

Each model turn is one `generate` call whose input is the episode's exact token history: the
prompt, every token the policy sampled so far, and the observation tokens between turns. The
observation tokens are rendered by the chat template once (the text the template puts after an
assistant turn's end token: the tool-result turn and the next generation prompt) and appended;
nothing already in the history is ever re-tokenised, so the training tokens are the sampled tokens
(re-tokenisation drift is a known failure of multi-turn RL systems; `tests/test_env_rollout.py`
checks it). The loss mask is 1 on sampled tokens only.

Episodes run concurrently, one thread each: a thread blocked in `generate` lets the engine batch
turns from many episodes (continuous batching), and a thread running a sandbox tool does not hold
up the others. `run_episodes` returns the trajectories in job order; the tokens are deterministic
given the seeds (per-turn seeds derived from the episode's), whatever the thread timing.

What the engine batches together does depend on timing (which turns reach it before its next step),
and on several JAX processes every process's engine must run the same batches (SPMD): with
`EpisodeSettings.rounds` the episodes advance in rounds instead (`TurnRounds`): every live episode's
next turn goes to the engine in one call, ordered by request id, once all of them have asked for it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlvr.data.chat import render_text
from rlvr.envs.base import Environment, Trajectory
from rlvr.rollout.types import Completion, Request, SamplingParams

_TURN_SEED_STRIDE = 1_000_003


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    """How episodes are sampled. `max_tokens` bounds prompt + everything after it (rl.seq_len)."""

    max_new_tokens: int  # per model turn
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_turns: int = 0  # 0 = the environment's own limit
    # rl.deterministic_rollout: episodes advance in rounds (`TurnRounds`) and no clock cuts an episode
    # short, so the engine runs the same batches whatever the thread timing (several JAX processes)
    rounds: bool = False


@dataclasses.dataclass(frozen=True)
class EpisodeJob:
    """One episode to run: its task, sampling seed (None = greedy) and request-id prefix."""

    task: Any
    seed: int | None
    rid: str


def prompt_ids(tokenizer, messages: Sequence[Mapping[str, Any]], tools=None) -> list[int]:
    """The episode's opening messages with the template's generation prompt, as ids."""
    return tokenizer.encode(render_text(tokenizer, messages, tools, True))


def _end_text(tokenizer) -> str:
    eos = tokenizer.eos_id
    text = tokenizer.id_to_token(eos) if eos is not None else None
    if not text:
        raise ValueError("multi-turn episodes need a tokenizer with an end-of-turn (eos) token")
    return text


@functools.lru_cache(maxsize=64)
def _observation_text(tokenizer, observation_json: str, tools_json: str) -> str:
    import json

    observation, tools = json.loads(observation_json), json.loads(tools_json)
    end = _end_text(tokenizer)
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    before = render_text(tokenizer, base, tools, False)
    after = render_text(tokenizer, base + observation, tools, True)
    cut = before.rfind(end)
    if cut < 0 or not after.startswith(before[:cut + len(end)]):
        raise ValueError("the chat template is not prefix-stable after an assistant turn (or does not end the "
                         f"turn with {end!r}); multi-turn token-in/token-out rollouts need one that is")
    return after[cut + len(end):]


def observation_ids(tokenizer, observation: Sequence[Mapping[str, Any]], tools=None) -> list[int]:
    """The tokens the chat template puts after a sampled assistant turn (which ended with the eos
    token) for `observation` messages, through the next generation prompt."""
    import json

    return tokenizer.encode(_observation_text(tokenizer, json.dumps(list(observation), sort_keys=True),
                                              json.dumps(tools, sort_keys=True)))


def _turn_seed(seed: int | None, turn: int) -> int | None:
    return None if seed is None else (seed + turn * _TURN_SEED_STRIDE) % (2 ** 31 - 1)


def run_episode(backend, tokenizer, env: Environment, settings: EpisodeSettings, *, seed: int | None,
                rid: str) -> Trajectory:
    """Plays one episode of `env` with the policy behind `backend` (see the module docstring)."""
    start = time.monotonic()
    messages = env.reset()
    tools = env.tools
    prompt = prompt_ids(tokenizer, messages, tools)
    out, mask, logp, versions = [], [], [], []
    turns, truncated, done, stop = [], False, False, ""
    max_turns = min(settings.max_turns or env.max_turns, env.max_turns)
    for turn in range(max_turns):
        budget = min(settings.max_new_tokens, settings.max_tokens - len(prompt) - len(out))
        if budget <= 0:
            truncated, stop = True, "token_budget"
            break
        params = SamplingParams(max_new_tokens=budget, temperature=settings.temperature if seed is not None else 0.0,
                                top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p,
                                sampling_seed=_turn_seed(seed, turn))
        t0 = time.monotonic()
        completion = backend.generate([Request(f"{rid}-turn{turn}", prompt + out, params)])[0]
        generate_s = time.monotonic() - t0
        ids = list(completion.output_ids)
        out += ids
        mask += [1] * len(ids)
        logp += list(completion.output_logprobs)
        versions += list(completion.output_versions)
        finish = completion.finish_reason or {}
        record = {"turn": turn, "tokens": len(ids), "finish": finish, "generate_s": round(generate_s, 4)}
        turns.append(record)
        if finish.get("type") == "abort":
            raise RuntimeError(f"rollout aborted: {finish.get('message')}")
        ended = bool(ids) and ids[-1] == tokenizer.eos_id
        text = tokenizer.decode(ids[:-1] if ended else ids)
        record["text"] = text
        t0 = time.monotonic()
        step = env.step(text)
        record.update(env_s=round(time.monotonic() - t0, 4), observation=step.observation, rewards=step.rewards,
                      info=step.info)
        if step.done:
            done, stop = True, "done"
            break
        if not ended:  # cut mid-turn by the token budget: the template's turn structure is broken
            truncated, stop = True, "token_budget"
            break
        if not settings.rounds and time.monotonic() - start > env.time_budget_s:
            truncated, stop = True, "time_budget"
            break
        obs = observation_ids(tokenizer, step.observation, tools)
        if len(prompt) + len(out) + len(obs) >= settings.max_tokens:
            truncated, stop = True, "token_budget"
            break
        out += obs
        mask += [0] * len(obs)
        logp += [0.0] * len(obs)
        versions += [-1] * len(obs)
    else:
        truncated, stop = True, "turn_limit"
    rewards = dict(env.final_rewards())
    rewards["turns"] = float(len(turns))
    trace = {"rid": rid, "seed": seed, "stop": stop, "done": done, "messages": messages, "tools": tools,
             "wall_s": round(time.monotonic() - start, 4),
             "generate_s": round(sum(t["generate_s"] for t in turns), 4),
             "env_s": round(sum(t.get("env_s", 0.0) for t in turns), 4),
             "turns": turns, "rewards": rewards, "env": env.trace()}
    trajectory = Trajectory(prompt, out, mask, logp, versions, rewards, truncated, len(turns), trace)
    trajectory.validate()
    return trajectory


def failed_trajectory(job: EpisodeJob, error: BaseException) -> Trajectory:
    """An episode that could not run (environment bug, sandbox down): reward 0, the error kept."""
    message = f"{type(error).__name__}: {error}"
    trace = {"rid": job.rid, "seed": job.seed, "stop": "error", "error": message,
             "traceback": traceback.format_exception(error)[-5:]}
    return Trajectory([], [], [], [], [], {"reward": 0.0, "correct": 0.0, "env_error": 1.0}, False, 0, trace)


class TurnRounds:
    """`generate` for episode threads that advances them in rounds: a call blocks until each of the
    `episodes` live episodes has asked for its next turn or ended (`finished`); the round's requests
    then go to `backend` in one call, ordered by request id."""

    def __init__(self, backend, episodes: int):
        self.backend, self.live = backend, episodes
        self._cond = threading.Condition()
        self._asked: dict[str, list[Request]] = {}
        self._answers: dict[str, Any] = {}

    def generate(self, requests: Sequence[Request]) -> list[Completion]:
        key = requests[0].rid
        with self._cond:
            self._asked[key] = list(requests)
            self._run_round()
            while key not in self._answers:
                self._cond.wait()
            answer = self._answers.pop(key)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def finished(self) -> None:
        with self._cond:
            self.live -= 1
            self._run_round()

    def _run_round(self) -> None:
        """(holding the lock) When every live episode has asked: generates the round's turns."""
        if not self._asked or len(self._asked) < self.live:
            return
        asked, self._asked = sorted(self._asked.items()), {}
        try:
            done = iter(self.backend.generate([r for _, requests in asked for r in requests]))
            answers = {key: [next(done) for _ in requests] for key, requests in asked}
        except Exception as e:  # noqa: BLE001 - each episode of the round fails with it (recorded)
            answers = dict.fromkeys((key for key, _ in asked), e)
        self._answers.update(answers)
        self._cond.notify_all()


def run_episodes(backend, tokenizer, jobs: Sequence[EpisodeJob], settings: EpisodeSettings,
                 make_env: Callable[[Any], Environment], workers: int = 64) -> list[Trajectory]:
    """Runs `jobs` concurrently (`workers` threads; with `settings.rounds`, one each, in rounds) and
    returns their trajectories in order. An episode that raises becomes a `failed_trajectory` (its
    error in `trace["error"]`)."""
    rounds = TurnRounds(backend, len(jobs)) if settings.rounds else None

    def play(job: EpisodeJob) -> Trajectory:
        try:
            env = make_env(job.task)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            return failed_trajectory(job, e)
        try:
            trajectory = run_episode(rounds or backend, tokenizer, env, settings, seed=job.seed, rid=job.rid)
        except Exception as e:  # noqa: BLE001
            return failed_trajectory(job, e)
        finally:
            env.close()
        trajectory.trace["task"] = {"family": job.task.family, "index": job.task.index, "level": job.task.level,
                                    "stream": job.task.stream}
        return trajectory

    def one(job: EpisodeJob) -> Trajectory:
        try:
            return play(job)
        finally:
            if rounds is not None:  # ended (or failed): the rounds stop waiting for it
                rounds.finished()

    if not jobs:
        return []
    threads = len(jobs) if rounds is not None else max(1, min(workers, len(jobs)))
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="rlvr-episode") as pool:
        return list(pool.map(one, jobs))
