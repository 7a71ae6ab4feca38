"""See what the model will see: task prompts rendered with a tokenizer, and their token counts.

    python -m rlvr.tasks.preview --task=asdiv,algebra_linear --tokenizer=path/to/hf_dir --prompt_format=chat
    python -m rlvr.tasks.preview --task=add --count=3                       # byte-level, raw prompts
    python -m rlvr.tasks.preview --config=configs/vlm.py                    # a run's tasks, tokenizer and VLM

Prints a few rendered prompts per family (exactly the text the tokens decode to), then per family the
prompt lengths of every measured task (dataset families: all items of both splits; procedural
families: `--per_level` tasks per level and split), and with `--max_new_tokens` the budgets a run
would derive; the measuring is `rlvr.budgets.measure`, the one RL and eval jobs derive those budgets with.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

import numpy as np

from rlvr import budgets
from rlvr.budgets import PER_LEVEL, Measured, longest, measure, sample_tasks


def family_table(measured: Sequence[Measured]) -> str:
    """Per family: tasks measured and prompt tokens min / median / max."""
    lines = ["| family | tasks | min | median | max |", "|---|---|---|---|---|"]
    for family in sorted({m.task.family for m in measured}):
        lengths = np.array([m.tokens for m in measured if m.task.family == family])
        lines.append(f"| {family} | {len(lengths)} | {lengths.min()} | {int(np.median(lengths))} | {lengths.max()} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rlvr import config_lib, start
    from rlvr.rl.producer import prompt_ids
    from rlvr.tasks import build_tasks

    parser = argparse.ArgumentParser(prog="python -m rlvr.tasks.preview", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="", help="An rlvr config file[:arg]: its rl.task, tokenizer, "
                        "rl.prompt_format and, for a VLM, the vision config that counts image placeholders "
                        "(the flags below override them).")
    parser.add_argument("--task", default=None, help="rl.task spec: a family, or a weighted mixture with globs "
                        "(default add).")
    parser.add_argument("--tokenizer", default=None, help="A Hugging Face tokenizer directory ('' = byte-level); "
                        "a Qwen2.5-VL checkpoint directory also gives the vision config.")
    parser.add_argument("--prompt_format", default=None, choices=["raw", "chat"], help="Raw text or chat messages "
                        "(default raw).")
    parser.add_argument("--chat_template", default=None, help="A template, a .jinja file or 'chatml' ('' = the "
                        "tokenizer's).")
    parser.add_argument("--system_prompt", default=None, help="A system prompt put first (chat).")
    parser.add_argument("--count", type=int, default=2, help="Rendered prompts printed per family.")
    parser.add_argument("--per_level", type=int, default=PER_LEVEL, help="Procedural families: tasks measured per "
                        "level and split.")
    parser.add_argument("--max_new_tokens", type=int, default=0, help="With a response budget: the budgets a run "
                        "derives.")
    args = parser.parse_args(argv)
    try:
        settings, vision = _settings(args)
        tokenizer = start.build_tokenizer(settings["tokenizer"])
        rl = config_lib.rl_config()
        rl.task = settings["task"]
        tasks = build_tasks(rl, 0)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt_format = settings["prompt_format"]
    for family in tasks.families.values():
        for t in family.tasks(0, args.count):
            ids = prompt_ids(tokenizer, t, prompt_format, vision) if not t.metadata.get("env") else []
            print(f"--- {t.family} level {t.level} #{t.index}: {len(ids)} tokens ---")
            print(_shown(tokenizer, ids, vision) if ids else "(multi-turn: the prompt comes from its environment)")
    measured = measure(sample_tasks(tasks, args.per_level), tokenizer, prompt_format, vision)
    if measured:
        print(family_table(measured))
        print(f"longest prompts: {longest(measured)}")
    if args.max_new_tokens and measured:
        seq_len, max_len = budgets.derive(max(m.tokens for m in measured), args.max_new_tokens, page_size=16)
        print(f"with rl.max_new_tokens={args.max_new_tokens}: rl.seq_len={seq_len}, rl.engine.max_len={max_len} "
              "(page size 16)")
    return 0


def _shown(tokenizer, ids: Sequence[int], vision) -> str:
    """The prompt's text, each image's run of placeholder tokens written once with its count."""
    text = tokenizer.decode(ids)
    if vision is None:
        return text
    pad = tokenizer.decode([vision.image_token_id])
    return re.sub(f"(?:{re.escape(pad)})+", lambda m: f"{pad}x{len(m.group(0)) // len(pad)}", text)


def _settings(args) -> tuple[dict, object]:
    """The task spec, tokenizer settings and prompt format to preview, and the VLM's vision config (or None):
    from `--config` when given (resolved as the job would: a checkpoint's tokenizer and vision config), else
    the defaults; explicit flags win."""
    from rlvr import config_lib, start
    from rlvr.models.config import VisionConfig

    settings = {"task": "add", "prompt_format": "raw",
                "tokenizer": {"path": "", "chat_template": "", "system_prompt": ""}}
    vision = None
    if args.config:
        config = start.resolve(config_lib.load_config(args.config))
        settings = {"task": config.rl.task, "prompt_format": config.rl.prompt_format,
                    "tokenizer": {k: config.tokenizer[k] for k in ("path", "chat_template", "system_prompt")}}
        vision = VisionConfig.of(config.model.get("vision"))
    for key in ("task", "prompt_format"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    for key in ("chat_template", "system_prompt"):
        if getattr(args, key) is not None:
            settings["tokenizer"][key] = getattr(args, key)
    if args.tokenizer is not None:
        settings["tokenizer"]["path"] = args.tokenizer
        vision = _checkpoint_vision(args.tokenizer) or vision
    return settings, vision


def _checkpoint_vision(path: str):
    """The vision config of a Qwen2.5-VL checkpoint directory, else None."""
    import json
    import os

    from rlvr.models import hf

    config_path = os.path.join(path, "config.json") if path else ""
    if not config_path or not os.path.exists(config_path):
        return None
    with open(config_path) as f:
        config = json.load(f)
    return hf.vlm_config_from_hf(config).vision if config.get("model_type") == hf.VLM_MODEL_TYPE else None


if __name__ == "__main__":
    sys.exit(main())
