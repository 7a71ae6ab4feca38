"""Low-rank adapters (LoRA) and quantised frozen bases (QLoRA), beside the params they adapt.

`Linear` in rlvr/models/transformer.py runs them. A LoRA model's params are its base model's tree
with, in every projection named in `lora.targets` (q_proj … down_proj: the Hugging Face / PEFT
module names), two more leaves:

  lora_a [*in_shape, rank]   logical axes: the kernel's input axes + "lora_rank" (PEFT's lora_A, transposed)
  lora_b [rank, *out_shape]  "lora_rank" + the kernel's output axes (PEFT's lora_B, transposed)

and `y = x·W + (dropout(x)·A)·B · alpha/rank`. B starts at zero, so a fresh adapter is the base model
exactly. With `lora.quantize` (QLoRA) every projection kernel of the base is stored as an int8 `kernel`
(int4: two per byte, a uint8 `kernel` with the last output dim halved) with a float32 `kernel_scale`
[in/block, *out_shape] (blockwise absmax), dequantised in the forward pass; embeddings, norms and the
output head stay in `model.param_dtype`.

What trains is decided once, by leaf name (`is_trainable`): the adapters, and a value head. `split`
cuts a tree into (trainable, frozen base): the train state holds only the first (so the optimizer has
state for the adapters alone, and checkpoints hold adapters only); the base is a frozen jit argument,
and also the reference policy (no copy). `attach` turns a base model's params into the LoRA model's
(quantised, fresh adapters); `merge` folds adapters and quantisation back into plain weights (for
the rollout engine, the export and the next job of a chain).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rlvr.models import params as params_lib
from rlvr.models.config import LORA_TARGETS, QUANTIZE, LoraConfig, ModelConfig
from rlvr.models.layers import dequantize, pack_int4

Params = dict[str, Any]
ADAPTER_LEAVES = ("lora_a", "lora_b")
TRAINABLE_MODULES = ("value_proj",)  # trained alongside the adapters (a reward model's / PPO critic's head)
# Input dims of each projection's kernel ([*in, *out] after any stacked-layers axis).
IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1, "up_proj": 1, "down_proj": 1}


def is_trainable(path: tuple[str, ...]) -> bool:
    """Whether the leaf at `path` trains in a LoRA model: an adapter, or a value head."""
    return path[-1] in ADAPTER_LEAVES or path[0] in TRAINABLE_MODULES


def _select(tree: Mapping[str, Any], keep: Callable[[tuple[str, ...]], bool], path=()) -> Params:
    out = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            inner = _select(value, keep, (*path, key))
            if inner:
                out[key] = inner
        elif keep((*path, key)):
            out[key] = value
    return out


def trainable(tree: Mapping[str, Any]) -> Params:
    """The trainable leaves of a params-shaped tree (params, shardings, shapes)."""
    return _select(tree, is_trainable)


def frozen(tree: Mapping[str, Any]) -> Params:
    """The frozen leaves: the base model (quantised or not), without adapters."""
    return _select(tree, lambda p: not is_trainable(p))


def split(tree: Mapping[str, Any]) -> tuple[Params, Params]:
    return trainable(tree), frozen(tree)


def combine(a: Mapping[str, Any], b: Mapping[str, Any]) -> Params:
    """The union of two disjoint params-shaped trees (e.g. trainable + frozen)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = combine(out[key], value) if key in out and isinstance(value, Mapping) else value
    return out


def without_lora(cfg: ModelConfig) -> ModelConfig:
    """The base model's config (plain weights, no adapters)."""
    return dataclasses.replace(cfg, lora=LoraConfig())


def adapter_count(cfg: ModelConfig) -> int:
    """Adapter parameters (all layers) of a LoRA model."""
    shapes = params_lib.abstract_params(cfg)
    return sum(x.size for x in jax.tree.leaves(_select(shapes, lambda p: p[-1] in ADAPTER_LEAVES)))


# --- quantisation -------------------------------------------------------------------------------

def quantize(w: jax.Array, bits: int, block: int) -> tuple[jax.Array, jax.Array]:
    """Blockwise symmetric absmax quantisation of w [..., in, out] (blocks of `block` input rows):
    (q [..., in, out] int8, or for 4 bits uint8 [..., in, out / 2] (`pack_int4`: two values per
    byte), scale [..., in / block, out] float32); `dequantize` inverts it."""
    *lead, n_in, n_out = w.shape
    if bits == 4 and n_out % 2:
        raise ValueError(f"int4 QLoRA packs two weights per byte along the output dim; {n_out} is odd "
                         "(use lora.quantize='int8')")
    qmax = 2 ** (bits - 1) - 1
    blocks = w.astype(jnp.float32).reshape(*lead, n_in // block, block, n_out)
    scale = jnp.max(jnp.abs(blocks), axis=-2) / qmax
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(blocks / scale[..., None, :]), -qmax, qmax)
    q = q.reshape(w.shape).astype(jnp.int8)
    return (q if bits == 8 else pack_int4(q)), scale


def _as_2d(kernel: jax.Array, name: str, lead: int) -> tuple[jax.Array, tuple[int, ...]]:
    """A projection kernel [*lead, *in, *out] as [*lead, in, out] (and the original shape)."""
    shape = kernel.shape
    n_in = IN_DIMS[name]
    ins, outs = shape[lead:lead + n_in], shape[lead + n_in:]
    return kernel.reshape(*shape[:lead], _prod(ins), _prod(outs)), shape


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _projections(tree: Mapping[str, Any], path=()):
    """Yields (path, module dict) of every decoder projection (a dict named in LORA_TARGETS with a kernel;
    not a VLM's vision tower under `visual`, whose layers take no adapters and stay unquantised)."""
    for key, value in tree.items():
        if isinstance(value, Mapping) and (path or key != "visual"):
            if key in LORA_TARGETS and "kernel" in value:
                yield (*path, key), value
            else:
                yield from _projections(value, (*path, key))


def _stacked(path: tuple[str, ...]) -> int:
    """Leading stacked-layer axes of a param under `path` (scanned `layers/...`: 1)."""
    return 1 if path[0] == "layers" else 0


def _set(tree: Params, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def quantize_base(lora: LoraConfig, base: Params) -> Params:
    """The base with every projection kernel quantised (`lora.quantize`) into kernel + kernel_scale."""
    out = jax.tree.map(lambda x: x, base)
    bits = QUANTIZE[lora.quantize]
    for path, module in _projections(base):
        lead = _stacked(path)
        w2, shape = _as_2d(module["kernel"], path[-1], lead)
        if w2.shape[-2] % lora.quant_block:
            raise ValueError(f"lora.quant_block={lora.quant_block} must divide the input width of every quantised "
                             f"projection; {'/'.join(path)} takes {w2.shape[-2]}: set lora.quant_block to a divisor "
                             f"of it (e.g. {math.gcd(w2.shape[-2], lora.quant_block)}) or lora.quantize='none'.")
        q, scale = quantize(w2, bits, lora.quant_block)
        _set(out, (*path, "kernel"), q.reshape(*shape[:-1], -1))  # int4: the last dim packed, halved
        n_in = IN_DIMS[path[-1]]
        _set(out, (*path, "kernel_scale"), scale.reshape(*scale.shape[:-1], *shape[lead + n_in:]))
    return out


# --- attach and merge ---------------------------------------------------------------------------

def attach(cfg: ModelConfig, base: Params, rng: jax.Array, mesh: Mesh) -> Params:
    """The LoRA model `cfg`'s params from its base model's (plain weights): the base quantised when
    `lora.quantize` is set, fresh adapters (A random, B zero) from `rng`; all in their shardings."""
    shardings = dict(_leaves(params_lib.param_shardings(cfg, mesh)))

    def build(base, rng):
        boxed = params_lib.init_boxed(cfg, rng)  # only the adapters are kept: XLA drops the rest
        adapters = _select(nn.unbox(boxed), lambda p: p[-1] in ADAPTER_LEAVES)
        stored = quantize_base(cfg.lora, base) if cfg.lora.quantize != "none" else base
        return combine(stored, adapters)

    out_shardings = _unflatten(shardings_like(build, (base, rng), shardings))
    return jax.jit(build, out_shardings=out_shardings)(base, rng)


def merge(cfg: ModelConfig, params: Params) -> Params:
    """Plain weights of a LoRA model (for `without_lora(cfg)`): each projection's kernel dequantised
    and its adapter's update B·A·alpha/rank added, in `model.param_dtype`; same shardings."""
    if not cfg.lora.enabled:
        return params
    return _merge_fn(cfg)(params)


@functools.lru_cache(maxsize=8)
def _merge_fn(cfg: ModelConfig):
    def fold(params):
        out = _select(params, lambda p: p[-1] not in (*ADAPTER_LEAVES, "kernel_scale"))
        for path, module in _projections(params):
            _set(out, (*path, "kernel"), merged_kernel(cfg, path, module))
        return out

    def run(params):
        # every output leaf keeps its input's sharding (a merged kernel: the stored kernel's)
        shardings = {path: value.sharding for path, value in _leaves(params)}
        return jax.jit(fold, out_shardings=_unflatten(shardings_like(fold, (params,), shardings)))(params)
    return run


def shardings_like(fn, args: tuple, shardings: Mapping[tuple[str, ...], Any]) -> dict:
    """{path: sharding} of the leaves of `fn(*args)` (a params-shaped dict), from `shardings` by path."""
    return {path: shardings[path] for path, _ in _leaves(jax.eval_shape(fn, *args))}


def merged_kernel(cfg: ModelConfig, path: tuple[str, ...], module: Mapping[str, jax.Array]) -> jax.Array:
    """One projection's plain kernel: dequantised (QLoRA) plus its adapter's update (when it has one)."""
    lead, name = _stacked(path), path[-1]
    kernel = module["kernel"]
    w2, shape = _as_2d(kernel, name, lead)
    if "kernel_scale" in module:
        scale = module["kernel_scale"]
        w2 = dequantize(w2, scale.reshape(*scale.shape[:lead + 1], -1))
        shape = (*shape[:-1], shape[-1] * 2) if kernel.dtype == jnp.uint8 else shape  # int4 unpacked
    w2 = w2.astype(jnp.float32)
    if "lora_a" in module:
        a, b = module["lora_a"], module["lora_b"]
        rank = a.shape[-1]
        a2 = a.reshape(*a.shape[:lead], -1, rank).astype(jnp.float32)
        b2 = b.reshape(*b.shape[:lead], rank, -1).astype(jnp.float32)
        w2 = w2 + jnp.einsum("...ir,...ro->...io", a2, b2) * cfg.lora.scale
    return w2.reshape(shape).astype(cfg.param_dtype)


def _leaves(tree: Mapping[str, Any], path=()):
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


def _unflatten(flat: Mapping[tuple[str, ...], Any]) -> Params:
    out: Params = {}
    for path, value in flat.items():
        _set(out, path, value)
    return out
