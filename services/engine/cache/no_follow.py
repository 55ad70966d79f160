"""No-follow file-system access below the cache root (docs/architecture.md, 'Disk tier').

The folder is not trusted. Below the cache root (`root=`), every path component is
opened with O_NOFOLLOW through directory file descriptors, so a symlink anywhere
under the root (a shard folder, a file named like a snapshot) is never followed,
and a FIFO or device named like a snapshot is never read (O_NONBLOCK open, then
fstat must say regular file). A link or a non-directory on the way raises
SnapshotFileError('symlink' / 'not_regular'); FileNotFoundError passes through.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from keepwarm.engine.cache.snapshot_error import SnapshotFileError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _rel_parts(path: Path, root: Path | None) -> tuple[Path, tuple[str, ...]]:
    """(trusted folder, untrusted components below it). Without a root only the file
    name itself is untrusted."""
    if root is None:
        return path.parent, (path.name,)
    parts = path.relative_to(root).parts
    assert parts and ".." not in parts, f"{path} is not below {root}"
    return root, parts


@contextlib.contextmanager
def dir_fd(path: Path, root: Path | None, *, create: bool = False, fsync: bool = False) -> Iterator[int]:
    """An fd of `path`'s parent folder, every component below `root` opened O_NOFOLLOW
    (created when `create`; each new level made durable when `fsync`). A symlink or a
    non-directory on the way raises SnapshotFileError('symlink' / 'not_regular')."""
    base, parts = _rel_parts(path, root)
    if create:
        base.mkdir(parents=True, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if fsync:
                        os.fsync(fd)
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    kind = _lstat_kind(part, fd)
                    raise SnapshotFileError(kind, f"{part} in {path} is not a folder") from e
                raise
            os.close(fd)
            fd = nfd
        yield fd
    finally:
        os.close(fd)


def _lstat_kind(name: str, dir_fd: int) -> str:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return "not_regular"
    return "symlink" if stat.S_ISLNK(st.st_mode) else "not_regular"


def open_in(name: str, dir_fd: int) -> int:
    """Open a regular file for reading, never through a link, never blocking on a FIFO."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SnapshotFileError("symlink", f"{name} is a symbolic link") from e
        if e.errno in (errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
            raise SnapshotFileError("not_regular", f"{name}: {e.strerror}") from e
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SnapshotFileError("not_regular", f"{name} is not a regular file")
    return fd


@contextlib.contextmanager
def open_regular(path: Path, root: Path | None = None) -> Iterator[int]:
    """A read fd of `path`, which must be a regular file reached without following a
    link below `root`. FileNotFoundError passes through; a link, folder, FIFO or device
    raises SnapshotFileError('symlink' / 'not_regular')."""
    with dir_fd(path, root) as dfd:
        fd = open_in(path.name, dfd)
    try:
        yield fd
    finally:
        os.close(fd)


def read_exact(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def fsync_dir(d: Path) -> None:
    """Make a folder's entries (new or renamed files) durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_tmp(path: Path, *, root: Path | None = None) -> bool:
    """Delete a regular temp file (never a link or a folder). True when deleted."""
    try:
        with dir_fd(path, root) as dfd:
            st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return False
            os.unlink(path.name, dir_fd=dfd)
            return True
    except (FileNotFoundError, SnapshotFileError):
        return False
