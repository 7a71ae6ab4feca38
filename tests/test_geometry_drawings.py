"""The geometry-drawing family (rlvr.tasks.geometry_drawings): shapes are drawn to scale (their proportions and
angles measured from the pixels match the given numbers), the answer follows from the given numbers, and
only the right answer (within 0.05 for a measured length) scores 1."""

import math

import numpy as np

from rlvr.tasks.base import HELD_OUT
from rlvr.tasks.geometry_drawings import GRID_PX, LINE, GeometryDrawingFamily
from rlvr.tasks.rendered import image_of


def _outline(task) -> np.ndarray:
    """(row, column) of every pixel drawn in the shapes' line colour (PIL draws it without antialiasing)."""
    pixels = np.asarray(image_of(task)).astype(int)
    return np.argwhere(np.abs(pixels - [int(LINE[i:i + 2], 16) for i in (1, 3, 5)]).sum(-1) == 0)


def _angle(at, a, b) -> float:
    u, v = np.subtract(a, at), np.subtract(b, at)
    return math.degrees(math.acos(u @ v / np.linalg.norm(u) / np.linalg.norm(v)))


def _measured_answer(task) -> float:
    """The answer from the drawing: proportions and angles measured in pixels, scaled by the given numbers."""
    points = _outline(task)
    (top, left), (bottom, right) = points.min(0), points.max(0)
    width, height = right - left, bottom - top
    a, b = task.metadata["given"]
    kind = task.metadata["kind"]
    if kind in ("rectangle_area", "right_triangle_area"):
        assert abs(width / height - a / b) <= (a / b) * (1 / width + 1 / height) + 1e-9, (width, height, a, b)
        return a * b / (1 if kind == "rectangle_area" else 2)
    if kind == "third_angle":
        apex = (points[points[:, 0] == top][:, 1].mean(), top)
        base = [(left, bottom), (right, bottom)]
        assert abs(_angle(base[0], apex, base[1]) - a) < 2 and abs(_angle(base[1], apex, base[0]) - b) < 2
        return 180 - _angle(base[0], apex, base[1]) - _angle(base[1], apex, base[0])
    squares = (width - 6) / GRID_PX, (height - 6) / GRID_PX  # the end dots have a radius of 3
    assert squares == (a, b)
    return math.hypot(*squares)


def test_geometry_drawings_are_to_scale_and_score_only_the_right_answer():
    family = GeometryDrawingFamily(seed=0)
    for level in family.levels():
        for index in range(3):
            task = family.task(index, HELD_OUT, level)
            want, answer = _measured_answer(task), float(task.answer)
            measured = task.metadata["kind"] in ("third_angle", "segment_length")
            assert abs(answer - want) <= (2 if measured else 0), (task.prompt, answer, want)
            if task.metadata["kind"] == "segment_length":
                assert task.answer == f"{want:.1f}"
                right = [f"<answer>{want + 0.04:.3f}</answer>", f"<answer>{want - 0.04:.3f}</answer>"]
                wrong = [f"<answer>{answer + 0.1:.1f}</answer>", f"<answer>{answer - 0.1:.1f}</answer>"]
            else:
                right = [f"<answer> {task.answer}</answer>"]
                wrong = [f"<answer>{answer + d}</answer>" for d in (1, -1, 0.5)]
            wrong += [task.answer, f"<answer>{task.answer} cm</answer>", *(t for _, t in family.audit_probes(task))]
            right.append(family.reference_completion(task))
            assert [family.score(task, text, False)["correct"] for text in right] == [1] * len(right)
            assert [family.score(task, text, False)["correct"] for text in wrong] == [0] * len(wrong), wrong
    # hand-checked: a 4 x 9 rectangle, legs 6 and 12, angles 49 and 77, a segment 4 across and 5 up (sqrt 41)
    assert [family.task(1, level=level).answer for level in family.levels()] == ["36", "36", "54", "6.4"]
