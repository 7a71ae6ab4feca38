"""SGLang's native HTTP API over an `EngineDriver`, on the standard library only.

`serve(driver)` answers the routes RL frameworks (slime, veRL, our `SGLangClient`) call on a real
SGLang server, so the embedded JAX engine and GPU SGLang servers are interchangeable:

* generation: `POST|PUT /generate` (text or input_ids, single or batch, `n`, `rid`, output, prompt
  and top log-probs, SSE streaming), OpenAI `POST /v1/completions`, `POST /v1/chat/completions`
  (tools, streaming, structured output) and `GET /v1/models`, `/v1/models/{id}`;
* tokenizer: `POST /tokenize`, `/detokenize` (also under `/v1/`);
* control: `/abort_request`, `/pause_generation` (abort, retract, in_place), `/continue_generation`,
  `/flush_cache`, `/update_weights_from_disk`, `/update_weight_version`,
  `/release_memory_occupation`, `/resume_memory_occupation` (tags "kv_cache", "weights");
* status: `/health`, `/health_generate`, `/ready`, `/model_info` (`/get_model_info`),
  `/server_info` (`/get_server_info`: the engine's sizes under SGLang's server-arg names, e.g.
  max_running_requests, max_total_num_tokens, page_size, dp_size, tp_size), `/v1/loads`, `/get_load`.

Every finished request can be recorded for training: `serve(..., recorder=fn)` calls `fn(record)`
with the exact prompt / output ids, logprobs, weight versions, finish reason, endpoint and request
body (see `server_protocol.record_of`); it runs on the HTTP handler threads, so it must be
thread-safe (`list.append` is). Bad requests get SGLang-style 4xx JSON errors, never a crash.

Differences from SGLang: `/health` is a cheap liveness check and `/health_generate` the 1-token
generation; a weight-version label that is not a number is mapped to the next integer version
(`meta_info.weight_version` reports the label, `output_weight_versions` the integers); features
the engine lacks (its `model_info()["features"]`) are refused with 400 rather than ignored. A
client that disconnects has its requests aborted.

Run one from a Hugging Face directory with `python -m rlvr.rollout.server --hf_dir=DIR --port=30000`
(`--port=0`: any free port, logged as "serving DIR on URL"; `--request_log=FILE`: every finished request's
record appended to FILE as one JSON line, e.g. to audit which rids a server answered; `--traffic_dir=DIR`:
traffic and `POST /v1/feedback` captured for the flywheel, see `rlvr.flywheel`). SGLang's launch flags that
have an engine counterpart (`--model-path`, `--max-running-requests`, `--context-length`, `--page-size`,
`--max-total-tokens`, `--chunked-prefill-size`, `--dtype`, `--kv-cache-dtype`, `--random-seed`, `--dp-size`,
`--tp-size`, `--disable-radix-cache`, `--schedule-policy`, `--served-model-name`, `--attention-backend` for the
engine's own decode attentions) set it, and a few without
one are accepted and logged (`SGLANG_NO_OP_FLAGS`), so a `python -m sglang.launch_server ...` command line
starts this server as is;
`--engine_option KEY=JSON` sets any other Engine keyword.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, wait
from datetime import datetime, timezone
from typing import Any

from rlvr.rollout import server_openai
from rlvr.rollout.driver import DriverClosedError, EngineDriver, RequestRejected
from rlvr.rollout.server_http import Reply, RolloutHTTPServer
from rlvr.rollout.server_protocol import (
    ApiError,
    ModelLimits,
    check_bool,
    check_str,
    expect_object,
    generate_output,
    is_int,
    parse_generate,
    parse_json,
    record_of,
)
from rlvr.rollout.types import Completion, Request, SamplingParams

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 20.0
_CANCEL_GRACE_S = 5.0
Recorder = Callable[[dict[str, Any]], None]


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _label(name: str, value: Any) -> str:
    """SGLang's weight_version: any string label (a JSON number is taken as its text)."""
    if is_int(value) and value >= 0:
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise ApiError(f"{name} must be a non-empty string label (or a non-negative integer)")


MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # SGLang's GPU_MEMORY_ALL_TYPES


class RolloutApp:
    """The route handlers; `RolloutHTTPServer` only moves bytes."""

    def __init__(self, driver: EngineDriver, recorder: Recorder | None = None, served_model_name: str | None = None,
                 routes: dict[str, tuple[set[str], Callable[..., Reply]]] | None = None):
        self.driver = driver
        self.recorder = recorder
        info = driver.model_info()
        self.model_path = str(info.get("model_path") or "rlvr-model")
        self.model_name = served_model_name or self.model_path
        vision = getattr(getattr(driver.engine, "cfg", None), "vision", None)  # a VLM: image placeholders
        self.limits = ModelLimits.from_model_info(info, driver.tokenizer, vision)
        self.start_time = time.time()
        self.address: tuple[str, int] = ("", 0)
        self.labels: dict[int, str] = {}  # engine weight version -> the label a client gave it
        self.routes: dict[str, tuple[set[str], Callable[..., Reply]]] = {
            "/generate": ({"POST", "PUT"}, self.generate),
            "/abort_request": ({"POST"}, self.abort_request),
            "/pause_generation": ({"POST"}, self.pause_generation),
            "/continue_generation": ({"POST"}, self.continue_generation),
            "/flush_cache": ({"GET", "POST"}, self.flush_cache),
            "/health": ({"GET"}, self.health),
            "/health_generate": ({"GET"}, self.health_generate),
            "/ready": ({"GET"}, self.health),
            "/model_info": ({"GET"}, self.model_info),
            "/get_model_info": ({"GET"}, self.model_info),
            "/server_info": ({"GET"}, self.server_info),
            "/get_server_info": ({"GET"}, self.server_info),
            "/v1/loads": ({"GET"}, self.loads),
            "/get_load": ({"GET"}, self.get_load),
            "/release_memory_occupation": ({"GET", "POST"}, self.release_memory),
            "/resume_memory_occupation": ({"GET", "POST"}, self.resume_memory),
            "/update_weights_from_disk": ({"POST"}, self.update_weights_from_disk),
            "/update_weight_version": ({"POST"}, self.update_weight_version),
            "/v1/completions": ({"POST"}, self.openai(server_openai.completions)),
            "/v1/chat/completions": ({"POST"}, self.openai(server_openai.chat_completions)),
            "/v1/models": ({"GET"}, lambda raw, cancelled: Reply(200, server_openai.models(self))),
        }
        for prefix in ("", "/v1"):
            self.routes[prefix + "/tokenize"] = ({"POST"}, self.tool(server_openai.tokenize))
            self.routes[prefix + "/detokenize"] = ({"POST"}, self.tool(server_openai.detokenize))
        self.routes.update(routes or {})  # e.g. rlvr.flywheel.capture's POST /v1/feedback

    def dispatch(self, method: str, path: str, raw: bytes, cancelled: Callable[[], bool]) -> Reply:
        path = path.rstrip("/") or "/"
        if path.startswith("/v1/models/") and method == "GET":
            return self.model(path.removeprefix("/v1/models/"))
        if path not in self.routes:
            raise ApiError(f"no route {path}", 404)
        methods, handler = self.routes[path]
        if method not in methods:
            reply = Reply(405, ApiError(f"method {method} not allowed on {path}", 405).body())
            reply.headers["Allow"] = ", ".join(sorted(methods))
            return reply
        return handler(raw, cancelled)

    # --- running requests -----------------------------------------------------------------

    def precompile(self, requests: list[Request]) -> None:
        """Compiles the requests' grammars here, on the handler thread (cached for the engine, which
        would otherwise stall every running request while a large grammar compiles); 400 if one
        does not compile."""
        for request in requests:
            constraint = request.sampling.constraint
            if constraint is not None:
                from rlvr.rollout.grammar import compile_constraint

                try:
                    compile_constraint(*constraint, self.limits.tokenizer, self.limits.vocab_size)
                except ValueError as e:
                    raise ApiError(f"{constraint[0]}: {e}") from None

    def run(self, requests: list[Request], cancelled: Callable[[], bool] | None = None) -> list[Completion]:
        """Completions of `requests` in order; aborts them if the HTTP client goes away."""
        self.precompile(requests)
        try:
            futures = self.driver.submit_many(requests)
        except ValueError as e:
            raise ApiError(str(e)) from None
        except DriverClosedError as e:
            raise ApiError(str(e), 503) from None
        pending, deadline = set(futures), None
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in done):
                break
            if pending and deadline is None and cancelled is not None and cancelled():
                for request in requests:
                    self.driver.abort(request.rid)
                deadline = time.monotonic() + _CANCEL_GRACE_S
            if pending and deadline is not None and time.monotonic() > deadline:
                raise ApiError("client disconnected", 499, "ClientClosedRequest")
        errors = [f.exception() for f in futures if f.done() and f.exception() is not None]
        if errors:
            for request in requests:
                self.driver.abort(request.rid)
            raise self.error_of(errors[0])
        return [f.result() for f in futures]

    def stream(self, requests: list[Request]) -> Iterator[tuple[int, Completion]]:
        """(index, partial completion) as outputs grow; closing it aborts what is unfinished."""
        self.precompile(requests)
        try:
            return self.driver.stream_many(requests)
        except ValueError as e:
            raise ApiError(str(e)) from None
        except DriverClosedError as e:
            raise ApiError(str(e), 503) from None

    @staticmethod
    def error_of(error: BaseException) -> ApiError:
        """The HTTP error for an engine-side failure of a request."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, RequestRejected):
            return ApiError(f"request rejected by the engine: {error}")
        status = 503 if isinstance(error, DriverClosedError) else 500
        return ApiError(f"engine error: {type(error).__name__}: {error}", status)

    def label(self, version: int) -> str:
        """The weight-version label clients see (SGLang's labels are strings)."""
        return self.labels.get(version, str(version))

    def _version_of(self, label: str) -> int:
        """The engine's integer version for a label: the number itself, else the next version."""
        if label.isdigit():
            return int(label)
        known = [v for v, name in self.labels.items() if name == label]
        return known[0] if known else self.driver.weight_version + 1

    def _name(self, version: int, label: str | None) -> None:
        if label is not None:
            self.labels = {v: name for v, name in self.labels.items() if name != label and v != version}
            self.labels[version] = label

    def record(self, endpoint: str, body: Any, c: Completion, text: str | None, response_id: str | None = None,
               index: int = 0, start: float | None = None) -> None:
        """Hands the recorder `record_of(...)`: with the id a client gives feedback on (`response_id`,
        choice `index`), the served version's label and the latency since `start`."""
        if self.recorder is None:
            return
        try:
            self.recorder(record_of(endpoint, body, c, text, response_id, index, start, self.label(c.weight_version)))
        except Exception:
            logger.exception("recorder failed on %s", c.rid)

    def generate(self, raw: bytes, cancelled: Callable[[], bool]) -> Reply:
        body = parse_json(raw)
        gen = parse_generate(body, self.limits)
        start, tok = time.monotonic(), self.limits.tokenizer
        if gen.stream:
            return Reply(stream=self._stream(self.stream(gen.requests), gen, body, start))
        outs = []
        for c, opts in zip(self.run(gen.requests, cancelled), gen.options, strict=True):
            outs.append(generate_output(c, opts, tok, start, label=self.label))
            self.record("/generate", body, c, outs[-1]["text"], start=start)
        return Reply(200, outs if gen.batch else outs[0])

    def _stream(self, chunks: Iterator[tuple[int, Completion]], gen: Any, body: Any, start: float) -> Iterator[bytes]:
        """Cumulative SSE chunks (`index` in batch streams), then `data: [DONE]`."""
        try:
            for index, c in chunks:
                out = generate_output(c, gen.options[index], self.limits.tokenizer, start,
                                      index if gen.batch else None, label=self.label)
                if c.finish_reason is not None:
                    self.record("/generate", body, c, out["text"], start=start)
                yield _sse(out)
        except Exception as e:
            yield _sse(self.error_of(e).body())
        finally:
            chunks.close()  # type: ignore[attr-defined]  # aborts unfinished requests
        yield b"data: [DONE]\n\n"

    def openai(self, fn: Callable[..., Any]) -> Callable[[bytes, Callable[[], bool]], Reply]:
        """An OpenAI generation route: a JSON answer, or an SSE stream with stream=true."""
        def handler(raw: bytes, cancelled: Callable[[], bool]) -> Reply:
            reply = fn(self, parse_json(raw), cancelled)
            return Reply(200, reply) if isinstance(reply, dict) else Reply(stream=reply)
        return handler

    def tool(self, fn: Callable[[Any, Any], dict[str, Any]]) -> Callable[[bytes, Callable[[], bool]], Reply]:
        return lambda raw, cancelled: Reply(200, fn(self, parse_json(raw)))

    def model(self, name: str) -> Reply:
        """GET /v1/models/{id}: the model card, or an OpenAI-style 404 for another name."""
        name = urllib.parse.unquote(name)
        if name != self.model_name:
            return Reply(404, {"error": {"message": f"The model '{name}' does not exist", "type":
                                         "invalid_request_error", "param": "model", "code": "model_not_found"}})
        return Reply(200, server_openai.model_card(self))

    # --- control --------------------------------------------------------------------------

    def abort_request(self, raw: bytes, cancelled: Any) -> Reply:
        """Aborts `rid` (and the `rid_i` samples of an n>1 request), or everything with abort_all."""
        body = expect_object(parse_json(raw, allow_empty=True))
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            raise ApiError("rid must be a string")
        if check_bool("abort_all", body.get("abort_all", False)):
            self.driver.abort_all()
        elif rid:
            for live in self.driver.live_rids():
                if live == rid or live.startswith(rid + "_"):
                    self.driver.abort(live)
        return Reply(200)

    def pause_generation(self, raw: bytes, cancelled: Any) -> Reply:
        """mode "abort" (default) aborts running and queued requests; "retract" moves the running
        ones back to the queue, freeing their KV cache (recomputed on continue, so flush_cache
        works while paused); "in_place" freezes them with their KV cache kept (flush_cache fails)."""
        body = expect_object(parse_json(raw, allow_empty=True))
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise ApiError(f"mode must be 'abort', 'retract' or 'in_place', got {json.dumps(mode)[:40]}")
        count = self.driver.pause(mode)
        what = {"abort": "aborted", "retract": "retracted", "in_place": "paused in place"}[mode]
        return Reply(200, {"message": f"Generation paused ({mode}); {count} requests {what}.", "status": "ok"})

    def continue_generation(self, raw: bytes, cancelled: Any) -> Reply:
        expect_object(parse_json(raw, allow_empty=True))
        self.driver.resume()
        return Reply(200, {"message": "Generation continued.", "status": "ok"})

    def flush_cache(self, raw: bytes, cancelled: Any) -> Reply:
        """Drops the prefix cache when no request holds KV (queued ones may wait: while paused,
        retracted requests recompute theirs), else 400, as SGLang."""
        try:
            self.driver.flush_cache()
        except RuntimeError as e:
            raise ApiError(f"Cache not flushed: {e}") from None
        return Reply(200, "Cache flushed.\n")

    def _memory_tags(self, raw: bytes) -> list[str]:
        body = expect_object(parse_json(raw, allow_empty=True))
        tags = body.get("tags")
        if tags is None or tags == []:
            return list(MEMORY_TAGS)
        if not isinstance(tags, list) or any(t not in MEMORY_TAGS for t in tags):
            raise ApiError(f"tags must be null or a list of {list(MEMORY_TAGS)}, got {json.dumps(tags)[:80]}")
        return list(tags)

    def release_memory(self, raw: bytes, cancelled: Any) -> Reply:
        """Frees device memory by tag: "kv_cache" (the KV pool, flushing the prefix cache), "weights"
        (kept on the host). Needs an idle engine (queued requests may wait while paused); requests
        sent meanwhile wait until everything is resumed."""
        return self._memory("release", self.driver.release_memory, raw)

    def resume_memory(self, raw: bytes, cancelled: Any) -> Reply:
        """Re-allocates what `release_memory` freed (the KV pool empty, the weights as they were)."""
        return self._memory("resume", self.driver.resume_memory, raw)

    def _memory(self, verb: str, fn: Callable[[list[str]], None], raw: bytes) -> Reply:
        tags = self._memory_tags(raw)
        try:
            fn(tags)
        except (RuntimeError, ValueError) as e:
            raise ApiError(f"{verb}_memory_occupation: {e}") from None
        return Reply(200, {"success": True, "message": f"{verb}d {tags}"})

    def update_weights_from_disk(self, raw: bytes, cancelled: Any) -> Reply:
        """Loads an HF safetensors dir (rlvr.models.hf.export_hf_checkpoint) as `weight_version`
        (default: current + 1). With flush_cache, the prefix cache is dropped if nothing runs."""
        body = expect_object(parse_json(raw))
        path = check_str("model_path", body.get("model_path"))
        label = body.get("weight_version")
        label = None if label is None else _label("weight_version", label)
        version = self.driver.weight_version + 1 if label is None else self._version_of(label)
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise ApiError("load_format must be 'auto' or 'safetensors'")
        load = self.driver.load()
        paused = load["num_running_reqs"] + load["num_waiting_reqs"]
        if check_bool("abort_all_requests", body.get("abort_all_requests", False)):
            self.driver.abort_all()
        try:
            self.driver.update_weights_from_disk(path, version)
        except Exception as e:
            message = f"Failed to update weights: {type(e).__name__}: {e}"
            return Reply(400, {"success": False, "message": message, "num_paused_requests": 0})
        self._name(version, label)
        message = "Succeeded to update model weights."
        if check_bool("flush_cache", body.get("flush_cache", True)):
            try:
                self.driver.flush_cache()
            except RuntimeError:
                message += " The prefix cache was not flushed: requests are still running."
        return Reply(200, {"success": True, "message": message, "num_paused_requests": paused})

    def update_weight_version(self, raw: bytes, cancelled: Any) -> Reply:
        body = expect_object(parse_json(raw))
        label = _label("new_version", body.get("new_version"))
        version = self._version_of(label)
        if check_bool("abort_all_requests", body.get("abort_all_requests", True)):
            self.driver.abort_all()
        try:
            self.driver.set_weight_version(version)
        except Exception as e:
            return Reply(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
        self._name(version, label)
        return Reply(200, {"success": True, "message": f"weight version set to {label}", "new_version": label})

    # --- status ---------------------------------------------------------------------------

    def health(self, raw: bytes, cancelled: Any) -> Reply:
        return Reply(200 if self.driver.alive else 503)

    def health_generate(self, raw: bytes, cancelled: Any) -> Reply:
        """A 1-token greedy generation from input_ids=[0]; skipped (200) while paused or while
        running requests make progress, as SGLang skips it on a busy server."""
        if not self.driver.alive:
            return Reply(503)
        load = self.driver.load()
        busy = load["num_running_reqs"] > 0 and time.monotonic() - self.driver.last_progress < HEALTH_TIMEOUT_S
        if self.driver.paused or busy:
            return Reply(200)
        request = Request(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], SamplingParams(max_new_tokens=1, temperature=0.0))
        try:
            self.driver.submit(request).result(HEALTH_TIMEOUT_S)
        except Exception:
            self.driver.abort(request.rid)
            return Reply(503)
        return Reply(200)

    def model_info(self, raw: bytes, cancelled: Any) -> Reply:
        info = {k: v for k, v in self.driver.model_info().items() if k != "server_args"}  # /server_info's
        return Reply(200, {**info, "model_path": self.model_path, "served_model_name": self.model_name,
                           "tokenizer_path": info.get("tokenizer_path", self.model_path), "is_generation": True,
                           "preferred_sampling_params": None, "weight_version": self.label(self.driver.weight_version),
                           "has_tokenizer": self.limits.tokenizer is not None})

    def server_info(self, raw: bytes, cancelled: Any) -> Reply:
        state = {**self.driver.load(), "weight_version": self.label(self.driver.weight_version),
                 "paused": self.driver.paused, "engine_metrics": self.driver.metrics()}
        args = self.driver.model_info().get("server_args", {})  # the engine's sizes, as SGLang names them
        return Reply(200, {**args, "host": self.address[0], "port": self.address[1], "model_path": self.model_path,
                           "served_model_name": self.model_name, "context_length": self.limits.context_length,
                           "vocab_size": self.limits.vocab_size, "engine": "rlvr", "version": "rlvr-0.1.0",
                           "startup_time": self.start_time, "internal_states": [state]})

    def loads(self, raw: bytes, cancelled: Any) -> Reply:
        load = self.driver.load()
        return Reply(200, {"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1,
                           "loads": [{"dp_rank": 0, **load}], **load})

    def get_load(self, raw: bytes, cancelled: Any) -> Reply:
        """The older per-DP-rank list (sglang-jax still serves it)."""
        load = self.driver.load()
        return Reply(200, [{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                            **load}])


def serve(driver: EngineDriver, host: str = "127.0.0.1", port: int = 0, recorder: Recorder | None = None,
          served_model_name: str | None = None, routes: dict[str, tuple[set[str], Callable[..., Reply]]] | None = None,
          ) -> tuple[RolloutHTTPServer, threading.Thread]:
    """Starts the HTTP server on a daemon thread; `server.url` is its address (port 0 = any free).
    `routes` adds handlers `(raw body, cancelled) -> Reply` by path, with their methods."""
    app = RolloutApp(driver, recorder, served_model_name, routes)
    server = RolloutHTTPServer((host, port), app)
    app.address = server.server_address[:2]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name=f"rlvr-http-{app.address[1]}", daemon=True)
    thread.start()
    return server, thread


def jsonl_recorder(path: str) -> Recorder:
    """A recorder appending each record to `path` as one JSON line, with one `write` on an O_APPEND file:
    concurrent handler threads never interleave lines, and a process killed mid-way leaves every line it
    finished (the last one may be cut short)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(entry: dict[str, Any]) -> None:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    return record


def _both(first: Recorder | None, second: Recorder) -> Recorder:
    if first is None:
        return second

    def record(entry: dict[str, Any]) -> None:
        first(entry)
        second(entry)
    return record


def build_engine(hf_dir: str, options: dict[str, Any], tp_size: int = 1) -> Any:
    """Engine(cfg, params, tokenizer) from a Hugging Face checkpoint directory; `tp_size` > 1 reads
    the weights sharded over that many devices' `tensor` mesh axis (tensor parallelism: heads, MLP
    and vocabulary split; the engine's calls run on that mesh)."""
    import jax

    from rlvr import sharding
    from rlvr.models.hf import load_hf_checkpoint
    from rlvr.models.tokenizer import Tokenizer
    from rlvr.rollout.engine import Engine
    from rlvr.rollout.replicas import build_engine as engine_for

    if tp_size > len(jax.devices()):
        raise SystemExit(f"--tp-size {tp_size}: only {len(jax.devices())} {jax.default_backend()} devices here; "
                         f"use at most that many")
    cfg, params = load_hf_checkpoint(hf_dir, sharding.make_mesh({"tensor": tp_size}, devices=jax.devices()[:tp_size]))
    has_tok = os.path.exists(os.path.join(hf_dir, "tokenizer.json"))
    if "model_path" in inspect.signature(Engine).parameters:
        options.setdefault("model_path", hf_dir)
    return engine_for(cfg, params, Tokenizer.from_dir(hf_dir) if has_tok else None, **options)


# SGLang's launch_server flags without an effect here, and why: accepted (and logged) so that a
# `python -m sglang.launch_server ...` command line runs unchanged against the embedded engine
SGLANG_NO_OP_FLAGS = {
    "--trust-remote-code": "no checkpoint code is ever run (the architectures are rlvr's own)",
    "--skip-server-warmup": "the server compiles on first use",
    "--enable-memory-saver": "/release_memory_occupation works without it",
    "--mem-fraction-static": "the KV pool is sized by --max-total-tokens, or --max-running-requests x --context-length",
    "--log-level": "the server logs at INFO",
}
SGLANG_SWITCHES = ("--trust-remote-code", "--skip-server-warmup", "--enable-memory-saver")  # take no value


def add_sglang_flags(parser: argparse.ArgumentParser) -> None:
    """SGLang's launch_server flags that map onto the engine (see `engine_options`), under its names."""
    group = parser.add_argument_group("SGLang launch flags", "mapped onto the engine's keywords")
    group.add_argument("--max-running-requests", type=int, help="-> max_slots: sequences decoded at once")
    group.add_argument("--context-length", type=int,
                       help="-> max_len: prompt + output tokens a request can hold (rounded up to a whole page)")
    group.add_argument("--page-size", type=int, help="-> page_size: tokens a KV page holds")
    group.add_argument("--max-total-tokens", type=int, help="-> num_pages: the KV pool's size in tokens")
    group.add_argument("--chunked-prefill-size", type=int,
                       help="-> prefill_chunk: prompt tokens a row prefills per call; -1: its whole context")
    group.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                       help="-> dtype of the rollout weights (auto: the engine's float32)")
    group.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16", "bf16"), help="-> kv_dtype (auto: --dtype)")
    group.add_argument("--random-seed", type=int, help="-> seed")
    group.add_argument("--dp-size", "--data-parallel-size", "--dp", dest="dp_size", type=int,
                       help="-> replicas: engines sharing --max-running-requests, stepped at once")
    group.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=int, default=1,
                       help="the weights sharded over this many devices (the mesh's tensor axis)")
    group.add_argument("--disable-radix-cache", action="store_true", help="-> prefix_cache=False")
    group.add_argument("--schedule-policy", choices=("fcfs", "lof", "batch_lof"), help="-> schedule_policy")
    group.add_argument("--attention-backend", help="-> decode_attention for the engine's own names (auto, window, "
                       "ragged, native); SGLang's GPU backends (flashinfer, triton, fa3, ...) are logged and left "
                       "to 'auto'")
    for flag, why in SGLANG_NO_OP_FLAGS.items():
        group.add_argument(flag, **({"action": "store_true"} if flag in SGLANG_SWITCHES else {}),
                           help=f"no effect: {why}")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine keywords from `--engine_option KEY=JSON` (any Engine keyword) and the SGLang flags; a
    keyword set both ways is an error that names both."""
    options = {}
    for item in args.engine_option:
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    from rlvr.rollout.engine import DECODE_ATTENTION, Engine

    defaults = {name: p.default for name, p in inspect.signature(Engine).parameters.items()}
    page_size = args.page_size or options.get("page_size", defaults["page_size"])
    pages = lambda tokens: -(-tokens // page_size)  # noqa: E731  (whole pages holding `tokens`)
    max_len = None if args.context_length is None else pages(args.context_length) * page_size
    chunk = args.chunked_prefill_size
    if chunk == -1:  # SGLang's "no chunking": a row's whole context per call
        chunk = max_len or options.get("max_len", defaults["max_len"])
    from_flags = {
        "max_slots": args.max_running_requests, "max_len": max_len, "page_size": args.page_size,
        "num_pages": None if args.max_total_tokens is None else pages(args.max_total_tokens) + 1,  # + page 0
        "prefill_chunk": chunk, "dtype": None if args.dtype == "auto" else args.dtype,
        "kv_dtype": {"auto": None, "bf16": "bfloat16"}.get(args.kv_cache_dtype, args.kv_cache_dtype),
        "seed": args.random_seed, "replicas": args.dp_size, "schedule_policy": args.schedule_policy,
        "prefix_cache": False if args.disable_radix_cache else None,
    }
    for key, value in from_flags.items():
        if value is not None:
            if key in options:
                raise SystemExit(f"--engine_option {key}=... and an SGLang flag both set the engine's {key}: keep one")
            options[key] = value
    for flag, why in SGLANG_NO_OP_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            logger.info("%s has no effect on the rlvr engine: %s", flag, why)
    backend = args.attention_backend
    if backend in DECODE_ATTENTION:
        if "decode_attention" in options:
            raise SystemExit("--engine_option decode_attention=... and --attention-backend both set the engine's "
                             "decode attention: keep one")
        options["decode_attention"] = backend
    elif backend is not None:
        logger.info("--attention-backend %s is an SGLang GPU kernel; the rlvr engine picks its own ('auto': one of "
                    "%s)", backend, ", ".join(DECODE_ATTENTION[1:]))
    return options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's command line: its own flags, SGLang's launch flags (`add_sglang_flags`)."""
    parser = argparse.ArgumentParser(description="SGLang-compatible server over the rlvr JAX engine.")
    parser.add_argument("--hf_dir", "--model-path", dest="hf_dir", required=True, help="HF checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--served_model_name", "--served-model-name", default=None)
    parser.add_argument("--engine_option", action="append", default=[], metavar="KEY=JSON",
                        help="any rlvr.rollout.engine.Engine keyword, e.g. --engine_option decode_steps=16")
    parser.add_argument("--request_log", default=None, metavar="FILE",
                        help="append every finished request's record (rid, ids, logprobs, ...) to FILE as JSON lines")
    parser.add_argument("--traffic_dir", default=None, metavar="DIR",
                        help="capture traffic and POST /v1/feedback to DIR for the flywheel (rlvr.flywheel.capture): "
                             "append-only, fsynced, partitioned JSONL")
    add_sglang_flags(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    driver = EngineDriver(build_engine(args.hf_dir, engine_options(args), args.tp_size))
    recorder = jsonl_recorder(args.request_log) if args.request_log else None
    routes = None
    if args.traffic_dir:
        from rlvr.flywheel.capture import TrafficCapture

        capture = TrafficCapture(args.traffic_dir)
        recorder, routes = _both(recorder, capture.record), capture.routes()
    server, thread = serve(driver, args.host, args.port, recorder=recorder, served_model_name=args.served_model_name,
                           routes=routes)
    logger.info("serving %s on %s", args.hf_dir, server.url)
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        driver.close()


if __name__ == "__main__":
    main()
