"""The recipes (configs/recipes/) at their target topology: the ahead-of-time fit check.

    .venv/bin/python benchmarks/recipes_fit.py [--targets v5e-8,v5p-8,v6e-8,8xh100]
        [--stages "grpo_math.py;chat_sft_dpo.py,sft"] [--out benchmarks/results/recipes_fit.json]

Qwen3-1.7B's architecture (benchmarks/data/qwen3-1.7b/config.json, its published config.json; no
weights: only shapes are compiled) with a stand-in BPE tokenizer (the recipes fix the RL prompt
budget, so the tokenizer only decides which prompts would be skipped). Each recipe stage is compiled
by `rlvr.launch.fit` (what `rlvr.launch --target=...` runs before writing manifests) for each target:
TPU targets with the TPU compiler for their topology (libtpu, deviceless: the `tpu` extra), GPU
targets on fake CPU devices (XLA:CPU's estimate, labelled so in each result's `compiler`), and its
per-device memory compared with the target's HBM x the launch check's 0.9 headroom. Prints one JSON
line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# devices, accelerator (rlvr.launch.fit.HBM_GIB), TPU topology (None: XLA:CPU estimate on fake devices)
TARGETS = {"v5e-8": (8, "v5e", "v5e:2x4"), "v5p-8": (4, "v5p", "v5p:2x2x1"), "v6e-8": (8, "v6e", "v6e:2x4"),
           "8xh100": (8, "h100", None)}
STAGES = (("configs/recipes/grpo_math.py", ""), ("configs/recipes/chat_sft_dpo.py", ",sft"),
          ("configs/recipes/chat_sft_dpo.py", ",dpo"))
HEADROOM = 0.9


def model_dir(directory: str) -> str:
    """Qwen3-1.7B's config.json and a stand-in tokenizer with the ChatML template."""
    from rlvr.models.tokenizer import train_bpe

    shutil.copy(os.path.join(REPO, "benchmarks", "data", "qwen3-1.7b", "config.json"), directory)
    texts = []
    for path in [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*", "*.md")))]:
        with open(path, encoding="utf-8") as f:  # the README and the written docs pages (once the README alone)
            texts.append(f.read())
    train_bpe(texts, 2048).save(directory)
    return directory


def main() -> None:
    from rlvr.launch import fit

    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--stages", default="", help="recipe labels to run, separated by ';' (default: all)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "recipes_fit.json"))
    args = parser.parse_args()
    record = {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "load_1m": os.getloadavg()[0],
              "command": "python " + " ".join(sys.argv), "model": "Qwen3-1.7B (shapes)", "headroom": HEADROOM,
              "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        directory = model_dir(tmp)
        for target in args.targets.split(","):
            devices, accelerator, topology = TARGETS[target]
            budget = fit.hbm_gib(accelerator) * HEADROOM * fit.GIB
            for spec, stage in STAGES:
                label = os.path.basename(spec) + stage
                if args.stages and label not in args.stages.split(";"):
                    continue
                t0 = time.perf_counter()
                [analysis] = fit.analyze_jobs(f"{spec}:{directory}{stage}", [{}], devices, [spec + stage],
                                              topology=topology)
                needed = analysis["needed_bytes"]
                record["results"].append({
                    "recipe": label, "target": target, "devices": devices, "topology": topology,
                    "compiler": analysis["note"],
                    "needed_gib": round(needed / fit.GIB, 2), "budget_gib": round(budget / fit.GIB, 2),
                    "fits": needed <= budget, "components_gib": {k: round(v / fit.GIB, 2)
                                                               for k, v in analysis["components"].items()},
                    "compile_s": round(time.perf_counter() - t0, 1)})
                print(json.dumps(record["results"][-1]), file=sys.stderr)
    from common import emit

    emit(record, args.out, sort_keys=True)


if __name__ == "__main__":
    main()
