"""Cluster targets (k8s, slurm, xm), multi-host start-up from their environment, and the fit check.

Every artefact is checked by something independent of the code that wrote it: k8s objects by the
kubernetes client models plus a strict key walk and the JobSet schema, sbatch scripts by `bash -n`,
sbatch's real option list and a dry run under fake `sbatch`/`srun`, the xm plan by a recording fake
whose signatures are those of xmanager 0.8.5.post1. The multi-host environment each target writes
is fed to `rlvr.launch.distributed.plan_from_env`, so a manifest and the init cannot drift apart.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import pytest
import yaml
from rlvr.launch import distributed, fit, sweep
from rlvr.launch.local_cluster import k8s_pod_env
from rlvr.launch.targets import TARGETS, k8s, k8s_validate, options, xm

from rlvr import config_lib, start

# --- helpers -------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _in_repo(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)  # config specs are relative to the repository


def experiment(tmp_path, spec: str, overrides: dict | None = None, use_sweep: bool = False, name: str = "exp"):
    return sweep.expand(spec, overrides or {}, use_sweep, str(tmp_path / "experiments"), name, python="python")


def flags_to_config(args: list[str], devices: int):
    """What `rlvr.main` would run: --config=SPEC and --config.k=v flags loaded and validated."""
    spec = next(a.split("=", 1)[1] for a in args if a.startswith("--config="))
    base = sweep.load_base_config(spec)
    overrides = {}
    for arg in args:
        if arg.startswith("--config."):
            key, _, text = arg[len("--config."):].partition("=")
            overrides[key] = sweep.parse_value(base, key, text)
    config = config_lib.load_config(spec, overrides)
    start.validate(config, devices, sweep.trainer_names())
    return config


# --- options and accelerators --------------------------------------------------------------------

def test_options_refuse_unknown_keys_and_bad_values():
    with pytest.raises(options.OptionError, match=r"--imgae is not a --target=k8s option\. Did you mean --image\?"):
        options.parse_options(k8s.K8sOptions, {"imgae": "x"}, "k8s")
    with pytest.raises(options.OptionError, match=r"--nodes='two' \(k8s\): must be an integer"):
        options.parse_options(k8s.K8sOptions, {"nodes": "two", "image": "i", "pvc": "p"}, "k8s")
    with pytest.raises(options.OptionError, match=r"--aot_check='maybe'.*true or false"):
        options.parse_options(k8s.K8sOptions, {"aot_check": "maybe", "image": "i", "pvc": "p"}, "k8s")
    with pytest.raises(options.OptionError, match=r"needs --image="):
        options.parse_options(k8s.K8sOptions, {"pvc": "p"}, "k8s")
    opts = options.parse_options(k8s.K8sOptions, {"image": "i", "pvc": "p", "aot_check": "false",
                                                  "sglang_servers": "2"}, "k8s")
    assert opts.aot_check is False and opts.sglang_servers == 2 and opts.root == "/mnt/rlvr/experiments"
    with pytest.raises(options.OptionError, match=r"exactly one of --tpu"):
        options.accelerator_from("v5p-8", "", "h100", 8, 1, "k8s")
    with pytest.raises(options.OptionError, match=r"--tpu='v9-8'"):
        options.tpu_accelerator("v9-8")
    with pytest.raises(options.OptionError, match=r"--tpu_topology='2x2x2'.*16 chips"):
        options.tpu_accelerator("v5p-32", "2x2x2")
    with pytest.raises(options.OptionError, match=r"--gpu='k80'"):
        options.gpu_accelerator("k80", 8, 1)


@pytest.mark.parametrize("spec,hosts,per_host,topology,label", [
    # Hand-checked against the Cloud TPU tables: v4/v5p sizes count TensorCores (2 per chip), 4-chip hosts;
    # v5e/v6e sizes count chips, one 8-chip host up to 2x4, then 4-chip hosts (GKE ct6e-standard-4t).
    ("v5p-32", 4, 4, "2x2x4", "tpu-v5p-slice"),
    ("v4-8", 1, 4, "2x2x1", "tpu-v4-podslice"),
    ("v6e-16", 4, 4, "4x4", "tpu-v6e-slice"),
    ("v5litepod-8", 1, 8, "2x4", "tpu-v5-lite-podslice"),
    ("v5e-4", 1, 4, "2x2", "tpu-v5-lite-podslice"),
])
def test_tpu_slice_hosts_and_topology(spec, hosts, per_host, topology, label):
    acc = options.tpu_accelerator(spec)
    assert (acc.hosts, acc.chips_per_host, acc.topology, acc.gke_accelerator) == (hosts, per_host, topology, label)
    assert acc.hbm_gib == {"v5p": 95, "v4": 32, "v6e": 32, "v5e": 16}[acc.name]


# --- multi-host start-up -------------------------------------------------------------------------

def test_plan_from_env_decisions():
    assert distributed.plan_from_env({}).kwargs is None
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
             "SLURM_STEP_NODELIST": "a[1-2]", "SLURM_STEP_NUM_NODES": "2"}
    assert distributed.plan_from_env({**slurm, "RLVR_DISTRIBUTED": "off"}).kwargs is None
    # Two tasks per node: each keeps one GPU, like JAX's own Slurm detection (port 77 % 4096 + 61440).
    assert distributed.plan_from_env(slurm).kwargs == {
        "coordinator_address": "a1:61517", "num_processes": 4, "process_id": 3, "local_device_ids": [1],
        "cluster_detection_method": "deactivate"}
    assert distributed.plan_from_env({**slurm, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).kwargs is None
    heartbeat = distributed.plan_from_env({**slurm, "RLVR_HEARTBEAT_TIMEOUT_S": "5"})
    assert heartbeat.kwargs["heartbeat_timeout_seconds"] == 5
    with pytest.raises(distributed.DistributedEnvError, match="RLVR_HEARTBEAT_TIMEOUT_S=0: must be >= 1"):
        distributed.plan_from_env({**slurm, "RLVR_HEARTBEAT_TIMEOUT_S": "0"})
    assert distributed.plan_from_env({"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}) == distributed.DistributedPlan("tpu", {})
    assert distributed.plan_from_env({"TPU_WORKER_HOSTNAMES": "h0"}).kwargs is None
    with pytest.raises(distributed.DistributedEnvError, match="RLVR_NUM_PROCESSES, RLVR_PROCESS_ID missing"):
        distributed.plan_from_env({"RLVR_COORDINATOR_ADDRESS": "h:1"})
    with pytest.raises(distributed.DistributedEnvError, match=r"RLVR_PROCESS_ID=2: must be in \[0, RLVR_NUM"):
        distributed.plan_from_env({"RLVR_COORDINATOR_ADDRESS": "h:1", "RLVR_NUM_PROCESSES": "2",
                                   "RLVR_PROCESS_ID": "2"})
    with pytest.raises(distributed.DistributedEnvError, match="HOST:PORT"):
        distributed.plan_from_env({"RLVR_COORDINATOR_ADDRESS": "h", "RLVR_NUM_PROCESSES": "2",
                                   "RLVR_PROCESS_ID": "0"})


@pytest.mark.parametrize("nodelist", ["node001", "node001,host2", "node[001-015],host2", "node[007,009-015]", "gpu12"])
def test_slurm_coordinator_matches_jax_detection(nodelist, monkeypatch):
    from jax._src.clusters.slurm_cluster import SlurmCluster

    env = {"SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": nodelist, "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_STEP_NUM_NODES": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    expected = SlurmCluster.get_coordinator_address(None, None)  # JAX's own reading of the same variables
    assert distributed.plan_from_env(env).kwargs["coordinator_address"] == expected


def test_two_processes_initialize_from_the_explicit_env(tmp_path):
    """A real jax.distributed start-up on localhost: 2 processes x 2 CPU devices see 4 global devices."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import json
        from rlvr.launch import distributed
        plan = distributed.initialize_from_env()
        import jax
        print(json.dumps([plan.source, jax.process_index(), jax.process_count(), jax.device_count()]))
        jax.distributed.shutdown()
    """))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "JAX_PLATFORMS": "cpu",
                                   "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
                                   "RLVR_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "RLVR_NUM_PROCESSES": "2",
                                   "RLVR_PROCESS_ID": str(i)}) for i in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(results) == [["explicit", 0, 2, 4], ["explicit", 1, 2, 4]]


# --- k8s -----------------------------------------------------------------------------------------

def load_yaml(paths: list[str]) -> list[dict]:
    objects = []
    for path in paths:
        if not path.endswith("kustomization.yaml"):
            objects += [o for o in yaml.safe_load_all(open(path)) if o]
    return objects


def pod_env(container: dict, completion_index: int) -> dict[str, str]:
    """The container's environment as the kubelet resolves it for the pod at `completion_index`."""
    return k8s_pod_env(container, completion_index)


def trainer_of(jobset: dict) -> tuple[dict, dict, dict]:
    replicated = jobset["spec"]["replicatedJobs"][0]
    job_spec = replicated["template"]["spec"]
    return replicated, job_spec, job_spec["template"]["spec"]["containers"][0]


def test_k8s_tpu_jobset_with_sglang_validates_and_matches_the_init(tmp_path):
    exp = experiment(tmp_path, "configs/quickstart.py:smoke", {"data.batch_size": 16})
    paths = TARGETS["k8s"](exp, {"image": "reg/rlvr:1", "tpu": "v5p-32", "pvc": "data", "aot_check": "false",
                                 "sglang_servers": "2", "sglang_model": "/mnt/rlvr/models/policy"})
    assert paths[-1].endswith("kustomization.yaml") and all(p.startswith(exp.directory + "/k8s/") for p in paths)
    objects = load_yaml(paths)
    k8s_validate.validate_objects(objects)
    kinds = {o["kind"]: o for o in objects}
    assert sorted(kinds) == ["JobSet", "Service", "StatefulSet"]
    jobset = kinds["JobSet"]
    replicated, job_spec, container = trainer_of(jobset)
    hosts = job_spec["parallelism"]
    assert hosts == job_spec["completions"] == 4 and job_spec["completionMode"] == "Indexed"  # v5p-32: 4 hosts
    pod = job_spec["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x4"}
    assert container["resources"]["limits"] == {"google.com/tpu": "4"}
    # Pod 0's DNS name per the JobSet API: <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>.
    name = jobset["metadata"]["name"]
    subdomain = jobset["spec"]["network"].get("subdomain", name)
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True and replicated["replicas"] == 1
    ports = {p["containerPort"] for p in container["ports"]}
    plans = [distributed.plan_from_env(pod_env(container, i)) for i in range(hosts)]
    host, port = plans[0].kwargs["coordinator_address"].rsplit(":", 1)
    assert host == f"{name}-{replicated['name']}-0-0.{subdomain}" and int(port) in ports
    assert [p.kwargs["process_id"] for p in plans] == list(range(hosts))
    assert {p.kwargs["num_processes"] for p in plans} == {hosts}
    assert len({p.kwargs["coordinator_address"] for p in plans}) == 1
    # The trainer command loads and validates; it points at every SGLang server by its own DNS name.
    config = flags_to_config(container["args"], devices=16)
    assert config.rl.backend == "sglang" and container["command"] == ["python", "-m", "rlvr.main"]
    service, statefulset = kinds["Service"], kinds["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None" and statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    sts, svc = statefulset["metadata"]["name"], service["metadata"]["name"]
    server_port = service["spec"]["ports"][0]["port"]
    expected = [f"http://{sts}-{i}.{svc}:{server_port}" for i in range(statefulset["spec"]["replicas"])]
    assert config.rl.sglang_urls.split(",") == expected and len(expected) == 2
    workdir = next(a for a in container["args"] if a.startswith("--workdir="))
    assert workdir == f"--workdir=/mnt/rlvr/experiments/exp/jobs/{exp.jobs[0].name}"
    assert container["volumeMounts"][0]["mountPath"] == "/mnt/rlvr"


def test_k8s_sglang_router_fronts_the_servers(tmp_path):
    """--sglang_router: a router Deployment + Service whose --worker-urls are the StatefulSet's servers;
    the trainer sends generation to the router (rl.sglang_router) and control to each server."""
    exp = experiment(tmp_path, "configs/quickstart.py:smoke", {"data.batch_size": 16})
    paths = TARGETS["k8s"](exp, {"image": "i", "gpu": "h100", "pvc": "p", "aot_check": "false",
                                 "sglang_servers": "3", "sglang_model": "m", "sglang_router": "true",
                                 "sglang_router_policy": "round_robin"})
    objects = load_yaml(paths)
    k8s_validate.validate_objects(objects)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"].endswith("-router"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    workers = args[args.index("--worker-urls") + 1: args.index("--policy")]
    config = flags_to_config(trainer_of(objects[0])[2]["args"], devices=8)
    assert workers == config.rl.sglang_urls.split(",") and len(workers) == 3
    assert args[:2] == ["-m", "sglang_router.launch_router"] and args[args.index("--policy") + 1] == "round_robin"
    port = service["spec"]["ports"][0]["port"]
    assert config.rl.sglang_router == f"http://{service['metadata']['name']}:{port}"
    assert args[args.index("--port") + 1] == str(port) and container["readinessProbe"]["httpGet"]["port"] == port
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    with pytest.raises(ValueError, match="--sglang_router=true needs --sglang_servers"):
        TARGETS["k8s"](exp, {"image": "i", "gpu": "h100", "pvc": "p", "sglang_router": "true"})
    with pytest.raises(ValueError, match="--sglang_router_policy='fastest'"):
        TARGETS["k8s"](exp, {"image": "i", "gpu": "h100", "pvc": "p", "sglang_servers": "1",
                             "sglang_router": "true", "sglang_router_policy": "fastest"})


def test_k8s_gpu_nodes_and_refusals(tmp_path):
    exp = experiment(tmp_path, "configs/sft_tiny.py", {"data.batch_size": 16}, use_sweep=True)
    paths = TARGETS["k8s"](exp, {"image": "i", "gpu": "h100", "nodes": "2", "workdir_root": "gs://b/x",
                                 "aot_check": "false", "hbm_fraction": "0.8"})
    objects = load_yaml(paths)
    assert len(objects) == len(exp.jobs) == 4 and len(set(paths)) == 5
    k8s_validate.validate_objects(objects)
    _, job_spec, container = trainer_of(objects[0])
    assert job_spec["parallelism"] == 2 and container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert "nodeSelector" not in job_spec["template"]["spec"] and job_spec["template"]["spec"]["volumes"] == []
    env = pod_env(container, 1)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"  # the budget the fit check would assume
    assert distributed.plan_from_env(env).kwargs["process_id"] == 1
    assert flags_to_config(container["args"], devices=16).optimizer.learning_rate == 1e-3
    with pytest.raises(ValueError, match="SGLang servers serve RL rollouts only"):
        TARGETS["k8s"](exp, {"image": "i", "gpu": "h100", "pvc": "p", "aot_check": "false", "sglang_servers": "1",
                             "sglang_model": "m"})
    with pytest.raises(ValueError, match=r"job 00 on 1 x 8 h100 \(8 devices\): data.batch_size=12"):
        TARGETS["k8s"](experiment(tmp_path, "configs/sft_tiny.py", {"data.batch_size": 12}, name="e2"),
                       {"image": "i", "gpu": "h100", "pvc": "p", "aot_check": "false"})


def test_k8s_sandbox_workers_run_under_gvisor(tmp_path):
    exp = experiment(tmp_path, "configs/quickstart.py:smoke", {"data.batch_size": 16})
    opts = options.parse_options(k8s.K8sOptions, {"image": "i", "pvc": "p", "sandbox_workers": "3"}, "k8s")
    objects = k8s.sandbox_objects("exp-0", opts, {"app": "rlvr"})
    k8s_validate.validate_objects(objects)
    head_service, head, workers = objects
    assert workers["spec"]["replicas"] == 3 and workers["spec"]["template"]["spec"]["runtimeClassName"] == "gvisor"
    join = next(a for a in workers["spec"]["template"]["spec"]["containers"][0]["args"] if a.startswith("--address="))
    assert join == f"--address={head_service['metadata']['name']}:6379"
    assert "runtimeClassName" not in head["spec"]["template"]["spec"]  # the head schedules, it runs no verifier
    paths = TARGETS["k8s"](exp, {"image": "i", "pvc": "p", "gpu": "h100", "aot_check": "false",
                                 "sandbox_workers": "3"})
    _, _, container = trainer_of(load_yaml(paths)[0])
    trainer = flags_to_config(container["args"], 8).rl  # the trainer's verifiers run on the Ray head's workers
    assert (trainer.verifier_backend, trainer.verifier_address) == ("ray", k8s.ray_address(k8s.k8s_name("exp-0")))
    sft = experiment(tmp_path, "configs/sft_tiny.py:smoke", {"data.batch_size": 16}, name="sft")
    with pytest.raises(ValueError, match="verifier workers score RL rollouts only"):
        TARGETS["k8s"](sft, {"image": "i", "pvc": "p", "gpu": "h100", "aot_check": "false", "sandbox_workers": "3"})


def test_k8s_validator_rejects_typos_and_wrong_types(tmp_path):
    exp = experiment(tmp_path, "configs/quickstart.py:smoke", {"data.batch_size": 16})
    objects = load_yaml(TARGETS["k8s"](exp, {"image": "i", "gpu": "h100", "pvc": "p", "aot_check": "false",
                                             "sglang_servers": "1", "sglang_model": "m"}))
    k8s_validate.validate_objects(objects)
    jobset, service, statefulset = objects

    def pod_spec(o):
        return trainer_of(o)[1]["template"]["spec"] if o["kind"] == "JobSet" else o["spec"]["template"]["spec"]

    def rename(d, old, new):
        d[new] = d.pop(old)

    mutations = {
        "jobset spec typo": (jobset, lambda o: rename(o["spec"], "replicatedJobs", "replicatedJob"), "replicatedJob"),
        "jobset wrong type": (jobset, lambda o: o["spec"]["failurePolicy"].update(maxRestarts="0"), "maxRestarts"),
        "job template typo": (jobset, lambda o: rename(trainer_of(o)[1], "completionMode", "completionMod"),
                              "completionMod"),
        "container typo": (jobset, lambda o: rename(trainer_of(o)[2], "workingDir", "workdir"), "workdir"),
        "env wrong type": (jobset, lambda o: trainer_of(o)[2]["env"][1].update(value=4), "expected str"),
        "quantity type": (jobset, lambda o: trainer_of(o)[2]["resources"]["limits"].update({"nvidia.com/gpu": 8}),
                          "expected str"),
        "missing name": (jobset, lambda o: trainer_of(o)[2].pop("name"), "rejects it as V1JobTemplateSpec"),
        "statefulset replicas": (statefulset, lambda o: o["spec"].update(replicas="1"), "replicas"),
        "pod typo": (statefulset, lambda o: rename(pod_spec(o), "containers", "contianers"), "contianers"),
        "service port": (service, lambda o: o["spec"]["ports"][0].update(port="80"), "port"),
        "unknown kind": (service, lambda o: o.update(kind="Servic"), "kind 'Servic'"),
    }
    for label, (original, mutate, message) in mutations.items():
        broken = copy.deepcopy(original)
        mutate(broken)
        with pytest.raises(k8s_validate.ManifestError, match=re.escape(message)):
            k8s_validate.validate_object(broken)
            pytest.fail(f"{label}: not rejected")


# --- slurm ---------------------------------------------------------------------------------------

# sbatch's long options: sbatch(1) of slurm-client 22.05.8 (Debian 12), also slurm.schedmd.com/sbatch.html.
SBATCH_LONG_OPTIONS = set("""
account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint container
contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency
distribution error exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind gpu-freq gpus
gpus-per-node gpus-per-socket gpus-per-task gres gres-flags hint hold ignore-pbs input job-name kill-on-invalid-dep
licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill
no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket
open-mode output overcommit oversubscribe parsable partition power prefer priority profile propagate qos quiet
reboot requeue reservation signal sockets-per-node spread-job switches test-only thread-spec threads-per-core
time time-min tmp uid use-min-nodes verbose wait wait-all-nodes wckey wrap""".split())

FAKE_SBATCH = """#!{python}
# Fake sbatch: reads the #SBATCH directives, gives the job an id and a node list, runs the script.
import os, re, subprocess, sys
script = sys.argv[-1]
directives = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(\\S*))?", open(script).read(), re.M))
nodes = int(directives["nodes"])
job_id = 4000 + len(os.listdir(os.environ["FAKE_SLURM_LOG"]))
env = dict(os.environ, SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST=f"gpu[{{7:03d}}-{{6 + nodes:03d}}]",
           SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes))
with open(os.path.join(os.environ["FAKE_SLURM_LOG"], f"{{job_id}}.jsonl"), "w") as log:
    subprocess.run(["bash", script], env=env, check=True, stdout=log)
print(f"Submitted batch job {{job_id}}")
"""

FAKE_SRUN = """#!{python}
# Fake srun: one line per task with the argv and the environment srun gives that task.
import json, os, sys
args = sys.argv[1:]
opts = {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes, per_node = int(opts["nodes"]), int(opts.get("ntasks-per-node", "1"))
for node in range(nodes):
    for local in range(per_node):
        env = {{k: v for k, v in os.environ.items() if k.startswith(("SLURM_", "RLVR_", "XLA_", "JAX_"))}}
        env.update(SLURM_PROCID=str(node * per_node + local), SLURM_LOCALID=str(local), SLURM_NODEID=str(node),
                   SLURM_NTASKS=str(nodes * per_node), SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
                   SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NUM_TASKS=str(nodes * per_node))
        print(json.dumps({{"argv": args, "env": env, "cwd": os.getcwd()}}))
"""


def test_slurm_scripts_parse_and_dry_run(tmp_path, repo_root):
    exp = experiment(tmp_path, "configs/sft_tiny.py", {"data.batch_size": 16}, use_sweep=True)
    paths = TARGETS["slurm"](exp, {"gpu": "h100", "nodes": "2", "partition": "gpu", "time": "2:00:00",
                                   "aot_check": "false", "repo_dir": repo_root})
    scripts, submit = paths[:-1], paths[-1]
    assert len(scripts) == len(exp.jobs) == 4 and submit.endswith("submit.sh")
    for path in paths:
        assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0, path
    for path in scripts:
        directives = re.findall(r"^#SBATCH --([a-z-]+)", open(path).read(), re.M)
        assert set(directives) <= SBATCH_LONG_OPTIONS
        assert {"nodes", "ntasks-per-node", "gpus-per-node", "time", "output"} <= set(directives)
    bin_dir, log_dir = tmp_path / "bin", tmp_path / "slurm-log"
    bin_dir.mkdir()
    log_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_SLURM_LOG=str(log_dir))
    result = subprocess.run(["bash", submit], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("Submitted batch job") == 4
    runs = [[json.loads(line) for line in open(log_dir / f)] for f in sorted(os.listdir(log_dir))]
    for job, tasks in zip(exp.jobs, runs, strict=True):
        assert len(tasks) == 2  # one process per node
        plans = [distributed.plan_from_env(t["env"]) for t in tasks]
        assert [p.kwargs["process_id"] for p in plans] == [0, 1]
        assert {p.kwargs["num_processes"] for p in plans} == {2}
        port = int(tasks[0]["env"]["SLURM_JOB_ID"]) % 4096 + 61440  # JAX's Slurm port rule
        assert {p.kwargs["coordinator_address"] for p in plans} == {f"gpu007:{port}"}
        assert all("local_device_ids" not in p.kwargs for p in plans)  # each process sees its node's 8 GPUs
        assert tasks[0]["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9" and tasks[0]["cwd"] == repo_root
        argv = tasks[0]["argv"]
        assert argv[:3] == ["python", "-m", "rlvr.main"]
        config = flags_to_config(argv[3:], devices=16)
        assert config.seed == job.config["seed"] and config.data.batch_size == 16
        workdir = f"{exp.directory}/jobs/{job.name}"
        assert f"--workdir={workdir}" in argv and os.path.isdir(workdir)
    with pytest.raises(ValueError, match=r"--time='tomorrow'"):
        TARGETS["slurm"](exp, {"time": "tomorrow"})


def test_slurm_rollout_fleet_runs_on_an_extra_node_behind_the_router(tmp_path, repo_root):
    """--rollout_workers: one more node; the fleet (servers + router) starts there first, the trainer's
    rl.sglang_router is that node's router, and the fleet command is one rlvr.rollout.fleet accepts."""
    from rlvr.rollout import fleet

    exp = experiment(tmp_path, "configs/quickstart.py:smoke", {"data.batch_size": 16})
    [script, _] = TARGETS["slurm"](exp, {"gpu": "h100", "nodes": "2", "aot_check": "false", "repo_dir": repo_root,
                                         "rollout_workers": "4", "rollout_gpus_per_worker": "2",
                                         "rollout_model": "/shared/policy"})
    text = open(script).read()
    assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0
    assert "#SBATCH --nodes=3" in text  # 2 trainer nodes + the fleet's
    fleet_line = next(line for line in text.splitlines() if "rlvr.rollout.fleet" in line)
    assert fleet_line.startswith("srun --nodes=1 --ntasks=1 --relative=2 ") and fleet_line.endswith(" &")
    argv = shlex.split(fleet_line.removesuffix(" &"))
    args, server_args = fleet.parse_args(argv[argv.index("rlvr.rollout.fleet") + 1:])
    assert (args.workers, args.devices_per_worker, args.hf_dir, args.server) == (4, 2, "/shared/policy", "sglang")
    assert args.router and args.host == "0.0.0.0" and server_args == []
    lines = text.splitlines()
    trainer = lines[lines.index(next(ln for ln in lines if ln.startswith("srun --nodes=2"))) + 1]
    assert lines.index(fleet_line) < lines.index(trainer)
    trainer_argv = shlex.split(trainer.replace("${FLEET_NODE}", "gpu009"))
    config = flags_to_config(trainer_argv[3:], devices=16)
    assert (config.rl.backend, config.rl.sglang_router) == ("sglang", f"http://gpu009:{args.port}")
    with pytest.raises(ValueError, match="rollout fleet serves RL rollouts only"):
        TARGETS["slurm"](experiment(tmp_path, "configs/sft_tiny.py", {"data.batch_size": 16}, name="sft"),
                         {"aot_check": "false", "rollout_workers": "1", "rollout_model": "m"})
    with pytest.raises(ValueError, match="do not fit the fleet's node"):
        TARGETS["slurm"](exp, {"aot_check": "false", "rollout_workers": "5", "rollout_gpus_per_worker": "2"})


# --- xm ------------------------------------------------------------------------------------------

# Parameter names and kinds of the real API, read with inspect from xmanager 0.8.5.post1.
XM_SIGNATURES = {
    "python_container": ["executor_spec", "entrypoint", "path", "base_image", "docker_instructions",
                         "use_deep_module", "*args", "*env_vars"],
    "container": ["executor_spec", "image_path", "*args", "*env_vars"],
    "JobRequirements": ["resources", "*architecture", "*location", "*replicas", "*service_tier", "*num_slices",
                        "**kw_resources"],
    "Job": ["executable", "executor", "name", "args", "env_vars"],
    "create_experiment": ["experiment_title"],
    "package": ["packageables"],
    "add": ["job", "args", "*role", "*identity"],
    "Vertex": ["requirements", "tensorboard"],
    "Local": ["requirements", "docker_options", "experimental_stream_output"],
    "Kubernetes": ["requirements", "cloud_provider", "tpu_capability"],
}
XM_RESOURCE_TYPES = set("""a100 a100_80gib b200 b300 b40_48th cpu ephemeral_storage gb200 gb300 h100 h100_mega h200
l4_24th local_gpu memory p100 p4 t4 tpu_v2 tpu_v3 tpu_v4 tpu_v5e tpu_v5p tpu_v6e tpu_v7x v100 vr200 ram disk""".split())


class FakeXm:
    """Records the xm calls rlvr makes; same signatures and the same argument checks as xmanager."""

    def __init__(self):
        self.calls = []

    class ModuleName(NamedTuple):
        module_name: str

    def python_container(self, executor_spec, entrypoint, path=".", base_image=None, docker_instructions=None,
                         use_deep_module=False, *, args=None, env_vars=None):
        assert isinstance(entrypoint, FakeXm.ModuleName) and os.path.isdir(path)
        self.calls.append(("python_container", entrypoint.module_name, path, base_image))
        return ("packageable", executor_spec)

    def container(self, executor_spec, image_path, *, args=None, env_vars=None):
        self.calls.append(("container", image_path))
        return ("packageable", executor_spec)

    def JobRequirements(self, resources=None, *, architecture=None, location=None, replicas=None, service_tier=None,
                        num_slices=None, **kw_resources):  # noqa: N802 (xmanager's name)
        for name, value in kw_resources.items():
            assert name.lower() in XM_RESOURCE_TYPES, f"xm.ResourceType has no {name!r}"
            assert not isinstance(value, str) or re.fullmatch(r"(\d+x?)+(_(un)?twisted)?", value), value
        return dict(kw_resources)

    def Job(self, executable, executor, name="", args=(), env_vars=None):  # noqa: N802
        for key in env_vars or {}:
            assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", key), key  # xmanager's _validate_env_vars
        assert all(isinstance(a, str) for a in args)
        return {"executable": executable, "executor": executor, "name": name, "args": list(args),
                "env_vars": dict(env_vars or {})}


class FakeXmLocal:
    def __init__(self):
        self.experiments = []

    class Vertex:
        Spec = type("VertexSpec", (), {})

        def __init__(self, requirements=None, tensorboard=None):
            self.kind, self.requirements = "Vertex", requirements

    class Local:
        Spec = type("LocalSpec", (), {})

        def __init__(self, requirements=None, docker_options=None, experimental_stream_output=True):
            self.kind, self.requirements = "Local", requirements

    class Kubernetes:
        Spec = type("KubernetesSpec", (), {})

        def __init__(self, requirements=None, cloud_provider="GKE", tpu_capability=None):
            self.kind, self.requirements = "Kubernetes", requirements

    def create_experiment(self, experiment_title):
        owner = self

        class Experiment:
            experiment_id = 17

            def __enter__(self):
                self.title, self.packaged, self.added = experiment_title, [], []
                owner.experiments.append(self)
                return self

            def __exit__(self, *exc):
                return False

            def package(self, packageables=()):
                self.packaged += list(packageables)
                return ["executable"] * len(packageables)

            def add(self, job, args=None, *, role=None, identity=""):
                self.added.append(job)

        return Experiment()


def _signature(fn) -> list[str]:
    prefix = {inspect.Parameter.KEYWORD_ONLY: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [prefix.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values() if p.name != "self"]


def test_xm_plan_and_launch_against_recording_fake(tmp_path):
    fake_xm, fake_local = FakeXm(), FakeXmLocal()
    fakes = {"create_experiment": fake_local.create_experiment,
             "package": fake_local.create_experiment("t").package, "add": fake_local.create_experiment("t").add,
             **{n: getattr(fake_xm, n) for n in ("python_container", "container", "JobRequirements", "Job")},
             **{n: getattr(FakeXmLocal, n).__init__ for n in ("Vertex", "Local", "Kubernetes")}}
    for name, expected in XM_SIGNATURES.items():
        assert _signature(fakes[name]) == expected, name
    exp = experiment(tmp_path, "configs/sft_tiny.py", {"data.batch_size": 8}, use_sweep=True)
    plan_path, launcher = TARGETS["xm"](exp, {"gpu": "h100", "aot_check": "false"})
    plan = json.load(open(plan_path))
    assert compile(open(launcher).read(), launcher, "exec") and "apply_plan" in open(launcher).read()
    assert plan["requirements"] == {"h100": 8} and len(plan["work_units"]) == 4
    assert xm.apply_plan(plan, fake_xm, fake_local) == 17
    run = fake_local.experiments[-1]
    assert run.title == "exp" and fake_xm.calls[0][:2] == ("python_container", "rlvr.main")
    assert [job["name"] for job in run.added] == [job.name for job in exp.jobs]
    for job, added in zip(exp.jobs, run.added, strict=True):
        assert added["executor"].kind == "Vertex" and added["executor"].requirements == {"h100": 8}
        config = flags_to_config(added["args"], devices=8)
        assert config.optimizer.learning_rate == job.config["optimizer"]["learning_rate"]
    with pytest.raises(ValueError, match="one host per job"):
        TARGETS["xm"](exp, {"gpu": "h100", "nodes": "2"})
    with pytest.raises(ValueError, match="maps only TPU v2/v3"):
        TARGETS["xm"](exp, {"tpu": "v5e-8"})
    assert xm.requirements(options.tpu_accelerator("v5e-8"), "kubernetes") == {"tpu_v5e": "2x4"}


# --- ahead-of-time fit check ---------------------------------------------------------------------

def test_fit_check_passes_a_tiny_job_and_refuses_a_huge_one(tmp_path, capsys):
    """On a v5e-4 slice (16 GiB HBM x 0.9 per chip, 4 chips): the smoke config fits; the same with a
    batch of 16384 x 2048 tokens does not, and nothing is written."""
    small = experiment(tmp_path, "configs/tiny.py:smoke", {"data.batch_size": 8}, name="small")
    huge = experiment(tmp_path, "configs/tiny.py:smoke", {"data.batch_size": 16384, "data.seq_len": 2048},
                      name="huge")
    both = dataclasses.replace(small, jobs=[dataclasses.replace(small.jobs[0], name="small"),
                                            dataclasses.replace(huge.jobs[0], index=1, name="huge")])
    with pytest.raises(fit.FitError) as error:
        TARGETS["k8s"](both, {"image": "i", "tpu": "v5e-4", "pvc": "p"})
    message = str(error.value)
    assert "job huge does not fit v5e-4 (4 devices)" in message and "14.400 GiB is available" in message
    needed = float(re.search(r"needs ([\d.]+) GiB per device", message).group(1))
    assert needed > 14.4 and "--config.train.micro_batches" in message and "--aot_check=false" in message
    out = capsys.readouterr().out
    small_line = next(line for line in out.splitlines() if "job small" in line)
    assert ": fits; tpu (v5e:2x2" in small_line  # compiled by the TPU compiler (libtpu, make test installs it)
    assert float(re.search(r"([\d.]+) GiB per device", small_line).group(1)) < 1
    assert not os.path.exists(os.path.join(both.directory, "k8s"))


def test_rl_fit_counts_the_step_the_reference_and_the_engine():
    from rlvr import aot
    from rlvr.models import params as params_lib
    from rlvr.models.transformer import init_paged_cache

    config = config_lib.load_config("configs/quickstart.py:smoke", {"rl.kl_coef": 0.1, "rl.kl_mode": "reward",
                                                                         "rl.kl_estimator": "k1"})
    result = fit.analyze_job(config)
    parts = result["components"]
    assert sorted(parts) == ["engine_kv_cache", "engine_params", "reference_params", "train_step"]
    assert result["needed_bytes"] == sum(parts.values())
    cfg = aot.model_config_of(config)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params_lib.abstract_params(cfg)))
    assert parts["engine_params"] == parts["reference_params"] == param_bytes  # mesh data=-1: replicated
    e = config.rl.engine
    cache = jax.eval_shape(lambda: init_paged_cache(cfg, e.max_slots * (e.max_len // e.page_size) + 1, e.page_size))
    assert parts["engine_kv_cache"] == cache["k"].size * cache["k"].dtype.itemsize * 2
    assert parts["train_step"] > 3 * param_bytes  # params + two Adam moments + gradients' temps
    e.dtype = "bfloat16"  # the engine's own bf16 copy and pages
    assert fit.engine_bytes(cfg, e, param_bytes) == {k: parts[k] // 2 for k in ("engine_params", "engine_kv_cache")}
    evaluation = config_lib.load_config("configs/quickstart.py", {"job": "eval"})
    report = fit.FitReport("e", 8, 1, None, {}, fit.analyze_job(evaluation)["note"])
    assert not report.fits and "NOT CHECKED" in report.line() and "'eval'" in report.line()
