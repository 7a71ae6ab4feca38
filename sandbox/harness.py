"""The host-side test harness of a check-style verdict: the dataset's test code, run where the candidate
cannot reach it, against the candidate's return values as plain data.

Runs as its own process on the host (`python -I -S`, started and bounded by `checks.judge_check`:
rlimits set here first, a wall clock and a kill from the parent). It execs the trusted `prelude` (e.g.
HumanEval's prompt: helpers such as `poly` that the tests use come from here, never from the candidate)
and the `tests` (e.g. `def check(candidate): ...`), then calls `check(candidate)`, where `candidate` is a
`Candidate`: calling it does not run any candidate code here. Each call's arguments are encoded
(`wire.encode`) and answered from the transcript of calls the sandbox ran; the answers are decoded into
fresh builtin values, or raised as the builtin exception the candidate raised. Whatever the test then does
with them (`==`, `abs(a - b) < eps`, loops over computed cases) happens here, on plain values.

The sandbox runs calls in batches (checks.py drives `verdict.run_calls`: one sandbox run per batch, the
candidate loaded once, the calls made in order). To learn the calls a test makes without one sandbox
round trip per call, an attempt that reaches a call not in the transcript switches to *probing*: from
there on each call is recorded and returns a `Probe`, a stand-in that makes every comparison true, and
every `assert` of the test code (compiled with `probing_asserts`) stops failing, so the test goes on and
shows its next calls (computed arguments, loops over 100 random cases) until it ends, stops, or passes
the probe budget (calls, seconds). The recorded calls (the transcript's plus the new ones) go to the
sandbox as the next round, and the test is run again from the start (fresh namespace, the same random
seed) against the longer transcript. Probing never decides anything: only an attempt that replays the
transcript to the end without probing gives the verdict (the test returned: pass; it raised: fail). A
test whose arguments depend on earlier results (`candidate(candidate(x))`) takes one more round per
dependency; a nondeterministic test that diverges from its transcript probes again from there. Each
round re-runs every call in order in a fresh process, so the final transcript is one sandbox run's.

Protocol with the parent: frames of a 4-byte big-endian length and a `marshal` body, both ways (both ends
are trusted; marshal needs no import, and carries the tests precompiled by the parent with
`probing_asserts`, so this process imports neither `ast` nor `json`). In: `{"code": {"prelude", "tests"}
(code objects), "entry_point", "seed", "max_calls", "probe_s", "memory_bytes", "cpu_s"}`; out
`{"run": [call, ...]}` (every call of the next round, each `{"args", "kwargs"}` in wire form), in
`{"results": [entry, ...]}` (one per call: `{"value"}`, `{"raised"}`, `{"unsupported"}` or `{"error"}`),
... and finally out `{"verdict": {"passed", "reason", "calls", "mutated"}}`.
"""

import builtins
import marshal
import os
import random
import resource
import signal
import sys

if __package__:
    from . import wire
else:  # the harness process: this directory is on sys.path
    import wire


class StopProbe(BaseException):
    """Ends a probing attempt (probe budget spent, an argument built from a Probe); a BaseException so
    that the test's `except Exception` does not swallow it."""


class Fatal(BaseException):
    """The verdict fails whatever the test does with it (the candidate timed out; a test argument that
    cannot be sent)."""


class CandidateError(Exception):
    """The candidate raised a non-builtin exception, or returned a value that cannot be sent as data."""


class Probe:
    """The stand-in result of a call not run yet (probing only): equal to, and on the true side of, every
    comparison; arithmetic, indexing, attributes and calls give the probe back; it is truthy, empty and
    zero-valued. Only used to learn which calls a test makes; never part of a verdict."""

    def _same(self, *args, **kwargs):
        return self

    def _true(self, other):
        return True

    def _false(self, other):
        return False

    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = _true
    __ne__ = _false
    __call__ = __getitem__ = __getattr__ = __round__ = __neg__ = __pos__ = __abs__ = __invert__ = _same
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _same
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __divmod__ = __rdivmod__ = _same
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __lshift__ = __rshift__ = __matmul__ = _same

    def __bool__(self):
        return True

    def __len__(self):
        return 0

    def __iter__(self):
        return iter(())

    def __hash__(self):
        return 0

    def __int__(self):
        return 0

    __index__ = __int__

    def __float__(self):
        return 0.0

    def __complex__(self):
        return 0j

    def __str__(self):
        return ""

    def __repr__(self):
        return "Probe()"


def _exception(name):
    """The builtin exception class named `name` (CandidateError when it is not one)."""
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return CandidateError


class Candidate:
    """The function under test as the test code sees it (see the module doc): one attempt's view of the
    transcript [(call, result entry)], and the calls it has recorded while probing."""

    def __init__(self, transcript, max_calls, probe_s):
        self.transcript, self.max_calls, self.probe_s = transcript, max_calls, probe_s
        self.index = 0
        self.calls = None  # the calls of the next round once probing (None: replaying)

    def __call__(self, *args, **kwargs):
        try:
            call = {"args": wire.encode(args), "kwargs": wire.encode(kwargs)}
        except wire.WireError as e:
            if self.calls is not None:
                raise StopProbe from None  # an argument built from a Probe: learn its value first
            raise Fatal(f"test_argument:{e}") from None
        i, self.index = self.index, self.index + 1
        if self.calls is None and i < len(self.transcript) and self.transcript[i][0] == call:
            return self._answer(self.transcript[i][1])
        if self.calls is None:
            self.calls = [c for c, _ in self.transcript[:i]]
            signal.setitimer(signal.ITIMER_REAL, self.probe_s)
        if len(self.calls) >= self.max_calls:
            raise StopProbe
        self.calls.append(call)
        return Probe()

    @staticmethod
    def _answer(entry):
        if "value" in entry:
            try:
                return wire.decode(entry["value"])
            except wire.WireError:  # a forged line: fail, never an exception the test might expect
                raise Fatal("malformed_result") from None
        if "raised" in entry:
            raise _exception(str(entry["raised"]))(f"raised by the candidate ({entry['raised']})")
        if "unsupported" in entry:
            raise CandidateError(f"the candidate returned a value that is not data: {entry['unsupported']}")
        raise Fatal(str(entry.get("error", "bad_result")))

    def stop(self, signum, frame):
        """SIGALRM: the probing budget is spent."""
        if self.calls is not None:
            raise StopProbe


def probing_asserts(source, filename):
    """`source` compiled with each `assert test, msg` rewritten to keep its meaning while replaying and to
    let the test go on while probing (a false or raising test is skipped):

        try:
            _ok = bool(test)
        except Exception:
            if not __rlvr_probing__(): raise
            _ok = True
        if not _ok and not __rlvr_probing__(): raise AssertionError(msg)
    """
    import ast

    class AssertRewriter(ast.NodeTransformer):
        def visit_Assert(self, node):
            return rewrite_assert(ast, node)

    from . import pyast  # the parent's side only: the harness process itself never parses

    tree = AssertRewriter().visit(pyast.parse(source, filename))
    return pyast.compile_tree(ast.fix_missing_locations(tree), filename)


def rewrite_assert(ast, node):
    """The statements that replace one `assert` node (see `probing_asserts`)."""
    probing = ast.Call(ast.Name("__rlvr_probing__", ast.Load()), [], [])
    truth = ast.Call(ast.Name("bool", ast.Load()), [node.test], [])
    guarded = ast.Try(
        body=[ast.Assign([ast.Name("__rlvr_ok", ast.Store())], truth)],
        handlers=[ast.ExceptHandler(ast.Name("Exception", ast.Load()), None, [
            ast.If(ast.UnaryOp(ast.Not(), probing), [ast.Raise(None, None)], []),
            ast.Assign([ast.Name("__rlvr_ok", ast.Store())], ast.Constant(True))])],
        orelse=[], finalbody=[])
    error = ast.Call(ast.Name("AssertionError", ast.Load()), [node.msg] if node.msg else [], [])
    failed = ast.BoolOp(ast.And(), [ast.UnaryOp(ast.Not(), ast.Name("__rlvr_ok", ast.Load())),
                                    ast.UnaryOp(ast.Not(), probing)])
    return [ast.copy_location(guarded, node), ast.copy_location(ast.If(failed, [ast.Raise(error, None)], []), node)]


def attempt(code, entry_point, seed, candidate):
    """Run the prelude and tests once against `candidate`; None when the test returned, else the reason."""
    signal.signal(signal.SIGALRM, candidate.stop)
    random.seed(seed)  # the same unseeded `random` draws in every attempt; unknown to the candidate
    namespace = {"__name__": "__rlvr_tests__", "__builtins__": builtins,
                 "__rlvr_probing__": lambda: candidate.calls is not None}
    try:
        exec(code["prelude"], namespace)
        namespace[entry_point] = candidate  # tests that call the function by name call the candidate too
        exec(code["tests"], namespace)
        check = namespace.get("check")
        if callable(check):
            check(candidate)
        return None
    except (Exception, StopProbe, Fatal) as e:
        return f"{type(e).__name__}: {e}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def judge(setup, send, receive):
    """Attempts and rounds until an attempt replays without probing; returns the verdict."""
    code = setup["code"]
    transcript, mutated = [], 0
    while True:
        candidate = Candidate(transcript, setup["max_calls"], setup["probe_s"])
        failure = attempt(code, setup["entry_point"], setup["seed"], candidate)
        if candidate.calls is None:
            if not transcript:
                return {"passed": False, "reason": "no_calls: the tests never call the function", "calls": 0,
                        "mutated": 0}
            return {"passed": failure is None, "reason": failure or "passed", "calls": candidate.index,
                    "mutated": mutated}
        send({"run": candidate.calls})
        results = receive()["results"]
        transcript = list(zip(candidate.calls, results, strict=True))
        mutated = sum(bool(r.get("mutated")) for r in results)


def read_frame(stream):
    size = int.from_bytes(stream.read(4), "big")
    return marshal.loads(stream.read(size))


def write_frame(stream, message):
    body = marshal.dumps(message)
    stream.write(len(body).to_bytes(4, "big") + body)
    stream.flush()


def main():
    channel_in, channel_out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the test code's prints go to stderr
    setup = read_frame(channel_in)
    for limit, value in ((resource.RLIMIT_AS, setup["memory_bytes"]), (resource.RLIMIT_CPU, setup["cpu_s"]),
                         (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))
    verdict = judge(setup, lambda message: write_frame(channel_out, message), lambda: read_frame(channel_in))
    write_frame(channel_out, {"verdict": verdict})


if __name__ == "__main__":
    main()
