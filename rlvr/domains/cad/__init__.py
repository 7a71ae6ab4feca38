"""The CAD domain kit: the policy writes OpenSCAD; the sandbox turns it into a mesh; the host compares geometry.

Reading order: `generate` (procedural targets at four levels, each with its reference script, its words and
its analytic volume), `scad` (OpenSCAD in the sandbox for candidates, on the host for references), `render`
(a deterministic numpy z-buffer: depth views, PNG, text pictures), `verify` (strict STL parsing, volumetric IoU
with manifold3d, Chamfer distance, render-and-compare, the layered score), `families` (`FAMILIES`, merged by
rlvr.tasks.registry), `env` (CadEnv: run_script, render, compare, measure, write_file).
Needs the `cad` extra (trimesh, manifold3d) and Debian's openscad.
"""
