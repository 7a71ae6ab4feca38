"""The architecture of a decoder, as a frozen dataclass built from a ConfigDict or HF config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_SCALING_TYPES = ("none", "linear", "llama3")
REMAT_POLICIES = ("none", "full", "dots", "dots_with_no_batch_dims")
DTYPES = ("float32", "bfloat16", "float16")
# Attention of the training (no-cache) path; decoding with a KV cache always uses the dense path.
#   xla      dense [T, T] mask, plain XLA (the reference behaviour)
#   flash    the flash kernel (rlvr.kernels.flash_attention) from segment ids and positions
#   ring     context parallelism over mesh.sequence: key/value blocks rotate around the devices
#   ulysses  context parallelism over mesh.sequence: all-to-all to a head split (heads divide)
# ring/ulysses run inside the train step's mesh; called without a mesh `sequence` axis > 1
# (evaluation, log-prob passes) they use the flash path and log it once.
ATTENTION = ("xla", "flash", "ring", "ulysses")
SHARED_PROMPT_ATTENTION = ("xla", "flash")  # those that train a shared-prompt batch (rl.share_prompts)


# Named architectures for configs: `config_lib.model_config_dict(preset="tiny", ...)`.
PRESETS: dict[str, dict] = {
    # Byte-level vocabulary (259 ids), 2 layers: learns small tasks in a minute on CPU.
    "tiny": dict(family="qwen3", vocab_size=264, hidden_size=128, intermediate_size=384, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0, max_position_embeddings=2048,
                 scan_unroll=2),
    # The fixed benchmark model shared with the Tunix peer figures (4,459,264 parameters).
    "bench": dict(family="qwen3", vocab_size=1024, hidden_size=256, intermediate_size=1024, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e6, max_position_embeddings=4096,
                  scan_unroll=4),
    # A realistic small chat model for the rollout benchmarks (34.9M parameters): a 32k BPE-sized
    # vocabulary with tied embeddings, 6 layers, GQA 8:2 heads, as Qwen3-0.6B scaled down.
    "bench_32k": dict(family="qwen3", vocab_size=32768, hidden_size=512, intermediate_size=1536, num_layers=6,
                      num_heads=8, num_kv_heads=2, head_dim=64, rope_theta=1e6, max_position_embeddings=4096,
                      tie_word_embeddings=True, scan_unroll=6),
}


# How a field relates to a checkpoint: RUNTIME fields choose how the model runs (a job may set them
# freely); every other field (the architecture, and value_head) is fixed by the weights, so a job that
# starts from a checkpoint takes them from it and refuses a `model.*` value that contradicts them.
RUNTIME_FIELDS = ("dtype", "param_dtype", "remat_policy", "scan_unroll", "scan_layers", "attention")

# The projections an adapter can target (their Hugging Face / PEFT module names), and groups of them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_GROUPS = {"all": LORA_TARGETS, "attention": LORA_TARGETS[:4], "mlp": LORA_TARGETS[4:]}
QUANTIZE = {"none": 0, "int8": 8, "int4": 4}  # frozen-base storage of QLoRA: bits per weight


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (`config.lora.*`, rlvr.models.lora); rank 0 = full fine-tuning."""

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0
    quantize: str = "none"
    quant_block: int = 64

    def __post_init__(self):
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets:
            raise ValueError(f"lora.targets: {', '.join(bad) or 'empty'} is not a projection; use a comma-separated "
                             f"subset of {', '.join(LORA_TARGETS)}, or one of {sorted(LORA_GROUPS)}.")
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank}: must be >= 0 (0 = full fine-tuning).")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha={self.alpha}: must be positive (the update is scaled by alpha/rank).")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout}: must be in [0, 1).")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"lora.quantize={self.quantize!r}: must be one of {sorted(QUANTIZE)}.")
        if self.quantize != "none" and not self.rank:
            raise ValueError(f"lora.quantize={self.quantize!r} freezes a quantised base, which needs adapters to "
                             "train: set lora.rank > 0 (QLoRA), or lora.quantize='none'.")
        if self.quant_block <= 0:
            raise ValueError(f"lora.quant_block={self.quant_block}: must be positive.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None) -> LoraConfig:
        """From the `lora.*` config section (None or missing: off). `targets` is comma-separated
        projection names or a group (all | attention | mlp)."""
        values = dict(values or {})
        names = [t.strip() for t in str(values.pop("targets", "all")).split(",") if t.strip()]
        targets = tuple(dict.fromkeys(n for name in names for n in LORA_GROUPS.get(name, (name,))))
        return cls(targets=targets, **{k: v for k, v in values.items() if k in _LORA_FIELDS})


_LORA_FIELDS = ("rank", "alpha", "dropout", "quantize", "quant_block")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision encoder of a Qwen2.5-VL-style model (rlvr.models.vision): a ViT over 14x14 patches
    (2 frames deep: an image is its own second frame) with 2-D RoPE, windowed attention except in
    `full_attention_layers`, and a merger that maps each 2x2 block of patches to one decoder token.
    Field names follow the HF `vision_config`; the token ids are the VLM's placeholders. It computes
    in the decoder's `dtype` / `param_dtype`."""

    @classmethod
    def of(cls, value: Any) -> VisionConfig | None:
        """From a VisionConfig, a mapping of its fields (a config file's `model.vision`), or None."""
        if value is None or isinstance(value, cls):
            return value
        return cls(**{k: v for k, v in dict(value.items()).items() if v is not None})

    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_layers: int = 32  # HF `depth`
    num_heads: int = 16
    out_hidden_size: int = 3584  # the decoder's hidden size
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels per side of an attention window
    full_attention_layers: tuple[int, ...] = (7, 15, 23, 31)  # HF `fullatt_block_indexes`
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    image_token_id: int = 151655  # <|image_pad|>: one per merged patch
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653

    def __post_init__(self):
        object.__setattr__(self, "full_attention_layers", tuple(self.full_attention_layers))
        def check(ok: bool, field: str, message: str) -> None:
            if not ok:
                raise ValueError(f"vision.{field}: {message}")
        check(self.hidden_size % self.num_heads == 0, "num_heads",
              f"must divide hidden_size={self.hidden_size}, got {self.num_heads}.")
        check(self.head_dim % 4 == 0, "num_heads", f"2-D RoPE needs head_dim % 4 == 0, got {self.head_dim}.")
        check(self.window_size >= self.patch_size * self.spatial_merge_size, "window_size",
              f"must be at least patch_size * spatial_merge_size = {self.patch_size * self.spatial_merge_size}.")
        bad = [i for i in self.full_attention_layers if not 0 <= i < self.num_layers]
        check(not bad, "full_attention_layers", f"{bad} are not layer indices below num_layers={self.num_layers}.")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x frames x patch x patch (the processor's row width)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one decoder token."""
        return self.spatial_merge_size ** 2

    def dim_sizes(self) -> dict[str, int]:
        """Sizes of the named dims of the HF parameter table (rlvr.models.vision.VISION_TABLE)."""
        return {"embed": self.hidden_size, "mlp": self.intermediate_size, "heads": self.num_heads,
                "head_dim": self.head_dim, "qkv": 3, "channels": self.in_channels,
                "frames": self.temporal_patch_size, "patch": self.patch_size,
                "merged": self.hidden_size * self.merge_unit, "out": self.out_hidden_size}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture. Field names follow the config file's `model.*` keys."""

    family: str = "qwen3"  # llama | qwen2 (q/k/v bias) | qwen3 (q/k norm) | mistral (sliding window)
    vocab_size: int = 1024  # embedding rows (>= the tokenizer's ids)
    hidden_size: int = 256  # residual width
    intermediate_size: int = 1024  # MLP width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (GQA; 1 = MQA)
    head_dim: int = 64  # width of each attention head
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 1e6  # RoPE base frequency
    rope_scaling_type: str = "none"  # none | linear | llama3
    rope_scaling_factor: float = 1.0  # RoPE scaling factor (linear, llama3)
    rope_low_freq_factor: float = 1.0  # llama3 RoPE scaling: low-frequency factor
    rope_high_freq_factor: float = 4.0  # llama3 RoPE scaling: high-frequency factor
    rope_original_max_position: int = 8192  # llama3 RoPE scaling: the original context length
    max_position_embeddings: int = 4096  # the longest sequence (prompt + response) the model takes
    tie_word_embeddings: bool = False  # the output projection is the embedding matrix
    qkv_bias: bool = False  # biases on the q/k/v projections
    o_bias: bool = False  # a bias on the attention output projection
    mlp_bias: bool = False  # biases on the MLP projections
    qk_norm: bool = True  # RMSNorm on queries and keys per head (Qwen3)
    sliding_window: int = 0  # 0 = full attention; Mistral-style local attention otherwise
    # M-RoPE (Qwen2-VL / Qwen2.5-VL decoders): how many of the head_dim/2 rotary frequencies read the
    # temporal, height and width position ids (sums to head_dim/2); () = ordinary 1-D RoPE
    mrope_section: tuple[int, ...] = ()
    # a vision encoder (a VLM, rlvr.models.vision): its `VisionConfig` fields, None for a text model
    vision: VisionConfig | None = None
    value_head: bool = False  # a scalar value head on the backbone (reward models, PPO's critic)
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # parameter (master weight) dtype
    remat_policy: str = "none"  # activation rematerialisation: none | full | dots | dots_with_no_batch_dims
    # Layers are scanned (stacked params, compile time flat in depth); unrolling k layers per
    # scan iteration trades compile time for speed (on CPU, full unroll is ~1.4x faster).
    scan_unroll: int = 1
    # False: one module per layer (params layers_0, …): the decode layout, and faster training steps on CPU for
    # small models (benchmarks/train_step.py); checkpoints restore into either layout, HF/PEFT files take both.
    scan_layers: bool = True
    attention: str = "xla"  # training attention: xla | flash | ring | ulysses (see ATTENTION)
    # low-rank adapters and a quantised frozen base: set from the `lora.*` section, not a `model.*` key
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        object.__setattr__(self, "vision", VisionConfig.of(self.vision))
        validate_model_config(self)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ModelConfig:
        """From a `model.*` mapping: its `preset` (a name in PRESETS) first, then every field that
        is set (None = unset: the preset's value or the default)."""
        values = dict(values)
        preset = values.get("preset") or ""
        if preset and preset not in PRESETS:
            raise ValueError(f"model.preset: {preset!r} is not one of {sorted(PRESETS)}.")
        names = {f.name for f in dataclasses.fields(cls)} - {"lora"}
        merged = dict(PRESETS.get(preset, {}))
        merged.update({k: v for k, v in values.items() if k in names and v is not None})
        merged["mrope_section"] = tuple(merged.get("mrope_section") or ())
        return cls(**merged)

    def to_dict(self) -> dict[str, Any]:
        """The `model.*` fields (the adapters are the `lora.*` section's); `vision` as a dict or None."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("lora", "vision")}
        return out | {"vision": dataclasses.asdict(self.vision) if self.vision is not None else None}

    def num_params(self) -> int:
        """Parameter count (excluding the value head), by formula."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        attn += hd * (self.num_heads + 2 * self.num_kv_heads) if self.qkv_bias else 0
        attn += h if self.o_bias else 0
        attn += 2 * hd if self.qk_norm else 0
        mlp = 3 * h * self.intermediate_size
        mlp += (2 * self.intermediate_size + h) if self.mlp_bias else 0
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embed + h


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"model.{field}: {message}")


def validate_model_config(cfg: ModelConfig) -> None:
    """Raises ValueError naming the `model.*` field and the fix."""
    _check(cfg.family in FAMILIES, "family", f"{cfg.family!r} is not one of {FAMILIES}.")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "max_position_embeddings"):
        _check(getattr(cfg, field) > 0, field, f"must be positive, got {getattr(cfg, field)}.")
    _check(cfg.num_heads % cfg.num_kv_heads == 0, "num_kv_heads",
           f"num_heads={cfg.num_heads} must be a multiple of num_kv_heads={cfg.num_kv_heads}.")
    _check(cfg.head_dim % 2 == 0, "head_dim", f"RoPE needs an even head_dim, got {cfg.head_dim}.")
    _check(cfg.rms_norm_eps > 0, "rms_norm_eps", "must be positive.")
    _check(cfg.rope_theta > 0, "rope_theta", "must be positive.")
    _check(cfg.rope_scaling_type in ROPE_SCALING_TYPES, "rope_scaling_type",
           f"{cfg.rope_scaling_type!r} is not one of {ROPE_SCALING_TYPES}.")
    _check(cfg.rope_scaling_factor > 0, "rope_scaling_factor", "must be positive.")
    _check(cfg.sliding_window >= 0, "sliding_window", "must be 0 (off) or a positive window.")
    _check(not cfg.mrope_section or (len(cfg.mrope_section) == 3 and sum(cfg.mrope_section) == cfg.head_dim // 2),
           "mrope_section", f"{cfg.mrope_section} must be 3 sizes (temporal, height, width) summing to "
           f"head_dim/2={cfg.head_dim // 2}, or empty for 1-D RoPE.")
    _check(cfg.dtype in DTYPES, "dtype", f"{cfg.dtype!r} is not one of {DTYPES}.")
    _check(cfg.param_dtype in DTYPES, "param_dtype", f"{cfg.param_dtype!r} is not one of {DTYPES}.")
    _check(cfg.remat_policy in REMAT_POLICIES, "remat_policy",
           f"{cfg.remat_policy!r} is not one of {REMAT_POLICIES}.")
    _check(1 <= cfg.scan_unroll <= cfg.num_layers, "scan_unroll",
           f"must be between 1 and num_layers={cfg.num_layers}, got {cfg.scan_unroll}.")
    _check(cfg.attention in ATTENTION, "attention",
           f"{cfg.attention!r} is not one of {ATTENTION}; use 'ring' or 'ulysses' (with mesh.sequence > 1) for "
           "context parallelism, 'flash' for the flash kernel, 'xla' for dense attention.")


def validate_attention_mesh(cfg: ModelConfig, mesh: Mapping[str, int]) -> None:
    """Raises ValueError naming `model.attention` / `mesh.sequence` when the attention cannot be
    context-parallel on a mesh of these axis sizes."""
    n = int(mesh.get("sequence", 1))
    if cfg.attention in ("ring", "ulysses") and n == 1:
        raise ValueError(f"model.attention={cfg.attention!r} shards attention over mesh.sequence, which is 1: set "
                         "mesh.sequence > 1 (devices per sequence) or use model.attention='flash'.")
    if cfg.attention != "ulysses":
        return
    from rlvr.kernels.context_parallel.ulysses import kv_head_repeats

    tensor = int(mesh.get("tensor", 1))
    split = tensor if cfg.num_heads % tensor == 0 and cfg.num_kv_heads % tensor == 0 else 1
    try:
        kv_head_repeats(cfg.num_heads // split, cfg.num_kv_heads // split, n)
    except ValueError as e:
        raise ValueError(f"model.attention='ulysses' with mesh.sequence={n} (heads per mesh.tensor shard: "
                         f"{cfg.num_heads // split}): {e} Set model.attention='ring', or a mesh.sequence that divides "
                         "the heads per tensor shard.") from None
