"""A private, size-capped host directory that becomes the sandbox's `/workspace`.

As root the directory is a fresh tmpfs (size and inode caps: a bind mount has no total quota, so a disk or
inode fill stops at the cap instead of filling the host disk). Without root it is a plain temp directory
(RLIMIT_FSIZE still caps each file). The digest covers names, types, modes and contents, read without
following links, so the trace shows exactly what a run changed.

Templates (`Template`, `Workspace(template=...)`): a workspace can start as a template's contents without a
copy per call. As root the workspace is an overlayfs mount: the template's prepared layer is the read-only
lower dir, and the upper and work dirs live in the per-call size-capped tmpfs, so every write, delete, chmod
or rename lands in that tmpfs and is discarded with it (mount + umount ~ a few ms: the reset). overlayfs never
writes to a lower dir, and the layer is not the caller's directory anyway: `Template` copies the source
once into a private layer owned by the sandbox uid. That one copy is what lets the program edit, delete
and chmod template files (copy-up keeps the owner; the source is usually root's, which uid 1000 could only
read); later calls pay only the overlay mount. Limits: overlay needs root (without root `Workspace` falls
back to a full copy of the layer per call: correct, just not cheap), the template takes only regular
files, directories and symlinks (no devices or FIFOs), and renaming a template *directory* relies on
overlayfs `redirect_dir=on`.

Host-side file access (`write`, `read_file`) walks the path one component at a time with O_NOFOLLOW, so
symlinks a program left in the workspace (e.g. `d -> /etc`) cannot redirect the host's own writes or reads.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
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


MOUNTED_HERE: set[str] = set()  # every workspace tmpfs/overlay this process ever mounted (leak checks: none left)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class Template:
    """A template directory prepared once as a read-only layer for overlay workspaces (see the module doc).

    The source is copied once (regular files, directories, symlinks; modes kept) into a private directory
    whose entries belong to `owner_uid`; `digest` is the tree digest of that layer, equal to the source's.
    The source itself is never written. `close()` removes the layer (only when no workspace uses it)."""

    def __init__(self, source: str, owner_uid: int = SANDBOX_UID, parent: str | None = None):
        self.source = os.path.realpath(source)
        if not os.path.isdir(self.source):
            raise ValueError(f"template {source!r} is not a directory")
        self.owner_uid = owner_uid if _is_root() else os.geteuid()
        self.root = tempfile.mkdtemp(prefix="rlvr-tpl-", dir=parent)
        os.chmod(self.root, 0o711)
        self.path = os.path.join(self.root, "t")
        try:
            shutil.copytree(self.source, self.path, symlinks=True, copy_function=_copy_regular)
            if _is_root():
                for dirpath, dirnames, filenames in os.walk(self.path):
                    for name in [*dirnames, *filenames, ""]:
                        os.chown(os.path.join(dirpath, name), self.owner_uid, self.owner_uid,
                                 follow_symlinks=False)
            self.hashes: dict[tuple, bytes] = {}  # content hashes of the layer's files (see tree_digest)
            self.digest = tree_digest(self.path, learn=self.hashes)
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _copy_regular(src: str, dst: str) -> None:
    if not stat.S_ISREG(os.lstat(src).st_mode):
        raise ValueError(f"template entry {src!r} is not a regular file, directory or symlink")
    shutil.copy2(src, dst, follow_symlinks=False)


_templates: dict[tuple[str, int], tuple[tuple, Template]] = {}
_retired_templates: list[Template] = []
_templates_lock = threading.Lock()


def template_for(source: str | Template, owner_uid: int, parent: str | None = None) -> Template:
    """A prepared Template for a directory, cached per (path, owner) and re-prepared when any entry's
    name, mode, size, mtime or ctime changed (an lstat walk, no content read). A superseded layer is kept until
    `close_templates()` (a workspace mounted on it may still be in use)."""
    if isinstance(source, Template):
        return source
    key = (os.path.realpath(source), owner_uid)
    signature = _stat_signature(key[0])
    with _templates_lock:
        cached = _templates.get(key)
        if cached is not None and cached[0] == signature:
            return cached[1]
        template = Template(key[0], owner_uid, parent)
        if cached is not None:
            _retired_templates.append(cached[1])
        _templates[key] = (signature, template)
        return template


def close_templates() -> None:
    """Remove every cached template layer (call when no workspace is mounted on them; atexit does)."""
    with _templates_lock:
        for _, template in _templates.values():
            template.close()
        for template in _retired_templates:
            template.close()
        _templates.clear()
        _retired_templates.clear()


atexit.register(close_templates)  # registered before runsc's exit hook, so it runs after the reaper drained


def _stat_signature(top: str) -> tuple:
    entries = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            st = os.lstat(os.path.join(dirpath, name))
            entries.append((os.path.relpath(os.path.join(dirpath, name), top), st.st_mode, st.st_size,
                            st.st_mtime_ns, st.st_ctime_ns))
    return tuple(entries)


_copy_warned: list[bool] = []


def _warn_copy_once() -> None:
    if not _copy_warned:
        _copy_warned.append(True)
        warnings.warn("sandbox workspace templates need root for overlayfs: without it each workspace is a full "
                      "copy of the template (correct, but the reset costs a copy, not a mount)", RuntimeWarning,
                      stacklevel=4)


class Workspace:
    """A fresh workspace directory; `close()` unmounts and removes it (idempotent).

    With `template`, it starts as the template's contents: an overlay over the template's layer with the
    upper dir in this workspace's tmpfs (root), or a copy of the layer (not root: see the module doc)."""

    def __init__(self, size_bytes: int, inodes: int, owner_uid: int = SANDBOX_UID, parent: str | None = None,
                 template: Template | None = None):
        self.root = tempfile.mkdtemp(prefix="rlvr-ws-", dir=parent)
        os.chmod(self.root, 0o711)  # traversable by the sandbox uid (local backends), not listable
        self.path = os.path.join(self.root, "w")
        os.mkdir(self.path, 0o755)
        self.mounted = False
        self.mounts: list[str] = []  # innermost last: unmounted in reverse
        self.template = template
        self.owner_uid = owner_uid if _is_root() else os.geteuid()
        try:
            if _is_root() and template is not None:
                layer = os.path.join(self.root, "layer")
                os.mkdir(layer, 0o700)
                self._mount_tmpfs(layer, size_bytes, inodes)
                self._mount_overlay(template.path, layer)
            elif _is_root():
                self._mount_tmpfs(self.path, size_bytes, inodes)
            elif template is not None:
                _warn_copy_once()
                shutil.copytree(template.path, self.path, symlinks=True, dirs_exist_ok=True)
            self._own(self.path)
        except BaseException:
            self.close()
            raise

    def _own(self, path: str) -> None:
        """Give a path to the sandbox user (as root), so the program can change its own workspace."""
        if _is_root():
            os.chown(path, self.owner_uid, self.owner_uid, follow_symlinks=False)

    def _mount_tmpfs(self, target: str, size_bytes: int, inodes: int) -> None:
        # nosuid,nodev: nothing the sandbox leaves here can raise privileges on the host. Not noexec: gVisor
        # maps binaries through the host file, so noexec would break programs a task compiles and runs.
        options = f"size={size_bytes},nr_inodes={inodes},mode=0755,nosuid,nodev"
        self._mount(["-t", "tmpfs", "-o", options, "rlvr-ws", target], target, "the workspace tmpfs")

    def _mount_overlay(self, lower: str, layer: str) -> None:
        upper, work = os.path.join(layer, "upper"), os.path.join(layer, "work")
        os.mkdir(upper, 0o755)
        os.mkdir(work, 0o700)
        os.chown(upper, self.owner_uid, self.owner_uid)  # the merged root takes the upper root's owner
        options = f"lowerdir={lower},upperdir={upper},workdir={work},redirect_dir=on,nosuid,nodev"
        self._mount(["-t", "overlay", "-o", options, "rlvr-ws-overlay", self.path], self.path,
                    "the workspace overlay")

    def _mount(self, args: list[str], target: str, what: str) -> None:
        done = subprocess.run(["mount", *args], capture_output=True, timeout=10)
        if done.returncode != 0:
            raise SandboxError(f"cannot mount {what}: {done.stderr.decode(errors='replace')}")
        self.mounts.append(target)
        self.mounted = True
        MOUNTED_HERE.add(target)

    def write(self, files: Mapping[str, bytes | str]) -> None:
        """Write each file (relative path -> bytes or text), creating directories, owned by the sandbox user.
        No component of the path is followed if it is a symlink (ELOOP/ENOTDIR instead)."""
        for name, content in files.items():
            parts = check_relative(name).split("/")
            data = content.encode() if isinstance(content, str) else bytes(content)
            dir_fd = self._open_dir(parts[:-1], create=True)
            try:
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if _is_root():
                        os.fchown(f.fileno(), self.owner_uid, self.owner_uid)
            finally:
                os.close(dir_fd)

    def read_file(self, name: str, max_bytes: int = 1 << 20) -> bytes:
        """A regular file's first `max_bytes` bytes; no path component is followed if it is a symlink."""
        parts = check_relative(name).split("/")
        dir_fd = self._open_dir(parts[:-1], create=False)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"workspace file {name!r} is not a regular file")
            return f.read(max_bytes)

    def _open_dir(self, parts: list[str], create: bool) -> int:
        """An fd of the workspace directory at `parts`, walked without following links (made when `create`)."""
        fd = os.open(self.path, _O_DIR)
        try:
            for part in parts:
                if create:
                    try:
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if _is_root():
                            os.chown(part, self.owner_uid, self.owner_uid, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                nxt = os.open(part, _O_DIR, dir_fd=fd)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd

    def digest(self) -> str:
        """sha256 over (path, type, mode, size, content) of every entry, links not followed; over a template,
        only files the program changed are read (the template's are known)."""
        return tree_digest(self.path, known=self.template.hashes if self.template is not None else None)

    def changes(self) -> dict[str, list[str]] | None:
        """Over a template (as root): what the program changed, read from the overlay's upper layer, the
        workspace's diff: {"written": paths created or modified (directories end in /), "deleted": paths of
        template entries removed}. None without an overlay."""
        if self.template is None or not self.mounts or self.mounts[-1] != self.path:
            return None
        upper = os.path.join(self.root, "layer", "upper")
        written, deleted = [], []
        for dirpath, dirnames, filenames in os.walk(upper):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, upper)
                st = os.lstat(full)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlayfs whiteout: deleted from the lower
                    deleted.append(rel)
                else:
                    written.append(rel + "/" if stat.S_ISDIR(st.st_mode) else rel)
        return {"written": written, "deleted": deleted}

    def free_fraction(self) -> tuple[float, float]:
        """(free bytes, free inodes) as fractions of the workspace's caps (1.0 when not a tmpfs).
        An overlay reports its upper layer's file system: the per-call tmpfs."""
        if not self.mounted:
            return 1.0, 1.0
        st = os.statvfs(self.path)
        return st.f_bavail / max(st.f_blocks, 1), st.f_favail / max(st.f_files, 1)

    def close(self) -> None:
        """Unmount (lazily, if still busy) and delete the directory; the overlay's upper layer goes with it."""
        for target in reversed(self.mounts):
            done = subprocess.run(["umount", target], capture_output=True, timeout=10)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", target], capture_output=True, timeout=10)
        self.mounts = []
        self.mounted = False
        shutil.rmtree(self.root, ignore_errors=True)


def tree_digest(top: str, known: Mapping[tuple, bytes] | None = None, learn: dict[tuple, bytes] | None = None) -> str:
    """A sha256 of a directory tree: relative path, file type, permission bits, size, and the sha256 of each
    regular file's content (capped in total), links not followed; zygote.digest computes the same.

    `known` maps `file_key`s to content hashes already computed (a template's files: in an overlay, a file
    the program did not touch has the lower file's inode, size, mtime and ctime; any change, copy-up
    included, moves its ctime, which no program can set back), so only changed files are read; `learn`
    collects the hashes computed here."""
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
                key = file_key(st)
                if known is not None and st.st_size <= budget and key in known:
                    h.update(known[key])
                    budget -= st.st_size
                    continue
                content = hashlib.sha256()
                read = _hash_file(content, full, budget)
                budget -= read
                h.update(content.digest())
                if learn is not None and read == st.st_size:
                    learn[key] = content.digest()
    return h.hexdigest()


def file_key(st: os.stat_result) -> tuple[int, int, int, int]:
    """(inode, size, mtime, ctime) in ns: what identifies an unchanged file for `tree_digest`'s cache."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


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
