"""Host-side verification of a candidate mesh against its target: typed geometry, never the sandbox's word.

The sandbox hands back bytes (a binary STL on stdout); the host parses them strictly (`parse_stl`: the size must
be 84 + 50 n bytes, at most `MAX_TRIANGLES`, finite coordinates) and measures everything itself:

  measure        triangles, watertight (every edge shared by exactly two faces, consistent winding), volume,
                 bounding box (trimesh)
  volumetric IoU vol(A n B) / vol(A u B) with exact mesh booleans (manifold3d)
  baseline       the IoU the target's own bounding box (one cube) reaches: `skill` = (IoU - baseline) /
                 (1 - baseline) is the IoU's improvement over that trivial answer (<= 0 for the cube itself;
                 clipped at -1)
  Chamfer        the mean nearest-surface distance both ways between 2,000 surface samples of each mesh (fixed
                 seed), divided by the target's bounding-box diagonal
  renders        silhouette IoU and depth error of the three axis views (rlvr.domains.cad.render), in the
                 target's frame

The layered terminal score (`score`): compiles (a non-empty mesh came out) 0.1; watertight 0.1 (gated by
compiles); bounding box within tolerance 0.1 (gated by compiles); then 0.7 x the share of the skill thresholds
SKILL_THRESHOLDS met (gated by watertight: a volumetric IoU needs a closed solid). Every component is returned
and logged. Solved ("correct") = the full score: the bounding box right and skill >= 0.9.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from rlvr.domains.cad import render

MAX_TRIANGLES = 200_000
SKILL_THRESHOLDS = (0.25, 0.5, 0.75, 0.9)
BBOX_TOLERANCE = 0.02  # of the target's bounding-box diagonal, per face of the box (at least 0.25 mm)
CHAMFER_SAMPLES = 2000
WEIGHTS = {"compiles": 0.1, "watertight": 0.1, "bbox": 0.1, "iou": 0.7}


class MeshError(ValueError):
    """The bytes are not a usable binary STL."""


def _libs():
    try:
        import manifold3d
        import trimesh
    except ImportError as e:
        raise ImportError("the CAD kit needs trimesh and manifold3d: pip install -e '.[cad]'") from e
    return trimesh, manifold3d


def parse_stl(data: bytes) -> np.ndarray:
    """Triangles (n, 3, 3) float64 of a binary STL; raises MeshError on anything else."""
    if len(data) < 84:
        raise MeshError(f"{len(data)} bytes: not a binary STL (84-byte header + count)")
    count, stated = divmod(len(data) - 84, 50)[0], int.from_bytes(data[80:84], "little")
    if (len(data) - 84) % 50 or stated not in (0, count):  # OpenSCAD 2021 leaves 0 for some meshes
        raise MeshError(f"{len(data)} bytes for {stated} triangles (expected {84 + 50 * stated})")
    if count > MAX_TRIANGLES:
        raise MeshError(f"{count} triangles: more than the {MAX_TRIANGLES} allowed")
    records = np.frombuffer(data, np.uint8, count * 50, 84).reshape(count, 50)
    tris = records[:, 12:48].copy().view("<f4").reshape(count, 3, 3).astype(np.float64)
    if not np.isfinite(tris).all():
        raise MeshError("non-finite coordinates")
    return tris


def canonical(triangles: np.ndarray) -> np.ndarray:
    """The triangles in an order that depends on the geometry only (OpenSCAD's face order varies from run to
    run): each triangle starts at its smallest vertex (winding kept), then triangles sorted by coordinates."""
    tris = np.asarray(triangles, np.float64).reshape(-1, 3, 3)
    if not len(tris):
        return tris
    keys = tris[:, :, 0] * 1e12 + tris[:, :, 1] * 1e6 + tris[:, :, 2]  # a vertex order (ties rotate the same way)
    first = np.argmin(keys, axis=1)
    tris = tris[np.arange(len(tris))[:, None], (first[:, None] + np.arange(3)) % 3]
    flat = np.round(tris.reshape(len(tris), 9), 6)
    return tris[np.lexsort(flat.T[::-1])]


def to_mesh(triangles: np.ndarray) -> Any:
    """A trimesh with shared vertices (exact duplicates merged), built from the canonical triangle order."""
    trimesh, _ = _libs()
    tris = canonical(triangles)
    return trimesh.Trimesh(vertices=tris.reshape(-1, 3), faces=np.arange(len(tris) * 3).reshape(-1, 3), process=True)


def measure(mesh: Any) -> dict[str, Any]:
    """What the `measure` tool reports and the score reads: triangles, watertight, volume, bounding box."""
    if mesh is None or len(mesh.faces) == 0:
        return {"triangles": 0, "watertight": False, "volume": 0.0, "bbox_min": [0.0] * 3, "bbox_max": [0.0] * 3}
    lo, hi = mesh.bounds
    watertight = bool(mesh.is_watertight and mesh.is_winding_consistent)
    return {"triangles": int(len(mesh.faces)), "watertight": watertight,
            "volume": round(float(abs(mesh.volume)) if watertight else 0.0, 3),
            "bbox_min": [round(float(x), 3) for x in lo], "bbox_max": [round(float(x), 3) for x in hi]}


def manifold(mesh: Any) -> Any:
    """The mesh as a manifold3d solid, or None when it is not a valid 2-manifold."""
    _, m3d = _libs()
    solid = m3d.Manifold(m3d.Mesh(vert_properties=np.asarray(mesh.vertices, np.float32),
                                  tri_verts=np.asarray(mesh.faces, np.uint32)))
    return solid if solid.status() == m3d.Error.NoError and not solid.is_empty() else None


def iou(a: Any, b: Any) -> float:
    """Volumetric IoU of two manifold3d solids (exact booleans)."""
    inter = (a ^ b).volume()
    union = a.volume() + b.volume() - inter
    return float(inter / union) if union > 0 else 0.0


def box_solid(lo: Any, hi: Any) -> Any:
    _, m3d = _libs()
    size = np.asarray(hi, float) - np.asarray(lo, float)
    return m3d.Manifold.cube(tuple(float(s) for s in size)).translate(tuple(float(x) for x in lo))


def chamfer(a: Any, b: Any, diagonal: float) -> float:
    """Symmetric mean nearest-sample distance between the two surfaces / the target's diagonal."""
    from scipy.spatial import cKDTree

    trimesh, _ = _libs()
    pa, _ = trimesh.sample.sample_surface(a, CHAMFER_SAMPLES, seed=0)
    pb, _ = trimesh.sample.sample_surface(b, CHAMFER_SAMPLES, seed=0)
    d_ab, _ = cKDTree(pb).query(pa)
    d_ba, _ = cKDTree(pa).query(pb)
    return float((d_ab.mean() + d_ba.mean()) / 2 / diagonal)


class Target:
    """A target mesh with what every comparison needs: its solid, frame, renders and bounding-box baseline."""

    def __init__(self, stl: bytes):
        self.triangles = parse_stl(stl)
        self.mesh = to_mesh(self.triangles)
        _ = self.mesh.area_faces, self.mesh.is_watertight  # fill trimesh's caches now: threads then only read them
        self.solid = manifold(self.mesh)
        if self.solid is None:
            raise MeshError("the target is not a closed 2-manifold solid")
        self.lo, self.hi = (np.asarray(x, float) for x in self.mesh.bounds)
        self.diagonal = float(np.linalg.norm(self.hi - self.lo))
        self.frame = render.Frame.around(self.lo, self.hi)
        self.images = {v: render.depth_image(self.triangles, v, self.frame) for v in render.VIEWS}
        self.baseline = iou(box_solid(self.lo, self.hi), self.solid)


@functools.lru_cache(maxsize=64)
def target(stl: bytes) -> Target:
    return Target(stl)


def score(candidate_stl: bytes | None, tgt: Target) -> dict[str, float]:
    """The layered terminal score and every component (see the module doc); never raises on bad candidates."""
    out = {"compiles": 0.0, "watertight": 0.0, "bbox": 0.0, "iou": 0.0, "skill": 0.0, "chamfer": 1.0,
           "silhouette_iou": 0.0, "depth_error": 1.0, "iou_baseline": round(tgt.baseline, 4)}
    try:
        tris = parse_stl(candidate_stl) if candidate_stl else None
    except MeshError:
        tris = None
    if tris is None or len(tris) == 0:
        return {**out, "terminal": 0.0}
    mesh = to_mesh(tris)
    out["compiles"] = 1.0
    lo, hi = (np.asarray(x, float) for x in mesh.bounds)
    tol = max(0.25, BBOX_TOLERANCE * tgt.diagonal)
    out["bbox"] = float(np.abs(lo - tgt.lo).max() <= tol and np.abs(hi - tgt.hi).max() <= tol)
    images = {v: render.depth_image(tris, v, tgt.frame) for v in render.VIEWS}
    out["silhouette_iou"] = float(np.mean([render.silhouette_iou(images[v], tgt.images[v]) for v in images]))
    out["depth_error"] = float(np.mean([render.depth_error(images[v], tgt.images[v]) for v in images]))
    if len(mesh.faces):
        out["chamfer"] = chamfer(mesh, tgt.mesh, tgt.diagonal)
    solid = manifold(mesh) if mesh.is_watertight and mesh.is_winding_consistent else None
    if solid is not None:
        out["watertight"] = 1.0
        out["iou"] = iou(solid, tgt.solid)
        out["skill"] = max(-1.0, (out["iou"] - tgt.baseline) / (1 - tgt.baseline))  # -1: far worse than the box
    met = sum(out["skill"] >= t for t in SKILL_THRESHOLDS) / len(SKILL_THRESHOLDS)
    terminal = (WEIGHTS["compiles"] + WEIGHTS["watertight"] * out["watertight"] + WEIGHTS["bbox"] * out["bbox"]
                + WEIGHTS["iou"] * met * out["watertight"])
    out = {k: round(float(v), 6) for k, v in out.items()}
    return {**out, "terminal": round(terminal, 6)}
