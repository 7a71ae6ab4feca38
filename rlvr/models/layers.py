"""The layers the decoder (rlvr.models.transformer) and the vision encoder (rlvr.models.vision) share:
RMSNorm, `Linear` (quantised bases, LoRA adapters, packed kernels), rotary embedding and plain-XLA GQA
attention. Below both model modules, so the decoder can hold the VLM without a circle.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from rlvr.kernels.chunked_logprob.reference import project
from rlvr.kernels.packed_matmul import packed_matmul
from rlvr.kernels.target import target_platform
from rlvr.models.config import QUANTIZE, LoraConfig

_INIT = nn.initializers.normal(stddev=0.02)


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _param(module: nn.Module, name: str, init, shape, axes, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as Hugging Face does), scale applied in input dtype."""

    dim: int
    eps: float
    axis_name: str = "embed"
    param_dtype: str = "float32"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(self, "scale", nn.initializers.ones, (self.dim,), (self.axis_name,),
                       _dtype(self.param_dtype))
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * normed.astype(x.dtype)


class Linear(nn.Module):
    """`y = x · W (+ b)` contracting the last `len(in_axes)` dims of x; logical axes given.

    With `lora` (the model's LoraConfig): a base quantised by QLoRA is stored as an int `kernel` (int8,
    or int4 packed two per byte into uint8 along the last output dim) with `kernel_scale` and
    dequantised here; a projection named in `lora.targets` adds its low-rank
    update `(dropout(x) · lora_a) · lora_b · alpha/rank` when the params hold the adapter (so the same
    module runs the base alone from a tree without adapters: the reference policy of a LoRA run).
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_axes: tuple[str, ...]
    out_axes: tuple[str, ...]
    use_bias: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    lora: LoraConfig | None = None
    # the output projection: float32 products and output whatever `dtype` (`project`, the chunked
    # log-probs' own), so logits in bf16 models are not rounded to bf16
    float32_output: bool = False
    # on XLA:CPU, the kernel's gradient from a transposed copy of the input (`cpu_matmul`); off under
    # activation rematerialisation, whose policies cannot save a custom VJP's product
    cpu_weight_grad: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        # As one 2-D matmul [tokens, in] x [in, out]: XLA:CPU handles the weight gradient of a
        # single contraction without materialising transposed activations.
        n_in = len(self.in_shape)
        lead = x.shape[: x.ndim - n_in]
        x2 = x.reshape(-1, math.prod(self.in_shape)).astype(self.dtype)
        if self.has_variable("params", "kernel_packed"):  # the rollout engine's packed tree (`pack_projections`)
            y = self._packed(x2).reshape(*lead, *self.out_shape)
        else:
            w2 = self._weight_2d()
            if self.cpu_weight_grad and target_platform() == "cpu":
                y = cpu_matmul(x2, w2, jnp.dtype(jnp.float32 if self.float32_output else x2.dtype))
            else:
                y = project(x2, w2) if self.float32_output else _matmul(x2, w2)
            y = y.reshape(*lead, *self.out_shape)
        if self.use_bias:
            bias = _param(self, "bias", nn.initializers.zeros, self.out_shape, self.out_axes,
                          _dtype(self.param_dtype))
            y = y + bias.astype(self.dtype)
        if self.lora is not None and self.lora.enabled and self.name in self.lora.targets:
            delta = self._adapter(x2)
            y = y if delta is None else y + delta.reshape(y.shape)
        return y

    def _packed(self, x2: jax.Array) -> jax.Array:
        """x2 @ the kernel held as `kernel_packed` (`pack_projections`), float32 through the native kernel."""
        packed = self.get_variable("params", "kernel_packed")
        if packed.shape[1] != x2.shape[1]:
            raise ValueError(f"{self.name}: kernel_packed {packed.shape} packs {packed.shape[1]} inputs, the layer "
                             f"takes {x2.shape[1]} (in_shape {self.in_shape}); pack with pack_projections")
        return packed_matmul(x2, packed, math.prod(self.out_shape)).astype(self.dtype)

    def _weight_2d(self) -> jax.Array:
        """The kernel as [in, out] in the compute dtype (dequantised when the base is quantised)."""
        shape, axes = self.in_shape + self.out_shape, self.in_axes + self.out_axes
        bits = QUANTIZE[self.lora.quantize] if self.lora is not None else 0
        n_in = math.prod(self.in_shape)
        if not bits:
            kernel = _param(self, "kernel", _INIT, shape, axes, _dtype(self.param_dtype))
            return kernel.reshape(n_in, -1).astype(self.dtype)
        blocks = n_in // self.lora.quant_block
        if bits == 4:  # packed two per byte along the last output dim (`pack_int4`)
            shape = (*shape[:-1], shape[-1] // 2)
        kernel = _param(self, "kernel", nn.initializers.zeros, shape, axes, jnp.int8 if bits == 8 else jnp.uint8)
        scale = _param(self, "kernel_scale", nn.initializers.ones, (blocks, *self.out_shape), (None, *self.out_axes),
                       jnp.float32)
        return dequantize(kernel.reshape(n_in, -1), scale.reshape(blocks, -1)).astype(self.dtype)

    def _adapter(self, x2: jax.Array) -> jax.Array | None:
        lora = self.lora
        if not (self.is_initializing() or self.has_variable("params", "lora_a")):
            return None  # a tree without adapters: the base model
        a = _param(self, "lora_a", _lora_a_init(math.prod(self.in_shape)), (*self.in_shape, lora.rank),
                   (*self.in_axes, "lora_rank"), _dtype(self.param_dtype))
        b = _param(self, "lora_b", nn.initializers.zeros, (lora.rank, *self.out_shape), ("lora_rank", *self.out_axes),
                   _dtype(self.param_dtype))
        if lora.dropout and self.has_rng("dropout"):
            x2 = nn.Dropout(lora.dropout, deterministic=False)(x2)
        h = x2 @ a.reshape(-1, lora.rank).astype(self.dtype)
        return (h @ b.reshape(lora.rank, -1).astype(self.dtype)) * jnp.asarray(lora.scale, self.dtype)


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w in their dtype; 16-bit operands are multiplied with float32 accumulation and the
    result rounded once (what a TPU's MXU does), which XLA:CPU runs as a native bf16 product
    (~1.8x its fp32 FLOP/s on AVX512-BF16) instead of converting the weights to fp32 per call."""
    if jnp.dtype(x.dtype).itemsize >= 4:
        return x @ w
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _product(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """a @ b in `out_dtype`, float32 accumulation (`_matmul`'s rule)."""
    if jnp.dtype(a.dtype).itemsize >= 4 and jnp.dtype(b.dtype).itemsize >= 4 and jnp.dtype(out_dtype) == jnp.float32:
        return a @ b
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def cpu_matmul(x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
    """x [M, K] @ w [K, N] in `out_dtype`, whose weight gradient xᵀ·dy multiplies a transposed copy
    of x. Why: XLA:CPU runs the plain transpose rule's product (contracting both operands over their
    major axis, the tokens) on its generic path at about half the FMA rate of a product that contracts
    over a minor axis (one thread, [512, 256]ᵀ·[512, 1024]: 46 vs 87 GFLOP/s; copying x costs ~0.1 ms);
    the optimisation barrier keeps XLA from folding the copy back into the product."""
    return _product(x, w, out_dtype)


def _cpu_matmul_fwd(x, w, out_dtype):
    return _product(x, w, out_dtype), (x, w)


def _cpu_matmul_bwd(out_dtype, residuals, dy):
    x, w = residuals
    return _product(dy, w.T, x.dtype), _product(jax.lax.optimization_barrier(x.T), dy, w.dtype)


cpu_matmul.defvjp(_cpu_matmul_fwd, _cpu_matmul_bwd)


def _lora_a_init(fan_in: int):
    """PEFT's default for lora_A (kaiming-uniform with a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return lambda rng, shape, dtype: jax.random.uniform(rng, shape, dtype, -bound, bound)


def pack_int4(q: jax.Array) -> jax.Array:
    """int4 values in [-8, 7] [..., 2n] -> uint8 [..., n]: two per byte along the last axis (even
    index in the low nibble), the storage of an int4 QLoRA base."""
    q = q.astype(jnp.int8)
    return ((q[..., 0::2] & 0xF) | (q[..., 1::2] << 4)).astype(jnp.uint8)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """`pack_int4`'s inverse: uint8 [..., n] -> int8 [..., 2n] (each nibble sign-extended)."""
    byte = packed.astype(jnp.int8)
    low, high = (byte << 4) >> 4, byte >> 4  # arithmetic shifts sign-extend the nibbles
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
    """Blockwise absmax dequantisation (rlvr.models.lora.quantize): q [..., in, out] int8 (or uint8
    [..., in, out / 2]: int4 packed two per byte, `pack_int4`) and scale [..., in / block, out]
    -> float32 [..., in, out]."""
    if q.dtype == jnp.uint8:
        q = unpack_int4(q)
    blocks = scale.shape[-2]
    w = q.astype(jnp.float32).reshape(*q.shape[:-2], blocks, q.shape[-2] // blocks, q.shape[-1])
    return (w * scale[..., :, None, :]).reshape(q.shape)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, length, heads, head_dim]; rotate-half RoPE computed in float32."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def dot_product_attention(q, k, v, mask) -> jax.Array:
    """Plain-XLA GQA attention. q [B,T,H,D], k/v [B,S,KVH,D], mask [B,1,1,T,S].

    The G = H/KVH query heads sharing a KV head are folded into the query axis, so both
    products are plain batched matmuls over (batch, kv_head) and only the small [T, D]
    operands are transposed (1.6x faster fwd+bwd on CPU than transposing [T, S] scores).
    Queries are scaled before the product: T·D multiplies instead of T·S.
    """
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    if t == 1:
        return _single_query_attention(q, k, v, mask)
    q = (q * (1.0 / math.sqrt(d))).reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    logits = jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32).reshape(b, kvh, g, t, s)
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype).reshape(b, kvh, g * t, s)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, v).reshape(b, kvh, g, t, d)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def _single_query_attention(q, k, v, mask) -> jax.Array:
    """One query per row (decoding): broadcast-multiply-and-reduce in the cache's own
    [B, S, KVH, D] layout. The work is tiny; what matters is not transposing the gathered
    cache (a batched matmul would copy it to [B, KVH, S, D] every layer and step)."""
    b, _, h, d = q.shape
    kvh = k.shape[2]
    q = (q[:, 0] * (1.0 / math.sqrt(d))).reshape(b, 1, kvh, h // kvh, d)
    logits = jnp.sum(q.astype(jnp.float32) * k[:, :, :, None, :].astype(jnp.float32), axis=-1)  # [B,S,KVH,G]
    logits = jnp.where(mask[:, 0, 0, 0, :, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=1).astype(v.dtype)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :], axis=1)  # [B, KVH, G, D]
    return out.reshape(b, 1, h, d)
