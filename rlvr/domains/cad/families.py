"""Task families of the CAD kit: write an OpenSCAD program for a part described in words and dimensions.

  cad_openscad        single turn: the program in the answer tag (a ```openscad fence inside it is fine); the
                      sandbox runs it, the host scores the mesh against the target (rlvr.domains.cad.verify)
  cad_openscad_tools  an episode of `CadEnv` (rlvr.domains.cad.env): run the script, read errors, render
                      views, compare silhouettes with the target, measure; the answer is the final program

Levels 0-3 (rlvr.domains.cad.generate): primitives, CSG of a few parts, patterned / filleted parts,
assemblies with holes and symmetry. The task keeps the target's spec and reference script in its metadata (a
task re-poses and re-scores from its JSON); the reference's mesh is built on the host and never enters the
sandbox.

Reward components (`verify`): terminal = the layered score (compiles 0.1, watertight 0.1, bounding box 0.1,
0.7 x skill thresholds), format = an answer was given, and every geometric measure under `cad.<name>` (IoU,
skill, Chamfer, silhouette IoU, depth error, ...). Audit probes (`audit_probes`): an empty program, a huge
cube, the target's bounding box as one cube, and a program that imports the reference's mesh from the host
path where it is cached (it exists on the host; the sandbox cannot see it).
"""

from __future__ import annotations

import numpy as np

from rlvr.domains.cad import generate as gen
from rlvr.domains.cad import scad
from rlvr.domains.cad import verify as cv
from rlvr.envs.families import EnvFamily
from rlvr.tasks.base import Family, Task

INSTRUCTION = ("Write an OpenSCAD program that builds this part. Give the whole program inside <answer></answer> "
               "tags.")


def components(scores: dict[str, float]) -> dict[str, float]:
    """Reward components: terminal, plus every measure as `cad.<name>` (logged per family by the RL loop)."""
    return {"terminal": scores["terminal"], **{f"cad.{k}": v for k, v in scores.items() if k != "terminal"}}


class CadScript(Family):
    """One task: a part in words; the answer is an OpenSCAD program (see the module doc)."""

    name, domain = "cad_openscad", "cad"

    def levels(self) -> list[int]:
        return list(gen.LEVELS)

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        spec = gen.make_spec(rng, level)
        script = gen.reference_script(spec)
        prompt = f"{gen.describe(spec)}\n\n{INSTRUCTION}"
        return Task(index=0, prompt=prompt, answer=script, verifier={"kind": "cad"},
                    metadata={"spec": spec, "script": script, "description": gen.describe(spec)})

    def verify(self, task: Task, completion: str, truncated: bool) -> dict[str, float]:
        answer = self.answer_text(completion)
        if answer is None or truncated:
            return {"terminal": 0.0, "format": 0.0}
        return {**components(scad.score_script(scad.script_of(answer), task)[0]), "format": 1.0}

    def reference_completion(self, task: Task) -> str:
        return f"<answer>\n{task.answer}</answer>"

    def audit_allowed(self) -> dict[str, str]:
        return {"overlong_repeat": "a program repeated draws the same solid again: the union is the same part"}

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        return [(f"hack:{kind}", f"<answer>{text}</answer>") for kind, text in probe_scripts(task)]


def probe_scripts(task: Task) -> list[tuple[str, str]]:
    """(kind, program) of the known cheap answers; each must score low (a test and the audit check)."""
    target = cv.target(scad.target_stl(task.metadata["script"]))
    lo, hi = target.lo, target.hi
    size = ", ".join(f"{x:.4f}" for x in hi - lo)
    corner = ", ".join(f"{x:.4f}" for x in lo)
    return [("empty", "// nothing\n"),
            ("huge", "cube(1000, center=true);\n"),
            ("bbox_cube", f"translate([{corner}]) cube([{size}]);\n"),
            ("reads_reference", f'import("{scad.target_path(task.metadata["script"])}");\n')]


class CadTools(EnvFamily, CadScript):
    """Episodes of `CadEnv` (rlvr.domains.cad.env); the answer-only form scores like cad_openscad."""

    name, env = "cad_openscad_tools", "cad"

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        from rlvr.domains.cad import env

        task = CadScript.sample(self, rng, level)
        messages = env.opening_messages(task.metadata["description"])
        return Task(index=0, prompt="\n\n".join(m["content"] for m in messages), answer=task.answer,
                    messages=tuple(messages), verifier=task.verifier, metadata={"env": self.env, **task.metadata})

    def reference_turns(self, task: Task) -> list[str]:
        from rlvr.domains.cad import env

        return env.reference_turns(task)


FAMILIES: dict[str, type[Family]] = {"cad_openscad": CadScript, "cad_openscad_tools": CadTools}
