"""The multi-turn environment protocol and the trajectory it produces.

An episode alternates model turns and environment observations:

    messages = env.reset()                      # the task's opening messages
    while not done:
        text = <one assistant turn sampled by the policy>
        step = env.step(text)                   # tool calls run, observation messages returned
        messages += [assistant text] + step.observation
    rewards = env.final_rewards()               # terminal + process + format + safety, "reward", "correct"

An environment instance serves exactly one episode (built per task by `rlvr.envs.make_env`).
Reward components follow `rlvr.tasks.base`: terminal (solved), process (useful steps),
format (penalty <= 0 for malformed calls), safety (penalty <= 0 for refused operations);
`final_rewards` returns them plus `reward` (the weighted sum) and `correct` (solved or not).

The rollout side (`rlvr.envs.rollout`) turns an episode into a `Trajectory`: the exact token ids
the model sampled, with the chat template's tool-result tokens appended between turns (never
re-tokenised), and a loss mask that is 1 on sampled tokens only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass
class StepResult:
    """What one model turn leads to."""

    observation: list[dict[str, Any]]  # messages to append (role "tool" or "user"); [] when done
    rewards: dict[str, float]  # per-step components (e.g. {"format": -0.1}); summed over the episode
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # tool calls, outputs, timings


class Environment(Protocol):
    """One episode of a multi-turn task (see the module docstring)."""

    max_turns: int  # model turns before the episode is cut
    # wall-clock budget: the environment bounds its tool calls by it, and the rollout ends an episode
    # (truncated) that has run longer, generation included
    time_budget_s: float

    def reset(self) -> list[dict[str, Any]]:
        """The opening messages (system / user), tools described in `tools`."""

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """JSON-schema tool declarations for the chat template, or None."""

    def step(self, text: str) -> StepResult:
        """Consumes one assistant turn (decoded text) and returns the observation."""

    def final_rewards(self) -> dict[str, float]:
        """Episode reward components plus `reward` and `correct`."""

    def trace(self) -> dict[str, Any]:
        """Everything needed to inspect or replay the episode (tool calls, sandbox commands,
        outputs, timings); JSON-serialisable."""

    def close(self) -> None:
        """Releases the episode's resources (sandbox workspace)."""


@dataclasses.dataclass
class Trajectory:
    """One episode as training data: token-in/token-out, aligned lists over `output_ids`."""

    prompt_ids: list[int]
    output_ids: list[int]  # sampled tokens and observation tokens, in order
    loss_mask: list[int]  # 1 = sampled by the policy, 0 = observation (tool output, template)
    logprobs: list[float]  # behaviour log-prob per output token (0.0 where loss_mask is 0)
    versions: list[int]  # weight version per output token (-1 where loss_mask is 0)
    rewards: dict[str, float]
    truncated: bool  # cut by the token budget or the turn limit before the episode ended
    turns: int = 0
    trace: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> None:
        n = len(self.output_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries for {n} output tokens")
