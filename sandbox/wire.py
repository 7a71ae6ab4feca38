"""Typed JSON: the only form in which values cross the sandbox boundary of a verdict.

    data = encode(value)       # JSON-ready lists, strings, booleans and null
    value = decode(data)       # a fresh value of builtin types only

Both directions of a host-judged verdict use it: the test's arguments go into the sandbox this way, the
candidate's return values come out this way, and the host (or the host-side test harness) only ever sees
the decoded plain values, so nothing the candidate defined (a class, an `__eq__`, a frame) reaches the
comparison. Types are kept exactly; each value is a JSON string, boolean or null, or a two-item tag list:

    None, True, False        null, true, false         (bool is never confused with int)
    str                      a JSON string
    int                      ["i", "-0x1f"]             hex text: any size (no digit limit), exact
    float                    ["f", "0x1.8p+1"]          float.hex: exact, also "inf", "-inf", "nan"
    complex                  ["c", [re, im]]            two float.hex texts
    bytes                    ["b", "00ff"]
    list, tuple              ["l", [...]], ["t", [...]]
    dict                     ["d", [[key, value], ...]]  (any hashable keys, insertion order kept)
    set, frozenset           ["s", [...]], ["z", [...]]

Encoding (in the sandbox, of the candidate's values): an instance of a subclass of one of these types is
sent as its base-type value (an `int` subclass as `int(v)`, a namedtuple as a tuple, a Counter as a dict),
and a NumPy scalar as its `.item()`: whatever the conversion runs, only plain data comes out, so an `int`
subclass whose `__eq__` always returns True arrives as the number it holds. Any other object raises
`WireError` ("unsupported"). Decoding is strict: a malformed item, an unknown tag, a bare JSON number,
an unhashable set element or key raises `WireError`. Both sides bound the nesting depth and the number of
values. Stdlib only and no package imports: this source also runs inside the sandbox (prepended to the
verdict driver) and in the host-side harness process.
"""

MAX_DEPTH = 64
MAX_VALUES = 200_000
_SEQUENCES = {list: "l", tuple: "t", set: "s", frozenset: "z"}
_BUILDERS = {"l": list, "t": tuple, "s": set, "z": frozenset}
_BASES = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


class WireError(ValueError):
    """A value that cannot be sent (unsupported type, too deep, too many values) or malformed data."""


def encode(value, max_values=MAX_VALUES):
    """JSON-ready typed data for `value` (see the module doc); WireError when it cannot be sent."""
    return _encode(value, 0, [max_values])


def _spend(depth, budget):
    """One more value at `depth`: WireError past the value budget or the depth limit."""
    budget[0] -= 1
    if budget[0] < 0:
        raise WireError("too many values")
    if depth > MAX_DEPTH:
        raise WireError("nested too deep")


def _encode(value, depth, budget):
    _spend(depth, budget)
    kind = type(value)
    if value is None or kind is bool or kind is str:
        return value
    if kind is int:
        return ["i", hex(value)]
    if kind is float:
        return ["f", value.hex()]
    if kind is complex:
        return ["c", [value.real.hex(), value.imag.hex()]]
    if kind is bytes:
        return ["b", value.hex()]
    if kind in _SEQUENCES:
        return [_SEQUENCES[kind], [_encode(v, depth + 1, budget) for v in value]]
    if kind is dict:
        return ["d", [[_encode(k, depth + 1, budget), _encode(v, depth + 1, budget)] for k, v in value.items()]]
    return _encode(_plain(value), depth + 1, budget)


def _plain(value):
    """The base-type value of a subclass instance (or a NumPy scalar's `.item()`); WireError for others.
    The real type decides (`issubclass(type(v), ...)`: a `__class__` property cannot claim a base)."""
    kind = type(value)
    try:
        for base in _BASES[1:]:
            if issubclass(kind, base):
                return base(value) if base in (int, float, complex, str, bytes, dict) else base(iter(value))
        if getattr(kind, "__module__", None) == "numpy" and hasattr(value, "item"):
            item = value.item()
            if item is None or type(item) in _BASES:
                return item
    except Exception as e:  # noqa: BLE001 - the candidate's conversion code failed: not sendable
        raise WireError(f"unsupported {getattr(kind, '__name__', '?')}: {type(e).__name__}") from None
    raise WireError(f"unsupported type {getattr(kind, '__name__', '?')}")


def decode(data, max_values=MAX_VALUES):
    """The value `encode` made `data` from, built of builtin types only; WireError when malformed."""
    try:
        return _decode(data, 0, [max_values])
    except (TypeError, ValueError, OverflowError) as e:  # unhashable keys, bad hex, ...
        if isinstance(e, WireError):
            raise
        raise WireError(f"malformed value: {e}") from None


def _decode(data, depth, budget):
    _spend(depth, budget)
    if data is None or type(data) is bool or type(data) is str:
        return data
    if type(data) is not list or len(data) != 2 or type(data[0]) is not str:
        raise WireError("malformed value")
    tag, body = data
    if tag in ("i", "f", "b"):
        if type(body) is not str:
            raise WireError("malformed value")
        return int(body, 16) if tag == "i" else float.fromhex(body) if tag == "f" else bytes.fromhex(body)
    if type(body) is not list:
        raise WireError("malformed value")
    if tag == "c" and len(body) == 2 and all(type(part) is str for part in body):
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    if tag in _BUILDERS:
        return _BUILDERS[tag](_decode(v, depth + 1, budget) for v in body)
    if tag == "d":
        if not all(type(pair) is list and len(pair) == 2 for pair in body):
            raise WireError("malformed value")
        return {_decode(k, depth + 1, budget): _decode(v, depth + 1, budget) for k, v in body}
    raise WireError(f"unknown tag {tag[:20]!r}")
