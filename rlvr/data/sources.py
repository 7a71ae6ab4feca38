"""Random-access record sources: JSONL files and TFDS data sources (no TensorFlow)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import ml_collections


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """All records of a JSONL file; a bad line is reported with its number."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({e.msg}).") from None
    if not rows:
        raise ValueError(f"{path}: no records.")
    return rows


class _TfdsRecords:
    """Decodes bytes fields of a tfds data source into str (JSON strings into objects)."""

    def __init__(self, source, json_fields: Sequence[str]):
        self.source, self.json_fields = source, tuple(json_fields)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, Any]:
        record = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in dict(self.source[i]).items()}
        for field in self.json_fields:
            if field in record:
                record[field] = json.loads(record[field])
        return record


def tfds_source(name: str, split: str, data_dir: str | None, json_fields: Sequence[str] = ("messages",)):
    """`tfds.data_source(...)` (ArrayRecord, random access, no TensorFlow needed)."""
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise ImportError("data.source='tfds' needs the tfds extra: pip install -e '.[tfds]'") from None
    return _TfdsRecords(tfds.data_source(name, split=split, data_dir=data_dir or None), json_fields)


def load_records(data: ml_collections.ConfigDict, split: str | None = None) -> Sequence[dict[str, Any]]:
    """The records named by `data.source` ('jsonl' or 'tfds') for `split` (default data.split)."""
    if data.source == "jsonl":
        path = data.path if split in (None, data.split) else data.eval_path
        return read_jsonl(path)
    if data.source == "tfds":
        return tfds_source(data.tfds_name, split or data.split, data.tfds_dir)
    raise ValueError(f"data.source={data.source!r} has no records to load")
