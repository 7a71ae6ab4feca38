"""One filesystem layer: local paths, `s3://`, `gs://` (any fsspec protocol) through the same calls.

Local paths use the operating system directly (atomic writes: a temporary file, fsync, rename). Remote
paths go through fsspec (`s3fs` for s3://, `gcsfs` for gs://: the `storage` extra installs s3fs); an
object store PUT is atomic per object, so a reader never sees half a file there either. An S3-compatible
server other than AWS is reached the standard way: `AWS_ENDPOINT_URL` (and the usual credentials
variables), read by botocore.

Directories are copied with `upload_dir` / `download_dir`, so a job that needs a local directory (the
engine loading an HF checkpoint, a trainer's workdir) can stage it.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
from typing import Any


def is_remote(path: str) -> bool:
    return "://" in str(path) and not str(path).startswith("file://")


def _fs(path: str) -> tuple[Any, str]:
    import fsspec

    try:
        return fsspec.core.url_to_fs(path)
    except ImportError as e:
        raise ImportError(f"{path}: this protocol needs its fsspec backend ({e}); for s3:// install the "
                          "storage extra: pip install -e '.[storage]' (gs://: pip install gcsfs)") from None


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if is_remote(base) else os.path.join(base, *parts)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, p = _fs(path)
    return fs.exists(p)


def write_bytes(path: str, data: bytes) -> None:
    """Writes the whole file atomically (readers see the old file or the new one, never a part)."""
    if is_remote(path):
        fs, p = _fs(path)
        fs.pipe_file(p, data)
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def read_bytes(path: str) -> bytes:
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = _fs(path)
    return fs.cat_file(p)


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def listdir(path: str) -> list[str]:
    """Names (not paths) directly under `path`, sorted; [] when it does not exist."""
    if not is_remote(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    fs, p = _fs(path)
    if not fs.exists(p):
        return []
    return sorted(posixpath.basename(e.rstrip("/")) for e in fs.ls(p, detail=False))


def upload_dir(local: str, dest: str) -> None:
    """Copies the local directory tree `local` to `dest` (remote or local), file by file."""
    for folder, _, names in os.walk(local):
        rel = os.path.relpath(folder, local)
        for name in names:
            target = join(dest, *([] if rel == "." else rel.split(os.sep)), name)
            with open(os.path.join(folder, name), "rb") as f:
                write_bytes(target, f.read())


def download_dir(src: str, local: str) -> str:
    """Copies the tree at `src` into the local directory `local`; returns `local`."""
    if not is_remote(src):
        shutil.copytree(src, local, dirs_exist_ok=True)
        return local
    fs, p = _fs(src)
    for path in fs.find(p):
        target = os.path.join(local, *posixpath.relpath(path, p).split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as f:
            f.write(fs.cat_file(path))
    return local
