"""Export a trained workdir as a Hugging Face directory that transformers and SGLang load.

    python -m rlvr.export WORKDIR --out=DIR [--step=N] [--verify]
    python -m sglang.launch_server --model-path DIR        # or transformers.AutoModelForCausalLM.from_pretrained(DIR)

Writes config.json (the architecture the run recorded), the weights as safetensors (float32, the
value head left out), generation_config.json (the tokenizer's special ids: the end-of-turn token
stops generation) and the run's tokenizer files with its chat template, the system prompt included
(`tokenizer.system_prompt` lives in the template, so a server renders the prompts the run trained on).

`--verify` (needs the `hf` extra) reloads DIR with transformers and checks, on a few chat prompts, that
its chat template renders the same ids as the run's and that its greedy generation equals the
embedded engine's, token for token.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rlvr import api
from rlvr.models import hf

VERIFY_PROMPTS = (
    [{"role": "user", "content": "What is 12 + 30? Give your final answer inside <answer></answer> tags."}],
    [{"role": "user", "content": "Solve for x: 3x + 4 = 19"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
)


def export(workdir: str, out: str, step: int | None = None) -> api.Model:
    """Writes the workdir's latest (or `step`) checkpoint to `out`; returns the loaded model."""
    from rlvr import start

    model = api.with_value_head(api.load_trained(workdir, step), False)
    hf.export_hf_checkpoint(model.cfg, model.params, out, tokenizer_dir=os.path.join(workdir, start.TOKENIZER_DIR),
                            chat_template=model.tokenizer.chat_template)
    return model


def verify(model: api.Model, out: str, prompts=VERIFY_PROMPTS, max_new_tokens: int = 16) -> dict[str, Any]:
    """Greedy tokens of transformers on `out` vs the embedded engine on `model`, per prompt (and the
    chat template's ids). Returns {"prompts", "same_prompt_ids", "same_tokens", "engine", "transformers"}."""
    import torch
    import transformers

    from rlvr.rollout.engine import Engine
    from rlvr.rollout.types import Request, SamplingParams

    theirs_tok = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours_ids = [model.tokenizer.apply_chat_template(p, add_generation_prompt=True) for p in prompts]
    theirs_ids = [list(theirs_tok.apply_chat_template(p, add_generation_prompt=True, return_dict=False))
                  for p in prompts]
    page = 16
    max_len = -(-(max(map(len, ours_ids)) + max_new_tokens + 1) // page) * page
    engine = Engine(model.cfg, model.params, model.tokenizer, max_slots=len(prompts), max_len=max_len, page_size=page)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    engine_out = [c.output_ids for c in engine.generate([Request(f"v{i}", ids, greedy)
                                                        for i, ids in enumerate(ours_ids)])]
    hf_out = []
    with torch.no_grad():
        for ids in ours_ids:
            tokens = theirs.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=max_new_tokens, do_sample=False)
            hf_out.append(tokens[0, len(ids):].tolist())
    return {"prompts": len(prompts), "same_prompt_ids": ours_ids == theirs_ids,
            "same_tokens": [list(e) for e in engine_out] == hf_out, "engine": engine_out, "transformers": hf_out}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rlvr.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", help="An rlvr workdir (a job's --workdir).")
    parser.add_argument("--out", required=True, help="The Hugging Face directory to write.")
    parser.add_argument("--step", type=int, default=None, help="Checkpoint step (default: the latest).")
    parser.add_argument("--verify", action="store_true",
                        help="Reload with transformers; compare chat-template ids and greedy tokens with the engine's.")
    args = parser.parse_args(argv)
    try:
        model = export(args.workdir, args.out, args.step)
    except (api.ConfigError, FileNotFoundError) as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} ({model.cfg.family}, {model.cfg.num_params():,} parameters, vocabulary "
          f"{model.cfg.vocab_size})")
    if args.verify:
        report = verify(model, args.out)
        print(f"verify: chat template ids equal: {report['same_prompt_ids']}; greedy tokens equal (transformers vs "
              f"engine, {report['prompts']} prompts): {report['same_tokens']}")
        if not (report["same_prompt_ids"] and report["same_tokens"]):
            print(f"engine: {report['engine']}\ntransformers: {report['transformers']}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
