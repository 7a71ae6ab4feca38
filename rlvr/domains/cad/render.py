"""A small deterministic renderer: orthographic depth images of a triangle mesh (a numpy z-buffer), PNG, text.

Views look at the part along the axes: `top` (down -z; image right = +x, up = +y), `front` (from -y along +y;
right = +x, up = +z), `side` (from +x along -x; right = +y, up = +z). The frame (`Frame`) is fitted to a box,
the TARGET's bounding box in comparisons, so a candidate and its target are rendered pixel for pixel in the same
frame. Pixels hold the nearest surface's depth, quantised to uint8 (0 = background, 1..255 = far..near within
the frame): the same mesh gives the same bytes, hence the same image hash (`image_hash`), on any machine
whose float rounding agrees to within one quantum.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib

import numpy as np

VIEWS = {"top": (0, 1, 2), "front": (0, 2, 1), "side": (1, 2, 0)}  # (image right, image up, depth) world axes
DEPTH_SIGN = {"top": 1.0, "front": -1.0, "side": 1.0}  # +1: larger world coordinate is nearer the viewer
RESOLUTION = 64
SHADES = " .:-=+*#%@"


@dataclasses.dataclass(frozen=True)
class Frame:
    """The world box a render maps to its pixels (centre and one scale for every view: square pixels)."""

    center: tuple[float, float, float]
    half: float  # half the side of the square window, mm
    resolution: int = RESOLUTION

    @classmethod
    def around(cls, lo: np.ndarray, hi: np.ndarray, margin: float = 0.1, resolution: int = RESOLUTION) -> Frame:
        lo, hi = np.asarray(lo, float), np.asarray(hi, float)
        half = float(max(hi - lo) / 2 * (1 + margin)) or 1.0
        return cls(tuple(float(c) for c in (lo + hi) / 2), half, resolution)


def depth_image(triangles: np.ndarray, view: str, frame: Frame) -> np.ndarray:
    """(resolution, resolution) uint8 depth image of `triangles` (n, 3, 3) seen from `view` (row 0 = top)."""
    right, up, depth_axis = VIEWS[view]
    n = frame.resolution
    center = np.asarray(frame.center)
    scale = n / (2 * frame.half)
    tri = np.asarray(triangles, np.float64).reshape(-1, 3, 3)
    u = (tri[:, :, right] - center[right]) * scale + n / 2
    v = n / 2 - (tri[:, :, up] - center[up]) * scale
    d = DEPTH_SIGN[view] * (tri[:, :, depth_axis] - center[depth_axis]) / frame.half  # in [-1, 1] inside the frame
    zbuf = np.full((n, n), -np.inf)
    area = (u[:, 1] - u[:, 0]) * (v[:, 2] - v[:, 0]) - (u[:, 2] - u[:, 0]) * (v[:, 1] - v[:, 0])
    for i in np.flatnonzero(np.abs(area) > 1e-12):
        x0, x1 = max(int(np.floor(u[i].min())), 0), min(int(np.ceil(u[i].max())), n - 1)
        y0, y1 = max(int(np.floor(v[i].min())), 0), min(int(np.ceil(v[i].max())), n - 1)
        if x0 > x1 or y0 > y1:
            continue
        px, py = np.meshgrid(np.arange(x0, x1 + 1) + 0.5, np.arange(y0, y1 + 1) + 0.5)
        (ua, ub, uc), (va, vb, vc) = u[i], v[i]
        w0 = ((ub - px) * (vc - py) - (uc - px) * (vb - py)) / area[i]
        w1 = ((uc - px) * (va - py) - (ua - px) * (vc - py)) / area[i]
        w2 = 1.0 - w0 - w1
        inside = (w0 >= 0) & (w1 >= 0) & (w2 >= 0)
        if not inside.any():
            continue
        z = w0 * d[i, 0] + w1 * d[i, 1] + w2 * d[i, 2]
        block = zbuf[y0:y1 + 1, x0:x1 + 1]
        np.maximum(block, np.where(inside, z, -np.inf), out=block)
    hit = np.isfinite(zbuf)
    image = np.zeros((n, n), np.uint8)
    image[hit] = np.clip(np.round((zbuf[hit] + 1) / 2 * 254) + 1, 1, 255).astype(np.uint8)
    return image


def image_hash(image: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()[:16]


def png(image: np.ndarray) -> bytes:
    """A grayscale 8-bit PNG (no timestamps or metadata: the same image gives the same bytes)."""
    image = np.ascontiguousarray(image, np.uint8)
    h, w = image.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + image[row].tobytes() for row in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def as_text(image: np.ndarray) -> str:
    """The depth image as characters (every other row: a character is about twice as tall as wide)."""
    rows = ["".join(" " if p == 0 else SHADES[1 + (int(p) - 1) * (len(SHADES) - 2) // 254] for p in row)
            for row in image[::2]]
    return _trim(rows)


def _trim(rows: list[str]) -> str:
    """The rows without trailing spaces, and without the empty rows above and below the part."""
    rows = [r.rstrip() for r in rows]
    filled = [i for i, r in enumerate(rows) if r]
    return "\n".join(rows[filled[0]:filled[-1] + 1]) if filled else "(empty)"


def compare_text(candidate: np.ndarray, target: np.ndarray) -> str:
    """Silhouettes side by side in one picture: '#' both, '+' the candidate only (extra), '-' the target only
    (missing), ' ' neither."""
    a, b = candidate[::2] > 0, target[::2] > 0
    chars = np.full(a.shape, " ")
    chars[a & b], chars[a & ~b], chars[~a & b] = "#", "+", "-"
    return _trim(["".join(r) for r in chars])


def silhouette_iou(candidate: np.ndarray, target: np.ndarray) -> float:
    a, b = candidate > 0, target > 0
    union = int((a | b).sum())
    return float((a & b).sum() / union) if union else 1.0


def depth_error(candidate: np.ndarray, target: np.ndarray) -> float:
    """Mean absolute difference of the quantised depths over the pixels either covers (background = 0), / 255."""
    union = (candidate > 0) | (target > 0)
    if not union.any():
        return 0.0
    return float(np.abs(candidate[union].astype(float) - target[union].astype(float)).mean() / 255)
