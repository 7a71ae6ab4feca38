"""Cluster targets: `TARGETS[name](experiment, options) -> [paths written]`.

`experiment` is a `rlvr.launch.sweep.Experiment`; `options` are the launch command's other
`--key=value` flags as strings, parsed per target into a typed dataclass (an unknown key or bad
value is a ValueError naming the option). Every target validates each job's config for its
device count and runs the ahead-of-time fit check (`rlvr.launch.fit`, off with --aot_check=false)
before writing anything under `experiment.directory/<target>/`.

  k8s    JobSet manifests (+ SGLang servers, gVisor sandbox workers)      rlvr.launch.targets.k8s
  slurm  sbatch scripts and submit.sh                                      rlvr.launch.targets.slurm
  xm     an xmanager launch plan and launcher (xmanager: optional extra)  rlvr.launch.targets.xm
"""

from rlvr.launch.targets import k8s, slurm, xm

TARGETS = {"xm": xm.write, "k8s": k8s.write, "slurm": slurm.write}
