"""Kubernetes target: plain manifests for `kubectl apply -k EXPERIMENT/k8s/`.

    python -m rlvr.launch configs/X.py --sweep --target=k8s --image=REGISTRY/rlvr:TAG --tpu=v5p-32 \\
        --pvc=rlvr-data [--sglang_servers=2 --sglang_model=/mnt/rlvr/models/qwen] [--sandbox_workers=4]

Per job, one YAML file with:
  JobSet (jobset.x-k8s.io/v1alpha2) `trainer`: one Indexed Job of `hosts` pods (a TPU slice's hosts,
      with the GKE TPU node selectors and `google.com/tpu` chips, or `--nodes` GPU nodes with
      `nvidia.com/gpu`). Multi-host JAX reads RLVR_COORDINATOR_ADDRESS (pod 0's stable hostname
      `<jobset>-trainer-0-0.<jobset>` from the JobSet's headless service), RLVR_NUM_PROCESSES and
      RLVR_PROCESS_ID (the pod's completion index) -- see `rlvr.launch.distributed`.
  --sglang_servers=N: a StatefulSet of N SGLang servers plus a headless Service. A StatefulSet, not a
      Deployment, because the trainer must reach every server by name: weight updates are broadcast
      to each URL (`rl.sglang_urls` lists `<name>-i.<service>`), which one load-balanced Service
      address cannot do. The servers mount the same volume: weights are synced through the workdir.
  --sglang_router=true: also a Deployment + Service of SGLang's router (sglang-router, in --sglang_image)
      in front of those servers (`rl.sglang_router`): generation goes through it, control still to
      each server (rlvr.rollout.router).
  --sandbox_workers=N: a Ray head (Deployment + Service) and N verifier worker pods under
      `runtimeClassName: gvisor` that join it; the trainer's verifiers run there (rl.verifier_backend).
The workdir lives on a shared volume (--pvc, mounted at --mount_path) or a bucket path (--workdir_root).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from typing import Any

import yaml
from rlvr.launch.targets import common
from rlvr.launch.targets.options import Accelerator, OptionError, accelerator_from, parse_options, positive

TRAINER = "trainer"
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


@dataclasses.dataclass
class K8sOptions:
    """`--key=value` options of --target=k8s."""

    image: str = ""  # the trainer's container image (rlvr installed, the repo at --repo_dir)
    tpu: str = ""  # TPU slice, e.g. v5p-32 / v6e-16
    tpu_topology: str = ""  # slice shape override, e.g. 4x4
    gpu: str = ""  # GPU type: a100, h100, h200
    gpus_per_node: int = 8
    nodes: int = 1  # GPU nodes per job
    namespace: str = "default"
    pvc: str = ""  # a ReadWriteMany PersistentVolumeClaim for workdirs (and SGLang weight sync)
    mount_path: str = "/mnt/rlvr"
    workdir_root: str = ""  # default: MOUNT_PATH/experiments with --pvc; or gs://bucket/path
    repo_dir: str = "/workspace/rlvr"  # the container's working directory (holds configs/)
    coordinator_port: int = 8476
    max_restarts: int = 0  # JobSet restarts of the whole slice after a failure
    service_account: str = ""
    sglang_servers: int = 0
    sglang_model: str = ""  # the servers' initial HF checkpoint (a path on the volume)
    sglang_image: str = "lmsysorg/sglang:latest"
    sglang_gpus: int = 1  # GPUs (tensor parallel) per server
    sglang_port: int = 30000
    sglang_router: bool = False  # an sglang-router Deployment + Service in front of the servers
    sglang_router_port: int = 30100
    sglang_router_policy: str = "cache_aware"  # cache_aware | round_robin | power_of_two | random
    sandbox_workers: int = 0
    sandbox_image: str = ""  # default: --image (needs ray and rlvr)
    sandbox_cpus: int = 4
    aot_check: bool = True
    hbm_fraction: float = 0.9

    def check(self) -> None:
        if not self.image:
            raise OptionError("--target=k8s needs --image=REGISTRY/IMAGE:TAG (rlvr installed, the repo at --repo_dir).")
        if not self.pvc and not self.workdir_root:
            raise OptionError("--target=k8s needs shared storage for workdirs: --pvc=CLAIM (mounted at --mount_path) "
                              "or --workdir_root=gs://BUCKET/PATH.")
        if self.sglang_servers and not self.pvc:
            raise OptionError("--sglang_servers needs --pvc: the servers load new weights from the trainer's workdir.")
        if self.sglang_router and not self.sglang_servers:
            raise OptionError("--sglang_router=true needs --sglang_servers=N: the router balances over those servers.")
        if self.sglang_router_policy not in ROUTER_POLICIES:
            raise OptionError(f"--sglang_router_policy={self.sglang_router_policy!r}: use one of "
                              f"{list(ROUTER_POLICIES)}.")
        for name in ("coordinator_port", "sglang_gpus", "sglang_port", "sglang_router_port", "sandbox_cpus"):
            positive(name, getattr(self, name), "k8s")
        for name in ("sglang_servers", "sandbox_workers", "max_restarts"):
            if getattr(self, name) < 0:
                raise OptionError(f"--{name}={getattr(self, name)}: must be >= 0.")

    @property
    def root(self) -> str:
        return self.workdir_root or f"{self.mount_path.rstrip('/')}/experiments"


def k8s_name(text: str, limit: int = 40) -> str:
    """A DNS-1035 label from `text` (lowercase letters, digits, '-'; a letter first), at most `limit`
    characters; when `text` had to change, a short hash of it keeps names of different texts apart."""
    clean = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if clean == text and len(clean) <= limit and clean[:1].isalpha():
        return clean
    head = clean[: limit - 7].strip("-")
    if not head[:1].isalpha():
        head = ("r" + head)[: limit - 7].strip("-")
    return f"{head}-{hashlib.sha1(text.encode()).hexdigest()[:6]}"


# --- objects -------------------------------------------------------------------------------------

def _metadata(name: str, opts: K8sOptions, labels: dict[str, str], job_name: str = "") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": opts.namespace, "labels": dict(labels)}
    if job_name:
        meta["annotations"] = {"rlvr/job-name": job_name}
    return meta


def _volumes(opts: K8sOptions) -> tuple[list[dict], list[dict]]:
    """(pod volumes, container mounts) of the shared workdir volume."""
    if not opts.pvc:
        return [], []
    return ([{"name": "workdir", "persistentVolumeClaim": {"claimName": opts.pvc}}],
            [{"name": "workdir", "mountPath": opts.mount_path}])


def trainer_env(jobset: str, acc: Accelerator, opts: K8sOptions) -> list[dict[str, Any]]:
    """What `rlvr.launch.distributed` reads, plus the GPU memory fraction the fit check assumed."""
    env: list[dict[str, Any]] = [
        {"name": "RLVR_COORDINATOR_ADDRESS", "value": f"{jobset}-{TRAINER}-0-0.{jobset}:{opts.coordinator_port}"},
        {"name": "RLVR_NUM_PROCESSES", "value": str(acc.hosts)},
        {"name": "RLVR_PROCESS_ID", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if acc.kind == "gpu":
        env.append({"name": "XLA_PYTHON_CLIENT_MEM_FRACTION", "value": f"{opts.hbm_fraction:g}"})
    return env


def _trainer_pod(jobset: str, job, acc: Accelerator, opts: K8sOptions, labels: dict) -> dict[str, Any]:
    volumes, mounts = _volumes(opts)
    resource = "google.com/tpu" if acc.kind == "tpu" else "nvidia.com/gpu"
    container = {"name": TRAINER, "image": opts.image, "workingDir": opts.repo_dir,
                 "command": job.command[:3], "args": job.command[3:],
                 "env": trainer_env(jobset, acc, opts),
                 "ports": [{"containerPort": opts.coordinator_port, "name": "coordinator"}],
                 "resources": {"limits": {resource: str(acc.chips_per_host)}}, "volumeMounts": mounts}
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": volumes}
    if acc.kind == "tpu":
        spec["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": acc.gke_accelerator,
                                "cloud.google.com/gke-tpu-topology": acc.topology}
    if opts.service_account:
        spec["serviceAccountName"] = opts.service_account
    return {"metadata": {"labels": dict(labels)}, "spec": spec}


def jobset(name: str, job, acc: Accelerator, opts: K8sOptions, labels: dict) -> dict[str, Any]:
    """The trainer JobSet: one Indexed Job of `acc.hosts` pods that all start together."""
    job_spec = {"parallelism": acc.hosts, "completions": acc.hosts, "completionMode": "Indexed", "backoffLimit": 0,
                "template": _trainer_pod(name, job, acc, opts, labels)}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": _metadata(name, opts, labels, job.name),
            "spec": {"failurePolicy": {"maxRestarts": opts.max_restarts},
                     "network": {"enableDNSHostnames": True},
                     "successPolicy": {"operator": "All", "targetReplicatedJobs": [TRAINER]},
                     "replicatedJobs": [{"name": TRAINER, "replicas": 1, "template": {"spec": job_spec}}]}}


def sglang_urls(name: str, opts: K8sOptions) -> list[str]:
    service = f"{name}-sglang"
    return [f"http://{service}-{i}.{service}:{opts.sglang_port}" for i in range(opts.sglang_servers)]


def sglang_objects(name: str, model: str, opts: K8sOptions, labels: dict) -> list[dict[str, Any]]:
    """A headless Service and a StatefulSet of SGLang servers (stable per-server DNS names)."""
    service = f"{name}-sglang"
    selector = {"rlvr/component": service}
    volumes, mounts = _volumes(opts)
    args = ["-m", "sglang.launch_server", "--model-path", model, "--host", "0.0.0.0",
            "--port", str(opts.sglang_port), "--tp-size", str(opts.sglang_gpus)]
    container = {"name": "sglang", "image": opts.sglang_image, "command": ["python3"], "args": args,
                 "ports": [{"containerPort": opts.sglang_port, "name": "http"}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": opts.sglang_port},
                                    "periodSeconds": 10, "failureThreshold": 60},
                 "resources": {"limits": {"nvidia.com/gpu": str(opts.sglang_gpus)}}, "volumeMounts": mounts}
    pod_labels = {**labels, **selector}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(service, opts, labels),
         "spec": {"clusterIP": "None", "selector": selector,
                  "ports": [{"name": "http", "port": opts.sglang_port, "targetPort": opts.sglang_port}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _metadata(service, opts, labels),
         "spec": {"serviceName": service, "replicas": opts.sglang_servers, "podManagementPolicy": "Parallel",
                  "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": pod_labels},
                               "spec": {"containers": [container], "volumes": volumes}}}},
    ]


def router_url(name: str, opts: K8sOptions) -> str:
    return f"http://{name}-router:{opts.sglang_router_port}"


def router_objects(name: str, opts: K8sOptions, labels: dict) -> list[dict[str, Any]]:
    """A Service and a one-replica Deployment of the sglang-router (in the SGLang image) in front of
    the StatefulSet's servers; the trainer sends generation to it and control to each server."""
    router = f"{name}-router"
    selector = {"rlvr/component": router}
    port = opts.sglang_router_port
    args = ["-m", "sglang_router.launch_router", "--host", "0.0.0.0", "--port", str(port),
            "--worker-urls", *sglang_urls(name, opts), "--policy", opts.sglang_router_policy,
            "--prometheus-host", "0.0.0.0", "--prometheus-port", "29000"]
    container = {"name": "router", "image": opts.sglang_image, "command": ["python3"], "args": args,
                 "ports": [{"containerPort": port, "name": "http"}, {"containerPort": 29000, "name": "metrics"}],
                 "readinessProbe": {"httpGet": {"path": "/readiness", "port": port},
                                    "periodSeconds": 10, "failureThreshold": 60}}
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(router, opts, labels),
         "spec": {"selector": selector, "ports": [{"name": "http", "port": port, "targetPort": port}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(router, opts, labels),
         "spec": {"replicas": 1, "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": {**labels, **selector}},
                               "spec": {"containers": [container]}}}},
    ]


def ray_address(name: str) -> str:
    return f"ray://{name}-ray-head:10001"


def sandbox_objects(name: str, opts: K8sOptions, labels: dict) -> list[dict[str, Any]]:
    """A Ray head (no CPUs of its own: it only schedules) and N gVisor-isolated verifier workers."""
    head, workers = f"{name}-ray-head", f"{name}-sandbox"
    image = opts.sandbox_image or opts.image
    head_sel, worker_sel = {"rlvr/component": head}, {"rlvr/component": workers}
    ports = [("gcs", 6379), ("client", 10001), ("dashboard", 8265)]
    head_container = {"name": "ray-head", "image": image, "command": ["ray"],
                      "args": ["start", "--head", "--port=6379", "--ray-client-server-port=10001", "--num-cpus=0",
                               "--dashboard-host=0.0.0.0", "--block"],
                      "ports": [{"containerPort": p, "name": n} for n, p in ports]}
    worker_container = {"name": "sandbox", "image": image, "command": ["ray"], "workingDir": opts.repo_dir,
                        "args": ["start", f"--address={head}:6379", f"--num-cpus={opts.sandbox_cpus}", "--block"],
                        "resources": {"requests": {"cpu": str(opts.sandbox_cpus)},
                                      "limits": {"cpu": str(opts.sandbox_cpus)}}}

    def deployment(dep_name, selector, replicas, pod_spec):
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(dep_name, opts, labels),
                "spec": {"replicas": replicas, "selector": {"matchLabels": selector},
                         "template": {"metadata": {"labels": {**labels, **selector}}, "spec": pod_spec}}}

    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(head, opts, labels),
         "spec": {"selector": head_sel, "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports]}},
        deployment(head, head_sel, 1, {"containers": [head_container]}),
        deployment(workers, worker_sel, opts.sandbox_workers,
                   {"runtimeClassName": "gvisor", "containers": [worker_container]}),
    ]


# --- the target ----------------------------------------------------------------------------------

def _extra_overrides(job, name: str, opts: K8sOptions) -> dict[str, Any]:
    """Config overrides the cluster layout implies for one job (validated with the rest)."""
    extra: dict[str, Any] = {}
    if opts.sglang_servers:
        if job.config.get("job") != "rl":
            raise OptionError(f"--sglang_servers: job {job.name} is a {job.config.get('job')!r} job; SGLang "
                              "servers serve RL rollouts only (drop the option).")
        extra.update({"rl.backend": "sglang", "rl.sglang_urls": ",".join(sglang_urls(name, opts))})
        if opts.sglang_router:
            extra["rl.sglang_router"] = router_url(name, opts)
    if opts.sandbox_workers:
        if job.config.get("job") != "rl":
            raise OptionError(f"--sandbox_workers: job {job.name} is a {job.config.get('job')!r} job; verifier "
                              "workers score RL rollouts only (drop the option).")
        extra.update({"rl.verifier_backend": "ray", "rl.verifier_address": ray_address(name)})
    return extra


def _sglang_model(job, opts: K8sOptions) -> str:
    model = opts.sglang_model or job.config.get("init", {}).get("hf_checkpoint", "")
    if not model:
        raise OptionError(f"--sglang_servers: give --sglang_model=PATH (an HF checkpoint on the volume with "
                          f"job {job.name}'s architecture) for the servers to start from.")
    return model


def job_objects(job, name: str, acc: Accelerator, opts: K8sOptions) -> list[dict[str, Any]]:
    """Every object of one (already adjusted) job."""
    labels = {"app.kubernetes.io/part-of": "rlvr", "rlvr/jobset": name}
    objects = [jobset(name, job, acc, opts, labels)]
    if opts.sglang_servers:
        objects += sglang_objects(name, _sglang_model(job, opts), opts, labels)
    if opts.sglang_router:
        objects += router_objects(name, opts, labels)
    if opts.sandbox_workers:
        objects += sandbox_objects(name, opts, labels)
    return objects


def write(experiment, options: dict[str, str]) -> list[str]:
    """TARGETS["k8s"]: writes EXPERIMENT/k8s/<job>.yaml and kustomization.yaml; returns the paths."""
    opts = parse_options(K8sOptions, options, "k8s")
    acc = accelerator_from(opts.tpu, opts.tpu_topology, opts.gpu, opts.gpus_per_node, opts.nodes, "k8s")
    prefix = k8s_name(experiment.name, 30)
    names = {job.name: k8s_name(f"{prefix}-{job.index}", 40) for job in experiment.jobs}
    adjusted = common.adjust_jobs(experiment, lambda job: _extra_overrides(job, names[job.name], opts),
                                  lambda job: f"{opts.root.rstrip('/')}/{experiment.name}/jobs/{job.name}")
    common.check(adjusted, acc, opts.aot_check, opts.hbm_fraction)
    validator = common.k8s_validator()
    out = os.path.join(experiment.directory, "k8s")
    os.makedirs(out, exist_ok=True)
    paths = []
    for job in adjusted.jobs:
        objects = job_objects(job, names[job.name], acc, opts)
        if validator is not None:
            validator(objects)
            print(f"k8s: job {job.name}: {len(objects)} objects valid (kubernetes client models, JobSet schema)")
        path = os.path.join(out, f"{names[job.name]}.yaml")
        with open(path, "w") as f:
            f.write(f"# rlvr job {job.name}: {acc.spec}, {acc.hosts} host(s) x {acc.chips_per_host} chip(s)\n")
            yaml.safe_dump_all(objects, f, sort_keys=False)
        paths.append(path)
    kustomization = os.path.join(out, "kustomization.yaml")
    with open(kustomization, "w") as f:
        yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                        "resources": [os.path.basename(p) for p in paths]}, f, sort_keys=False)
    return paths + [kustomization]
