"""Flash attention: Pallas kernels (TPU/GPU, interpret mode on CPU), a blockwise XLA fallback and a
float32 reference, behind one entry point, `flash_attention` (see `api.py`)."""

from .api import IMPLEMENTATIONS, flash_attention
from .config import BlockSizes, default_block_sizes
from .reference import reference_attention, reference_mask

__all__ = ["IMPLEMENTATIONS", "BlockSizes", "default_block_sizes", "flash_attention", "reference_attention",
           "reference_mask"]
