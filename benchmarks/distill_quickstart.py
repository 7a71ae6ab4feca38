"""On-policy distillation on the quickstart: an RL-trained teacher distilled into a fresh SFT student.

    .venv/bin/python benchmarks/distill_quickstart.py [--seeds 0,1,2] [--set optimizer.learning_rate=3e-3] \
        [--steps 100 --eval_every 4] [--teacher_steps 200] [--root workdirs/issue22] \
        [--out benchmarks/results/distill_quickstart.json --plot benchmarks/results/distill_quickstart.png]

Per seed: (1) the quickstart (`configs/quickstart.py`: SFT warm start, then 100 GRPO steps, held-out
greedy accuracy every 10 steps; with `--teacher_steps N` the same run trained N steps, resumed from the
100-step run under `--root`) trains the teacher; its final accuracy is the target (with
`--best_teacher`: its kept checkpoint with the best held-out accuracy is the teacher, and that accuracy
the target). (2) RL alone from
the student: the same run (the student is the same seed's SFT warm start), `--steps` steps with
evaluation every `--eval_every` (the teacher's own first steps, deterministic, evaluated more often).
(3) The same config with `rl.teacher` = the teacher's workdir, `rl.distill_task_advantage=False` and the
`--set` overrides trains a fresh student (the identical warm start) on the teacher's per-token reverse
KL alone (rlvr.rl.distill), also `--steps` steps, evaluated as often. The record holds the curves and,
for (2) and (3), the first evaluated step within 5 points of the target (None: never in the steps run;
RL alone's also on the teacher's own run, which is RL alone from the same student for longer), the
first step from which three consecutive evaluations average within 5 points, and the mean held-out
accuracy over the evaluations after step 0.
With `--root` the runs are kept and reused (the teacher is `quickstart_seeds.py --root DIR --set
rl.eval_every=10`'s full run of the seed), else they live in a temporary directory.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import sys
import tempfile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import emit  # noqa: E402
from quickstart_seeds import _override, run_dir, run_seed  # noqa: E402

EVAL_EVERY, WITHIN = 10, 0.05


def _first_within(evals, target: float):
    return next((step for step, acc, *_ in evals if acc >= target - WITHIN), None)


def _first_within_smoothed(evals, target: float, span: int = 3):
    """The first evaluated step from which the mean of `span` consecutive evaluations is within 5 points
    of `target` (one evaluation on 256 problems moves by about ±3 points): a less noisy crossing."""
    after = [(step, acc) for step, acc, *_ in evals if step]
    return next((after[i][0] for i in range(len(after) - span + 1)
                 if sum(acc for _, acc in after[i:i + span]) / span >= target - WITHIN), None)


def _mean_after_start(evals) -> float:
    return round(sum(acc for step, acc, *_ in evals if step) / max(sum(1 for step, *_ in evals if step), 1), 4)


def best_checkpoint(workdir: str, evals) -> tuple[int, float]:
    """(step, held-out accuracy) of the run's kept checkpoint with the best held-out evaluation."""
    kept = {int(name) for name in os.listdir(os.path.join(workdir, "checkpoints")) if name.isdigit()}
    return max(((step, acc) for step, acc, *_ in evals if step in kept), key=lambda e: e[1])


def train_teacher(seed: int, spec: str, root: str, teacher_steps: int) -> tuple[dict, dict]:
    """(overrides, summary) of the seed's quickstart GRPO run trained `teacher_steps` steps (0: the
    config's own). A longer run under a kept `root` resumes a copy of the config-length run's workdir
    (its checkpoint and record), so its first steps are that run's."""
    plain = {"rl.eval_every": EVAL_EVERY, **({"train.num_steps": teacher_steps} if teacher_steps else {})}
    if teacher_steps and root:
        short, long = run_dir(root, seed, {"rl.eval_every": EVAL_EVERY}, spec), run_dir(root, seed, plain, spec)
        if os.path.exists(os.path.join(short, "summary.json")) and not os.path.exists(long):
            shutil.copytree(short, long, ignore=shutil.ignore_patterns("summary.json"))
    return plain, run_seed(seed, spec, plain, root)


def one_seed(seed: int, root: str, student_overrides: dict, spec: str = "configs/quickstart.py",
             steps: int = 0, fine_eval: int = EVAL_EVERY, best_teacher: bool = False,
             teacher_steps: int = 0) -> dict:
    """One seed's teacher (the quickstart's own GRPO run, 100 steps or `teacher_steps`; with
    `best_teacher` its kept checkpoint with the best held-out accuracy, else its last), RL alone from
    the student and the distilled student (both `steps` steps, 0 = the teacher's, evaluated every
    `fine_eval`), all kept under `root` (quickstart_seeds.py --root shares the teacher)."""
    plain, teacher = train_teacher(seed, spec, root, teacher_steps)
    teacher_dir = run_dir(root, seed, plain, spec)
    teacher_step, target = teacher["final_step"], teacher["heldout_accuracy_after"]
    if best_teacher:
        teacher_step, target = best_checkpoint(teacher_dir, teacher["evals"])
    compare = {"rl.eval_every": fine_eval, **({"train.num_steps": steps} if steps else {})}
    rl_alone = teacher if compare == plain else run_seed(seed, spec, compare, root)  # = the teacher's first steps
    distill = {**compare, "rl.teacher": teacher_dir, "rl.distill_task_advantage": False,
               **({"rl.teacher_step": teacher_step} if best_teacher else {}), **student_overrides}
    student = run_seed(seed, spec, distill, root)
    return {"seed": seed, "teacher_step": teacher_step, "teacher_accuracy": target,
            "student_start_accuracy": student["heldout_accuracy_before"],
            "distilled_accuracy": student["heldout_accuracy_after"], "steps_run": student["final_step"],
            "rl_steps_to_within_5_points": _first_within(rl_alone["evals"], target),
            # the teacher's own run is RL alone from the same student, evaluated every 10 steps
            "rl_steps_to_within_5_points_teacher_run": _first_within(teacher["evals"], target),
            "distill_steps_to_within_5_points": _first_within(student["evals"], target),
            # less noisy than one crossing: the mean of 3 consecutive evaluations within 5 points, and the
            # mean held-out accuracy over the evaluations after step 0
            "rl_steps_to_within_5_points_mean_of_3": _first_within_smoothed(rl_alone["evals"], target),
            "distill_steps_to_within_5_points_mean_of_3": _first_within_smoothed(student["evals"], target),
            "rl_mean_accuracy": _mean_after_start(rl_alone["evals"]),
            "distill_mean_accuracy": _mean_after_start(student["evals"]),
            "rl_curve": rl_alone["evals"], "distill_curve": student["evals"], "teacher_curve": teacher["evals"],
            "wall_s": {"teacher": teacher["wall_s"], "rl": rl_alone["wall_s"], "distill": student["wall_s"]}}


def plot(runs: list[dict], path: str, label: str = "distillation") -> None:
    """One panel per seed: held-out accuracy of RL alone and of the distilled student by step, and the
    target band (within 5 points of the teacher's accuracy); RL alone continued by the teacher's own
    run (the same student and seed) when that ran longer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.4), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        for key, name in (("rl_curve", "RL alone"), ("distill_curve", label)):
            ax.plot([e[0] for e in r[key]], [e[1] for e in r[key]], marker=".", label=name)
        if r["teacher_curve"][-1][0] > r["rl_curve"][-1][0]:  # RL alone continued: the teacher's own run
            ax.plot([e[0] for e in r["teacher_curve"]], [e[1] for e in r["teacher_curve"]], color="C0", ls=":",
                    label="RL alone (teacher's run)")
        ax.axhspan(r["teacher_accuracy"] - WITHIN, r["teacher_accuracy"], color="grey", alpha=0.2,
                   label="teacher - 5 points")
        ax.set(title=f"seed {r['seed']}", xlabel="step", ylabel="held-out greedy accuracy", ylim=(0, 0.8))
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--config", default="configs/quickstart.py", help="path[:arg] (`:smoke` to try the script)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of the distilled student's run (e.g. optimizer.learning_rate=3e-3)")
    parser.add_argument("--root", default="", help="keep the runs under this directory (resumable; the teachers "
                        "are quickstart_seeds.py --root DIR --set rl.eval_every=10's full runs); default: temporary")
    parser.add_argument("--steps", type=int, default=0, help="steps of the compared runs (RL alone from the "
                        "student, distillation); 0 = the teacher's 100")
    parser.add_argument("--eval_every", type=int, default=EVAL_EVERY, help="held-out evaluation interval of the "
                        "compared runs (the teacher's stays 10)")
    parser.add_argument("--best_teacher", action="store_true", help="the teacher (and the target) is the "
                        "quickstart run's kept checkpoint (every 25 steps) with the best held-out accuracy")
    parser.add_argument("--teacher_steps", type=int, default=0, help="train the teacher this many GRPO steps "
                        "(0 = the config's 100); with --root it resumes the 100-step run")
    parser.add_argument("--out", default="")
    parser.add_argument("--plot", default="", help="a PNG of the curves")
    args = parser.parse_args(argv)
    overrides = dict(_override(item) for item in args.set)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="distill_") as scratch:
        runs = [one_seed(int(s), args.root or scratch, overrides, args.config, args.steps, args.eval_every,
                         args.best_teacher, args.teacher_steps)
                for s in args.seeds.split(",")]
    rl_steps = [r["rl_steps_to_within_5_points"] for r in runs]
    distill_steps = [r["distill_steps_to_within_5_points"] for r in runs]
    record = {"benchmark": "distill_quickstart", "date": datetime.date.today().isoformat(),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs (shared)",
              "command": " ".join([".venv/bin/python benchmarks/distill_quickstart.py", *(argv or sys.argv[1:])]),
              "load_average_1_5_15min": {"before": [round(x, 2) for x in load_before],
                                         "after": [round(x, 2) for x in os.getloadavg()]},
              "config": args.config, "student_overrides": overrides, "runs": runs,
              "distill_faster_seeds": sum(d is not None and (r is None or d < r)
                                          for r, d in zip(rl_steps, distill_steps, strict=True)),
              "distill_reached_seeds": sum(d is not None for d in distill_steps)}
    emit(record, args.out)
    if args.plot:
        coef = overrides.get("rl.distill_coef", 1.0)
        task = overrides.get("rl.distill_task_advantage", False)
        plot(runs, args.plot, f"distillation + RL (coef {coef})" if task else "distillation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
