"""Capture: the serving endpoint's traffic and the feedback on it, as durable logs.

    python -m rlvr.rollout.server --hf_dir=DIR --port=30000 --traffic_dir=FLY/traffic

With `--traffic_dir`, every finished request (`/v1/chat/completions`, `/v1/completions`, `/generate`)
is appended to `FLY/traffic/traffic/` before its answer is sent: the request body, the rendered prompt
ids, the output ids and their log-probs, the text, the served model version (its label), the finish
reason and the latency. `POST /v1/feedback` records feedback on one answer in `FLY/traffic/feedback/`:

    {"response_id": "chatcmpl-…",   # the answer's `id` (`/generate`: meta_info.id)
     "index": 0,                    # the choice, for n > 1
     "rating": 1.0,                 # any number, higher is better
     "preferred": "a better answer",  # an alternative the user preferred to this one
     "correction": "the right answer",  # what the answer should have been
     "outcome": {"passed": true, "answer": "55"}}  # a downstream check: passed, and what makes it checkable:
                                    # "answer" (exact), or "verifier" (a rlvr.tasks.verifiers spec)

At least one of rating, preferred, correction, outcome is required; an unknown response id is 404.
Both logs are `rlvr.flywheel.log` AppendLogs (fsynced, CRC-framed lines, one file per process).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from rlvr.flywheel import log
from rlvr.rollout.server_http import Reply
from rlvr.rollout.server_protocol import ApiError, expect_object, is_int, parse_json

TRAFFIC, FEEDBACK = "traffic", "feedback"
_TRAFFIC_FIELDS = ("response_id", "index", "endpoint", "rid", "request", "prompt_ids", "output_ids",
                   "output_logprobs", "output_versions", "text", "model_version", "weight_version", "finish_reason",
                   "cached_tokens", "latency_s", "session")
_FEEDBACK_FIELDS = {"response_id", "id", "index", "rating", "preferred", "correction", "outcome", "source"}


class TrafficCapture:
    """The recorder and the `/v1/feedback` route of one server, writing under `root`."""

    def __init__(self, root: str, fsync: bool = True):
        self.root = root
        self.traffic = log.AppendLog(root, TRAFFIC, fsync)
        self.feedback = log.AppendLog(root, FEEDBACK, fsync)
        self._lock = threading.Lock()
        self._known = KnownAnswers()
        for r in log.read(root, TRAFFIC):
            self._known.add(r["response_id"], r.get("index", 0))

    def record(self, entry: dict[str, Any]) -> None:
        """The server's recorder: one traffic record, durable before the answer goes out."""
        record = self.traffic.append({k: entry.get(k) for k in _TRAFFIC_FIELDS})
        with self._lock:
            self._known.add(record["response_id"], record["index"])

    def routes(self) -> dict[str, tuple[set[str], Callable[..., Reply]]]:
        return {"/v1/feedback": ({"POST"}, self.handle_feedback)}

    def handle_feedback(self, raw: bytes, cancelled: Any) -> Reply:
        body = parse_feedback(parse_json(raw))
        with self._lock:
            known = self._known.contains(body["response_id"], body["index"])
        if not known:
            raise ApiError(f"response_id {body['response_id']!r} (index {body['index']}) is not in this server's "
                           "traffic log: give the `id` of an answer this server recorded", 404)
        record = self.feedback.append(body)
        return Reply(200, {"id": record["id"], "response_id": body["response_id"], "index": body["index"],
                           "status": "recorded"})

    def close(self) -> None:
        self.traffic.close()
        self.feedback.close()


class KnownAnswers:
    """The (response id, choice index) pairs a server has recorded, as 8 bytes each: a sorted
    array of their 64-bit digests and a set of the newest, merged into the array every MERGE_AT
    (a set of id strings grew ~150 bytes a request, for as long as the server ran). Two different
    answers share a digest with probability ~n²/2⁶⁵: a feedback on an answer never recorded is
    then accepted instead of refused, and the flywheel's join (by the id itself) finds no answer
    for it."""

    MERGE_AT = 1 << 16

    def __init__(self):
        self._sorted = np.zeros(0, np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        return self._sorted.size + len(self._recent)

    @property
    def nbytes(self) -> int:
        return self._sorted.nbytes + 8 * len(self._recent)

    def add(self, response_id: str, index: int) -> None:
        self._recent.add(_digest(response_id, index))
        if len(self._recent) >= self.MERGE_AT:
            self._sorted = np.union1d(self._sorted, np.fromiter(self._recent, np.uint64, len(self._recent)))
            self._recent.clear()

    def contains(self, response_id: str, index: int) -> bool:
        key = _digest(response_id, index)
        if key in self._recent:
            return True
        at = int(np.searchsorted(self._sorted, np.uint64(key)))
        return at < self._sorted.size and int(self._sorted[at]) == key


def _digest(response_id: str, index: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{index}:{response_id}".encode(), digest_size=8).digest(), "little")


def parse_feedback(body: Any) -> dict[str, Any]:
    """A validated feedback record; a bad field is a 400 naming it."""
    body = dict(expect_object(body))
    unknown = sorted(set(body) - _FEEDBACK_FIELDS)
    if unknown:
        raise ApiError(f"unknown feedback field(s) {unknown}; known: {sorted(_FEEDBACK_FIELDS)}")
    rid = body.get("response_id", body.get("id"))  # "id" accepted as an alias
    if not isinstance(rid, str) or not rid:
        raise ApiError("response_id must be the `id` of an answer (a non-empty string)")
    out: dict[str, Any] = {"response_id": rid, "index": body.get("index", 0)}
    if not is_int(out["index"]) or out["index"] < 0:
        raise ApiError("index must be a non-negative integer (the choice's index)")
    rating = body.get("rating")
    if rating is not None:
        if isinstance(rating, bool) or not isinstance(rating, (int, float)) or not math.isfinite(rating):
            raise ApiError("rating must be a finite number (higher is better)")
        out["rating"] = float(rating)
    for key in ("preferred", "correction", "source"):
        if body.get(key) is not None:
            if not isinstance(body[key], str) or not body[key].strip():
                raise ApiError(f"{key} must be a non-empty string")
            out[key] = body[key]
    if body.get("outcome") is not None:
        out["outcome"] = _outcome(body["outcome"])
    if not {"rating", "preferred", "correction", "outcome"} & set(out):
        raise ApiError("feedback needs at least one of rating, preferred, correction, outcome")
    return out


def _outcome(value: Any) -> dict[str, Any]:
    outcome = dict(expect_object(value, "outcome"))
    if "passed" in outcome and not isinstance(outcome["passed"], bool):
        raise ApiError("outcome.passed must be true or false")
    if "answer" in outcome and not isinstance(outcome["answer"], str):
        raise ApiError("outcome.answer must be a string (the reference answer)")
    verifier = outcome.get("verifier")
    if verifier is not None:
        from rlvr.tasks.verifiers import VERIFIERS

        if not isinstance(verifier, dict) or verifier.get("kind") not in VERIFIERS:
            raise ApiError(f"outcome.verifier must be a verifier spec {{'kind': one of {sorted(VERIFIERS)}, ...}}")
    return outcome
