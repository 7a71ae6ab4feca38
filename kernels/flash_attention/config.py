"""Block sizes for the flash-attention kernels: a frozen dataclass, defaults per platform, validation.

The forward kernel tiles queries by `block_q` and walks keys in steps of `block_kv`; the backward
kernels (dq, and dk/dv) use `block_q_bwd` / `block_kv_bwd` (default: the forward sizes). The
blockwise "xla" implementation only uses the key-side sizes. The defaults are educated guesses,
not tuned on hardware (no TPU or GPU was at hand when they were written).

Platform rules (checked by `BlockSizes.validate`):
  * every size is a positive multiple of 8;
  * TPU (Mosaic): multiples of 128, because each size is a lane dimension in one of the kernels;
  * GPU (Triton): powers of two >= 16 (Triton tiles are power-of-two shaped, `tl.dot` needs >= 16).
A sequence shorter than a block gets a smaller block (`effective`), rounded to the platform's
granule; sequences are padded to a whole number of blocks inside the kernel wrapper.
"""

from __future__ import annotations

import dataclasses

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes (tokens). `None` backward sizes mean "same as forward"."""

    block_q: int = 128
    block_kv: int = 128
    block_q_bwd: int | None = None
    block_kv_bwd: int | None = None
    # Skip key blocks that no query of the tile can see (causal / sliding window), decided at run
    # time from the tiles' position ranges, so it stays right for any positions (packing, ring
    # attention's global offsets).
    skip_masked_blocks: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            value = getattr(self, name)
            if value is None and name.endswith("_bwd"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 8:
                raise ValueError(f"BlockSizes.{name}={value!r}: must be a positive multiple of 8")

    @property
    def q_bwd(self) -> int:
        return self.block_q_bwd or self.block_q

    @property
    def kv_bwd(self) -> int:
        return self.block_kv_bwd or self.block_kv

    def sizes(self) -> dict[str, int]:
        return {"block_q": self.block_q, "block_kv": self.block_kv, "block_q_bwd": self.q_bwd,
                "block_kv_bwd": self.kv_bwd}

    def validate(self, platform: str) -> BlockSizes:
        """Raise a ValueError naming the field and the fix if these sizes cannot run on `platform`."""
        for name, value in self.sizes().items():
            if platform == "tpu" and value % 128:
                raise ValueError(f"BlockSizes.{name}={value} must be a multiple of 128 on TPU "
                                 f"(it is a lane dimension); try {max(128, value // 128 * 128)}")
            if platform == "gpu" and (value < 16 or value & (value - 1)):
                raise ValueError(f"BlockSizes.{name}={value} must be a power of two >= 16 on GPU (Triton); "
                                 f"try {max(16, 1 << (value.bit_length() - 1))}")
        return self


DEFAULTS = {
    # Interpret mode / blockwise XLA: bigger tiles mean fewer loop steps, which is what costs on CPU.
    "cpu": BlockSizes(block_q=256, block_kv=512),
    "gpu": BlockSizes(block_q=64, block_kv=64, block_q_bwd=32, block_kv_bwd=32),
    "tpu": BlockSizes(block_q=256, block_kv=512, block_q_bwd=256, block_kv_bwd=256),
}

# TPU sizes per generation (`rlvr.kernels.target.tpu_generation`). With the key sequence on the grid
# (pallas_tpu.py) a program holds a few tiles whatever the length: about (2 bq + 4 bk) D bf16 blocks
# (double-buffered) plus the f32 [bq, bk] logits and probabilities, ~3 MiB at 512 x 512 and D=128, inside
# the 16 MiB scoped VMEM of v5e and v5p (32 MiB on v6e). Compile-checked by the TPU compiler at 2k-128k
# tokens (benchmarks/tpu_compile.py); not timed on chips (none at hand), so not tuned.
TPU_GENERATIONS = {
    "v4": BlockSizes(block_q=512, block_kv=512, block_q_bwd=256, block_kv_bwd=256),
    "v5e": BlockSizes(block_q=512, block_kv=512, block_q_bwd=256, block_kv_bwd=256),
    "v5p": BlockSizes(block_q=512, block_kv=1024, block_q_bwd=512, block_kv_bwd=512),
    "v6e": BlockSizes(block_q=512, block_kv=1024, block_q_bwd=512, block_kv_bwd=512),
}

# The smallest tile a short sequence is rounded up to.
GRANULE = {"cpu": 8, "gpu": 16, "tpu": 128}


def default_block_sizes(platform: str, generation: str | None = None) -> BlockSizes:
    """The platform's sizes; on TPU the generation's (`TPU_GENERATIONS`) when it is known."""
    if platform == "tpu" and generation in TPU_GENERATIONS:
        return TPU_GENERATIONS[generation]
    if platform not in DEFAULTS:
        raise ValueError(f"no default flash-attention block sizes for platform {platform!r}; "
                         f"known: {sorted(DEFAULTS)}")
    return DEFAULTS[platform]


def effective(block: int, length: int, platform: str) -> int:
    """The tile actually used for a sequence of `length`: `block`, or less for a short sequence."""
    granule = GRANULE[platform]
    short = -(-length // granule) * granule
    if platform == "gpu":
        short = max(16, 1 << (short - 1).bit_length())
    return min(block, short)
