"""Build: captured traffic and feedback -> SFT records, DPO pairs and RL tasks, with a data card.

    python -m rlvr.flywheel build --traffic=FLY/traffic --out=FLY/data [--heldout_fraction=0.2]

What each kind of feedback becomes (one answer can feed several):

  correction           SFT record (the prompt, the correction as the answer), and a DPO pair
                       correction > answer
  preferred            DPO pair preferred > answer
  ratings              DPO pairs between answers to the same prompt whose ratings differ by more than
                       `min_rating_gap`: higher > lower
  outcome              RL task, when checkable: `outcome.verifier` (a verifier spec) as given, or
                       `outcome.answer` with the exact verifier. An outcome without either is not
                       checkable and is counted, not used: `passed: true` alone says that this one
                       answer was acceptable, not that it is the only one (as an exact reference it
                       would score every other right answer, worded or formatted otherwise, 0)

Records are deduplicated (same prompt and same content: the earliest kept). The split is by time: the
prompts first seen last (`heldout_fraction` of them) and every record on those prompts are held out, so
no prompt is in both splits and the held-out part is the newest traffic. Filters drop aborted answers,
prompts the data cannot pose again (token ids), records over
`max_chars`, and traffic of model versions outside `versions`. Files: `OUT/{train,heldout}/{sft,dpo,rl}.jsonl`
(the formats of `data.source=jsonl` for SFT, the DPO job's pairs, and `rlvr.tasks.datasets.TaskFileFamily`
rows), and `OUT/data_card.json`: counts per kind and split, what was filtered and why, the model
versions and endpoints the data came from, the time range and the cutoff.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from rlvr import storage
from rlvr.flywheel import log
from rlvr.flywheel.capture import FEEDBACK, TRAFFIC

KINDS = ("sft", "dpo", "rl")


@dataclasses.dataclass(frozen=True)
class BuildSettings:
    heldout_fraction: float = 0.2  # of prompts, the newest
    min_rating_gap: float = 0.0  # rating pairs need a difference above this
    max_chars: int = 16384  # a prompt or answer longer is dropped
    versions: tuple[str, ...] = ()  # keep only traffic served by these model versions (empty: all)

    def __post_init__(self):
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction={self.heldout_fraction}: need 0 <= fraction < 1")


def prompt_of(record: dict[str, Any]) -> str | list[dict[str, Any]] | None:
    """The prompt as the caller posed it (text, or chat messages); None when it cannot be posed again."""
    request = record.get("request") or {}
    if record.get("endpoint") == "/v1/chat/completions":
        return request.get("messages") or None
    prompt = request.get("prompt") if record.get("endpoint") == "/v1/completions" else request.get("text")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    elif isinstance(prompt, list) and record.get("endpoint") == "/v1/completions":  # a batch: n choices a prompt
        index = record.get("index", 0) // (request.get("n") or 1)
        prompt = prompt[index] if index < len(prompt) else None
    return prompt if isinstance(prompt, str) and prompt else None


def prompt_key(prompt: Any) -> str:
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


def _feedback_by_answer(root: str, stats: dict[str, int], traffic: list[dict]) -> dict[int, dict[str, Any]]:
    """Per answer (its position in `traffic`), its feedback merged in time order (a later rating replaces an
    earlier one). A response id a client reused (its own `rid` on two requests) names several answers: a
    feedback record goes to the latest of them recorded before it (the answer the client had seen), or to
    the first when none is earlier (clocks of different processes)."""
    answers_of: dict[tuple[str, int], list[tuple[float, int]]] = defaultdict(list)
    for position, record in enumerate(traffic):
        answers_of[(record["response_id"], record.get("index", 0))].append((record["time"], position))
    for answers in answers_of.values():
        answers.sort()
    merged: dict[int, dict[str, Any]] = defaultdict(dict)
    for record in sorted(log.read(root, FEEDBACK, stats), key=lambda r: r["time"]):
        answers = answers_of.get((record["response_id"], record.get("index", 0)))
        if not answers:
            continue
        earlier = bisect.bisect_right(answers, (record["time"], math.inf))
        merged[answers[max(earlier - 1, 0)][1]].update(
            {k: v for k, v in record.items() if k not in ("id", "time", "response_id", "index")})
    return merged


def _answers(root: str, settings: BuildSettings, stats: dict[str, int], dropped: dict[str, int]) -> list[dict]:
    """The traffic records that pass the filters, each with its prompt and merged feedback."""
    traffic = list(log.read(root, TRAFFIC, stats))
    feedback = _feedback_by_answer(root, stats, traffic)
    answers = []
    for position, record in enumerate(traffic):
        prompt = prompt_of(record)
        reason = None
        if (record.get("finish_reason") or {}).get("type") == "abort":
            reason = "aborted"
        elif prompt is None:
            reason = "prompt not reusable (token ids)"
        elif settings.versions and str(record.get("model_version")) not in settings.versions:
            reason = "model version not selected"
        elif max(len(json.dumps(prompt)), len(record.get("text") or "")) > settings.max_chars:
            reason = "over max_chars"
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
            continue
        answers.append({**record, "prompt": prompt, "feedback": feedback.get(position, {})})
    return sorted(answers, key=lambda a: a["time"])


def _meta(answer: dict[str, Any]) -> dict[str, Any]:
    return {"time": answer["time"], "model_version": answer.get("model_version"), "source": answer["response_id"]}


def _rl_task(answer: dict[str, Any], dropped: dict[str, int]) -> dict[str, Any] | None:
    outcome = answer["feedback"].get("outcome")
    if outcome is None:
        return None
    reference = outcome.get("answer")
    spec = outcome.get("verifier") or ({"kind": "exact", "answer": reference} if reference else None)
    if spec is None:  # no reference: "passed" alone is a judgement of this answer, not a checker
        dropped["outcome not checkable"] = dropped.get("outcome not checkable", 0) + 1
        return None
    prompt = answer["prompt"]
    question = prompt if isinstance(prompt, str) else str(prompt[-1].get("content") or "")
    row = {"question": question, "answer": reference or "", "verifier": spec, **_meta(answer)}
    if not isinstance(prompt, str):
        row["messages"] = prompt
    return row


def _pairs_by_rating(answers: Sequence[dict[str, Any]], gap: float) -> list[dict[str, Any]]:
    """Higher- over lower-rated answers to the same prompt."""
    rated: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in answers:
        if "rating" in a["feedback"]:
            rated[prompt_key(a["prompt"])].append(a)
    pairs = []
    for group in rated.values():
        for hi in group:
            for lo in group:
                if hi["feedback"]["rating"] - lo["feedback"]["rating"] > gap and hi["text"] != lo["text"]:
                    later = hi if hi["time"] >= lo["time"] else lo
                    pairs.append({"prompt": hi["prompt"], "chosen": hi["text"], "rejected": lo["text"],
                                  **_meta(later), "from": "rating"})
    return pairs


def examples(answers: Sequence[dict[str, Any]], settings: BuildSettings,
             dropped: dict[str, int]) -> dict[str, list[dict[str, Any]]]:
    """The SFT, DPO and RL records the answers' feedback yields (before dedup and split)."""
    out: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for a in answers:
        fb, prompt, text = a["feedback"], a["prompt"], a.get("text") or ""
        correction = fb.get("correction")
        if correction is not None:
            if isinstance(prompt, str):
                out["sft"].append({"prompt": prompt, "completion": correction, **_meta(a)})
            else:
                out["sft"].append({"messages": [*prompt, {"role": "assistant", "content": correction}], **_meta(a)})
        for better, source in ((correction, "correction"), (fb.get("preferred"), "preferred")):
            if better is not None and better.strip() != text.strip():
                out["dpo"].append({"prompt": prompt, "chosen": better, "rejected": text, **_meta(a), "from": source})
        task = _rl_task(a, dropped)
        if task is not None:
            out["rl"].append(task)
    out["dpo"] += _pairs_by_rating(answers, settings.min_rating_gap)
    return out


def _content_key(kind: str, row: dict[str, Any]) -> str:
    fields = {"sft": ("prompt", "completion", "messages"), "dpo": ("prompt", "chosen", "rejected"),
              "rl": ("question", "messages", "verifier")}[kind]
    return prompt_key([row.get(f) for f in fields])


def _row_prompt(kind: str, row: dict[str, Any]) -> str:
    if kind == "rl":
        return prompt_key(row.get("messages") or row["question"])
    if kind == "sft" and "messages" in row:
        return prompt_key(row["messages"][:-1])
    return prompt_key(row["prompt"])


def dedup_and_split(rows: dict[str, list[dict[str, Any]]], answers: Sequence[dict[str, Any]], fraction: float,
                    dropped: dict[str, int]) -> tuple[dict[str, dict[str, list]], float | None]:
    """{split: {kind: rows}} with duplicates dropped (the earliest kept), and the cutoff time: prompts first
    seen at or after it are held out, with every record on them."""
    first_seen: dict[str, float] = {}
    for a in answers:
        first_seen.setdefault(prompt_key(a["prompt"]), a["time"])
    order = sorted(first_seen, key=first_seen.get)
    held = set(order[len(order) - round(fraction * len(order)):]) if fraction > 0 and order else set()
    cutoff = min((first_seen[k] for k in held), default=None)
    out: dict[str, dict[str, list]] = {"train": {k: [] for k in KINDS}, "heldout": {k: [] for k in KINDS}}
    for kind in KINDS:
        seen = set()
        for row in sorted(rows[kind], key=lambda r: r["time"]):
            key = _content_key(kind, row)
            if key in seen:
                dropped[f"duplicate {kind}"] = dropped.get(f"duplicate {kind}", 0) + 1
                continue
            seen.add(key)
            out["heldout" if _row_prompt(kind, row) in held else "train"][kind].append(row)
    return out, cutoff


def build(traffic: str, out: str, settings: BuildSettings = BuildSettings()) -> dict[str, Any]:
    """Writes the training data and its card under `out`; returns the card."""
    stats: dict[str, int] = {}
    dropped: dict[str, int] = {}
    answers = _answers(traffic, settings, stats, dropped)
    split, cutoff = dedup_and_split(examples(answers, settings, dropped), answers, settings.heldout_fraction, dropped)
    for name, kinds in split.items():
        for kind, rows in kinds.items():
            storage.write_text(storage.join(out, name, f"{kind}.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    times = [a["time"] for a in answers]
    card = {
        "built_at": time.time(), "traffic": traffic, "settings": dataclasses.asdict(settings),
        "counts": {name: {kind: len(rows) for kind, rows in kinds.items()} for name, kinds in split.items()},
        "answers_used": len(answers), "with_feedback": sum(bool(a["feedback"]) for a in answers),
        "dropped": dict(sorted(dropped.items())), "log": stats,
        "model_versions": _count(str(a.get("model_version")) for a in answers),
        "endpoints": _count(a.get("endpoint") for a in answers),
        "time_range": [min(times), max(times)] if times else None, "heldout_cutoff": cutoff,
        "files": {name: {kind: storage.join(out, name, f"{kind}.jsonl") for kind in KINDS} for name in split},
    }
    storage.write_text(storage.join(out, "data_card.json"), json.dumps(card, indent=1) + "\n")
    return card


def _count(values) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return dict(sorted(counts.items()))
