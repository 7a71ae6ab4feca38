"""The eval job: held-out pass@1 / pass@k of a policy per task family, level and domain.

    python -m rlvr.main --config=configs/eval_tasks.py --workdir=workdirs/eval

The policy is `init.workdir` (an rlvr run's latest checkpoint), `init.hf_checkpoint`, or a
random init; the tasks are `rl.task` (any mixture spec); generation uses `rl.max_new_tokens`,
`rl.prompt_format` and the embedded engine settings `rl.engine`. For each family and each level
(`eval.levels`), `eval.examples_per_level` held-out tasks get `eval.samples` completions each.
Writes eval.json and eval.md (tables by level, family and domain) to the workdir.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from rlvr import api, evaluation, observe
from rlvr.tasks import build_tasks
from rlvr.tasks.base import HELD_OUT


def _levels(spec: str, family) -> list[int | None]:
    if spec == "default":
        return [None]
    if spec == "all":
        return list(family.levels())
    wanted = [int(x) for x in spec.split(",")]
    return [lv for lv in wanted if lv in family.levels()]


def eval_task_list(tasks, eval_config: ml_collections.ConfigDict) -> list:
    """examples_per_level held-out tasks per (family, level); a task file's rows (TaskFileFamily: the
    flywheel's held-out traffic) each once instead."""
    out = []
    for family in tasks.families.values():
        if getattr(family, "evaluate_all", False):
            out += family.split_tasks(HELD_OUT)
            continue
        for level in _levels(eval_config.levels, family):
            out += [family.task(i, HELD_OUT, level) for i in range(eval_config.examples_per_level)]
    return out


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    from rlvr.trainers.rl import build_backend, policy_pointer

    tasks = build_tasks(config.rl, config.seed)
    tokenizer = api.build_tokenizer(config)
    model, source = api.build_model(config), policy_pointer(config)
    api.check_vocab(model.cfg, tokenizer)
    backend = build_backend(config, model, model.params, tokenizer, workdir, version=0)
    records: list[dict[str, Any]] = []
    try:
        task_list = eval_task_list(tasks, config.eval)
        result = evaluation.evaluate_tasks(backend, tokenizer, tasks, task_list,
                                           evaluation.EvalSettings.for_eval_job(config), seed=config.seed,
                                           records=records)
    finally:
        backend.close()
    result["policy"] = source
    samples_log = observe.SampleLog(workdir, tokenizer)
    samples_log.write(0, "eval", records, show=3)
    samples_log.close()
    json_path, md_path = evaluation.write(workdir, result)
    print(evaluation.table(result, "by_level"))
    if result["skipped_too_long"]:
        print(f"WARNING: {result['skipped_too_long']} of {len(task_list)} tasks have prompts longer than "
              f"rl.max_prompt_len={config.rl.max_prompt_len} and were not evaluated (rl.max_prompt_len=0 fits "
              "them all)")
    print(f"wrote {json_path}, {md_path} and samples.jsonl")
    return result
