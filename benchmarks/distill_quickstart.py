"""On-policy distillation on the quickstart: an RL-trained teacher distilled into a fresh SFT student.

    .venv/bin/python benchmarks/distill_quickstart.py [--seeds 0,1,2] [--out benchmarks/results/distill_quickstart.json]

Per seed, in a temporary directory: (1) the quickstart (`configs/quickstart.py`: SFT warm start, then
100 GRPO steps) trains the teacher; that run is also "RL alone from the student", since the student is
the same seed's SFT warm start. (2) The same config with `rl.teacher` = the teacher's workdir and
`rl.distill_task_advantage=False` trains a fresh student (the identical warm start) on the teacher's
per-token reverse KL alone (rlvr.rl.distill). Held-out greedy accuracy is evaluated every 10 steps in
both runs; the record holds both curves, the teacher's final accuracy, and for each run the first step
at which it is within 5 points of the teacher's final accuracy (None: never within 100 steps).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402

from rlvr import config_lib  # noqa: E402
from rlvr.main import run  # noqa: E402

EVAL_EVERY, WITHIN = 10, 0.05


def _first_within(evals, target: float):
    return next((step for step, acc, *_ in evals if acc >= target - WITHIN), None)


def one_seed(seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"distill_s{seed}_") as root:
        with contextlib.redirect_stdout(sys.stderr):
            config = config_lib.load_config("configs/quickstart.py", {"seed": seed, "rl.eval_every": EVAL_EVERY})
            teacher = run(config, os.path.join(root, "teacher"))
            config = config_lib.load_config("configs/quickstart.py", {
                "seed": seed, "rl.eval_every": EVAL_EVERY, "rl.teacher": os.path.join(root, "teacher"),
                "rl.distill_task_advantage": False})
            student = run(config, os.path.join(root, "student"))
    target = teacher["heldout_accuracy_after"]
    return {"seed": seed, "teacher_accuracy": target, "student_start_accuracy": student["heldout_accuracy_before"],
            "distilled_accuracy": student["heldout_accuracy_after"],
            "rl_steps_to_within_5_points": _first_within(teacher["evals"], target),
            "distill_steps_to_within_5_points": _first_within(student["evals"], target),
            "rl_curve": teacher["evals"], "distill_curve": student["evals"],
            "wall_s": {"rl": teacher["wall_s"], "distill": student["wall_s"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    runs = [one_seed(int(s)) for s in args.seeds.split(",")]
    record = {"benchmark": "distill_quickstart", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
              "command": " ".join([".venv/bin/python benchmarks/distill_quickstart.py", *(argv or sys.argv[1:])]),
              "config": "configs/quickstart.py", "runs": runs}
    emit(record)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
