"""`CadEnv`: write OpenSCAD, run it in the sandbox, look at the result, compare it with the target, answer.

Tools (declared to the chat template):

  run_script(code)          writes model.scad into the episode's workspace and runs OpenSCAD on it in the
                            sandbox: OpenSCAD's errors and warnings, or the mesh's triangles, watertightness,
                            volume and bounding box (measured on the host from the returned STL)
  render(view)              the current mesh's depth image ("top" | "front" | "side") as characters, in the
                            target's frame
  compare(view)             the current mesh's silhouette over the target's ('#' both, '+' extra, '-' missing)
                            and their silhouette IoU: the render-and-compare feedback (`compare=False` drops it)
  measure()                 volume, bounding box, watertightness of the current mesh
  write_file(path, content) a library file for `use <path>` / `include <path>`; a path outside the workspace is
                            refused (a safety penalty)

The episode's workspace persists across steps (rlvr.sandbox.Episode: each run a fresh gVisor sandbox over it);
the target's mesh never enters it. The answer is the final program; `judge` runs it in the same workspace and
scores the mesh on the host (rlvr.domains.cad.verify: the layered terminal score, every measure logged as
`cad.<name>` in the final rewards). Process credit: `compiles` when a run produced a non-empty mesh.

Images: with `artifact_dir` (the RL trainer passes WORKDIR/episode_images), each render and compare, and the
target's and the final mesh's three views, are saved as PNG files named by their content hash; the trace's
"images" list names them (the observations never do, so a replay without the directory sees the same observations).

    user       Model a tube: outer diameter 30 mm, inner diameter 18 mm, height 25 mm. ...
    assistant  <tool_call>{"name": "run_script", "arguments": {"code": "$fn = 32; difference() {...}"}}</tool_call>
    tool       mesh: 256 triangles, watertight, volume 10,120.3 mm^3, bounding box [-15, -15, 0] to [15, 15, 25]
    assistant  <tool_call>{"name": "compare", "arguments": {"view": "top"}}</tool_call>
    tool       silhouette IoU 1.000 (top) ...
    assistant  <answer>$fn = 32; difference() {...}</answer>
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rlvr.domains.cad import render, scad
from rlvr.domains.cad import verify as cv
from rlvr.envs.tool_env import ToolEnv
from rlvr.envs.tools import Refused, Tool, ToolError, call_text, truncate
from rlvr.tasks.base import Task

VIEW_WORDS = {"top": "looking down -z; right = +x, up = +y", "front": "looking along +y; right = +x, up = +z",
              "side": "looking along -x; right = +y, up = +z"}


def opening_messages(description: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": (
        f"{description}\n\nWrite an OpenSCAD program for it. Use the tools: run_script runs a program and reports "
        "errors or the mesh's measures; render and compare show the result (compare: against the target's "
        "silhouette); measure reports volume and bounding box. Give the final program inside <answer></answer> "
        "tags.")}]


def _fmt(values: Any) -> str:
    return "[" + ", ".join(f"{x:g}" for x in values) + "]"


def summary(stl: bytes) -> str:
    m = cv.measure(cv.to_mesh(cv.parse_stl(stl)))
    return (f"mesh: {m['triangles']} triangles, {'watertight' if m['watertight'] else 'NOT watertight'}, "
            f"volume {m['volume']:,.1f} mm^3, bounding box {_fmt(m['bbox_min'])} to {_fmt(m['bbox_max'])}")


class CadEnv(ToolEnv):
    """See the module doc. Options: compare (offer the compare tool), artifact_dir, and the sandbox options."""

    name = "cad"
    uses_sandbox = True
    saves_artifacts = True  # make_env passes artifact_dir
    default_max_turns = 6
    default_time_budget_s = 120.0

    def __init__(self, task: Task, *, compare: bool = True, sandbox: Any = None, artifact_dir: str | None = None,
                 **options: Any):
        self.compare_tool, self.sandbox, self.artifact_dir = compare, sandbox, artifact_dir
        self.stl: bytes | None = None  # the last successful run's mesh
        self.images: list[dict[str, Any]] = []
        self.ep: Any = None
        super().__init__(task, **options)

    def target(self) -> cv.Target:
        return cv.target(scad.target_stl(self.task.metadata["script"]))

    def episode(self) -> Any:
        if self.ep is None:
            from rlvr.sandbox import Episode

            base = self.sandbox.limits if self.sandbox is not None else None
            backend = self.sandbox.backend if self.sandbox is not None else "runsc"
            self.ep = Episode(scad.limits(base), backend, trace_path=False)
        return self.ep

    def make_tools(self) -> dict[str, Tool]:
        def obj(**props: Any) -> dict[str, Any]:
            return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

        view = {"type": "string", "enum": list(render.VIEWS), "description": "which view"}
        tools = {
            "run_script": Tool(self._run_script, "run_script", "Run an OpenSCAD program (saved as model.scad).",
                               obj(code={"type": "string", "description": "the OpenSCAD program"})),
            "render": Tool(self._render, "render", "The current mesh's depth image as characters.", obj(view=view)),
            "measure": Tool(self._measure, "measure", "Volume, bounding box and watertightness of the current mesh.",
                            obj()),
            "write_file": Tool(self._write_file, "write_file", "Write a library file into the workspace.",
                               obj(path={"type": "string", "description": "relative path, e.g. parts.scad"},
                                   content={"type": "string", "description": "the file's text"})),
        }
        if self.compare_tool:
            tools["compare"] = Tool(self._compare, "compare", "The current mesh's silhouette over the target's.",
                                    obj(view=view))
        return tools

    def _run_script(self, code: str) -> str:
        from rlvr.envs.sandboxes import record

        result, stl = scad.run_candidate(code, episode=self.episode())
        self.sandbox_log.append({**record(result, "openscad", 1000), "code": truncate(code, 4000)})
        notes = scad.diagnostics(result.text("stderr"))
        if stl is None:
            why = f"limit hit: {result.limit_hit}" if result.limit_hit else f"exit {result.exit_code}"
            raise ToolError(f"OpenSCAD failed ({why})\n{notes}".strip())
        try:
            text = summary(stl)
        except cv.MeshError as e:
            raise ToolError(f"OpenSCAD's output is not a usable mesh: {e}") from None
        self.stl = stl
        return f"{text}\n{notes}".strip()

    def _current(self) -> np.ndarray:
        if self.stl is None:
            raise ToolError("no mesh yet: run_script a program that builds a solid first")
        return cv.parse_stl(self.stl)

    def _render(self, view: str) -> str:
        image = render.depth_image(self._current(), view, self.target().frame)
        self._save(image, "render", view)
        return f"{view} view ({VIEW_WORDS[view]}; nearer is darker):\n{render.as_text(image)}"

    def _compare(self, view: str) -> str:
        target = self.target()
        image = render.depth_image(self._current(), view, target.frame)
        self._save(image, "compare", view)
        overlap = render.silhouette_iou(image, target.images[view])
        return (f"silhouette IoU {overlap:.3f} ({view} view, {VIEW_WORDS[view]}; '#' both, '+' extra, "
                f"'-' missing):\n{render.compare_text(image, target.images[view])}")

    def _measure(self) -> str:
        self._current()
        return summary(self.stl)

    def _write_file(self, path: str, content: str) -> str:
        from rlvr.sandbox.workspace import check_relative

        try:
            norm = check_relative(path)
        except ValueError as e:
            raise Refused(f"{e} (writes outside the workspace are not allowed)") from None
        if norm == scad.MAIN:
            raise ToolError(f"{scad.MAIN} is what run_script writes; give the library file another name")
        self.episode().write({norm: content})
        return f"wrote {norm} ({len(content.encode())} bytes)"

    def _save(self, image: np.ndarray, kind: str, view: str) -> None:
        entry = {"turn": self.turns, "kind": kind, "view": view, "hash": render.image_hash(image)}
        if self.artifact_dir:
            os.makedirs(self.artifact_dir, exist_ok=True)
            name = f"{entry['hash']}.png"
            path = os.path.join(self.artifact_dir, name)
            if not os.path.exists(path):
                with open(path, "wb") as f:
                    f.write(render.png(image))
            entry["path"] = os.path.join(os.path.basename(self.artifact_dir), name)
        self.images.append(entry)

    def after_calls(self, record: dict[str, Any], rewards: dict[str, float]) -> None:
        if record.get("name") == "run_script" and record["status"] == "ok":
            self.earn("compiles", self.shaping.compiles, rewards)

    def judge(self) -> float:
        target = self.target()
        for view in render.VIEWS:  # what was asked, next to every episode (once per target: named by content)
            self._save(target.images[view], "target", view)
        script = scad.script_of(self.answer) if self.answer is not None else ""  # no answer: every measure logged as 0
        scores, stl = scad.score_script(script, self.task, episode=self.episode() if script else None)
        self.details.update({f"cad.{k}": v for k, v in scores.items() if k != "terminal"})
        if scores["compiles"] and stl is not None:
            for view in render.VIEWS:
                self._save(render.depth_image(cv.parse_stl(stl), view, target.frame), "final", view)
        return scores["terminal"]

    def trace(self) -> dict[str, Any]:
        return {**super().trace(), "images": list(self.images)}

    def options(self) -> dict[str, Any]:
        return {**super().options(), "compare": self.compare_tool}

    def close(self) -> None:
        if self.ep is not None:
            self.ep.close()
        super().close()


def reference_turns(task: Task) -> list[str]:
    """The scripted episode: run the reference program, compare one view and measure, answer with it."""
    script = task.metadata["script"]
    return [call_text("run_script", {"code": script}),
            call_text("compare", {"view": "top"}) + "\n" + call_text("measure", {}),
            f"<answer>\n{script}</answer>"]


__all__ = ["CadEnv", "opening_messages", "reference_turns"]
