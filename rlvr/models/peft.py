"""LoRA adapters in PEFT's format: what `peft.PeftModel.from_pretrained(model, DIR)` and SGLang's
`/load_lora_adapter` read.

A PEFT adapter directory holds `adapter_config.json` (`r`, `lora_alpha`, `target_modules`, the base
model's path) and `adapter_model.safetensors` with, per layer and targeted projection,

  base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight   [rank, in_features]
  base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_B.weight   [out_features, rank]

Our `lora_a [*in, rank]` and `lora_b [rank, *out]` flatten their in/out dims in the order of the
Hugging Face weight's (`rlvr.models.hf.PARAM_TABLE`: heads-major for q/k/v/o), so lora_A is
`lora_a.reshape(in, rank).T` and lora_B is `lora_b.reshape(rank, out).T`; PEFT's update
`B·A·lora_alpha/r` is then exactly ours. A QLoRA adapter is written the same way: PEFT applies it
to the full-precision base (the quantisation error of the base is not in the file).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from rlvr.models.config import LoraConfig, ModelConfig
from rlvr.models.transformer import stack_layers

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_name(layer: int, name: str) -> str:
    """The PEFT (and transformers) module path of one projection."""
    return f"base_model.model.model.layers.{layer}.{_BLOCK[name]}.{name}"


def adapter_config(lora: LoraConfig, base_model: str) -> dict[str, Any]:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": list(lora.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "base_model_name_or_path": base_model}


def adapter_tensors(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """{PEFT tensor name: float32 array} of a LoRA model's adapters (either layer layout)."""
    params, out = stack_layers(params), {}
    for name in cfg.lora.targets:
        module = params["layers"][_BLOCK[name]][name]
        a, b = (np.asarray(jax.device_get(module[k]), np.float32) for k in ("lora_a", "lora_b"))
        for i in range(a.shape[0]):
            prefix = module_name(i, name)
            out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, cfg.lora.rank).T)
            out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(cfg.lora.rank, -1).T)
    return out


def write_adapter(cfg: ModelConfig, params: dict[str, Any], out_dir: str, base_model: str) -> None:
    """Writes a PEFT adapter directory for the LoRA model `cfg` on top of the HF model `base_model`."""
    if not cfg.lora.enabled:
        raise ValueError("lora.rank is 0: this run trained every weight; export it as a whole model.")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(adapter_config(cfg.lora, base_model), f, indent=2)
    save_file(adapter_tensors(cfg, params), os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_adapter(cfg: ModelConfig, path: str) -> tuple[LoraConfig, dict[str, dict[str, np.ndarray]]]:
    """A PEFT adapter directory as (its LoraConfig, {projection name: {"lora_a", "lora_b"} stacked over
    layers in our layout}) for the architecture `cfg`. Raises ValueError naming what does not fit."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        raw = json.load(f)
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    lora = LoraConfig(rank=int(raw["r"]), alpha=float(raw.get("lora_alpha", raw["r"])), targets=tuple(targets),
                      dropout=float(raw.get("lora_dropout", 0.0)))
    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    shapes = _kernel_shapes(cfg)
    out = {}
    for name in lora.targets:
        a, b = [], []
        for i in range(cfg.num_layers):
            prefix = module_name(i, name)
            if f"{prefix}.lora_A.weight" not in tensors:
                raise ValueError(f"{path}: no {prefix}.lora_A.weight; the adapter does not match this model.")
            ins, outs = shapes[name]
            a.append(tensors[f"{prefix}.lora_A.weight"].T.reshape(*ins, lora.rank))
            b.append(tensors[f"{prefix}.lora_B.weight"].T.reshape(lora.rank, *outs))
        out[name] = {"lora_a": np.stack(a), "lora_b": np.stack(b)}
    return lora, out


def _kernel_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    e, m, h, kvh, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {"q_proj": ((e,), (h, d)), "k_proj": ((e,), (kvh, d)), "v_proj": ((e,), (kvh, d)),
            "o_proj": ((h, d), (e,)), "gate_proj": ((e,), (m,)), "up_proj": ((e,), (m,)), "down_proj": ((m,), (e,))}
