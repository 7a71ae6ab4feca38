"""Where a jitted step's time goes, per op, grouped by what the op computes.

    from op_profile import op_profile
    op_profile(call, hlo_text, calls=3)  # -> {"ms_per_call": {...}, "share": {...}, "top_ops": [...]}

Runs the function under `jax.profiler.trace` (a Perfetto trace: XLA:CPU records one event per
thunk, i.e. per fusion or library call), maps each event to its instruction in the compiled HLO
and that instruction's `op_name` metadata (the JAX source path: `self_attn/q_proj/dot_general`,
`mlp/jit(silu)`, `transpose(jvp(...))` for the backward), and sums the time by group:
matmuls of the MLP and of the attention projections, the attention core (scores, mask, softmax,
values: split into its products and everything else), the output head and cross-entropy, norms,
the optimizer, other. Events can nest or run on two threads at once, so the groups are
shares of the summed op time, not of the wall time.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile

import jax

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _group(op_name: str, has_dot: bool) -> str:
    if "self_attn" in op_name and any(p in op_name for p in _PROJECTIONS):
        return "attention projections (matmul)" if has_dot else "attention projections (other)"
    if "self_attn" in op_name:
        return "attention core (score/value products)" if has_dot else "attention core (mask, softmax, layout)"
    if "/mlp/" in op_name:
        return "mlp (matmul)" if has_dot else "mlp (elementwise)"
    if any(k in op_name for k in ("lm_head", "log_softmax", "take_along_axis", "logits", "chunked")):
        return "output head + cross-entropy (matmul)" if has_dot else "output head + cross-entropy (other)"
    if "norm" in op_name:
        return "norms"
    if any(k in op_name for k in ("adam", "optax", "apply_updates", "update")):
        return "optimizer"
    return "other"


def _instructions(hlo: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction name -> its text, computation name -> its lines) of a compiled module's HLO."""
    lines, comps, current = {}, {}, None
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*)", line)
        if m and m.group(1) not in lines:
            lines[m.group(1)] = m.group(2)
        m = re.match(r"^%?([\w.\-]+) .*\{$", line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif current:
            comps[current].append(line.strip())
    return lines, comps


def op_profile(call, hlo_text: str, calls: int = 3, top: int = 12) -> dict:
    """Per-group op time of `calls` calls of `call()` (which runs the warm, compiled program whose
    optimized HLO is `hlo_text`, `jitted.lower(...).compile().as_text()`, and blocks): milliseconds
    per call and share of the summed op time, and the `top` single ops."""
    with tempfile.TemporaryDirectory(prefix="op_profile_") as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                call()
        with gzip.open(glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)[0]) as f:
            events = json.load(f)["traceEvents"]
    micros = collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            micros[e["name"]] += e["dur"]
    lines, comps = _instructions(hlo_text)
    groups, ops = collections.Counter(), []
    for name, us in micros.items():
        if name not in lines:  # runtime events (execute, wait), not ops
            continue
        called = re.findall(r"calls=%?([\w.\-]+)", lines[name])
        body = comps.get(called[0], []) if called else []
        has_dot = any(" dot(" in b or " convolution(" in b for b in body) or " dot(" in lines[name]
        op_names = re.findall(r'op_name="([^"]+)"', " ".join(body) + lines[name])
        op_name = op_names[-1] if op_names else ""
        ms = us / calls / 1000
        groups[_group(op_name, has_dot)] += ms
        ops.append((ms, name, op_name))
    total = sum(groups.values())
    return {"ms_per_call": {k: round(v, 1) for k, v in groups.most_common()},
            "share": {k: round(v / total, 3) for k, v in groups.most_common()},
            "top_ops": [{"ms": round(ms, 2), "op": name, "source": src[-100:]}
                        for ms, name, src in sorted(ops, reverse=True)[:top]]}
