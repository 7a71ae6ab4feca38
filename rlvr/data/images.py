"""Images for the VLM (rlvr.models.vision): load, resize, normalise, patchify; placeholders.

`preprocess` reproduces the Qwen2-VL / Qwen2.5-VL image processor (transformers'
`Qwen2VLImageProcessorPil`): RGB, `smart_resize` to multiples of patch*merge pixels within
[min_pixels, max_pixels] (PIL bicubic on uint8), scale to [0, 1], normalise by the CLIP mean and
std, then cut into 14x14 patches repeated over the 2 frames of the temporal patch and laid out
block by block (the 4 patches of each 2x2 merge block adjacent), one row per patch.

An image content part of a chat record is `{"type": "image", "image": <path | data URL | base64>}`
(or `{"type": "image_url", "image_url": {"url": ...}}`); `expand_placeholders` turns the one
`<|image_pad|>` a chat template writes per image into one per merged patch.
"""

from __future__ import annotations

import base64
import io
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from rlvr.models.config import VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
IMAGE_PAD = "<|image_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, area within
    [min_pixels, max_pixels], aspect ratio kept as nearly as possible (Qwen2-VL's rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {width}x{height}: aspect ratio over 200 is not supported; crop or pad it.")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(source: Any) -> Image.Image:
    """A PIL image from a PIL image, a file path, a `data:image/...;base64,` URL or bare base64."""
    if isinstance(source, Image.Image):
        return source
    if not isinstance(source, str):
        raise ValueError(f"image: expected a path, a data URL or base64 text, got {type(source).__name__}.")
    if source.startswith("data:"):
        source = source.split(",", 1)[-1]
    elif os.path.exists(source):
        return Image.open(source)
    try:
        return Image.open(io.BytesIO(base64.b64decode(source, validate=True)))
    except (ValueError, OSError):
        raise ValueError(f"image: {source[:60]!r} is neither a file nor base64 image data; give a path, a "
                         "data:image/...;base64 URL or base64 text.") from None


def patchify(image: np.ndarray, vcfg: VisionConfig) -> np.ndarray:
    """[C, H, W] float -> [H/p * W/p, C * frames * p * p], rows in merge-block order."""
    c, h, w = image.shape
    p, m = vcfg.patch_size, vcfg.spatial_merge_size
    patches = image.reshape(c, h // p // m, m, p, w // p // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], vcfg.temporal_patch_size,
                                                              *patches.shape[5:]))
    return patches.reshape((h // p) * (w // p), vcfg.patch_dim)


def preprocess(images: Sequence[Any], vcfg: VisionConfig, min_pixels: int = MIN_PIXELS,
               max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(patches float32 [N, patch_dim], grids [(1, h, w)] in patches) of `images`, concatenated."""
    all_patches, grids = [], []
    factor = vcfg.patch_size * vcfg.spatial_merge_size
    for source in images:
        image = load_image(source).convert("RGB")
        height, width = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
        pixels = np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC))
        pixels = (pixels.astype(np.float64) / 255.0).astype(np.float32)
        pixels = (pixels - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)
        all_patches.append(patchify(pixels.transpose(2, 0, 1), vcfg))
        grids.append((1, height // vcfg.patch_size, width // vcfg.patch_size))
    return np.concatenate(all_patches).astype(np.float32), grids


def placeholder_count(grid: Sequence[int], vcfg: VisionConfig) -> int:
    """Decoder tokens of one image: its patches over the merge unit."""
    t, h, w = grid
    return t * h * w // vcfg.merge_unit


def expand_placeholders(text: str, grids: Sequence[Sequence[int]], vcfg: VisionConfig) -> str:
    """`text` with its i-th `<|image_pad|>` repeated once per merged patch of image i (as the HF processor)."""
    pieces = text.split(IMAGE_PAD)
    if len(pieces) - 1 != len(grids):
        raise ValueError(f"{len(pieces) - 1} {IMAGE_PAD} placeholders in the text for {len(grids)} images; "
                         "each image content part needs one.")
    out = [pieces[0]]
    for grid, piece in zip(grids, pieces[1:], strict=True):
        out += [IMAGE_PAD * placeholder_count(grid, vcfg), piece]
    return "".join(out)
