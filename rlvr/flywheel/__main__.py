"""`python -m rlvr.flywheel build|promote|rollback|sync`: thin mains over rlvr.flywheel (see its docstring)."""

from __future__ import annotations

import argparse
import json
import sys

from rlvr.flywheel import build as build_lib
from rlvr.flywheel import promote as promote_lib


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlvr.flywheel", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="captured traffic and feedback -> SFT, DPO and RL data with a data card")
    b.add_argument("--traffic", required=True, help="the server's --traffic_dir")
    b.add_argument("--out", required=True, help="output directory (local, s3://, gs://)")
    b.add_argument("--heldout_fraction", type=float, default=0.2, help="newest share of prompts held out")
    b.add_argument("--min_rating_gap", type=float, default=0.0, help="rating pairs need a larger difference")
    b.add_argument("--max_chars", type=int, default=16384, help="drop prompts or answers longer than this")
    b.add_argument("--versions", default="", help="comma-separated model versions to keep (default: all)")
    pr = sub.add_parser("promote", help="gate a candidate against the served model; swap weights if it passes")
    pr.add_argument("--candidate", required=True, help="an rlvr workdir or an HF directory")
    pr.add_argument("--server", required=True, help="the serving endpoint's URL")
    pr.add_argument("--fly", required=True, help="flywheel directory (serving.json, promotions/, models/)")
    pr.add_argument("--suite", required=True,
                    help="the regression suite (an rl.task spec), e.g. FLY/data/heldout/rl.jsonl,add")
    pr.add_argument("--margin", type=float, default=0.02, help="largest pass@1 drop allowed per domain")
    pr.add_argument("--margins", default="", help="per-domain margins: traffic=0.1,arithmetic=0")
    pr.add_argument("--min_tasks", type=int, default=promote_lib.Gate.min_tasks,
                    help="refuse when fewer tasks were evaluated")
    pr.add_argument("--alpha", type=float, default=promote_lib.Gate.alpha,
                    help="the overall gain's one-sided p-value must be at most this (1: no significance test)")
    pr.add_argument("--eval_config", default="configs/eval_tasks.py", help="config of the eval job (settings)")
    pr.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="eval config override")
    pr.add_argument("--label", default=None, help="the promoted weight version's label")
    pr.add_argument("--models_dir", default=None, help="local directory for the candidate's HF export")
    sy = sub.add_parser("sync", help="copy a directory tree between local paths and object storage")
    sy.add_argument("src")
    sy.add_argument("dst")
    rb = sub.add_parser("rollback", help="load back the model the last promotion replaced")
    rb.add_argument("--server", required=True)
    rb.add_argument("--fly", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "build":
        settings = build_lib.BuildSettings(args.heldout_fraction, args.min_rating_gap, args.max_chars,
                                           tuple(v for v in args.versions.split(",") if v))
        card = build_lib.build(args.traffic, args.out, settings)
        print(json.dumps({"counts": card["counts"], "dropped": card["dropped"]}))
        return 0
    if args.command == "sync":
        from rlvr import storage

        if storage.is_remote(args.src):
            storage.download_dir(args.src, args.dst)
        else:
            storage.upload_dir(args.src, args.dst)
        return 0
    if args.command == "rollback":
        print(json.dumps(promote_lib.rollback(args.server, args.fly)))
        return 0
    margins = tuple((k, float(v)) for k, v in _pairs([m for m in args.margins.split(",") if m], "--margins").items())
    overrides = {k: _value(v) for k, v in _pairs(args.set, "--set").items()}
    gate = promote_lib.Gate(args.margin, margins, min_tasks=args.min_tasks, alpha=args.alpha)
    decision = promote_lib.promote(args.candidate, args.server, args.fly, args.suite, gate,
                                   eval_config=args.eval_config, overrides=overrides, label=args.label,
                                   models_dir=args.models_dir)
    print(json.dumps({k: decision[k] for k in ("promote", "label", "domains", "significance")}))
    if not decision["promote"]:
        print("NOT PROMOTED: " + "; ".join(decision["reasons"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
