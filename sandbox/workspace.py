"""A private, size-capped host directory that becomes the sandbox's `/workspace`.

As root the directory is a fresh tmpfs (size and inode caps: a bind mount has no total quota, so a disk or
inode fill stops at the cap instead of filling the host disk). Without root it is a plain temp directory
(RLIMIT_FSIZE still caps each file). The digest covers names, types, modes and contents, read without
following links, so the trace shows exactly what a run changed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping

from .types import SandboxError

SANDBOX_UID = 1000
_DIGEST_CAP = 64 << 20  # bytes hashed at most (the tmpfs cap is below this by default)


def _is_root() -> bool:
    return os.geteuid() == 0


def check_relative(path: str) -> str:
    """A normalised relative path inside the workspace; ValueError for absolute paths or `..` escapes."""
    norm = os.path.normpath(path)
    if os.path.isabs(norm) or norm == ".." or norm.startswith("../") or norm in ("", "."):
        raise ValueError(f"workspace file {path!r}: give a relative path inside the workspace")
    return norm


MOUNTED_HERE: set[str] = set()  # every workspace tmpfs this process mounted (leak checks look for these)


class Workspace:
    """A fresh workspace directory; `close()` unmounts and removes it (idempotent)."""

    def __init__(self, size_bytes: int, inodes: int, owner_uid: int = SANDBOX_UID, parent: str | None = None):
        self.root = tempfile.mkdtemp(prefix="rlvr-ws-", dir=parent)
        os.chmod(self.root, 0o711)  # traversable by the sandbox uid (local backends), not listable
        self.path = os.path.join(self.root, "w")
        os.mkdir(self.path, 0o755)
        self.mounted = False
        self.owner_uid = owner_uid if _is_root() else os.geteuid()
        if _is_root():
            self._mount(size_bytes, inodes)
        self._own(self.path)

    def _own(self, path: str) -> None:
        """Give a path to the sandbox user (as root), so the program can change its own workspace."""
        if _is_root():
            os.chown(path, self.owner_uid, self.owner_uid, follow_symlinks=False)

    def _mount(self, size_bytes: int, inodes: int) -> None:
        # nosuid,nodev: nothing the sandbox leaves here can raise privileges on the host. Not noexec: gVisor
        # maps binaries through the host file, so noexec would break programs a task compiles and runs.
        options = f"size={size_bytes},nr_inodes={inodes},mode=0755,nosuid,nodev"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "rlvr-ws", self.path],
                              capture_output=True, timeout=10)
        if done.returncode != 0:
            raise SandboxError(f"cannot mount the workspace tmpfs: {done.stderr.decode(errors='replace')}")
        self.mounted = True
        MOUNTED_HERE.add(self.path)

    def write(self, files: Mapping[str, bytes | str]) -> None:
        """Write each file (relative path -> bytes or text), creating directories, owned by the sandbox user."""
        for name, content in files.items():
            rel = check_relative(name)
            target = os.path.join(self.path, rel)
            self._makedirs(os.path.dirname(target))
            data = content.encode() if isinstance(content, str) else bytes(content)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self._own(target)

    def _makedirs(self, directory: str) -> None:
        missing = []
        while not os.path.isdir(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        for d in reversed(missing):
            os.mkdir(d, 0o755)
            self._own(d)

    def digest(self) -> str:
        """sha256 over (path, type, mode, size, content) of every entry, links not followed."""
        return tree_digest(self.path)

    def free_fraction(self) -> tuple[float, float]:
        """(free bytes, free inodes) as fractions of the workspace's caps (1.0 when not a tmpfs)."""
        if not self.mounted:
            return 1.0, 1.0
        st = os.statvfs(self.path)
        return st.f_bavail / max(st.f_blocks, 1), st.f_favail / max(st.f_files, 1)

    def close(self) -> None:
        """Unmount (lazily, if still busy) and delete the directory."""
        if self.mounted:
            done = subprocess.run(["umount", self.path], capture_output=True, timeout=10)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", self.path], capture_output=True, timeout=10)
            self.mounted = False
        shutil.rmtree(self.root, ignore_errors=True)


def tree_digest(top: str) -> str:
    """A sha256 of a directory tree: relative path, file type, permission bits, size, content (capped)."""
    h = hashlib.sha256()
    budget = _DIGEST_CAP
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            h.update(f"{os.path.relpath(full, top)}\0{stat.S_IFMT(st.st_mode)}\0{st.st_mode & 0o7777}\0"
                     f"{st.st_size}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(full).encode(errors="replace"))
            elif stat.S_ISREG(st.st_mode) and budget > 0:
                budget -= _hash_file(h, full, budget)
    return h.hexdigest()


def _hash_file(h: hashlib._Hash, path: str, budget: int) -> int:
    """Feed up to `budget` bytes of a regular file (opened without following links); bytes read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return 0
    read = 0
    with os.fdopen(fd, "rb") as f:
        while read < budget and (chunk := f.read(min(1 << 20, budget - read))):
            h.update(chunk)
            read += len(chunk)
    return read
