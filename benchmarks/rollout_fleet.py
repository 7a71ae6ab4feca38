"""Rollout throughput behind SGLang's router: 1, 2 and 4 engine servers vs one server, same total slots.

    .venv/bin/python benchmarks/rollout_fleet.py [--servers 1,2,4] [--slots 16] [--requests 64] \\
        [--max_new_tokens 32] [--out benchmarks/results/rollout_fleet.json]

Each configuration starts a fleet (`rlvr.rollout.fleet.Fleet`: k `python -m rlvr.rollout.server`
processes with `--slots / k` slots each, behind the real sglang-router, round robin) on a smoke-size
model with random weights (every request decodes exactly `--max_new_tokens`: ignore_eos), warms it
up (compiles), then times one batch of `--requests` sampled requests through `RouterClient`; the k=1
fleet also times the same batch sent to its server directly (the baseline: one server, all slots).
Reported per configuration: generated tokens/s, its ratio to the baseline, and where the time goes:
the CPU seconds of the servers, the router and this client process over the batch (from
/proc/PID/stat), against the wall time x the machine's cores. The router's added latency is the
median, over `--latency_requests` sequential 1-token requests, of (through the router) - (direct).

One JSON line goes to stdout (and to `--out`, with the date, command, machine and `uptime`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from rlvr.rollout.client import SGLangClient
from rlvr.rollout.fleet import Fleet
from rlvr.rollout.router import RouterClient
from rlvr.rollout.types import Request, SamplingParams

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def make_model(directory: str) -> str:
    """The smoke config's model shape with random weights, saved as an HF directory."""
    from rlvr import api, config_lib
    from rlvr.models import hf
    from rlvr.models.tokenizer import byte_level_tokenizer

    model = api.build_model(config_lib.load_config("configs/quickstart.py:smoke"))
    hf.export_hf_checkpoint(model.cfg, model.params, directory)
    byte_level_tokenizer().save(directory)
    return directory


def workload(count: int, max_new_tokens: int, prefix: str) -> list[Request]:
    """`count` sampled requests with distinct 16-token prompts and seeds, exactly max_new_tokens each."""
    return [Request(f"{prefix}{i}", [(7 * i + j) % 250 + 1 for j in range(16)],
                    SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True,
                                   sampling_seed=i))
            for i in range(count)]


def timed_batch(client: SGLangClient, requests: list[Request], pids: dict[str, list[int]]) -> dict:
    """Wall time, tokens/s and CPU seconds per role for one batch."""
    before = {role: sum(cpu_seconds(p) for p in ps) for role, ps in pids.items()}
    t0 = time.perf_counter()
    completions = client.generate_sync(requests)
    wall = time.perf_counter() - t0
    cpu = {role: round(sum(cpu_seconds(p) for p in ps) - before[role], 2) for role, ps in pids.items()}
    tokens = sum(len(c.output_ids) for c in completions)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1), "cpu_s": cpu,
            "cpu_busy_fraction": round(sum(cpu.values()) / (wall * os.cpu_count()), 3)}


def latency(url: str, count: int) -> list[float]:
    """Per-request seconds of `count` sequential 1-token greedy requests to `url`."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True}
    times = []
    with httpx.Client(timeout=120) as http:
        for _ in range(count):
            t0 = time.perf_counter()
            assert http.post(url + "/generate", json=body).status_code == 200
            times.append(time.perf_counter() - t0)
    return times


def run_config(hf_dir: str, servers: int, args, env: dict[str, str], log_root: str) -> dict:
    slots = args.slots // servers
    engine = {"max_slots": slots, "max_len": 64, "page_size": 16, "decode_steps": 4, "prefill_rows": min(slots, 4),
              "prefill_chunk": 16}
    server_args = [x for k, v in engine.items() for x in ("--engine_option", f"{k}={v}")]
    log_dir = os.path.join(log_root, f"k{servers}")
    os.makedirs(log_dir)
    t0 = time.perf_counter()
    with Fleet(hf_dir, servers, policy="round_robin", server_args=server_args, env=env, log_dir=log_dir) as fleet:
        started = time.perf_counter() - t0
        client = RouterClient(fleet.router_url, fleet.worker_urls)
        t0 = time.perf_counter()
        client.generate_sync(workload(args.slots, args.max_new_tokens, "warm"))  # every server compiles
        warm = time.perf_counter() - t0
        pids = {"servers": [p.pid for p in fleet.workers], "router": [fleet.router.pid], "client": [os.getpid()]}
        result = {"servers": servers, "slots_per_server": slots, "start_s": round(started, 1),
                  "warm_up_s": round(warm, 1),
                  "router": timed_batch(client, workload(args.requests, args.max_new_tokens, "r"), pids)}
        if servers == 1:
            direct = SGLangClient(fleet.worker_urls)
            result["direct"] = timed_batch(direct, workload(args.requests, args.max_new_tokens, "d"), pids)
            lat_direct = latency(fleet.worker_urls[0], args.latency_requests)
            lat_router = latency(fleet.router_url, args.latency_requests)
            result["latency_ms"] = {"direct_median": round(1e3 * statistics.median(lat_direct), 2),
                                    "router_median": round(1e3 * statistics.median(lat_router), 2),
                                    "router_added_median": round(1e3 * (statistics.median(lat_router)
                                                                        - statistics.median(lat_direct)), 2)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--slots", type=int, default=16, help="total slots, split evenly over the servers")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--latency_requests", type=int, default=30)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    counts = [int(x) for x in args.servers.split(",")]
    if any(args.slots % k for k in counts):
        raise SystemExit(f"--slots={args.slots} must split evenly over --servers={args.servers}")
    work = tempfile.mkdtemp(prefix="rollout-fleet-bench-")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=os.path.join(work, "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    hf_dir = make_model(os.path.join(work, "model"))
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    load_before = uptime()
    runs = [run_config(hf_dir, k, args, env, work) for k in counts]
    base = next(r["direct"] for r in runs if "direct" in r)["tokens_per_s"] if 1 in counts else None
    summary = {f"k{r['servers']}_router_tokens_per_s": r["router"]["tokens_per_s"] for r in runs}
    if base:
        summary["one_server_direct_tokens_per_s"] = base
        summary.update({f"k{r['servers']}_vs_one_server": round(r["router"]["tokens_per_s"] / base, 3) for r in runs})
        summary["router_added_latency_ms"] = runs[0]["latency_ms"]["router_added_median"]
    record = {"benchmark": "rollout fleet behind sglang-router", "date": datetime.date.today().isoformat(),
              "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
              "machine": f"{os.cpu_count()} cores, {platform.platform()}, {platform.processor() or platform.machine()}",
              "load_before": load_before, "load_after": uptime(),
              "setup": {"model": "configs/quickstart.py:smoke shape, random weights", "total_slots": args.slots,
                        "requests": args.requests, "max_new_tokens": args.max_new_tokens, "policy": "round_robin"},
              "summary": summary, "runs": runs}
    print(json.dumps(record))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
