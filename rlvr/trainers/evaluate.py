"""The eval job: held-out pass@1 / pass@k of a policy per task family, level and domain.

    python -m rlvr.main --config=configs/eval_tasks.py --workdir=workdirs/eval

The policy is `init.workdir` (an rlvr run's latest checkpoint), `init.hf_checkpoint`, or a
random init; the tasks are `rl.task` (any mixture spec); generation uses `rl.max_new_tokens`,
`rl.prompt_format` and the embedded engine settings `rl.engine`. For each family and each level
(`eval.levels`), `eval.examples_per_level` held-out tasks get `eval.samples` completions each.
Writes eval.json and eval.md (tables by level, family and domain) to the workdir.

Off-policy distillation data: with `eval.split="train"` the tasks come from the training stream, and
`eval.sft_out=PATH` writes the policy's completions as SFT JSONL (`{"prompt", "completion"}`, or chat
`{"messages"}` for chat prompts; only those the verifier accepts when `eval.sft_passed_only`), which
`job=sft` with `data.source=jsonl data.path=PATH` then trains a student on (docs/how-to/distillation.md).
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections

from rlvr import evaluation, observe
from rlvr.job import Job
from rlvr.tasks import build_tasks
from rlvr.tasks.base import HELD_OUT, TRAIN

SPLITS = {"held_out": HELD_OUT, "train": TRAIN}


def _levels(spec: str, family) -> list[int | None]:
    if spec == "default":
        return [None]
    if spec == "all":
        return list(family.levels())
    wanted = [int(x) for x in spec.split(",")]
    return [lv for lv in wanted if lv in family.levels()]


def eval_task_list(tasks, eval_config: ml_collections.ConfigDict) -> list:
    """examples_per_level tasks of the `eval.split` stream per (family, level); a task file's rows
    (TaskFileFamily: the flywheel's traffic) of that split each once instead."""
    out, stream = [], SPLITS[eval_config.split]
    for family in tasks.families.values():
        if getattr(family, "evaluate_all", False):
            out += family.split_tasks(stream)
            continue
        for level in _levels(eval_config.levels, family):
            out += [family.task(i, stream, level) for i in range(eval_config.examples_per_level)]
    return out


def write_sft_data(path: str, tokenizer, task_list: list, records: list[dict[str, Any]], prompt_format: str,
                   passed_only: bool) -> int:
    """The completions in `records` (`evaluate_tasks`'s) as SFT JSONL: off-policy distillation data.
    Returns the number of records written."""
    from rlvr.rl.producer import passed

    by_key = {(t.family, t.level, t.index): t for t in task_list}
    eos, written = tokenizer.eos_id, 0
    with open(path, "w") as f:
        for r in records:
            if passed_only and not passed(r["rewards"]):
                continue
            task, out = by_key[(r["family"], r["level"], r["task_index"])], r["output_ids"]
            text = tokenizer.decode(list(out[:-1] if out and out[-1] == eos else out))
            demo = ({"messages": [*task.chat(), {"role": "assistant", "content": text}]} if prompt_format == "chat"
                    else {"prompt": task.prompt, "completion": text})
            f.write(json.dumps(demo) + "\n")
            written += 1
    return written


def train(job: Job) -> dict[str, Any]:
    """The evaluation job (`job`: resolved by `rlvr.job.resolve`): the policy on `eval.*`'s tasks."""
    from rlvr.trainers.rl import build_backend

    config, workdir, tokenizer = job.config, job.workdir, job.tokenizer
    tasks = build_tasks(config.rl, config.seed)
    model, source = job.build_model(), job.policy_pointer()
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
    if config.eval.sft_out:
        kept = write_sft_data(config.eval.sft_out, tokenizer, task_list, records, config.rl.prompt_format,
                              config.eval.sft_passed_only)
        result["sft_records"] = kept
        print(f"wrote {kept} of {len(records)} completions as SFT data to {config.eval.sft_out}")
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
