"""The CAD domain kit (rlvr.domains.cad): references reach IoU 1 at every level through gVisor, every cheap answer
scores low, the geometry and the renderer agree with hand-computed values, a scripted episode replays exactly.

Independent references: the reference meshes' volumes against the analytic volumes of the specs (true circles;
OpenSCAD's polygons are within 2 %), manifold3d's IoU against the closed form for two offset boxes and for a
32-gon prism in its bounding box, the renderer's silhouette area against the box's area in pixels.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from rlvr.domains.cad import generate as gen
from rlvr.domains.cad import render, scad
from rlvr.domains.cad import verify as cv
from rlvr.domains.cad.families import FAMILIES, probe_scripts
from rlvr.envs import episodes, make_env, play
from rlvr.envs.tools import call_text
from rlvr.tasks.audit import FP_REWARD


def box_stl(lo, hi) -> bytes:
    """A binary STL of an axis-aligned box, written here (not by OpenSCAD)."""
    import trimesh

    mesh = trimesh.creation.box(bounds=[lo, hi])
    tris = mesh.triangles.astype("<f4")
    records = np.zeros((len(tris), 50), np.uint8)
    records[:, 12:48] = tris.reshape(len(tris), 9).view(np.uint8).reshape(len(tris), 36)
    return b"\0" * 80 + len(tris).to_bytes(4, "little") + records.tobytes()


def test_geometry_and_renders_match_hand_computed_values():
    a, b = cv.Target(box_stl([0, 0, 0], [10, 10, 10])), cv.Target(box_stl([5, 0, 0], [15, 10, 10]))
    assert cv.iou(a.solid, b.solid) == pytest.approx(500 / 1500)  # overlap 5x10x10 over the union
    n = gen.FN  # a cylinder's bounding box holds the 32-gon prism: IoU = polygon area / square area
    cyl = cv.Target(scad.target_stl(f"$fn = {n};\ncylinder(h=10, d=20);\n"))
    assert cyl.baseline == pytest.approx(n / 2 * math.sin(2 * math.pi / n) / 4, rel=1e-4)
    assert cv.measure(a.mesh) == {"triangles": 12, "watertight": True, "volume": 1000.0, "bbox_min": [0, 0, 0],
                                  "bbox_max": [10, 10, 10]}
    # the top view of the box in its own frame: 10 mm of an 11 mm window (margin 0.1) -> ~58 px a side
    image = a.images["top"]
    side = 64 * 10 / 11
    assert abs(int((image > 0).sum()) - side * side) <= 2 * side + 2
    top = round((5 / 5.5 + 1) / 2 * 254) + 1  # the face z = 10, 5 mm above the centre of an 11 mm window
    assert set(np.unique(image[image > 0])) == {top}
    again = cv.Target(box_stl([0, 0, 0], [10, 10, 10]))
    assert all(render.image_hash(again.images[v]) == render.image_hash(image) for v, image in a.images.items())
    assert render.png(again.images["front"]) == render.png(a.images["front"])
    moved = render.depth_image(b.triangles, "top", a.frame)
    assert render.image_hash(moved) != render.image_hash(image)
    assert render.silhouette_iou(moved, image) == pytest.approx(5 / 10.5, abs=0.03)  # x 5..10.5 of -0.5..10.5 seen
    for bad in (b"", box_stl([0, 0, 0], [1, 1, 1])[:-7], b"\0" * 80 + (10**7).to_bytes(4, "little")):
        with pytest.raises(cv.MeshError):
            cv.parse_stl(bad)


@pytest.mark.sandbox
@pytest.mark.parametrize("level", gen.LEVELS)
def test_references_reach_iou_one_and_every_probe_scores_low(level, monkeypatch):
    """Through gVisor: the reference scores 1 (IoU >= 0.99); its target's volume is the spec's; the empty
    program, a huge cube, the target's bounding box as one cube and a program importing the reference's mesh
    from its host path all score below the audit's line."""
    monkeypatch.setenv("RLVR_CODE_EXECUTOR", "runsc")  # gVisor whatever the environment says
    family = FAMILIES["cad_openscad"](seed=0)
    task = family.task(level, level=level)
    target = cv.target(scad.target_stl(task.answer))
    assert abs(target.mesh.volume) == pytest.approx(gen.volume(task.metadata["spec"]), rel=0.02)
    scores = family.score(task, family.reference_completion(task), False)
    assert scores["correct"] == 1.0 and scores["cad.iou"] >= 0.99 and scores["cad.silhouette_iou"] == 1.0, scores
    assert os.path.exists(scad.target_path(task.answer))  # the file the reads_reference probe names is real
    if level == 1:  # the same through a warm pool of one sandbox (RLVR_CAD_POOL)
        from rlvr.envs.sandboxes import close_shared_pools

        monkeypatch.setenv("RLVR_CAD_POOL", "1")
        try:
            assert family.score(task, family.reference_completion(task), False) == scores
        finally:
            close_shared_pools()
    kinds = []
    for kind, text in family.audit_probes(task) if level in (0, 3) else []:
        probe = family.score(task, text, False)
        assert probe["correct"] == 0 and probe["reward"] < FP_REWARD, (kind, probe)
        kinds.append(kind)
    assert level not in (0, 3) or kinds == [f"hack:{k}" for k, _ in probe_scripts(task)]


@pytest.mark.sandbox
def test_scripted_episode_saves_images_refuses_escapes_and_replays(tmp_path, monkeypatch):
    family = FAMILIES["cad_openscad_tools"](seed=0)
    task = family.task(1, level=2)
    monkeypatch.setenv("RLVR_CODE_EXECUTOR", "runsc")
    images = tmp_path / "episode_images"
    with make_env(task, artifact_dir=str(images)) as env:
        play(env, family.reference_turns(task))
        rewards, trace = env.final_rewards(), env.trace()
    assert rewards["correct"] == 1.0 and rewards["process.compiles"] > 0 and rewards["cad.iou"] >= 0.99, rewards
    saved = trace["images"]
    assert {e["kind"] for e in saved} == {"compare", "final", "target"}
    assert all((tmp_path / e["path"]).exists() for e in saved)
    record = {"task": task.to_json(), "rewards": rewards, "trace": {**trace, "messages": trace["opening"]}}
    assert episodes.replay(json.loads(json.dumps(record)))["identical"]
    escape = call_text("write_file", {"path": "../../usr/evil.scad", "content": "cube(1);"})
    with make_env(task) as env:
        play(env, [escape, "<answer>cube(1);</answer>"])
        rewards = env.final_rewards()
    assert rewards["safety"] < 0 and rewards["reward"] < FP_REWARD and env.trace()["turns"][0]["calls"][0][
        "status"] == "refused"
