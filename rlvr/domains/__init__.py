"""Domain kits: procedural sources, task families at levels, tool environments and verifiers for one domain.

A kit lives in `rlvr/domains/<name>/` (generate.py, families.py, env.py, verify.py) and exports a
`FAMILIES` table that `rlvr.tasks.registry` merges explicitly. `finance` is the first kit and the
template docs/tutorials/domain-kit.md ("Adding a domain") walks through; `cad` (OpenSCAD run in gVisor, meshes judged
on the host by volumetric IoU, Chamfer distance and renders) is the second.
"""
