"""Hugging Face interop of the Qwen2.5-VL-layout VLM (rlvr.models.vision): configs, load, export.

The decoder's tensors are the text model's (`hf.PARAM_TABLE`, family qwen2, same names: HF saves
Qwen2.5-VL as `model.layers.*`, `lm_head.weight`); the encoder's are `VISION_TABLE`, rows of the
same `HFParam` kind over `VisionConfig.dim_sizes`. Loading reads each device shard straight into
place (`hf.load_table`), as the text path does. `rlvr.models.hf`'s load / export / config
functions hand a `qwen2_5_vl` checkpoint (or a config with `vision`) to this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rlvr import sharding
from rlvr.models import hf
from rlvr.models.config import ModelConfig, VisionConfig
from rlvr.models.params import abstract_params, param_shardings

Params = dict[str, Any]
MODEL_TYPE = "qwen2_5_vl"

_B = "visual.blocks.{i}."
_HD = ("heads", "head_dim")
_row = hf._row  # noqa: SLF001 - the one row constructor of the table format
VISION_TABLE: tuple[hf.HFParam, ...] = (
    _row("visual.patch_embed.proj.weight", "visual/patch_embed/kernel",
         (("embed",), ("channels",), ("frames",), ("patch",), ("patch",)), (1, 2, 3, 4, 0)),
    _row(_B + "norm1.weight", "visual/blocks/norm1/scale", (("embed",),), (0,)),
    _row(_B + "norm2.weight", "visual/blocks/norm2/scale", (("embed",),), (0,)),
    _row(_B + "attn.qkv.weight", "visual/blocks/qkv/kernel", (("qkv", *_HD), ("embed",)), (3, 0, 1, 2)),
    _row(_B + "attn.qkv.bias", "visual/blocks/qkv/bias", (("qkv", *_HD),), (0, 1, 2)),
    _row(_B + "attn.proj.weight", "visual/blocks/proj/kernel", (("embed",), _HD), (1, 2, 0)),
    _row(_B + "attn.proj.bias", "visual/blocks/proj/bias", (("embed",),), (0,)),
    *(_row(_B + f"mlp.{name}.weight", f"visual/blocks/{name}/kernel", dims, (1, 0))
      for name, dims in (("gate_proj", (("mlp",), ("embed",))), ("up_proj", (("mlp",), ("embed",))),
                         ("down_proj", (("embed",), ("mlp",))))),
    *(_row(_B + f"mlp.{name}.bias", f"visual/blocks/{name}/bias", ((dim,),), (0,))
      for name, dim in (("gate_proj", "mlp"), ("up_proj", "mlp"), ("down_proj", "embed"))),
    _row("visual.merger.ln_q.weight", "visual/ln_q/scale", (("embed",),), (0,)),
    _row("visual.merger.mlp.0.weight", "visual/merger_fc1/kernel", (("merged",), ("merged",)), (1, 0)),
    _row("visual.merger.mlp.0.bias", "visual/merger_fc1/bias", (("merged",),), (0,)),
    _row("visual.merger.mlp.2.weight", "visual/merger_fc2/kernel", (("out",), ("merged",)), (1, 0)),
    _row("visual.merger.mlp.2.bias", "visual/merger_fc2/bias", (("out",),), (0,)),
)


def _text_dict(config: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The decoder's HF fields as a qwen2 config (nested `text_config` of transformers 5, or the flat
    hub layout), and the M-RoPE sections."""
    text = dict(config.get("text_config") or config)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {})
    section = tuple(rope.pop("mrope_section", ()))
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "default"}
    rope.setdefault("rope_theta", text.get("rope_theta", 1e6))
    text |= {"model_type": "qwen2", "rope_parameters": rope, "rope_scaling": None,
             "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
    return text, section


def config_from_hf(config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The VLM's config (the decoder's, with `vision`) from a Qwen2.5-VL `config.json` dict."""
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json model_type={config.get('model_type')!r}: the VLM loader reads "
                         f"{MODEL_TYPE!r} checkpoints (Qwen2.5-VL layout).")
    text, section = _text_dict(config)
    cfg = hf.config_from_hf(text, mrope_section=section, **{k: v for k, v in overrides.items() if k != "vision"})
    vision = dict(config["vision_config"])
    if vision.get("hidden_act", "silu") != "silu":
        raise ValueError(f"vision_config.hidden_act={vision['hidden_act']!r}: the encoder's MLP is SwiGLU (silu).")
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10_000.0)
    ids = {k: config[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id") if k in config}
    vcfg = VisionConfig(
        hidden_size=vision["hidden_size"], intermediate_size=vision["intermediate_size"],
        num_layers=vision["depth"], num_heads=vision["num_heads"], out_hidden_size=vision["out_hidden_size"],
        in_channels=vision.get("in_channels", vision.get("in_chans", 3)), patch_size=vision["patch_size"],
        temporal_patch_size=vision["temporal_patch_size"], spatial_merge_size=vision["spatial_merge_size"],
        window_size=vision["window_size"], full_attention_layers=tuple(vision["fullatt_block_indexes"]),
        rope_theta=float(theta), **ids)
    if vcfg.out_hidden_size != cfg.hidden_size:
        raise ValueError(f"vision_config.out_hidden_size={vcfg.out_hidden_size} must equal the decoder's "
                         f"hidden_size={cfg.hidden_size}.")
    return dataclasses.replace(cfg, vision=vcfg)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers-5 `config.json` dict (nested text and vision configs)."""
    vcfg = cfg.vision
    text = hf.config_to_hf(dataclasses.replace(cfg, vision=None))
    text.pop("architectures")
    text.pop("rope_scaling")
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_section)}
    text["model_type"] = f"{MODEL_TYPE}_text"
    vision = {"model_type": f"{MODEL_TYPE}_vision", "depth": vcfg.num_layers, "hidden_size": vcfg.hidden_size,
              "intermediate_size": vcfg.intermediate_size, "num_heads": vcfg.num_heads, "hidden_act": "silu",
              "out_hidden_size": vcfg.out_hidden_size, "in_channels": vcfg.in_channels,
              "patch_size": vcfg.patch_size, "temporal_patch_size": vcfg.temporal_patch_size,
              "spatial_merge_size": vcfg.spatial_merge_size, "window_size": vcfg.window_size,
              "fullatt_block_indexes": list(vcfg.full_attention_layers),
              "rope_parameters": {"rope_type": "axial", "rope_theta": vcfg.rope_theta}}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": MODEL_TYPE,
            "text_config": text, "vision_config": vision, "tie_word_embeddings": cfg.tie_word_embeddings,
            "image_token_id": vcfg.image_token_id, "vision_start_token_id": vcfg.vision_start_token_id,
            "vision_end_token_id": vcfg.vision_end_token_id, "dtype": cfg.param_dtype}


def processor_config(vcfg: VisionConfig) -> dict[str, Any]:
    """`preprocessor_config.json` of an export: the Qwen2-VL image processor set to what
    `rlvr.data.images.preprocess` does (CLIP mean/std, bicubic resize to multiples of the merged patch
    within MIN_PIXELS..MAX_PIXELS), so transformers' and SGLang's processors give the patches we trained on."""
    from rlvr.data import images

    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
            "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "do_normalize": True,
            "rescale_factor": 1 / 255, "resample": 3, "image_mean": list(images.CLIP_MEAN),
            "image_std": list(images.CLIP_STD), "min_pixels": images.MIN_PIXELS, "max_pixels": images.MAX_PIXELS,
            "size": {"shortest_edge": images.MIN_PIXELS, "longest_edge": images.MAX_PIXELS},
            "patch_size": vcfg.patch_size, "temporal_patch_size": vcfg.temporal_patch_size,
            "merge_size": vcfg.spatial_merge_size}


def load_vlm_params(cfg: ModelConfig, path: str, mesh: Mesh, rules: sharding.Rules) -> Params:
    """The VLM's params (`cfg` from `config_from_hf`) from a checkpoint directory, each shard read into place."""
    files = hf.weight_files(path)
    missing = [n for e in VISION_TABLE for n in e.names(cfg.vision) if n not in files]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}; is it Qwen2.5-VL?")
    shapes, shardings = abstract_params(cfg), param_shardings(cfg, mesh, rules)
    text_cfg = dataclasses.replace(cfg, vision=None)
    params = hf.load_table(text_cfg, hf.table_for(text_cfg), files, shapes, shardings)
    return params | hf.load_table(cfg.vision, list(VISION_TABLE), files, shapes, shardings)


def to_hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """All parameters as `{hf_name: numpy array}` in the HF layout."""
    tensors = hf.to_hf_tensors(dataclasses.replace(cfg, vision=None), params)
    for entry in VISION_TABLE:
        value = np.asarray(jax.device_get(hf.get_path(params, entry.path)))
        for i, name in enumerate(entry.names(cfg.vision)):
            tensors[name] = hf.to_hf(entry, cfg.vision, value[i] if entry.per_layer else value)
    return tensors
