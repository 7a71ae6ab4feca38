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
    """(resolution, resolution) uint8 depth image of `triangles` (n, 3, 3) seen from `view` (row 0 = top).

    Vectorised over triangles: those whose pixel box fits in s x s (s = 1, 2, 4, ...) are rasterised together,
    in chunks, and merged into the z-buffer with an order-free maximum (the image never depends on face order)."""
    right, up, depth_axis = VIEWS[view]
    n = frame.resolution
    center = np.asarray(frame.center)
    scale = n / (2 * frame.half)
    tri = np.asarray(triangles, np.float64).reshape(-1, 3, 3)
    u = (tri[:, :, right] - center[right]) * scale + n / 2
    v = n / 2 - (tri[:, :, up] - center[up]) * scale
    d = DEPTH_SIGN[view] * (tri[:, :, depth_axis] - center[depth_axis]) / frame.half  # in [-1, 1] inside the frame
    area = (u[:, 1] - u[:, 0]) * (v[:, 2] - v[:, 0]) - (u[:, 2] - u[:, 0]) * (v[:, 1] - v[:, 0])
    x0 = np.maximum(np.floor(u.min(1)), 0).astype(int)
    x1 = np.minimum(np.ceil(u.max(1)), n - 1).astype(int)
    y0 = np.maximum(np.floor(v.min(1)), 0).astype(int)
    y1 = np.minimum(np.ceil(v.max(1)), n - 1).astype(int)
    keep = (np.abs(area) > 1e-12) & (x0 <= x1) & (y0 <= y1)
    size = np.maximum(x1 - x0, y1 - y0) + 1
    zbuf = np.full(n * n, -np.inf)
    lower = 0
    for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        bucket = np.flatnonzero(keep & (size > lower) & (size <= s))
        lower = s
        for chunk in np.array_split(bucket, max(1, len(bucket) * s * s // (1 << 20) + 1)):
            if len(chunk):
                _raster(chunk, s, u, v, d, area, x0, x1, y0, y1, zbuf, n)
    zbuf = zbuf.reshape(n, n)
    hit = np.isfinite(zbuf)
    image = np.zeros((n, n), np.uint8)
    image[hit] = np.clip(np.round((zbuf[hit] + 1) / 2 * 254) + 1, 1, 255).astype(np.uint8)
    return image


def _raster(idx: np.ndarray, s: int, u, v, d, area, x0, x1, y0, y1, zbuf: np.ndarray, n: int) -> None:
    """Rasterises triangles `idx` (pixel boxes at most s x s) into the flat z-buffer (edge functions at pixel
    centres; a pixel is covered when all three barycentric weights are >= 0)."""
    offsets = np.arange(s)
    px = x0[idx, None, None] + offsets[None, None, :]
    py = y0[idx, None, None] + offsets[None, :, None]
    valid = (px <= x1[idx, None, None]) & (py <= y1[idx, None, None])
    cx, cy = px + 0.5, py + 0.5
    (ua, ub, uc), (va, vb, vc) = (u[idx, k, None, None] for k in range(3)), (v[idx, k, None, None] for k in range(3))
    a = area[idx, None, None]
    w0 = ((ub - cx) * (vc - cy) - (uc - cx) * (vb - cy)) / a
    w1 = ((uc - cx) * (va - cy) - (ua - cx) * (vc - cy)) / a
    w2 = 1.0 - w0 - w1
    inside = valid & (w0 >= 0) & (w1 >= 0) & (w2 >= 0)
    z = w0 * d[idx, 0, None, None] + w1 * d[idx, 1, None, None] + w2 * d[idx, 2, None, None]
    np.maximum.at(zbuf, (py * n + px)[inside], z[inside])


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
