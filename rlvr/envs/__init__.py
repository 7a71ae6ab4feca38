"""Multi-turn environments with tools: the protocol (base), tools and their parser, the environments.

    env = make_env(task, **options)      # dispatches on task.metadata["env"]
    messages = env.reset()               # opening messages; env.tools: JSON-schema declarations or None
    step = env.step(assistant_text)      # StepResult(observation, rewards, done, info)
    rewards = env.final_rewards()        # terminal, format, process, safety, reward, correct (+ process.* detail)
    env.trace(); env.close()

Environments (`ENVIRONMENTS`):

  tool_calc     ToolUseEnv     arithmetic with a calculator (compact mode for tiny byte-level models)
  code_repair   CodeRepairEnv  fix a bug in a sandboxed repository until its tests pass
  tool_state    ToolStateEnv   bank / file-store goals that need queries, judged by the final state
  finance_docs  FinanceDocsEnv a generated filing behind search / PDF-table / calculator tools
                               (the finance domain kit, rlvr.domains.finance)
  cad           CadEnv         OpenSCAD in the sandbox, renders and silhouette comparison with a target
                               (the CAD domain kit, rlvr.domains.cad)

Their task families (rlvr.envs.families, registered in rlvr.tasks.registry): tool_calc,
tool_calc_compact, code_repair, code_repair_humaneval, tool_state.

`make_env` options (all optional; those an environment does not use are ignored):

  max_turns, time_budget_s   the episode's turn limit and tool-time budget (0 / None: the env's default)
  weights                    RewardWeights of the final reward (default ENV_WEIGHTS: all components count)
  shaping                    Shaping: penalty and process-credit sizes
  backend                    sandbox backend (default: RLVR_CODE_EXECUTOR, else "runsc")
  limits                     rlvr.sandbox.Limits (or its JSON dict) of one sandboxed run
  sandbox_workers            N > 0: stateless runs go to a process-wide warm pool of N sandboxes
  pool                       an explicit rlvr.sandbox Executor for stateless runs (overrides the above)
  sandbox_trace              the sandbox's own JSONL trace path (default: none; the episode trace has it all)
  artifact_dir               where environments that save files (images: cad) write them (the RL trainer
                             passes WORKDIR/episode_images); ignored by the others
  env-specific: compact, python, require_tool (tool_calc); python_tool, snapshot_dir (code_repair)

Modules: base (protocol, Trajectory), tools (Tool, @tool, parse_turn), calculator, tool_env (ToolEnv: the
turn loop, rewards, traces), tool_use, code_repair (+ repos: repositories and the host judge, bugs: bug
injection, humaneval_bugs.jsonl: the validated table, build_humaneval_bugs: its builder and loader),
tool_state, sandboxes (pools, templates), families, rollout (episodes as token-in/token-out trajectories).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlvr.envs.base import Environment, StepResult, Trajectory
from rlvr.envs.code_repair import CodeRepairEnv
from rlvr.envs.tool_env import ENV_WEIGHTS, Shaping, ToolEnv
from rlvr.envs.tool_state import ToolStateEnv
from rlvr.envs.tool_use import ToolUseEnv
from rlvr.envs.tools import Refused, Tool, ToolError, parse_turn, tool

ENVIRONMENTS: dict[str, type[ToolEnv]] = {
    "tool_calc": ToolUseEnv,
    "code_repair": CodeRepairEnv,
    "tool_state": ToolStateEnv,
}
# the domain kits' environments (rlvr.domains), imported when first used: a kit builds on rlvr.envs, so
# importing it here would be circular
DOMAIN_ENVIRONMENTS = {"finance_docs": ("rlvr.domains.finance.env", "FinanceDocsEnv"),
                       "cad": ("rlvr.domains.cad.env", "CadEnv")}
_SANDBOXED = (ToolUseEnv, CodeRepairEnv)


def environment_class(name: str) -> type[ToolEnv]:
    """The environment class called `name` (ENVIRONMENTS, then DOMAIN_ENVIRONMENTS)."""
    if name in DOMAIN_ENVIRONMENTS:
        import importlib

        module, attribute = DOMAIN_ENVIRONMENTS[name]
        return getattr(importlib.import_module(module), attribute)
    return ENVIRONMENTS[name]


def make_env(task: Any, *, max_turns: int | None = None, time_budget_s: float | None = None, weights: Any = None,
             shaping: Shaping | None = None, backend: str | None = None, limits: Any = None, sandbox_workers: int = 0,
             pool: Any = None, sandbox_trace: str | bool | None = False, artifact_dir: str | None = None,
             **env_options: Any) -> Environment:
    """The environment of `task` (see the module doc for the options)."""
    name = task.metadata.get("env") if isinstance(task.metadata, Mapping) else None
    if name not in ENVIRONMENTS and name not in DOMAIN_ENVIRONMENTS:
        raise ValueError(f"task {task.family!r}/{task.index}: metadata['env'] is {name!r}; known environments: "
                         f"{sorted([*ENVIRONMENTS, *DOMAIN_ENVIRONMENTS])}")
    cls = environment_class(name)
    options: dict[str, Any] = {"max_turns": max_turns or None, "time_budget_s": time_budget_s or None,
                               "weights": weights, "shaping": shaping, **env_options}
    if issubclass(cls, _SANDBOXED) or getattr(cls, "uses_sandbox", False):
        from rlvr.envs.sandboxes import SandboxOptions

        if isinstance(limits, Mapping):
            from rlvr.sandbox import Limits

            limits = Limits(**dict(limits))
        options["sandbox"] = SandboxOptions(backend, limits, sandbox_workers, pool, sandbox_trace)
    if artifact_dir and getattr(cls, "saves_artifacts", False):
        options["artifact_dir"] = artifact_dir
    return cls(task, **options)


def play(env: Environment, turns: Sequence[str]) -> list[dict[str, Any]]:
    """Plays scripted assistant turns through `env`: the conversation (opening messages, then each turn's
    text as an assistant message followed by its observation messages), until the episode ends."""
    messages = env.reset()
    for text in turns:
        step = env.step(text)
        messages.append({"role": "assistant", "content": text})
        messages += step.observation
        if step.done:
            break
    return messages


__all__ = ["DOMAIN_ENVIRONMENTS", "ENVIRONMENTS", "ENV_WEIGHTS", "CodeRepairEnv", "Environment", "Refused", "Shaping",
           "StepResult", "Tool", "ToolEnv", "ToolError", "ToolStateEnv", "ToolUseEnv", "Trajectory",
           "environment_class", "make_env", "parse_turn", "play", "tool"]
