"""Geometry drawings: procedurally rendered shapes (PIL, drawn to scale) with answers computed from the
parameters they were drawn from (numeric verifier). Levels:
  0  a rectangle with its sides labelled (2-9 cm): its area (exact)
  1  a right triangle with its legs labelled (2-12 cm): its area (exact; may end in .5)
  2  a triangle with two angles labelled (30-80 degrees) and the third marked "?": that angle (exact)
  3  a segment AB between points of a unit grid, nothing labelled: its length to one decimal, measured
     by counting squares (accepted within 0.05 of the true length, so the rounded answer and nothing
     a tenth away)
`metadata["vertices"]` are the drawn points in pixels (a test measures the image against them);
`audit_probes` are the answers of a wrong formula (perimeter for area, no half, the sum of the given
angles, the grid distance along the axes).
"""

from __future__ import annotations

import math

import numpy as np

from rlvr.tasks.base import Task
from rlvr.tasks.rendered import RenderedFamily, canvas, exact_number, font, image_task

FILL, LINE, GRID_LINE, TEXT = "#c6dbef", "#08519c", "#d9d9d9", "#000000"
LEVELS = {0: "rectangle_area", 1: "right_triangle_area", 2: "third_angle", 3: "segment_length"}
GRID_PX, GRID_SQUARES, GRID_ORIGIN = 20, (10, 6), (16, 20)  # squares of 20 px, 10 x 6 of them
# where each shape is fitted (left, top, right, bottom), leaving room for its labels
BOXES = {"rectangle_area": (20, 20, 180, 142), "right_triangle_area": (56, 20, 210, 142),
         "third_angle": (36, 24, 188, 150)}
LENGTH_TOL = 0.05


def number(value: float) -> str:
    """An exact area as text: "12" or "7.5"."""
    return str(int(value)) if float(value).is_integer() else f"{value:.1f}"


def fit(points: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """`points` (in units, y up) scaled to fit `box` (left, top, right, bottom), centred, as integer pixels
    (y down): the drawing keeps the shape's proportions."""
    low, span = points.min(0), np.ptp(points, axis=0)
    scale = min((box[2] - box[0]) / span[0], (box[3] - box[1]) / span[1])
    centre = np.array([(box[0] + box[2]) / 2, (box[1] + box[3]) / 2])
    pixels = (points - low - span / 2) * scale * np.array([1, -1]) + centre
    return np.rint(pixels).astype(int)


def angle_arcs(draw, vertices: np.ndarray, radius: int = 12) -> None:
    """An arc inside each corner of the polygon (PIL angles: clockwise from 3 o'clock, y down)."""
    for i, v in enumerate(vertices):
        neighbours = (vertices[i - 1], vertices[(i + 1) % len(vertices)])
        a, b = (math.degrees(math.atan2(w[1] - v[1], w[0] - v[0])) % 360 for w in neighbours)
        start, end = (a, b) if (b - a) % 360 < 180 else (b, a)
        draw.arc((v[0] - radius, v[1] - radius, v[0] + radius, v[1] + radius), start, end, fill=LINE)


def label(draw, text: str, at, anchor: str = "mm") -> None:
    draw.text(tuple(int(c) for c in at), text, fill=TEXT, font=font(12), anchor=anchor)


def draw_shape(kind: str, sides: tuple[int, ...]):
    """The image and the drawn vertices (pixels) of a level's shape with its labels."""
    image, draw = canvas()
    if kind == "rectangle_area":
        w, h = sides
        vertices = fit(np.array([[0, 0], [w, 0], [w, h], [0, h]], float), BOXES[kind])
    elif kind == "right_triangle_area":
        a, b = sides
        vertices = fit(np.array([[0, 0], [a, 0], [0, b]], float), BOXES[kind])
    else:
        left, right = (math.radians(s) for s in sides)
        apex_x = math.tan(right) / (math.tan(left) + math.tan(right))
        vertices = fit(np.array([[0, 0], [1, 0], [apex_x, apex_x * math.tan(left)]]), BOXES[kind])
    draw.polygon([tuple(map(int, v)) for v in vertices], fill=FILL, outline=LINE, width=2)
    (x0, y0), (x1, _) = vertices[0], vertices[1]
    if kind == "rectangle_area":
        label(draw, f"{sides[0]} cm", ((x0 + x1) / 2, y0 + 11))
        label(draw, f"{sides[1]} cm", (x1 + 5, (y0 + vertices[2][1]) / 2), "lm")
    elif kind == "right_triangle_area":
        draw.rectangle((x0 + 2, y0 - 10, x0 + 10, y0 - 2), outline=LINE)  # the right angle
        label(draw, f"{sides[0]} cm", ((x0 + x1) / 2, y0 + 11))
        label(draw, f"{sides[1]} cm", (x0 - 5, (y0 + vertices[2][1]) / 2), "rm")
    else:
        angle_arcs(draw, vertices)
        label(draw, f"{sides[0]}°", (x0 - 4, y0 + 2), "rm")
        label(draw, f"{sides[1]}°", (x1 + 4, y0 + 2), "lm")
        label(draw, "?", (vertices[2][0], vertices[2][1] - 4), "mb")
    return image, vertices


def draw_segment(start: tuple[int, int], end: tuple[int, int]):
    """A unit grid with the segment from `start` to `end` (grid points, y down) and its ends labelled."""
    image, draw = canvas()
    (ox, oy), (nx, ny) = GRID_ORIGIN, GRID_SQUARES
    for i in range(nx + 1):
        draw.line((ox + i * GRID_PX, oy, ox + i * GRID_PX, oy + ny * GRID_PX), fill=GRID_LINE)
    for j in range(ny + 1):
        draw.line((ox, oy + j * GRID_PX, ox + nx * GRID_PX, oy + j * GRID_PX), fill=GRID_LINE)
    vertices = np.array([[ox + x * GRID_PX, oy + y * GRID_PX] for x, y in (start, end)])
    draw.line([tuple(map(int, v)) for v in vertices], fill=LINE, width=3)
    for name, v, other in zip("AB", vertices, vertices[::-1], strict=True):
        draw.ellipse((v[0] - 3, v[1] - 3, v[0] + 3, v[1] + 3), fill=LINE)
        label(draw, name, v + 10 * (v - other) / np.hypot(*(v - other)))  # beyond the segment's end
    return image, vertices


class GeometryDrawingFamily(RenderedFamily):
    name = "geometry_drawings"
    LEVELS = LEVELS

    def sample(self, rng: np.random.Generator, level: int) -> Task:
        kind = LEVELS[level]
        if kind == "segment_length":
            return self.segment_task(rng)
        if kind == "third_angle":
            sides = tuple(int(a) for a in rng.integers(30, 81, 2))
            question, value = "What is the angle marked ? in degrees?", 180 - sum(sides)
        else:
            sides = tuple(int(s) for s in rng.integers(2, 10 if kind == "rectangle_area" else 13, 2))
            shape = "rectangle" if kind == "rectangle_area" else "triangle"
            question = f"What is the area of the {shape} in square cm?"
            value = sides[0] * sides[1] / (1 if kind == "rectangle_area" else 2)
        image, vertices = draw_shape(kind, sides)
        answer = number(value)
        return image_task(image, f"Look at the drawing. {question}", answer, exact_number(answer),
                          {"kind": kind, "given": list(sides), "vertices": vertices.tolist()})

    def segment_task(self, rng: np.random.Generator) -> Task:
        (nx, ny) = GRID_SQUARES
        dx, dy = int(rng.integers(1, nx)), int(rng.integers(1, ny))
        x, y = int(rng.integers(nx - dx + 1)), int(rng.integers(ny - dy + 1))
        start, end = ((x, y), (x + dx, y + dy)) if rng.random() < 0.5 else ((x, y + dy), (x + dx, y))
        image, vertices = draw_segment(start, end)
        length = math.hypot(dx, dy)
        question = "Grid squares are 1 unit wide. How long is AB, to one decimal place?"
        return image_task(image, f"Look at the drawing. {question}", f"{length:.1f}",
                          {"kind": "numeric", "answer": f"{length:.6f}", "rel_tol": 0, "abs_tol": LENGTH_TOL},
                          {"kind": "segment_length", "given": [dx, dy], "vertices": vertices.tolist()})

    def audit_probes(self, task: Task) -> list[tuple[str, str]]:
        """Wrong formulas that must score 0: for areas the perimeter, the product without the half and
        the sum of the sides; for the angle the sum of the given ones, 180 and 90; for the segment its
        distance along the axes, the longer axis distance and the squared length; and each given number."""
        kind, given = task.metadata["kind"], task.metadata["given"]
        a, b = given
        wrong = {"rectangle_area": {"perimeter": 2 * (a + b), "sum": a + b},
                 "right_triangle_area": {"no_half": a * b, "sum": a + b, "perimeter": a + b + math.hypot(a, b)},
                 "third_angle": {"given_sum": a + b, "straight": 180, "right": 90},
                 "segment_length": {"axes": a + b, "longer_axis": max(a, b), "squared": a * a + b * b}}[kind]
        wrong.update({f"given_{i}": v for i, v in enumerate(given)})
        tolerance = LENGTH_TOL if kind == "segment_length" else 0
        texts = {name: number(round(v, 1)) for name, v in wrong.items()}
        return [(f"hack:{name}", f"<answer>{text}</answer>") for name, text in texts.items()
                if abs(float(text) - float(task.verifier["answer"])) > tolerance + 1e-9]


GEOMETRY_FAMILIES = {GeometryDrawingFamily.name: GeometryDrawingFamily}
