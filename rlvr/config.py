"""Every config key of an experiment: its type, value (and default when different) and meaning.

    python -m rlvr.config configs/quickstart.py[:arg]        # that config's keys
    python -m rlvr.config                                    # the schema's defaults
    python -m rlvr.config configs/quickstart.py --grep=budget

Generated from the schema itself: the keys and types are those of the loaded ConfigDict, the
meanings are the comments beside each key in `rlvr/config_lib.py` (`base_config`, `rl_config`) and
beside each field of `rlvr.models.config.ModelConfig`. A key without a comment there is listed as
undocumented (and a test fails), so the listing cannot drift from the schema.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import sys
import tokenize
from typing import Any

import ml_collections

from rlvr.sandbox import pyast

PRESET_DOC = ("a named architecture (rlvr.models.config.PRESETS) for random init; model.* fields left unset come "
              "from the checkpoint the job starts from, else this preset, else ModelConfig's defaults")


def _comments(source: str) -> dict[int, str]:
    """{line number: comment text} of a module's source."""
    out = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            out[token.start[0]] = token.string.lstrip("#").strip()
    return out


def _doc_at(line: int, comments: dict[int, str], lines: list[str]) -> str:
    """The comment on `line`, else the comment lines right above it."""
    if line in comments and not lines[line - 1].lstrip().startswith("#"):
        return comments[line]
    above, n = [], line - 1
    while n in comments and lines[n - 1].lstrip().startswith("#"):
        above.insert(0, comments[n])
        n -= 1
    return " ".join(above)


def _dict_docs(node: ast.Dict, prefix: str, comments, lines, out: dict[str, str]) -> None:
    for key, value in zip(node.keys, node.values, strict=True):
        if not isinstance(key, ast.Constant):
            continue
        path = f"{prefix}{key.value}"
        inner = _config_dict_literal(value)
        if inner is not None:
            _dict_docs(inner, f"{path}.", comments, lines, out)
        out[path] = _doc_at(key.lineno, comments, lines)


def _config_dict_literal(node: ast.AST) -> ast.Dict | None:
    """The dict literal of `ml_collections.ConfigDict({...})`, else None."""
    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "ConfigDict" and node.args \
            and isinstance(node.args[0], ast.Dict):
        return node.args[0]
    return None


@functools.lru_cache(maxsize=1)
def key_docs() -> dict[str, str]:
    """{dotted key: meaning} from the schema's source comments (see the module docstring)."""
    from rlvr import config_lib
    from rlvr.models import config as model_config

    source = inspect.getsource(config_lib)
    comments, lines = _comments(source), source.splitlines()
    out: dict[str, str] = {}
    for fn in pyast.parse(source).body:
        if not isinstance(fn, ast.FunctionDef) or fn.name not in ("base_config", "rl_config"):
            continue
        for node in ast.walk(fn):
            if fn.name == "rl_config" and isinstance(node, ast.Return) and _config_dict_literal(node.value):
                _dict_docs(_config_dict_literal(node.value), "rl.", comments, lines, out)
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
                name = node.targets[0].attr
                literal = _config_dict_literal(node.value)
                if literal is not None:
                    _dict_docs(literal, f"{name}.", comments, lines, out)
                out.setdefault(name, _doc_at(node.lineno, comments, lines))
    model_source = inspect.getsource(model_config.ModelConfig)
    model_comments, model_lines = _comments(model_source), model_source.splitlines()
    for node in pyast.parse(model_source).body[0].body:
        if isinstance(node, ast.AnnAssign) and node.target.id != "lora":  # the `lora.*` section's
            out[f"model.{node.target.id}"] = _doc_at(node.lineno, model_comments, model_lines)
    out["model.preset"] = PRESET_DOC
    return out


def _leaves(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, value, type name) of every leaf, in key order."""
    out = []
    for key in sorted(config.keys()):
        value = config[key]
        if isinstance(value, ml_collections.ConfigDict):
            out += _leaves(value, f"{prefix}{key}.")
            continue
        field = config._fields[key]  # a FieldReference keeps a placeholder's declared type
        kind = field.get_type() if isinstance(field, ml_collections.FieldReference) else type(value)
        out.append((f"{prefix}{key}", value, getattr(kind, "__name__", str(kind))))
    return out


def describe(config: ml_collections.ConfigDict, pattern: str = "") -> list[dict[str, Any]]:
    """One row per key: {"key", "type", "value", "default", "meaning"} (default: the schema's)."""
    from rlvr import config_lib

    defaults = {k: v for k, v, _ in _leaves(config_lib.base_config())}
    docs = key_docs()
    rows = []
    for key, value, kind in _leaves(config):
        row = {"key": key, "type": kind, "value": value, "default": defaults.get(key, value),
               "meaning": docs.get(key) or _group_doc(key, docs) or "(undocumented)"}
        if pattern.lower() in f"{key} {row['meaning']}".lower():
            rows.append(row)
    return rows


def _group_doc(key: str, docs: dict[str, str]) -> str:
    """Keys inside an open group (e.g. rl.agent_options.*) take the group's meaning."""
    parent = key.rpartition(".")[0]
    return docs.get(parent, "") if parent else ""


def format_rows(rows: list[dict[str, Any]]) -> str:
    width = max((len(r["key"]) for r in rows), default=0)
    lines = []
    for r in rows:
        value = "unset" if r["value"] is None else repr(r["value"])
        default = "" if r["value"] == r["default"] else \
            f" [default {'unset' if r['default'] is None else repr(r['default'])}]"
        lines.append(f"{r['key']:<{width}}  {r['type']:<5}  {value}{default}  # {r['meaning']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rlvr import config_lib

    parser = argparse.ArgumentParser(prog="python -m rlvr.config", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="", help="configs/NAME.py[:arg] (default: the schema's defaults)")
    parser.add_argument("--grep", default="", help="Only keys whose name or meaning contains this text.")
    args = parser.parse_args(argv)
    try:
        config = config_lib.load_config(args.config) if args.config else config_lib.base_config()
    except (config_lib.ConfigError, ValueError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    print(format_rows(describe(config, args.grep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
