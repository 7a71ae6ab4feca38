"""Gate and promote: a candidate replaces the served model only if it does not regress.

    python -m rlvr.flywheel promote --candidate=RUN --server=URL --fly=FLY \\
        --suite=FLY/data/heldout/rl.jsonl,add --margin=0.05 [--margins=traffic=0.1]
    python -m rlvr.flywheel rollback --server=URL --fly=FLY

1. The candidate (an rlvr workdir, exported with `rlvr.export`, or an HF directory) and the serving
   model (`FLY/serving.json`, else the server's own `model_path`) are evaluated by the eval job
   (`rlvr.trainers.evaluate`, settings from `--eval_config`) on the regression suite `--suite`, an
   `rl.task` spec: the held-out traffic tasks the flywheel built plus capability families.
2. Per domain (the eval's `by_domain`), a drop of the candidate's pass@1 below the serving model's by
   more than the domain's margin refuses the promotion. So do fewer than `--min_tasks` evaluated
   tasks, and an overall gain that is not significant: a one-sided two-proportion z-test of the
   candidate's overall pass@1 against the serving model's, p-value above `--alpha` (1 turns it off).
   The decision, both evaluations and the reasons are written to `FLY/promotions/<time>.json`
   either way.
3. Otherwise the server loads the candidate (`POST /update_weights_from_disk` with a new
   `weight_version` label) and must then report that label (`/model_info`): if it reports another,
   the served model is loaded back and the promotion fails with an error. `FLY/serving.json`
   records the promoted model with the one it replaced, which `rollback` loads back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
import urllib.request
from typing import Any

from rlvr import storage

SERVING = "serving.json"


@dataclasses.dataclass(frozen=True)
class Gate:
    margin: float = 0.02  # the largest pass@1 drop allowed in a domain
    margins: tuple[tuple[str, float], ...] = ()  # per-domain overrides
    metric: str = "pass@1"
    min_tasks: int = 100  # fewer evaluated tasks (either model) refuse the promotion
    alpha: float = 0.05  # the overall gain must be significant at this level (1: no test)

    def margin_of(self, domain: str) -> float:
        return dict(self.margins).get(domain, self.margin)


def gain_p_value(serving: float, candidate: float, n_serving: int, n_candidate: int) -> tuple[float, float]:
    """(z, one-sided p-value) of the two-proportion z-test of "the candidate's pass rate is higher":
    z = (p_c - p_s) / sqrt(p (1 - p) (1/n_s + 1/n_c)), p the pooled rate; p-value = P(Z >= z). The
    evaluations share their tasks, so the test (which assumes independent samples) is conservative
    when the two models tend to solve the same tasks."""
    pooled = (serving * n_serving + candidate * n_candidate) / (n_serving + n_candidate)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_serving + 1 / n_candidate))
    z = (candidate - serving) / se if se > 0 else 0.0
    return z, 0.5 * math.erfc(z / math.sqrt(2))


def compare(serving: dict[str, Any], candidate: dict[str, Any], gate: Gate) -> dict[str, Any]:
    """Per domain: both scores, the change, the margin, and whether it regresses beyond it; overall:
    the task counts against `gate.min_tasks` and the gain's significance (`gain_p_value`). "promote"
    when none refuses; "reasons" says why not."""
    domains = {}
    for domain, base in serving["by_domain"].items():
        new = candidate["by_domain"].get(domain)
        if new is None:
            domains[domain] = {"serving": base[gate.metric], "candidate": None, "regressed": True,
                               "reason": "the candidate's evaluation has no tasks in this domain"}
            continue
        delta = new[gate.metric] - base[gate.metric]
        domains[domain] = {"serving": base[gate.metric], "candidate": new[gate.metric], "delta": delta,
                           "margin": gate.margin_of(domain), "regressed": delta < -gate.margin_of(domain)}
    reasons = [f"{gate.metric} in {d!r} dropped beyond its margin {v.get('margin')}: {v['serving']} -> {v['candidate']}"
               for d, v in domains.items() if v["regressed"]]
    tasks = {name: int(result["overall"]["tasks"]) for name, result in (("serving", serving), ("candidate", candidate))}
    if min(tasks.values()) < gate.min_tasks:
        reasons.append(f"{min(tasks.values())} tasks evaluated, fewer than min_tasks={gate.min_tasks}: add tasks to "
                       "the suite (or lower --min_tasks)")
    scores = serving["overall"][gate.metric], candidate["overall"][gate.metric]
    z, p_value = gain_p_value(*scores, tasks["serving"], tasks["candidate"]) if min(tasks.values()) else (0.0, 1.0)
    significance = {"serving": scores[0], "candidate": scores[1], "tasks": tasks, "z": z, "p_value": p_value,
                    "alpha": gate.alpha, "significant": p_value <= gate.alpha}
    if not significance["significant"]:
        reasons.append(f"the overall {gate.metric} gain {scores[0]:.4f} -> {scores[1]:.4f} is not significant: "
                       f"one-sided p-value {p_value:.4f} > alpha={gate.alpha} (evaluate more tasks, or raise --alpha)")
    return {"domains": domains, "significance": significance, "reasons": reasons, "promote": not reasons}


def _post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}") | {"success": False, "status": e.code}


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return json.loads(reply.read())


def serving_model(server: str, fly: str) -> dict[str, Any]:
    """{"version", "model_path"} of what the server runs: FLY/serving.json, else the server's own."""
    path = storage.join(fly, SERVING)
    if storage.exists(path):
        return json.loads(storage.read_text(path))
    info = _get(server.rstrip("/") + "/model_info")
    return {"version": str(info["weight_version"]), "model_path": info["model_path"], "previous": None}


def as_hf_dir(model: str, out: str) -> str:
    """A local HF directory of `model` (local or on object storage): itself, or an export of an rlvr
    workdir, at `out`."""
    from rlvr import export, start

    if storage.is_remote(model):
        model = storage.download_dir(model, out + ".download")
    if "init.hf_checkpoint" in start.init_overrides(model):
        return model
    export.export(model, out)
    return out


def evaluate(hf_dir: str, suite: str, eval_config: str, workdir: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The eval job on `hf_dir` over the tasks `suite`; its result (by_domain etc.)."""
    from rlvr import config_lib, main

    config = config_lib.load_config(eval_config, {"init.hf_checkpoint": hf_dir, "init.workdir": "",
                                                  "rl.task": suite, **overrides})
    return main.run(config, workdir)


def promote(candidate: str, server: str, fly: str, suite: str, gate: Gate = Gate(), *,
            eval_config: str = "configs/eval_tasks.py", overrides: dict[str, Any] | None = None,
            label: str | None = None, models_dir: str | None = None) -> dict[str, Any]:
    """Evaluates, gates and (if it passes) promotes `candidate`; returns the decision record. The
    candidate's HF export goes to `models_dir/<label>` (a local directory the server can load from;
    default FLY/models when FLY is local, else rlvr-flywheel/models in the temporary directory)."""
    served = serving_model(server, fly)
    label = label or f"flywheel-{int(time.time())}"
    work = tempfile.mkdtemp(prefix="rlvr-promote-")
    if models_dir is None:
        models_dir = storage.join(fly, "models") if not storage.is_remote(fly) else \
            os.path.join(tempfile.gettempdir(), "rlvr-flywheel", "models")
    hf_dir = as_hf_dir(candidate, os.path.join(models_dir, label))
    results = {name: evaluate(path, suite, eval_config, os.path.join(work, name), overrides or {})
               for name, path in (("serving", served["model_path"]), ("candidate", hf_dir))}
    decision = {"time": time.time(), "candidate": candidate, "hf_dir": hf_dir, "label": label, "suite": suite,
                "serving": served, "gate": dataclasses.asdict(gate),
                **compare(results["serving"], results["candidate"], gate),
                "evaluations": {k: {"by_domain": v["by_domain"], "overall": v["overall"]} for k, v in results.items()}}
    error = _swap(server, hf_dir, label, served, decision) if decision["promote"] else None
    if decision["promote"]:
        record = {"version": label, "model_path": hf_dir, "promoted_at": decision["time"], "previous": served}
        storage.write_text(storage.join(fly, SERVING), json.dumps(record, indent=1) + "\n")
    storage.write_text(storage.join(fly, "promotions", f"{int(decision['time'] * 1000)}.json"),
                       json.dumps(decision, indent=1) + "\n")
    if error:
        raise RuntimeError(f"promoting {candidate}: {error}")
    return decision


def _swap(server: str, hf_dir: str, label: str, served: dict[str, Any], decision: dict[str, Any]) -> str | None:
    """The server loads `hf_dir` as `label`; decision["promote"] stays true only if it then reports
    `label`. If it reports another version, `served` is loaded back and the error is returned."""
    decision["update"] = update = load(server, hf_dir, label)
    if not update.get("success"):
        decision["promote"] = False
        decision["reasons"].append(f"the server did not load the candidate: {update.get('message')}")
        return None
    if update["served_version"] == label:
        return None
    decision["promote"] = False
    decision["rollback"] = back = load(server, served["model_path"], served["version"])
    error = (f"after loading {hf_dir} as {label!r} the server reports weight version {update['served_version']!r}; "
             f"loaded {served['version']!r} back ({served['model_path']}), the server now reports "
             f"{back['served_version']!r}")
    decision["reasons"].append(error)
    return error


def load(server: str, hf_dir: str, label: str) -> dict[str, Any]:
    """The server swaps to `hf_dir` as version `label`; the reply, plus the version it then reports."""
    reply = _post(server.rstrip("/") + "/update_weights_from_disk", {"model_path": hf_dir, "weight_version": label})
    reply["served_version"] = str(_get(server.rstrip("/") + "/model_info")["weight_version"])
    return reply


def rollback(server: str, fly: str) -> dict[str, Any]:
    """Loads the model the last promotion replaced; FLY/serving.json points at it again."""
    served = serving_model(server, fly)
    previous = served.get("previous")
    if not previous:
        raise ValueError(f"{storage.join(fly, SERVING)}: no previous model to roll back to")
    reply = load(server, previous["model_path"], previous["version"])
    if not reply.get("success"):
        raise RuntimeError(f"rollback to {previous['model_path']} failed: {reply.get('message')}")
    if reply["served_version"] != str(previous["version"]):
        raise RuntimeError(f"rollback to {previous['model_path']}: the server reports weight version "
                           f"{reply['served_version']!r}, not {previous['version']!r}")
    storage.write_text(storage.join(fly, SERVING), json.dumps(previous, indent=1) + "\n")
    return reply
