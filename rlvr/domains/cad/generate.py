"""Procedural CAD targets at four levels: a spec (plain JSON), its reference OpenSCAD script, its words.

  level 0  primitives          cylinder, cone frustum, sphere, hexagonal prism
  level 1  CSG of a few parts  plate with a hole, block with a boss, L-bracket, tube, block with a spherical pocket
  level 2  patterned/filleted  a row of holes, a plate with rounded corners, a bolt circle, a grid of pegs
  level 3  assemblies          a hub flange (bore + bolt circle), a pillow block (housing with a bore along x and
                               two mount holes, symmetric), a clevis (two mirrored lugs with a cross hole)

Every part stands on z = 0, centred on the z axis (x and y symmetric unless the words say otherwise), in
millimetres, round features with `$fn = FN` (the prompt asks for the same, so an exact answer reproduces the
reference's mesh). `volume(spec)` is the analytic volume with true circles (a test checks the reference mesh
against it); no target is a plain box, so the target's bounding box alone is never the answer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

FN = 32
LEVELS = [0, 1, 2, 3]
KINDS = {0: ["cylinder", "frustum", "sphere", "hex_prism"],
         1: ["plate_hole", "block_boss", "l_bracket", "tube", "pocket_block"],
         2: ["hole_row", "rounded_plate", "bolt_circle", "peg_grid"],
         3: ["flange", "pillow_block", "clevis"]}


def _i(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


def make_spec(rng: np.random.Generator, level: int) -> dict[str, Any]:
    """A random target of `level`: {"kind", **dimensions in mm}."""
    kind = KINDS[level][int(rng.integers(len(KINDS[level])))]
    s: dict[str, Any] = {"kind": kind}
    if kind == "cylinder":
        s.update(d=_i(rng, 8, 40), h=_i(rng, 5, 40))
    elif kind == "frustum":
        s.update(d1=_i(rng, 20, 40), d2=_i(rng, 4, 16), h=_i(rng, 8, 30))
    elif kind == "sphere":
        s.update(d=_i(rng, 10, 40))
    elif kind == "hex_prism":
        s.update(w=_i(rng, 10, 40), h=_i(rng, 4, 30))
    elif kind == "plate_hole":
        s.update(l=_i(rng, 30, 60), w=_i(rng, 20, 40), t=_i(rng, 3, 8))
        s["d"] = _i(rng, min(s["l"], s["w"]) // 2, min(s["l"], s["w"]) - 8)
    elif kind == "block_boss":
        s.update(l=_i(rng, 20, 40), w=_i(rng, 20, 40), t=_i(rng, 4, 10), h=_i(rng, 5, 20))
        s["d"] = _i(rng, 5, min(s["l"], s["w"]) - 4)
    elif kind == "l_bracket":
        s.update(l=_i(rng, 25, 50), w=_i(rng, 10, 30), t=_i(rng, 3, 6), h=_i(rng, 15, 40))
    elif kind == "tube":
        s.update(d=_i(rng, 12, 40), h=_i(rng, 10, 40))
        s["di"] = _i(rng, 4, s["d"] - 4)
    elif kind == "pocket_block":
        s.update(l=_i(rng, 25, 50), w=_i(rng, 25, 50), h=_i(rng, 12, 25))
        s["d"] = _i(rng, 10, min(s["l"], s["w"], 2 * s["h"]) - 4)
    elif kind == "hole_row":
        s.update(n=_i(rng, 3, 6), p=_i(rng, 8, 14), t=_i(rng, 3, 6))
        s.update(d=_i(rng, s["p"] // 2, s["p"] - 3), w=_i(rng, 12, 18))
        s["l"] = s["n"] * s["p"] + _i(rng, 4, 10)
    elif kind == "rounded_plate":
        s.update(l=_i(rng, 30, 60), w=_i(rng, 20, 40), t=_i(rng, 3, 8))
        short = min(s["l"], s["w"])
        s["r"] = _i(rng, short // 4, short // 2 - 2)
        s["d"] = _i(rng, short // 3, short - s["r"] - 4)
    elif kind == "bolt_circle":
        s.update(D=_i(rng, 40, 70), t=_i(rng, 4, 8), n=_i(rng, 3, 6), d=_i(rng, 4, 7))
        s["pcd"] = _i(rng, s["D"] // 2, s["D"] - 2 * s["d"] - 4)
    elif kind == "peg_grid":
        s.update(nx=_i(rng, 2, 3), ny=2, p=_i(rng, 8, 12), t=_i(rng, 3, 5), h=_i(rng, 4, 10))
        s["d"] = _i(rng, 3, s["p"] - 3)
    elif kind == "flange":
        s.update(D=_i(rng, 50, 80), t=_i(rng, 5, 9), n=_i(rng, 3, 6), d=_i(rng, 4, 7), hub_h=_i(rng, 8, 20))
        s["hub_d"] = _i(rng, 20, s["D"] // 2)
        s["bore"] = _i(rng, 8, s["hub_d"] - 8)
        s["pcd"] = _i(rng, s["hub_d"] + s["d"] + 4, s["D"] - s["d"] - 4)
    elif kind == "pillow_block":
        s.update(w=_i(rng, 16, 26), t=_i(rng, 5, 9), housing_d=_i(rng, 22, 34), hole_d=_i(rng, 4, 7))
        s["axis_h"] = s["t"] + s["housing_d"] // 2
        s["bore"] = _i(rng, 8, s["housing_d"] - 10)
        s["hole_x"] = s["housing_d"] // 2 + s["hole_d"] + _i(rng, 0, 6)
        s["l"] = 2 * (s["hole_x"] + s["hole_d"] + _i(rng, 2, 6))
    elif kind == "clevis":
        s.update(l=_i(rng, 30, 50), w=_i(rng, 16, 28), t=_i(rng, 4, 8), gap=_i(rng, 8, 16), lug_t=_i(rng, 4, 7))
        s.update(lug_h=_i(rng, 18, 30), pin_d=_i(rng, 5, 9))
    return s


def _cyl(h: float, d: float, center: bool = False, d2: float | None = None) -> str:
    size = f"d={d}" if d2 is None else f"d1={d}, d2={d2}"
    return f"cylinder(h={h}, {size}{', center=true' if center else ''})"


def _box(x: float, y: float, z: float) -> str:  # centred in x and y, from z = 0
    return f"translate([{-x / 2}, {-y / 2}, 0]) cube([{x}, {y}, {z}])"


def reference_script(s: dict[str, Any]) -> str:
    """The OpenSCAD program that builds the target (`$fn = FN`)."""
    k = s["kind"]
    lines = [f"$fn = {FN};"]
    if k == "cylinder":
        body = _cyl(s["h"], s["d"]) + ";"
    elif k == "frustum":
        body = _cyl(s["h"], s["d1"], d2=s["d2"]) + ";"
    elif k == "sphere":
        body = f"translate([0, 0, {s['d'] / 2}]) sphere(d={s['d']});"
    elif k == "hex_prism":
        body = f"cylinder(h={s['h']}, d={s['w']}, $fn=6);"
    elif k == "plate_hole":
        body = f"difference() {{\n  {_box(s['l'], s['w'], s['t'])};\n  {_cyl(3 * s['t'], s['d'], True)};\n}}"
    elif k == "block_boss":
        body = (f"union() {{\n  {_box(s['l'], s['w'], s['t'])};\n  translate([0, 0, {s['t']}]) "
                f"{_cyl(s['h'], s['d'])};\n}}")
    elif k == "l_bracket":
        body = (f"union() {{\n  {_box(s['l'], s['w'], s['t'])};\n  translate([{-s['l'] / 2}, {-s['w'] / 2}, 0]) "
                f"cube([{s['t']}, {s['w']}, {s['h']}]);\n}}")
    elif k == "tube":
        body = f"difference() {{\n  {_cyl(s['h'], s['d'])};\n  translate([0, 0, -1]) {_cyl(s['h'] + 2, s['di'])};\n}}"
    elif k == "pocket_block":
        body = (f"difference() {{\n  {_box(s['l'], s['w'], s['h'])};\n  translate([0, 0, {s['h']}]) "
                f"sphere(d={s['d']});\n}}")
    elif k == "hole_row":
        x0 = -(s["n"] - 1) * s["p"] / 2
        body = (f"difference() {{\n  {_box(s['l'], s['w'], s['t'])};\n  for (i = [0:{s['n'] - 1}])\n"
                f"    translate([{x0} + i * {s['p']}, 0, 0]) {_cyl(3 * s['t'], s['d'], True)};\n}}")
    elif k == "rounded_plate":
        cx, cy = s["l"] / 2 - s["r"], s["w"] / 2 - s["r"]
        body = (f"difference() {{\n  hull() {{\n    for (x = [{-cx}, {cx}], y = [{-cy}, {cy}])\n"
                f"      translate([x, y, 0]) cylinder(h={s['t']}, r={s['r']});\n  }}\n"
                f"  {_cyl(3 * s['t'], s['d'], True)};\n}}")
    elif k == "bolt_circle":
        body = (f"difference() {{\n  {_cyl(s['t'], s['D'])};\n  for (i = [0:{s['n'] - 1}])\n"
                f"    rotate([0, 0, i * 360 / {s['n']}]) translate([{s['pcd'] / 2}, 0, 0]) "
                f"{_cyl(3 * s['t'], s['d'], True)};\n}}")
    elif k == "peg_grid":
        lx, ly = s["nx"] * s["p"], s["ny"] * s["p"]
        body = (f"union() {{\n  {_box(lx, ly, s['t'])};\n  for (i = [0:{s['nx'] - 1}], j = [0:{s['ny'] - 1}])\n"
                f"    translate([{-lx / 2 + s['p'] / 2} + i * {s['p']}, {-ly / 2 + s['p'] / 2} + j * {s['p']}, "
                f"{s['t']}]) {_cyl(s['h'], s['d'])};\n}}")
    elif k == "flange":
        body = (f"difference() {{\n  union() {{\n    {_cyl(s['t'], s['D'])};\n"
                f"    {_cyl(s['t'] + s['hub_h'], s['hub_d'])};\n"
                f"  }}\n  translate([0, 0, -1]) {_cyl(s['t'] + s['hub_h'] + 2, s['bore'])};\n"
                f"  for (i = [0:{s['n'] - 1}])\n    rotate([0, 0, i * 360 / {s['n']}]) "
                f"translate([{s['pcd'] / 2}, 0, 0]) {_cyl(3 * s['t'], s['d'], True)};\n}}")
    elif k == "pillow_block":
        body = (f"difference() {{\n  union() {{\n    {_box(s['l'], s['w'], s['t'])};\n"
                f"    translate([0, 0, {s['axis_h']}]) rotate([90, 0, 0]) {_cyl(s['w'], s['housing_d'], True)};\n"
                f"    {_box(s['housing_d'], s['w'], s['axis_h'])};\n  }}\n"
                f"  translate([0, 0, {s['axis_h']}]) rotate([90, 0, 0]) {_cyl(s['w'] + 2, s['bore'], True)};\n"
                f"  for (x = [{-s['hole_x']}, {s['hole_x']}])\n    translate([x, 0, 0]) "
                f"{_cyl(3 * s['t'], s['hole_d'], True)};\n}}")
    elif k == "clevis":
        x = s["gap"] / 2
        body = (f"difference() {{\n  union() {{\n    {_box(s['l'], s['w'], s['t'])};\n"
                f"    for (m = [0, 1]) mirror([m, 0, 0])\n"
                f"      translate([{x}, {-s['w'] / 2}, 0]) cube([{s['lug_t']}, {s['w']}, {s['t'] + s['lug_h']}]);\n"
                f"  }}\n  translate([0, 0, {s['t'] + s['lug_h'] * 0.6}]) rotate([0, 90, 0]) "
                f"{_cyl(s['gap'] + 2 * s['lug_t'] + 2, s['pin_d'], True)};\n}}")
    else:
        raise ValueError(f"unknown CAD target kind {k!r}; kinds: {sorted(k for ks in KINDS.values() for k in ks)}")
    return "\n".join([*lines, body]) + "\n"


def describe(s: dict[str, Any]) -> str:
    """The target in words and dimensions (what the prompt shows)."""
    k = s["kind"]
    through = "through hole (along z)"
    words = {
        "cylinder": f"a solid cylinder, diameter {s.get('d')} mm, height {s.get('h')} mm",
        "frustum": (f"a cone frustum, height {s.get('h')} mm, base diameter {s.get('d1')} mm, top diameter "
                    f"{s.get('d2')} mm"),
        "sphere": f"a solid sphere of diameter {s.get('d')} mm resting on z = 0",
        "hex_prism": (f"a regular hexagonal prism, {s.get('w')} mm across corners (one corner on +x), "
                      f"height {s.get('h')} mm"),
        "plate_hole": (f"a plate {s.get('l')} x {s.get('w')} mm (x by y), {s.get('t')} mm thick, with a centred "
                       f"{s.get('d')} mm {through}"),
        "block_boss": (f"a block {s.get('l')} x {s.get('w')} mm, {s.get('t')} mm thick, with a cylindrical boss of "
                       f"diameter {s.get('d')} mm and height {s.get('h')} mm centred on its top face"),
        "l_bracket": (f"an L-bracket: a base plate {s.get('l')} x {s.get('w')} mm, {s.get('t')} mm thick, and an "
                      f"upright wall {s.get('t')} mm thick and {s.get('h')} mm tall (from z = 0) along the base's "
                      f"-x edge, as wide (y) as the base"),
        "tube": f"a tube: outer diameter {s.get('d')} mm, inner diameter {s.get('di')} mm, height {s.get('h')} mm",
        "pocket_block": (f"a block {s.get('l')} x {s.get('w')} mm, {s.get('h')} mm tall, with a hemispherical pocket "
                         f"of diameter {s.get('d')} mm whose centre is the centre of the top face"),
        "hole_row": (f"a plate {s.get('l')} x {s.get('w')} mm, {s.get('t')} mm thick, with a row of {s.get('n')} "
                     f"{s.get('d')} mm through holes along x at a {s.get('p')} mm pitch, the row centred"),
        "rounded_plate": (f"a plate {s.get('l')} x {s.get('w')} mm, {s.get('t')} mm thick, its four vertical edges "
                          f"rounded with radius {s.get('r')} mm, with a centred {s.get('d')} mm {through}"),
        "bolt_circle": (f"a disc of diameter {s.get('D')} mm, {s.get('t')} mm thick, with {s.get('n')} {s.get('d')} mm "
                        f"through holes equally spaced on a {s.get('pcd')} mm pitch circle, the first on +x"),
        "peg_grid": (f"a base {s.get('nx', 0) * s.get('p', 0)} x {s.get('ny', 0) * s.get('p', 0)} mm, {s.get('t')} mm "
                     f"thick, with a {s.get('nx')} x {s.get('ny')} grid of pegs (diameter {s.get('d')} mm, height "
                     f"{s.get('h')} mm) on its top at a {s.get('p')} mm pitch, the grid centred"),
        "flange": (f"a hub flange: a disc of diameter {s.get('D')} mm, {s.get('t')} mm thick; a hub of diameter "
                   f"{s.get('hub_d')} mm rising {s.get('hub_h')} mm above the disc; a {s.get('bore')} mm bore "
                   f"through both; {s.get('n')} {s.get('d')} mm through holes on a {s.get('pcd')} mm pitch circle, "
                   f"the first on +x"),
        "pillow_block": (f"a pillow block: a base plate {s.get('l')} x {s.get('w')} mm, {s.get('t')} mm thick; a "
                         f"cylindrical housing of diameter {s.get('housing_d')} mm and length {s.get('w')} mm "
                         f"(the base's "
                         f"width) whose axis runs along y at height {s.get('axis_h')} mm, joined to the base by a "
                         f"block as wide (x) as the housing's diameter; a {s.get('bore')} mm bore through the housing "
                         f"along its axis; two {s.get('hole_d')} mm mounting through holes at "
                         f"x = -{s.get('hole_x')} and "
                         f"x = +{s.get('hole_x')} mm"),
        "clevis": (f"a clevis: a base plate {s.get('l')} x {s.get('w')} mm, {s.get('t')} mm thick; two lugs "
                   f"{s.get('lug_t')} mm thick (x), as wide as the base (y), rising {s.get('lug_h')} mm above it, "
                   f"mirror images about x = 0 with a {s.get('gap')} mm gap between them; a {s.get('pin_d')} mm pin "
                   f"hole through both lugs along x at height {s.get('t', 0) + s.get('lug_h', 0) * 0.6:g} mm"),
    }[k]
    return (f"Model {words}. The part stands on z = 0 and is centred on the z axis (symmetric in x and y unless "
            f"stated otherwise); units are millimetres. Use $fn = {FN} for round features.")


def _circle(d: float) -> float:
    return math.pi * d * d / 4


def volume(s: dict[str, Any]) -> float:
    """The analytic volume (true circles), mm^3: an independent check of the reference meshes."""
    k, g = s["kind"], s.get
    if k == "cylinder":
        return _circle(s["d"]) * s["h"]
    if k == "frustum":
        r1, r2 = s["d1"] / 2, s["d2"] / 2
        return math.pi * s["h"] * (r1 * r1 + r1 * r2 + r2 * r2) / 3
    if k == "sphere":
        return math.pi * s["d"] ** 3 / 6
    if k == "hex_prism":
        return 3 * math.sqrt(3) / 2 * (s["w"] / 2) ** 2 * s["h"]
    if k in ("plate_hole", "hole_row"):
        return (s["l"] * s["w"] - g("n", 1) * _circle(s["d"])) * s["t"]
    if k == "block_boss":
        return s["l"] * s["w"] * s["t"] + _circle(s["d"]) * s["h"]
    if k == "l_bracket":
        return s["l"] * s["w"] * s["t"] + s["t"] * s["w"] * (s["h"] - s["t"])
    if k == "tube":
        return (_circle(s["d"]) - _circle(s["di"])) * s["h"]
    if k == "pocket_block":
        return s["l"] * s["w"] * s["h"] - math.pi * s["d"] ** 3 / 12
    if k == "rounded_plate":
        return (s["l"] * s["w"] - (4 - math.pi) * s["r"] ** 2 - _circle(s["d"])) * s["t"]
    if k == "bolt_circle":
        return (_circle(s["D"]) - s["n"] * _circle(s["d"])) * s["t"]
    if k == "peg_grid":
        return s["nx"] * s["ny"] * (s["p"] ** 2 * s["t"] + _circle(s["d"]) * s["h"])
    if k == "flange":
        return (_circle(s["D"]) * s["t"] + _circle(s["hub_d"]) * s["hub_h"] - _circle(s["bore"]) * (s["t"] + s["hub_h"])
                - s["n"] * _circle(s["d"]) * s["t"])
    if k == "pillow_block":
        hd, ah, w = s["housing_d"], s["axis_h"], s["w"]
        above = _circle(hd) / 2 * w  # the housing's upper half (its lower half lies inside the block)
        return (s["l"] * w * s["t"] + hd * w * (ah - s["t"]) + above - _circle(s["bore"]) * w
                - 2 * _circle(s["hole_d"]) * s["t"])
    if k == "clevis":
        return s["l"] * s["w"] * s["t"] + 2 * s["lug_t"] * s["w"] * s["lug_h"] - 2 * _circle(s["pin_d"]) * s["lug_t"]
    raise ValueError(f"unknown CAD target kind {k!r}")
