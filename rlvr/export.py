"""Export a trained workdir as a Hugging Face directory that transformers and SGLang load.

    python -m rlvr.export WORKDIR --out=DIR [--step=N] [--verify]
    python -m sglang.launch_server --model-path DIR        # or transformers.AutoModelForCausalLM.from_pretrained(DIR)
    python -m rlvr.export LORA_WORKDIR --out=DIR --adapter [--verify]   # a PEFT adapter directory

Writes config.json (the architecture the run recorded), the weights as safetensors (float32, the
value head left out), generation_config.json (the tokenizer's special ids: the end-of-turn token
stops generation) and the run's tokenizer files with its chat template, the system prompt included
(`tokenizer.system_prompt` lives in the template, so a server renders the prompts the run trained on).

A LoRA run (`lora.rank` > 0) exports merged: each adapter folded into its (dequantised) base weight.
With `--adapter` it exports the adapter alone as a PEFT directory (rlvr.models.peft) instead, whose
`base_model_name_or_path` is the run's base: its `init.hf_checkpoint`, or else (another starting point,
or a QLoRA base: dequantised, as the adapter was trained on it) an HF export of the base written to
DIR/base (`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
DIR)`; SGLang: `--enable-lora --lora-paths name=DIR`).

A VLM run (Qwen2.5-VL layout) exports as `Qwen2_5_VLForConditionalGeneration` with a
preprocessor_config.json set to our image preprocessing (rlvr.models.hf.processor_config).

`--verify` (needs the `hf` extra) reloads DIR with transformers (and peft) and checks, on a few chat
prompts, that its chat template renders the same ids as the run's and that its greedy generation
equals the embedded engine's, token for token; for a VLM also that transformers' logits, with the
export's own image processor, on a chat prompt with two images are within 1e-4 of ours.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from rlvr import api
from rlvr.models import hf, lora

VERIFY_PROMPTS = (
    [{"role": "user", "content": "What is 12 + 30? Give your final answer inside <answer></answer> tags."}],
    [{"role": "user", "content": "Solve for x: 3x + 4 = 19"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
)

IMAGE_LOGITS_ATOL = 1e-4  # float32: transformers and ours differ by summation order only


def export(workdir: str, out: str, step: int | None = None) -> api.Model:
    """Writes the workdir's latest (or `step`) checkpoint to `out`; returns the loaded model."""
    from rlvr import start

    model = merged(api.load_trained(workdir, step))
    hf.export_hf_checkpoint(model.cfg, model.params, out, tokenizer_dir=os.path.join(workdir, start.TOKENIZER_DIR),
                            chat_template=model.tokenizer.chat_template)
    return model


def merged(model: api.Model) -> api.Model:
    """The policy as plain weights: a LoRA model's adapters folded in, no value head."""
    plain = api.Model(lora.without_lora(model.cfg), lora.merge(model.cfg, model.params), model.mesh, model.tokenizer)
    return api.with_value_head(plain, False)


def export_adapter(workdir: str, out: str, step: int | None = None) -> tuple[api.Model, str]:
    """Writes a LoRA run's adapter to `out` as a PEFT directory (and its base to out/base when the base
    is not an HF directory). Returns (the model, the base model's HF directory)."""
    from rlvr import start
    from rlvr.models import peft

    model = api.load_trained(workdir, step)
    if not model.cfg.lora.enabled:
        raise api.ConfigError(f"{workdir!r} trained every weight (lora.rank=0): export it without --adapter.")
    config = api.load_run_config(workdir)
    src = start.run_source(config, workdir)
    own_base = src.kind != "hf" or model.cfg.lora.quantize != "none"
    base_dir = os.path.join(out, "base") if own_base else src.path
    if own_base:
        base = api.Model(lora.without_lora(model.cfg), lora.frozen(model.params), model.mesh, model.tokenizer)
        base = merged(base)  # (a quantised base: dequantised)
        hf.export_hf_checkpoint(base.cfg, base.params, base_dir,
                                tokenizer_dir=os.path.join(workdir, start.TOKENIZER_DIR),
                                chat_template=model.tokenizer.chat_template)
    peft.write_adapter(model.cfg, model.params, out, os.path.abspath(base_dir))
    return model, base_dir


def load_transformers(out: str, base_dir: str | None = None):
    """(tokenizer, model) of an HF export with transformers, or of a PEFT adapter `out` on the HF model
    `base_dir` with peft, in float32."""
    import torch
    import transformers

    auto = transformers.AutoModelForCausalLM
    with open(os.path.join(base_dir or out, "config.json")) as f:
        if json.load(f).get("vision_config"):  # a VLM (Qwen2.5-VL): the image-text-to-text class
            auto = transformers.AutoModelForImageTextToText
    model = auto.from_pretrained(base_dir or out, dtype=torch.float32)
    if base_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, out)
    return transformers.AutoTokenizer.from_pretrained(base_dir or out), model.eval()


def verify(model: api.Model, out: str, prompts=VERIFY_PROMPTS, max_new_tokens: int = 16,
           base_dir: str | None = None) -> dict[str, Any]:
    """Greedy tokens of transformers on `out` (a PEFT adapter on `base_dir` when given) vs the embedded
    engine on `model`, per prompt (and the chat template's ids). Returns {"prompts", "same_prompt_ids",
    "same_tokens", "engine", "transformers"}."""
    import torch

    from rlvr.rollout.engine import Engine
    from rlvr.rollout.types import Request, SamplingParams

    theirs_tok, theirs = load_transformers(out, base_dir)
    model = merged(model)
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


def verify_image_logits(model: api.Model, out: str, seed: int = 0) -> dict[str, Any]:
    """Logits of transformers on the VLM export `out` (its model and its image processor, from
    preprocessor_config.json) vs ours (rlvr.data.images preprocessing, the VLM's forward) on a chat
    prompt with two images and text. Returns {"max_abs_diff", "max_abs_logit", "image_effect"}:
    image_effect is how far our logits move when the images are replaced by black ones (a gap well
    below it shows the images are read the same way, not merely ignored on both sides)."""
    import numpy as np
    import torch
    import transformers
    from PIL import Image

    from rlvr.data import images as images_lib

    vcfg = model.cfg.vision
    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((84, 112), (56, 56))]
    urls = [_data_url(p) for p in pictures]
    content = [{"type": "image_url", "image_url": {"url": urls[0]}}, {"type": "text", "text": "Which bar is taller,"},
               {"type": "image_url", "image_url": {"url": urls[1]}}, {"type": "text", "text": "or this one?"}]
    ids, sources = images_lib.chat_prompt_ids(model.tokenizer, [{"role": "user", "content": content}], vcfg)
    patches, grids = images_lib.preprocess(sources, vcfg)
    black, _ = images_lib.preprocess([_data_url(Image.new("RGB", p.size)) for p in pictures], vcfg)
    ours, ours_black = (_vlm_logits(model, ids, p, grids) for p in (patches, black))
    _, theirs = load_transformers(out)
    inputs = transformers.AutoImageProcessor.from_pretrained(out)(images=pictures, return_tensors="pt")
    tokens = torch.tensor([ids])
    with torch.no_grad():
        ref = theirs(input_ids=tokens, attention_mask=torch.ones_like(tokens), pixel_values=inputs["pixel_values"],
                     image_grid_thw=inputs["image_grid_thw"],
                     mm_token_type_ids=(tokens == vcfg.image_token_id).long()).logits[0].float().numpy()
    return {"max_abs_diff": float(np.abs(ours - ref).max()), "max_abs_logit": float(np.abs(ref).max()),
            "image_effect": float(np.abs(ours - ours_black).max())}


def _data_url(picture) -> str:
    from rlvr.tasks.charts import png_data_url
    from rlvr.tasks.rendered import png_bytes

    return png_data_url(png_bytes(picture))


def _vlm_logits(model: api.Model, ids: list[int], patches, grids):
    """Our float32 logits [T, V] of one VLM prompt."""
    import jax
    import numpy as np

    from rlvr.models import vision
    from rlvr.models.transformer import forward

    tokens, segments = np.asarray([ids], np.int32), np.ones((1, len(ids)), np.int32)
    inputs = vision.image_inputs(model.cfg.vision, [patches], [grids], tokens, segments)
    cfg = dataclasses.replace(model.cfg, dtype="float32")
    params = jax.tree.map(lambda x: x.astype("float32"), model.params)
    logits = jax.jit(lambda p, i: forward(cfg, p, tokens, np.arange(len(ids))[None], segments, images=i)[0])
    return np.asarray(logits(params, inputs)[0])


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rlvr.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", help="An rlvr workdir (a job's --workdir).")
    parser.add_argument("--out", required=True, help="The Hugging Face directory to write.")
    parser.add_argument("--step", type=int, default=None, help="Checkpoint step (default: the latest).")
    parser.add_argument("--adapter", action="store_true",
                        help="A LoRA run: write its adapter as a PEFT directory (with its base) instead of merging.")
    parser.add_argument("--verify", action="store_true",
                        help="Reload with transformers; compare chat-template ids and greedy tokens with the engine's.")
    args = parser.parse_args(argv)
    base_dir = None
    try:
        if args.adapter:
            model, base_dir = export_adapter(args.workdir, args.out, args.step)
        else:
            model = export(args.workdir, args.out, args.step)
    except (api.ConfigError, FileNotFoundError) as e:
        print(f"export error: {e}", file=sys.stderr)
        return 2
    what = (f"a rank-{model.cfg.lora.rank} PEFT adapter ({lora.adapter_count(model.cfg):,} parameters) on {base_dir}"
            if args.adapter else f"{model.cfg.num_params():,} parameters")
    print(f"wrote {args.out} ({model.cfg.family}, {what}, vocabulary {model.cfg.vocab_size})")
    if args.verify:
        report = verify(model, args.out, base_dir=base_dir)
        print(f"verify: chat template ids equal: {report['same_prompt_ids']}; greedy tokens equal (transformers vs "
              f"engine, {report['prompts']} prompts): {report['same_tokens']}")
        if not (report["same_prompt_ids"] and report["same_tokens"]):
            print(f"engine: {report['engine']}\ntransformers: {report['transformers']}", file=sys.stderr)
            return 1
        if model.cfg.vision is not None:
            logits = verify_image_logits(model, args.out)
            print(f"verify: logits on a chat prompt with 2 images (transformers with the export's image processor "
                  f"vs ours): max|dlogit|={logits['max_abs_diff']:.2e} (max|logit|={logits['max_abs_logit']:.2f}, "
                  f"the images move ours by {logits['image_effect']:.2e}; tolerance {IMAGE_LOGITS_ATOL:.0e})")
            if not logits["max_abs_diff"] <= IMAGE_LOGITS_ATOL:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
