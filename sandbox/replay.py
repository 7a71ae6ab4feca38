"""Re-run a recorded sandbox call in a fresh sandbox and compare: `python -m rlvr.sandbox.replay TRACE --index N`.

`python -m rlvr.sandbox.replay --episode SNAPSHOT` replays a whole episode snapshot instead (see episode.py):
it prints the per-step report and exits 0 when every step was replayed exactly.

Prints one JSON object (what matched, what differed) and exits 0 when the replay reproduced the recorded
status, limit hit, outputs and workspace digest, 1 otherwise. Timings are reported, never compared.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from . import api, trace
from .trace import compare  # noqa: F401  (re-exported: replay.compare)
from .types import Limits, Result
from .workspace import tree_digest

FRESH = {"runsc-pool": "runsc"}  # a pool task replays in a fresh sandbox of the same kind


def replay(entry: Mapping[str, Any], backend: str | None = None) -> Result:
    """Run a trace record's call again (same argv, files, stdin, env, limits, read-only binds)."""
    if entry["files"] is None:
        raise ValueError("this record's input files were too large to keep in the trace; it cannot be replayed")
    template = entry.get("template")
    if template is not None:  # a record names its template; replay only over the very same contents
        if not os.path.isdir(template["source"]) or tree_digest(template["source"]) != template["digest"]:
            raise ValueError(f"the record's template {template['source']} is gone or changed (digest "
                             f"{template['digest'][:12]}); episodes keep theirs: see episode.py")
    with tempfile.TemporaryDirectory(prefix="rlvr-replay-") as tmp:
        binds = {}
        for i, (dest, files) in enumerate((entry.get("ro_binds") or {}).items()):
            binds[dest] = _materialise(os.path.join(tmp, str(i)), trace.decode_files(files or {}))
        return api.run(entry["argv"], files=trace.decode_files(entry["files"]), stdin=base64.b64decode(entry["stdin"]),
                       env=entry["env"], limits=Limits.from_json(entry["limits"]),
                       backend=backend or FRESH.get(entry["backend"], entry["backend"]),
                       ro_binds=binds, tag=f"replay of {entry['sandbox_id']}",
                       template=template["source"] if template else None)


def _materialise(directory: str, files: Mapping[str, bytes]) -> str:
    """Write a read-only bind's snapshot back to a directory the sandbox user can read."""
    os.makedirs(directory, 0o755)
    for name, data in files.items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    os.chmod(os.path.dirname(directory), 0o755)
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_file", nargs="?")
    parser.add_argument("--episode", metavar="SNAPSHOT", help="replay a whole episode snapshot (episode.py)")
    parser.add_argument("--index", type=int, default=-1, help="record number (0-based; default: the last)")
    parser.add_argument("--backend", default=None, help="override the recorded backend")
    args = parser.parse_args(argv)
    if args.episode:
        from .episode import replay_episode

        report = replay_episode(args.episode, args.backend)
        print(json.dumps(report))
        return 0 if report["replayed_exactly"] else 1
    if not args.trace_file:
        parser.error("give a trace file, or --episode SNAPSHOT")
    entry = trace.read(args.trace_file)[args.index]
    result = replay(entry, args.backend)
    diff = compare(entry, result)
    print(json.dumps({"index": args.index, "sandbox_id": entry["sandbox_id"], "replay_id": result.sandbox_id,
                      "reproduced": not diff, "differences": diff,
                      "timings": {"recorded": entry["timings"], "replayed": trace.record(
                          [], {}, b"", Limits(), result, None, None, {})["timings"]}}))
    return 0 if not diff else 1


if __name__ == "__main__":
    sys.exit(main())
