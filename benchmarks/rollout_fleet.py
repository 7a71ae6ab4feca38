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

Each timed batch is run three times (k=1: router and direct interleaved, A B B A A B) and the median
reported, with the machine's CPU busy fraction over the batch (/proc/stat) beside our processes' share.
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


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU jiffies of the whole machine so far (/proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


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
    busy0, total0 = machine_busy()
    t0 = time.perf_counter()
    completions = client.generate_sync(requests)
    wall = time.perf_counter() - t0
    busy1, total1 = machine_busy()
    cpu = {role: round(sum(cpu_seconds(p) for p in ps) - before[role], 2) for role, ps in pids.items()}
    tokens = sum(len(c.output_ids) for c in completions)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1), "cpu_s": cpu,
            "ours_cpu_fraction": round(sum(cpu.values()) / (wall * os.cpu_count()), 3),
            "machine_cpu_busy_fraction": round((busy1 - busy0) / max(1, total1 - total0), 3)}


def median_of(runs: list[dict]) -> dict:
    """The run with the median tokens/s (of an odd count), with every run's tokens/s beside it."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ranked[len(ranked) // 2], "all_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def latency(direct_url: str, router_url: str, count: int) -> dict:
    """Median ms of `count` 1-token greedy requests to the server directly and through the router,
    sent one at a time and alternating (direct, router, direct, ...), and the median pairwise difference."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=120) as http:
        for _ in range(count):
            for name, url in (("direct", direct_url), ("router", router_url)):
                t0 = time.perf_counter()
                assert http.post(url + "/generate", json=body).status_code == 200
                times[name].append(time.perf_counter() - t0)
    added = [r - d for d, r in zip(times["direct"], times["router"], strict=True)]
    return {"direct_median": round(1e3 * statistics.median(times["direct"]), 2),
            "router_median": round(1e3 * statistics.median(times["router"]), 2),
            "router_added_median": round(1e3 * statistics.median(added), 2), "requests": count}


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
        batch = lambda c, tag: timed_batch(c, workload(args.requests, args.max_new_tokens, tag), pids)  # noqa: E731
        result = {"servers": servers, "slots_per_server": slots, "start_s": round(started, 1),
                  "warm_up_s": round(warm, 1)}
        if servers == 1:  # router and direct interleaved A B B A A B: the machine's load drifts
            direct = SGLangClient(fleet.worker_urls)
            order = ["router", "direct", "direct", "router", "router", "direct"]
            runs = {"router": [], "direct": []}
            for i, name in enumerate(order):
                runs[name].append(batch(client if name == "router" else direct, f"{name}{i}-"))
            result.update({name: median_of(r) for name, r in runs.items()})
            result["latency_ms"] = latency(fleet.worker_urls[0], fleet.router_url, args.latency_requests)
        else:
            result["router"] = median_of([batch(client, f"r{i}-") for i in range(3)])
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
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(work, "jax_cache"))  # set it to reuse compilations
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
              "command": " ".join([*([f"JAX_COMPILATION_CACHE_DIR={os.environ['JAX_COMPILATION_CACHE_DIR']}"]
                                     if "JAX_COMPILATION_CACHE_DIR" in os.environ else []),
                                   ".venv/bin/python", *sys.argv]),
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
