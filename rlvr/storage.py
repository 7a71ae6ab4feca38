"""One filesystem layer: local paths, `s3://`, `gs://` (any fsspec protocol) through the same calls.

Local paths use the operating system directly (atomic writes: a temporary file, fsync, rename). Remote
paths go through fsspec (`s3fs` for s3://, `gcsfs` for gs://: the `storage` extra installs s3fs); an
object store PUT is atomic per object, so a reader never sees half a file there either. An S3-compatible
server other than AWS is reached the standard way: `AWS_ENDPOINT_URL` (and the usual credentials
variables), read by botocore.

Directories are copied with `upload_dir` / `download_dir`, so a job that needs a local directory (the
engine loading an HF checkpoint, a trainer's workdir) can stage it: `staged(remote)` is that local copy
(`rlvr.main.run` runs a job whose --workdir is remote in one, and uploads it when the job ends), and
`local_copy(remote)` a read-only one of an input (a starting workdir, a data file).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)
CHUNK = 8 << 20  # bytes per read when a file is copied (`copy_file`)


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
    _write_local(path, lambda f: f.write(data))


def _write_local(path: str, fill: Callable[[BinaryIO], Any]) -> None:
    """Writes the local file `path` atomically: `fill(f)` writes a temporary file beside it, which is
    fsynced and renamed over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def copy_file(src: str, dest: str) -> None:
    """Copies the file `src` to `dest`, one of them local, in pieces (CHUNK bytes, or fsspec's `put_file`),
    never the whole file in memory: a checkpoint's shards may be larger than the host's RAM. Atomic as
    `write_bytes`: a local file is renamed into place, an object store commits a multipart upload
    only when it is complete (s3fs aborts it on an error)."""
    if is_remote(src) and is_remote(dest):
        raise ValueError(f"copy_file({src!r}, {dest!r}): one side must be local")
    if is_remote(dest):
        fs, p = _fs(dest)
        fs.put_file(src, p)
    else:
        fs, p = _fs(src) if is_remote(src) else (None, src)
        with (fs.open(p, "rb") if fs else open(p, "rb")) as reader:
            _write_local(dest, lambda f: shutil.copyfileobj(reader, f, CHUNK))


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
    """Copies the local directory tree `local` to `dest` (remote or local), file by file; files under
    checkpoints/ last, so the metadata a reader needs is there before any checkpoint it describes."""
    files = []
    for folder, _, names in os.walk(local):
        rel = os.path.relpath(folder, local)
        files += [([] if rel == "." else rel.split(os.sep)) + [name] for name in names]
    for parts in sorted(files, key=lambda parts: (parts[0] == "checkpoints", parts)):
        copy_file(os.path.join(local, *parts), join(dest, *parts))


def download_dir(src: str, local: str) -> str:
    """Copies the tree at `src` into the local directory `local`; returns `local`."""
    if not is_remote(src):
        shutil.copytree(src, local, dirs_exist_ok=True)
        return local
    fs, p = _fs(src)
    for path in fs.find(p):
        copy_file(fs.unstrip_protocol(path), os.path.join(local, *posixpath.relpath(path, p).split("/")))
    return local


def cache_dir(remote: str) -> str:
    """The local directory that stands for `remote` (stable across runs, so a rerun finds it)."""
    key = hashlib.sha256(remote.rstrip("/").encode()).hexdigest()[:16]
    base = os.environ.get("RLVR_STAGING_DIR") or os.path.join(tempfile.gettempdir(), "rlvr-staging")
    return os.path.join(base, key)


def local_copy(path: str) -> str:
    """`path` itself when local; else a local copy of the remote file or directory (fetched once per run)."""
    if not is_remote(path):
        return path
    fs, p = _fs(path)
    local = os.path.join(cache_dir(path), posixpath.basename(p.rstrip("/")))
    if fs.isdir(p):
        shutil.rmtree(local, ignore_errors=True)
        return download_dir(path, local)
    copy_file(path, local)
    return local


def checkpoint_step(workdir: str) -> int | None:
    """The newest checkpoint step under `workdir`/checkpoints (orbax's step directories), None if none."""
    return max((int(name) for name in listdir(join(workdir, "checkpoints")) if name.isdigit()), default=None)


@contextlib.contextmanager
def staged(remote: str) -> Iterator[str]:
    """A local working copy of the directory `remote`: fetched when this machine has none yet (a job
    resumed elsewhere starts from what was uploaded) or when the remote copy holds a newer checkpoint
    than this machine's (a later run elsewhere: its files replace the stale ones here, which would
    otherwise be resumed from and uploaded over it); uploaded back when the block ends, also on an
    error, by JAX process 0 only (every process stages the same directory). Files are uploaded one by
    one, checkpoints/ last, so a remote copy interrupted mid-upload still holds its earlier checkpoints
    whole."""
    import jax

    local = cache_dir(remote)
    if exists(remote):
        here, there = checkpoint_step(local), checkpoint_step(remote)
        if not os.path.isdir(local) or (there is not None and (here is None or there > here)):
            if os.path.isdir(local):
                logger.warning("%s: its checkpoint step %s is newer than this machine's copy's (%s, in %s); "
                               "fetching it", remote, there, here, local)
            download_dir(remote, local)
    os.makedirs(local, exist_ok=True)
    try:
        yield local
    finally:
        if jax.process_index() == 0:
            upload_dir(local, remote)
