"""Hugging Face interop: config translation, the one parameter name table, load and export (the decoders
and the Qwen2.5-VL VLM).

`PARAM_TABLE` is the single source of truth for how a Hugging Face tensor maps to an rlvr
parameter. Each `HFParam` says, declaratively:

* `hf_name`: the HF tensor name (`{i}` is the layer index for per-layer tensors);
* `path`: our parameter path (per-layer parameters are stacked on a leading `layers` axis);
* `hf_dims`: the HF tensor's axes as groups of named dims. A group with several dims is one
  flattened HF axis, e.g. `(("heads", "head_dim"), ("embed",))` is a `[heads*head_dim, embed]`
  `q_proj.weight`. Flattening the groups gives the *view* (`[heads, head_dim, embed]`);
* `perm`: the permutation taking the view to our (per-layer) layout:
  `ours = hf.reshape(view).transpose(perm)` and `hf = ours.transpose(argsort(perm)).reshape(hf_shape)`;
* `when`: the `ModelConfig` flag that must be true for the tensor to exist (`"!flag"` negates).

Loading reads, for every device shard, only the layers and row ranges it needs
(`safe_open(...).get_slice`) inside `jax.make_array_from_callback`, so each host touches only
its part of the checkpoint and nothing is materialised unsharded on one device. The rollout
weight sync reuses `PARAM_TABLE` / `hf_tensor(...)` to stream tensors under HF names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from rlvr import sharding
from rlvr.models.config import ModelConfig, VisionConfig
from rlvr.models.params import abstract_params, param_shardings
from rlvr.models.tokenizer import TOKENIZER_FILES, Tokenizer, write_chat_template
from rlvr.models.transformer import in_layout, stack_layers

Params = dict[str, Any]
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


# --- the name / transpose table ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HFParam:
    """One row of the HF <-> rlvr parameter table (see the module docstring)."""

    hf_name: str
    path: tuple[str, ...]
    hf_dims: tuple[tuple[str, ...], ...]
    perm: tuple[int, ...]
    when: str = ""

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def view_dims(self) -> tuple[str, ...]:
        return tuple(d for group in self.hf_dims for d in group)

    def enabled(self, cfg: ModelConfig) -> bool:
        if not self.when:
            return True
        negate = self.when.startswith("!")
        return bool(getattr(cfg, self.when.lstrip("!"))) != negate

    def names(self, cfg: ModelConfig) -> list[str]:
        """Every HF tensor name this row produces for `cfg`."""
        if not self.per_layer:
            return [self.hf_name]
        return [self.hf_name.format(i=i) for i in range(cfg.num_layers)]


def _row(hf_name, path, hf_dims, perm, when="") -> HFParam:
    return HFParam(hf_name, tuple(path.split("/")), hf_dims, perm, when)


_L = "model.layers.{i}."
_HD, _KD = ("heads", "head_dim"), ("kv_heads", "head_dim")
PARAM_TABLE: tuple[HFParam, ...] = (
    _row("model.embed_tokens.weight", "embed_tokens", (("vocab",), ("embed",)), (0, 1)),
    _row("lm_head.weight", "lm_head/kernel", (("vocab",), ("embed",)), (1, 0), "!tie_word_embeddings"),
    _row("model.norm.weight", "norm/scale", (("embed",),), (0,)),
    _row(_L + "input_layernorm.weight", "layers/input_layernorm/scale", (("embed",),), (0,)),
    _row(_L + "post_attention_layernorm.weight", "layers/post_attention_layernorm/scale",
         (("embed",),), (0,)),
    _row(_L + "self_attn.q_proj.weight", "layers/self_attn/q_proj/kernel", (_HD, ("embed",)), (2, 0, 1)),
    _row(_L + "self_attn.k_proj.weight", "layers/self_attn/k_proj/kernel", (_KD, ("embed",)), (2, 0, 1)),
    _row(_L + "self_attn.v_proj.weight", "layers/self_attn/v_proj/kernel", (_KD, ("embed",)), (2, 0, 1)),
    _row(_L + "self_attn.o_proj.weight", "layers/self_attn/o_proj/kernel", (("embed",), _HD), (1, 2, 0)),
    _row(_L + "self_attn.q_proj.bias", "layers/self_attn/q_proj/bias", (_HD,), (0, 1), "qkv_bias"),
    _row(_L + "self_attn.k_proj.bias", "layers/self_attn/k_proj/bias", (_KD,), (0, 1), "qkv_bias"),
    _row(_L + "self_attn.v_proj.bias", "layers/self_attn/v_proj/bias", (_KD,), (0, 1), "qkv_bias"),
    _row(_L + "self_attn.o_proj.bias", "layers/self_attn/o_proj/bias", (("embed",),), (0,), "o_bias"),
    _row(_L + "self_attn.q_norm.weight", "layers/self_attn/q_norm/scale", (("head_dim",),), (0,), "qk_norm"),
    _row(_L + "self_attn.k_norm.weight", "layers/self_attn/k_norm/scale", (("head_dim",),), (0,), "qk_norm"),
    _row(_L + "mlp.gate_proj.weight", "layers/mlp/gate_proj/kernel", (("mlp",), ("embed",)), (1, 0)),
    _row(_L + "mlp.up_proj.weight", "layers/mlp/up_proj/kernel", (("mlp",), ("embed",)), (1, 0)),
    _row(_L + "mlp.down_proj.weight", "layers/mlp/down_proj/kernel", (("embed",), ("mlp",)), (1, 0)),
    _row(_L + "mlp.gate_proj.bias", "layers/mlp/gate_proj/bias", (("mlp",),), (0,), "mlp_bias"),
    _row(_L + "mlp.up_proj.bias", "layers/mlp/up_proj/bias", (("mlp",),), (0,), "mlp_bias"),
    _row(_L + "mlp.down_proj.bias", "layers/mlp/down_proj/bias", (("embed",),), (0,), "mlp_bias"),
)


def dim_sizes(cfg: ModelConfig | VisionConfig) -> dict[str, int]:
    """Sizes of the named dims used in `HFParam.hf_dims` (a VLM's vision table: `VisionConfig.dim_sizes`)."""
    if isinstance(cfg, VisionConfig):
        return cfg.dim_sizes()
    return {"vocab": cfg.vocab_size, "embed": cfg.hidden_size, "mlp": cfg.intermediate_size,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}


def table_for(cfg: ModelConfig) -> list[HFParam]:
    """The rows of `PARAM_TABLE` that exist for this architecture."""
    return [p for p in PARAM_TABLE if p.enabled(cfg)]


def hf_shape(entry: HFParam, cfg: ModelConfig) -> tuple[int, ...]:
    """Shape of one HF tensor of this row (one layer's, for per-layer rows)."""
    sizes = dim_sizes(cfg)
    return tuple(math.prod(sizes[d] for d in group) for group in entry.hf_dims)


def to_ours(entry: HFParam, cfg: ModelConfig, tensor: np.ndarray) -> np.ndarray:
    """One HF tensor -> our (per-layer) layout."""
    sizes = dim_sizes(cfg)
    return np.asarray(tensor).reshape([sizes[d] for d in entry.view_dims]).transpose(entry.perm)


def to_hf(entry: HFParam, cfg: ModelConfig, array: np.ndarray) -> np.ndarray:
    """Our (per-layer) array -> one HF tensor (C-contiguous, ready to serialise)."""
    inverse = tuple(int(i) for i in np.argsort(entry.perm))
    return np.ascontiguousarray(np.asarray(array).transpose(inverse).reshape(hf_shape(entry, cfg)))


def get_path(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set_path(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def iter_hf_tensors(cfg: ModelConfig, params: Params) -> Iterator[tuple[str, np.ndarray]]:
    """Yields `(hf_name, tensor)` one at a time (for streaming weight sync).

    Each parameter is fetched to host once (all layers of a stacked one), so arrays must be
    fully addressable: on several hosts, gather them first (`process_allgather`).
    """
    params = stack_layers(params)  # the table's paths are the scanned layout's
    for entry in table_for(cfg):
        value = np.asarray(jax.device_get(get_path(params, entry.path)))
        if not entry.per_layer:
            yield entry.hf_name, to_hf(entry, cfg, value)
            continue
        for i, name in enumerate(entry.names(cfg)):
            yield name, to_hf(entry, cfg, value[i])


def to_hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """All parameters as `{hf_name: numpy array}` in HF layout (value head excluded)."""
    if cfg.vision is not None:
        return vlm_to_hf_tensors(cfg, params)
    return dict(iter_hf_tensors(cfg, params))


def from_hf_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Params:
    """`{hf_name: array}` -> our nested param dict (numpy, in `cfg.param_dtype`)."""
    _check_names(cfg, tensors.keys())
    params: Params = {}
    dtype = np.dtype(jnp.dtype(cfg.param_dtype))
    for entry in table_for(cfg):
        arrays = [to_ours(entry, cfg, tensors[name]) for name in entry.names(cfg)]
        value = np.stack(arrays) if entry.per_layer else arrays[0]
        _set_path(params, entry.path, value.astype(dtype))
    return in_layout(cfg, params)


def _check_names(cfg: ModelConfig, available) -> None:
    available = set(available)
    missing = [n for e in table_for(cfg) for n in e.names(cfg) if n not in available]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors this config needs, e.g. {missing[:4]}; "
                         "check model_type / tie_word_embeddings / attention_bias in config.json.")


# --- config translation ------------------------------------------------------------------


def _rope_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Rope fields from `rope_parameters` (transformers v5), `rope_scaling` or `rope_theta`."""
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = dict(hf.get(field) or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return out | {"rope_scaling_type": "none"}
    if kind not in ("linear", "llama3"):
        raise ValueError(f"config.json {field}.rope_type={kind!r} is not supported; "
                         "supported rope types are 'default', 'linear' and 'llama3'.")
    out |= {"rope_scaling_type": kind, "rope_scaling_factor": float(rope["factor"])}
    if kind == "llama3":
        out |= {"rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
                "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
                "rope_original_max_position": int(rope["original_max_position_embeddings"])}
    return out


def _sliding_from_hf(hf: Mapping[str, Any], model_type: str) -> int:
    """One window for all layers (0 = off); mixed full/sliding layers are refused."""
    window = hf.get("sliding_window") or 0
    if model_type == "mistral" or not window:
        return int(window)
    if not hf.get("use_sliding_window", False):
        return 0
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 0) else "full_attention"
        for i in range(layers)]
    if all(t == "full_attention" for t in types):
        return 0
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise ValueError("config.json layer_types mixes full and sliding attention layers; rlvr supports one "
                     "window for all layers (set max_window_layers to 0 or to num_hidden_layers).")


def config_from_hf(hf: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """A `ModelConfig` from a HF `config.json` dict (llama / qwen2 / qwen3 / mistral; qwen2_5_vl: a VLM)."""
    model_type = hf.get("model_type")
    if model_type == VLM_MODEL_TYPE:
        return vlm_config_from_hf(hf, **overrides)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported model types "
                         f"are {SUPPORTED_MODEL_TYPES}.")
    heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False)) and model_type in ("llama", "qwen3")
    values = dict(
        family=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)) and model_type == "llama",
        qk_norm=model_type == "qwen3", sliding_window=_sliding_from_hf(hf, model_type),
        **_rope_from_hf(hf),
    )
    return ModelConfig(**(values | overrides))


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_type != "none":
        params |= {"rope_type": cfg.rope_scaling_type, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling_type == "llama3":
        params |= {"low_freq_factor": cfg.rope_low_freq_factor,
                   "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_position}
    legacy = {k: v for k, v in params.items() if k != "rope_theta"} if cfg.rope_scaling_type != "none" else None
    # rope_parameters for transformers 5; rope_theta / rope_scaling for 4.x readers (SGLang, vLLM).
    return {"rope_theta": cfg.rope_theta, "rope_parameters": params, "rope_scaling": legacy}


def _check_exportable(cfg: ModelConfig) -> None:
    """Refuses combinations the HF class of `cfg.family` cannot express."""
    expected = {
        "llama": dict(qk_norm=False, qkv_bias=cfg.o_bias),
        "qwen2": dict(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False),
        "qwen3": dict(qk_norm=True, qkv_bias=cfg.o_bias, mlp_bias=False),
        "mistral": dict(qk_norm=False, qkv_bias=False, o_bias=False, mlp_bias=False),
    }[cfg.family]
    wrong = {k: v for k, v in expected.items() if getattr(cfg, k) != v}
    if wrong:
        raise ValueError(f"model.family={cfg.family!r} in Hugging Face format needs {wrong}; "
                         "change those model.* fields or the family.")


def config_to_hf(cfg: ModelConfig, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A `config.json` dict that transformers 5.x (and 4.x / SGLang) loads."""
    if cfg.vision is not None:
        out = vlm_config_to_hf(cfg) | dict(extra or {})
        # the special ids in the decoder's config too (else transformers takes Qwen's 151645 as the eos)
        out["text_config"] |= {k: v for k, v in (extra or {}).items() if k.endswith("_token_id")}
        return out
    _check_exportable(cfg)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_dropout": 0.0, "use_cache": True,
        "dtype": cfg.param_dtype, "torch_dtype": cfg.param_dtype, **_rope_to_hf(cfg),
    }
    if cfg.family in ("llama", "qwen3"):
        out["attention_bias"] = cfg.qkv_bias
    if cfg.family == "llama":
        out["mlp_bias"] = cfg.mlp_bias
    if cfg.family == "mistral":
        out["sliding_window"] = cfg.sliding_window or None
    if cfg.family in ("qwen2", "qwen3"):
        kind = "sliding_attention" if cfg.sliding_window else "full_attention"
        out |= {"use_sliding_window": bool(cfg.sliding_window), "sliding_window": cfg.sliding_window or None,
                "max_window_layers": 0 if cfg.sliding_window else cfg.num_layers,
                "layer_types": [kind] * cfg.num_layers}
    return out | dict(extra or {})


# --- loading -----------------------------------------------------------------------------


def weight_files(path: str) -> dict[str, str]:
    """{tensor name: file} for a single-file or sharded (index json) checkpoint."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(single, framework="numpy") as f:
        return dict.fromkeys(f.keys(), single)


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append((start, stop))
    return out


def read_block(entry: HFParam, cfg: ModelConfig, get_slice: Callable[[tuple[slice, ...]], np.ndarray],
               bounds: list[tuple[int, int]]) -> np.ndarray:
    """The block `bounds` (per-layer dims, our layout) of one HF tensor, reading only its rows.

    Each flattened HF axis is read over the range of its *outer* dim, so a shard of heads
    reads only those heads' rows; slices of inner dims are applied after the reshape.
    """
    sizes = [dim_sizes(cfg)[d] for d in entry.view_dims]
    view_bounds: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for k, p in enumerate(entry.perm):
        view_bounds[p] = bounds[k]
    hf_index, block_shape, post = [], [], []
    pos = 0
    for group in entry.hf_dims:
        (start, stop), inner = view_bounds[pos], math.prod(sizes[pos + 1:pos + len(group)])
        hf_index.append(slice(start * inner, stop * inner))
        block_shape += [stop - start] + sizes[pos + 1:pos + len(group)]
        post += [slice(None)] + [slice(*b) for b in view_bounds[pos + 1:pos + len(group)]]
        pos += len(group)
    block = np.asarray(get_slice(tuple(hf_index))).reshape(block_shape)[tuple(post)]
    return block.transpose(entry.perm)


class _Reader:
    """Keeps safetensors files open during one load; serves slices by HF tensor name."""

    def __init__(self, files: Mapping[str, str], stack: contextlib.ExitStack):
        self.files = files
        self.handles = {f: stack.enter_context(safe_open(f, framework="numpy")) for f in set(files.values())}

    def slicer(self, name: str) -> Callable[[tuple[slice, ...]], np.ndarray]:
        handle = self.handles[self.files[name]].get_slice(name)
        return lambda index: handle[index]


def _load_param(entry: HFParam, cfg: ModelConfig, reader: _Reader, shape, sharding_, dtype) -> jax.Array:
    cache: dict[tuple, np.ndarray] = {}  # replicated shards ask for the same block repeatedly

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        bounds = _bounds(index, shape)
        key = tuple(bounds)
        if key not in cache:
            if entry.per_layer:
                blocks = [read_block(entry, cfg, reader.slicer(entry.hf_name.format(i=i)), bounds[1:])
                          for i in range(*bounds[0])]
                block = np.stack(blocks)
            else:
                block = read_block(entry, cfg, reader.slicer(entry.hf_name), bounds)
            cache[key] = np.ascontiguousarray(block.astype(dtype))
        return cache[key]

    return jax.make_array_from_callback(shape, sharding_, callback)


def load_hf_checkpoint(
    path: str,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.LOGICAL_AXIS_RULES,
    dtype: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, Params]:
    """(cfg, params) from a HF checkpoint directory, each shard read straight into place.

    `dtype` sets `param_dtype` (default: the config's float32, i.e. fp32 master weights even
    for bf16 files); `overrides` replace other `ModelConfig` fields (e.g. compute `dtype`,
    `remat_policy`). HF checkpoints have no value head, so `value_head=True` is refused.
    """
    with open(os.path.join(path, "config.json")) as f:
        cfg = config_from_hf(json.load(f), **dict(overrides or {}))
    if dtype is not None:
        cfg = dataclasses.replace(cfg, param_dtype=dtype)
    if cfg.value_head:
        raise ValueError("model.value_head: HF checkpoints have no value head; load without it and add one.")
    if mesh is None:
        mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
    if cfg.vision is not None:
        return cfg, load_vlm_params(cfg, path, mesh, rules)
    files = weight_files(path)
    _check_names(cfg, files.keys())
    stacked = dataclasses.replace(cfg, scan_layers=True)  # the table's paths; then the layout cfg runs
    return cfg, in_layout(cfg, load_table(cfg, table_for(cfg), files, abstract_params(stacked),
                                          param_shardings(stacked, mesh, rules)))


def load_table(cfg: ModelConfig | VisionConfig, table: list[HFParam], files: Mapping[str, str], shapes: Params,
               shardings: Params) -> Params:
    """The params of `table`'s rows read from `files` ({HF name: safetensors file}), each device
    shard read straight into place; `shapes` / `shardings` are the abstract params and their shardings."""
    params: Params = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(files, stack)
        for entry in table:
            abstract = get_path(shapes, entry.path)
            value = _load_param(entry, cfg, reader, abstract.shape, get_path(shardings, entry.path),
                                np.dtype(abstract.dtype))
            _set_path(params, entry.path, value)
    return params


# --- export ------------------------------------------------------------------------------


def _shard_groups(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    groups: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if groups[-1] and size + tensor.nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = tensor
        size += tensor.nbytes
    return groups


def write_safetensors(tensors: Mapping[str, np.ndarray], out_dir: str, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors + index json when larger."""
    groups = _shard_groups(tensors, max_shard_bytes)
    meta = {"format": "pt"}
    if len(groups) == 1:
        save_file(dict(groups[0]), os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(dict(group), os.path.join(out_dir, file), metadata=meta)
        weight_map |= dict.fromkeys(group, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def _token_ids(tokenizer: Tokenizer | None) -> dict[str, Any]:
    if tokenizer is None:
        return {}
    ids = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
    return {k: v for k, v in ids.items() if v is not None}


def export_hf_checkpoint(
    cfg: ModelConfig,
    params: Params,
    out_dir: str,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    extra_config: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
) -> None:
    """Writes a HF-layout checkpoint: config.json, weights, generation_config.json (the tokenizer's
    special ids: the end-of-turn token stops generation), a VLM's preprocessor_config.json and the
    tokenizer files of `tokenizer_dir`, with `chat_template` (when given) as its chat template."""
    os.makedirs(out_dir, exist_ok=True)
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        src = os.path.join(tokenizer_dir, name)
        if os.path.exists(src) and name != "generation_config.json":
            shutil.copyfile(src, os.path.join(out_dir, name))
    if chat_template:
        write_chat_template(out_dir, chat_template)
    ids = _token_ids(Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg, {**ids, **(extra_config or {})}), f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(ids, f, indent=2)
    if cfg.vision is not None:  # a VLM: its image processor's settings (`AutoProcessor`, SGLang)
        with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
            json.dump(processor_config(cfg.vision), f, indent=2)
    write_safetensors(to_hf_tensors(cfg, params), out_dir, max_shard_bytes)


# --- the Qwen2.5-VL-layout VLM (rlvr.models.vision) ------------------------------------------------------
# The decoder's tensors are the text model's (`PARAM_TABLE`, family qwen2, same names: HF saves Qwen2.5-VL as
# `model.layers.*`, `lm_head.weight`); the encoder's are `VISION_TABLE`, rows of the same `HFParam` kind over
# `VisionConfig.dim_sizes`. Loading reads each device shard straight into place (`load_table`), as the text
# path does; the load / export / config functions above hand a `qwen2_5_vl` checkpoint (or a config with
# `vision`) to the `vlm_*` functions here.

VLM_MODEL_TYPE = "qwen2_5_vl"

_B = "visual.blocks.{i}."
_HD = ("heads", "head_dim")
VISION_TABLE: tuple[HFParam, ...] = (
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


def _vlm_text_dict(config: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
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


def vlm_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """The VLM's config (the decoder's, with `vision`) from a Qwen2.5-VL `config.json` dict."""
    if config.get("model_type") != VLM_MODEL_TYPE:
        raise ValueError(f"config.json model_type={config.get('model_type')!r}: the VLM loader reads "
                         f"{VLM_MODEL_TYPE!r} checkpoints (Qwen2.5-VL layout).")
    text, section = _vlm_text_dict(config)
    cfg = config_from_hf(text, mrope_section=section, **{k: v for k, v in overrides.items() if k != "vision"})
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


def vlm_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers-5 `config.json` dict (nested text and vision configs)."""
    vcfg = cfg.vision
    text = config_to_hf(dataclasses.replace(cfg, vision=None))
    text.pop("architectures")
    text.pop("rope_scaling")
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.mrope_section)}
    text["model_type"] = f"{VLM_MODEL_TYPE}_text"
    vision = {"model_type": f"{VLM_MODEL_TYPE}_vision", "depth": vcfg.num_layers, "hidden_size": vcfg.hidden_size,
              "intermediate_size": vcfg.intermediate_size, "num_heads": vcfg.num_heads, "hidden_act": "silu",
              "out_hidden_size": vcfg.out_hidden_size, "in_channels": vcfg.in_channels,
              "patch_size": vcfg.patch_size, "temporal_patch_size": vcfg.temporal_patch_size,
              "spatial_merge_size": vcfg.spatial_merge_size, "window_size": vcfg.window_size,
              "fullatt_block_indexes": list(vcfg.full_attention_layers),
              "rope_parameters": {"rope_type": "axial", "rope_theta": vcfg.rope_theta}}
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": VLM_MODEL_TYPE,
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
    files = weight_files(path)
    missing = [n for e in VISION_TABLE for n in e.names(cfg.vision) if n not in files]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}; is it Qwen2.5-VL?")
    stacked = dataclasses.replace(cfg, scan_layers=True)  # the tables' paths; then the layout cfg runs
    shapes, shardings = abstract_params(stacked), param_shardings(stacked, mesh, rules)
    text_cfg = dataclasses.replace(stacked, vision=None)
    params = load_table(text_cfg, table_for(text_cfg), files, shapes, shardings)
    return in_layout(cfg, params | load_table(cfg.vision, list(VISION_TABLE), files, shapes, shardings))


def vlm_to_hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """All parameters as `{hf_name: numpy array}` in the HF layout."""
    tensors = to_hf_tensors(dataclasses.replace(cfg, vision=None), params)
    for entry in VISION_TABLE:
        value = np.asarray(jax.device_get(get_path(params, entry.path)))
        for i, name in enumerate(entry.names(cfg.vision)):
            tensors[name] = to_hf(entry, cfg.vision, value[i] if entry.per_layer else value)
    return tensors
