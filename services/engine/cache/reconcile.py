"""Index upkeep: the folder walked without following links (stat only), and the index made
to agree with it (docs/architecture.md, 'Disk tier'; disk_cache.py's docstring, 'Index upkeep').

The walk sees only what the cache could have written: namespace folders, two-character
shard folders, `<key>.safetensors` files and writers' temp files; anything else is counted
by kind (`foreign_by_kind`) and never touched. Reconcile indexes files without a row from
their headers (ours: checked, a bad one deleted), drops rows without a file and garbage rows,
settles stale WRITING/EVICTING rows of dead writers and (at start) removes stray temp files.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm.engine.cache.disk_state import DiskState
from keepwarm.engine.cache.index import EVICTING, LIVE, NAME, Row
from keepwarm.engine.cache.no_follow import DIR_FLAGS, unlink_tmp
from keepwarm.engine.cache.snapshot_error import SnapshotFileError
from keepwarm.engine.cache.snapshot_file import (
    SUFFIX,
    TMP_SUFFIX,
    read_header,
    read_identity,
    tmp_writer_pid,
    unlink_if_ours,
)

_NAMESPACE_FILES = ("prefill_cost.json",)  # ours, not snapshots (generation/prefill_cost.py)


@dataclass
class FolderScan:
    files: dict[tuple[str, str], int] = field(default_factory=dict)  # (namespace, key) -> size
    tmps: list[tuple[Path, float]] = field(default_factory=list)  # (path, mtime)
    foreign: Counter[str] = field(default_factory=Counter)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kind(entry: os.DirEntry[str]) -> str:
    """What a folder entry that is not a regular file is."""
    if entry.is_symlink():
        return "symlink"
    if entry.is_dir(follow_symlinks=False):
        return "directory"
    return "not_regular"


class Reconcile(DiskState):
    """The folder scan and the reconcile of the index with it."""

    def _scan(self) -> FolderScan:
        """Walk the folder through directory fds without following any link."""
        out = FolderScan()
        try:
            rfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return out
        try:
            with os.scandir(rfd) as it:
                top = list(it)
            for ns_e in top:
                if not NAME.fullmatch(ns_e.name):
                    continue  # the index, fingerprints.json, dot files: not namespaces
                if not ns_e.is_dir(follow_symlinks=False):
                    out.foreign["foreign_file" if ns_e.is_file(follow_symlinks=False) else _kind(ns_e)] += 1
                    continue
                self._scan_namespace(rfd, ns_e.name, out)
        finally:
            os.close(rfd)
        return out

    @staticmethod
    def _open_dir(name: str, dir_fd: int, out: FolderScan) -> int | None:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError:
            out.foreign["symlink"] += 1  # replaced by a link since it was listed
            return None

    def _scan_namespace(self, rfd: int, ns: str, out: FolderScan) -> None:
        nsfd = self._open_dir(ns, rfd, out)
        if nsfd is None:
            return
        try:
            with os.scandir(nsfd) as it:
                shards = list(it)
            for sh in shards:
                name = sh.name
                if name in _NAMESPACE_FILES or (
                    name.startswith(_NAMESPACE_FILES[0]) and name.endswith(TMP_SUFFIX)
                ):
                    continue
                if len(name) != 2 or not NAME.fullmatch(name * 2) or not sh.is_dir(follow_symlinks=False):
                    out.foreign["foreign_file" if sh.is_file(follow_symlinks=False) else _kind(sh)] += 1
                    continue
                sfd = self._open_dir(name, nsfd, out)
                if sfd is None:
                    continue
                try:
                    with os.scandir(sfd) as it2:
                        files = list(it2)
                    for f in files:
                        self._scan_file(ns, name, f, out)
                finally:
                    os.close(sfd)
        finally:
            os.close(nsfd)

    def _scan_file(self, ns: str, shard: str, f: os.DirEntry[str], out: FolderScan) -> None:
        name = f.name
        if name.endswith(TMP_SUFFIX) and SUFFIX in name:
            if f.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    out.tmps.append((self.root / ns / shard / name, f.stat(follow_symlinks=False).st_mtime))
                return
            out.foreign[_kind(f)] += 1
            return
        key = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else ""
        if not key or not NAME.fullmatch(key) or key[:2] != shard:
            out.foreign["foreign_file" if f.is_file(follow_symlinks=False) else _kind(f)] += 1
            return
        if not f.is_file(follow_symlinks=False):
            out.foreign[_kind(f)] += 1  # a folder or link named like a snapshot
            return
        with contextlib.suppress(FileNotFoundError):
            out.files[(ns, key)] = f.stat(follow_symlinks=False).st_size

    def _row_from_file(self, ns: str, key: str, size: int, foreign: Counter[str]) -> Row | None:
        """An index row for a file found in the folder, from its header; None when it
        is not a usable snapshot (ours and bad: deleted; not ours: counted)."""
        path = self._path(ns, key)
        try:
            h = read_header(path, root=self.root)
            if ns == self.namespace:
                h.check(namespace=ns, key=key)
            elif (h.namespace, h.key) != (ns, key):
                raise SnapshotFileError("key_mismatch", "file header names another entry")
            return Row(ns, key, h.key_tokens, h.position, h.file_bytes, h.created)
        except FileNotFoundError:
            return None
        except SnapshotFileError as e:
            if ns == self.namespace:
                if not self._reject(ns, key, e.reason, str(e), count_miss=False) and os.path.lexists(path):
                    foreign["foreign_file"] += 1
                return None
            ident = read_identity(path, root=self.root)
            if ident is None:
                foreign["foreign_file"] += 1
                return None
            # Another namespace's file this build cannot parse (another format version):
            # budgeted by its size and reaped, never read.
            try:
                mtime = os.lstat(path).st_mtime
            except OSError:
                return None
            return Row(ns, key, 0, 0, size, mtime)

    def _stale(self, row: Row, wall: float) -> bool:
        if wall - row.since > self.stale_s:
            return True
        host, _, rest = row.owner.partition(":")
        pid_text = rest.partition(":")[0]
        if host == socket.gethostname() and pid_text.isdigit():
            return not pid_alive(int(pid_text))
        return False

    def _reconcile(self, *, clean_tmp: bool) -> None:
        """Make the index agree with the folder (see the module docstring)."""
        idx = self._widx_()
        scan = self._scan()
        rows, bad = idx.all_rows()
        if bad:
            dropped = idx.drop_garbage()
            with self._lock:
                self._n.garbage_rows += dropped
            self._once("garbage_rows", "disk cache: dropped %d garbage index rows", dropped)
        by_key = {(r.namespace, r.key): r for r in rows}
        foreign = Counter(scan.foreign)
        fresh: list[Row] = []
        replaced: list[Row] = []
        for (ns, key), size in scan.files.items():
            r = by_key.get((ns, key))
            if r is not None and (r.state != LIVE or r.bytes == size):
                continue
            row = self._row_from_file(ns, key, size, foreign)
            if r is not None:
                replaced.append(r)  # a LIVE row whose file changed size
            if row is not None:
                fresh.append(row)
        if replaced:
            idx.remove(replaced)
        if fresh:
            idx.insert(fresh)
        wall = time.time()
        gone = [
            r
            for r in rows
            if r.state == LIVE
            and (r.namespace, r.key) not in scan.files
            and not os.path.lexists(self._path(r.namespace, r.key))
        ]
        if gone:
            idx.remove(gone)
        for r in rows:
            if r.state == LIVE or not self._stale(r, wall):
                continue
            path = self._path(r.namespace, r.key)
            if r.state == EVICTING:
                unlink_if_ours(path, root=self.root)
                idx.resolve(r, exists=False, size=None)
            else:  # WRITING: a published file of a writer that died before marking it
                found = scan.files.get((r.namespace, r.key))
                ok = found is not None and self._row_from_file(r.namespace, r.key, found, foreign) is not None
                idx.resolve(r, exists=ok, size=found)
        if clean_tmp:
            for path, mtime in scan.tmps:
                pid = tmp_writer_pid(path.name)
                if pid is None or not pid_alive(pid) or wall - mtime > self.stale_s:
                    unlink_tmp(path, root=self.root)
        with self._lock:
            self._foreign = foreign
        self._last_upkeep = time.monotonic()
