"""The persistent prefix cache: snapshot files under one folder (docs/architecture.md, 'Disk tier').

Layout: `<root>/<namespace>/<key[:2]>/<key>.safetensors` (snapshot_file.py), and the
index shared by every process on the folder (index_protocol.py), picked by `index`:
`<root>/index.sqlite3` (index.py, one host), or a Valkey server at `index_url`
(valkey_index.py, several hosts on one shared folder; `<root>/index.id` names the folder
there). Without a reachable index a lookup is a miss and a save is not written (counted in
`errors_by_kind`), and serving goes on.

The folder is the cache's alone. It is walked with directory fds and lstat
semantics (a link is never followed: not a namespace, a shard or a file), and the
cache deletes only regular files it could have written: name pattern, a
keepwarm header (snapshot_file.unlink_if_ours). Anything else there (links,
folders named like snapshots, FIFOs, a model's safetensors) is skipped and counted
(`foreign_by_kind`, as of the last scan), never deleted, never fatal.

Writes. `save` never blocks on disk: it marks the key *pending*, takes a
detached copy and hands it to ONE background writer thread through a queue bounded
in snapshots and in bytes (full queue: the save is dropped and counted; an empty
queue takes any one snapshot). `writer_nice` (Linux: the thread's own nice value)
lets the writer yield the CPU to the model's threads: writing a snapshot is mostly
the kernel's page-cache copy, and on a small CPU box a nice-0 writer beside the
model's spinning threads costs them more than its own time (2-core VM: 8 streams
decoding while ~10 snapshots/s of 36 MB were written ran at 106 tok/s instead of
140; at nice 19 at full speed, but the writer then managed ~1 snapshot/s, so under
sustained load the queue fills and saves are dropped). Default 0: every snapshot
reaches the disk as soon as it can. A pending key is a miss
for `load` and is never saved twice. The guard refuses snapshots covering more
positions than their key has tokens, before any copy. The writer claims room in
the index (one transaction: the budget excess or free-space deficit is freed by
marking victims, and the key is reserved with its exact size, so several
processes share one budget and never write the same key or evict the same file
twice), deletes the victims, publishes the file (temp, fsync, link, folder
fsync) and marks the row live. A full disk (ENOSPC) frees the file's size again
by eviction and retries before giving up. The writer thread cannot die: any error
is counted by kind and logged once per kind.

Reads. `load` verifies header, namespace, key, tokens, every checksum and then
the caller's geometry callback; a bad file of ours is deleted and its reason
counted, and the call returns None. A missing file is a plain miss. `contains`
and `known_lengths` are index queries (no folder listing per request).

Budget. One byte budget for everything under `root` (all namespaces) plus a
free-space floor (default: 5% of the volume, at most 1 GiB). Eviction order:
entries of namespaces no running engine uses (oldest first), then every used
namespace's entries by ascending score `(decayed_hits + 1) * tokens / bytes`, ties
least recently used first; hits decay with a half-life and are shared by every
process through the index. Pending keys and keys inside `protect(key)` (every
`load` protects its key while reading) are never evicted by this process. A save
that cannot fit is refused (logged once, counted in `refused_for_space`), so a file
is never stored and then immediately evicted.

Index upkeep (reconcile: at start and every `refresh_s` while idle): the folder is
walked (stat only), files without a row are indexed from their headers (ours:
checked, a bad one deleted; other namespaces: header or at least the keepwarm
marker), rows without a file are dropped, garbage rows are dropped, stale
WRITING/EVICTING rows of dead writers are settled, and (at start) stray temp
files of dead writers or older than `stale_s` are removed. A missing or corrupt
database is rebuilt this way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm.engine.cache.index import EVICTING, LIVE, NAME, WRITING, CacheIndex, Claim, Row, decay
from keepwarm.engine.cache.index_protocol import INDEX_ERRORS, INDEX_KINDS, Index
from keepwarm.engine.cache.no_follow import DIR_FLAGS, unlink_tmp
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_error import SnapshotFileError
from keepwarm.engine.cache.snapshot_file import (
    SUFFIX,
    TMP_SUFFIX,
    Alloc,
    encode_snapshot,
    publish,
    read_header,
    read_identity,
    read_snapshot,
    read_tokens,
    tmp_writer_pid,
    unlink_if_ours,
)

log = logging.getLogger(__name__)

HALF_LIFE_S = 6 * 3600.0
FLOOR_FRACTION = 0.05  # default free-space floor: this share of the volume ...
FLOOR_CAP = 1 << 30  # ... at most this many bytes
_NAMESPACE_FILES = ("prefill_cost.json",)  # ours, not snapshots (generation/prefill_cost.py)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_ENOSPC_RETRIES = 3


@dataclass(frozen=True)
class EntryInfo:
    """One indexed file. Files of other namespaces known only by their keepwarm marker
    (another format version) carry tokens=position=0."""

    key: str
    namespace: str
    tokens: int
    position: int
    bytes: int
    hits: int
    decayed_hits: float
    last_used: float
    created: float


@dataclass(frozen=True)
class DiskCacheStats:
    """num_entries/num_bytes cover every namespace under the root (bytes_by_namespace
    splits them), from the shared index; the rest are this process's counters since
    start. `misses` counts every load returning None, rejections included.
    `refused_for_space`: saves not stored for lack of budget or disk (the log says so
    once); `enospc`: writes that hit a full disk (each retried after eviction);
    `foreign_by_kind`: what the last folder scan skipped as not the cache's (symlink,
    directory, not_regular, foreign_file); `errors_by_kind`: errors the writer thread
    or the index survived ("write:OSError", "index:OperationalError", ...)."""

    num_entries: int
    num_bytes: int
    bytes_by_namespace: Mapping[str, int]
    saves: int
    dropped_saves: int
    refused_saves: int
    refused_for_space: int
    write_errors: int
    enospc: int
    evictions: int
    hits: int
    misses: int
    rejected_by_reason: Mapping[str, int]
    foreign_by_kind: Mapping[str, int]
    garbage_rows: int
    errors_by_kind: Mapping[str, int]
    bytes_read: int
    read_seconds: float
    pending: int
    budget_bytes: int
    min_free_bytes: int


@dataclass
class _Job:
    key: str
    tokens: list[int]
    snapshot: Snapshot


@dataclass
class _Counters:
    saves: int = 0
    dropped_saves: int = 0
    refused_saves: int = 0
    refused_for_space: int = 0
    write_errors: int = 0
    enospc: int = 0
    evictions: int = 0
    hits: int = 0
    misses: int = 0
    garbage_rows: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    rejected: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


@dataclass
class _Scan:
    files: dict[tuple[str, str], int] = field(default_factory=dict)  # (namespace, key) -> size
    tmps: list[tuple[Path, float]] = field(default_factory=list)  # (path, mtime)
    foreign: Counter[str] = field(default_factory=Counter)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def _disk_total(path: Path) -> int:
    return shutil.disk_usage(path).total


def default_min_free(total_bytes: int) -> int:
    """The default free-space floor of a volume: 5% of it, at most 1 GiB."""
    return min(int(total_bytes * FLOOR_FRACTION), FLOOR_CAP)


def _kind(entry: os.DirEntry[str]) -> str:
    """What a folder entry that is not a regular file is."""
    if entry.is_symlink():
        return "symlink"
    if entry.is_dir(follow_symlinks=False):
        return "directory"
    return "not_regular"


class DiskCache:
    """Snapshot files of one namespace under a shared, budgeted root (see module docstring)."""

    def __init__(
        self,
        root: Path,
        namespace: str,
        *,
        budget_bytes: int,
        min_free_bytes: int | None = None,
        queue_size: int = 4,
        queue_bytes: int | None = None,
        writer_nice: int = 0,
        fsync: bool = True,
        clock: Callable[[], float] = time.time,
        half_life_s: float = HALF_LIFE_S,
        stale_s: float = 600.0,
        refresh_s: float = 60.0,
        disk_free: Callable[[Path], int] = _disk_free,
        disk_total: Callable[[Path], int] = _disk_total,
        block_bytes: int = 4096,
        index_slack: int = 64 << 10,
        index: str = "sqlite",
        index_url: str | None = None,
    ) -> None:
        if not NAME.fullmatch(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 4-128 chars of [0-9A-Za-z_-] (use namespace_id())"
            )
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        if min_free_bytes is not None and min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0 (or None for the default), got {min_free_bytes}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if queue_bytes is not None and queue_bytes < 1:
            raise ValueError(f"queue_bytes must be >= 1 (or None: no byte bound), got {queue_bytes}")
        if not 0 <= writer_nice <= 19:
            raise ValueError(f"writer_nice must be in 0..19, got {writer_nice}")
        if writer_nice and sys.platform != "linux":
            raise ValueError(
                f"writer_nice needs Linux (a nice value per thread); leave it 0 on {sys.platform}"
            )
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        if index not in INDEX_KINDS:
            raise ValueError(f"index must be one of {', '.join(INDEX_KINDS)}, got {index!r}")
        if (index == "redis") != bool(index_url):
            raise ValueError("index_url is wanted with index='redis' and only then")
        self.root = Path(root)
        self.namespace = namespace
        self.folder = self.root / namespace
        self.budget_bytes = budget_bytes
        self._min_free_arg = min_free_bytes
        self.min_free_bytes = min_free_bytes or 0
        self.fsync = fsync
        self.queue_bytes = queue_bytes
        self.writer_nice = writer_nice
        self.half_life_s = half_life_s
        self.stale_s = stale_s
        self.refresh_s = refresh_s
        self._clock = clock
        self._disk_free = disk_free
        self._disk_total = disk_total
        self.block_bytes = max(1, block_bytes)  # a file takes whole blocks of the volume ...
        self.index_slack = index_slack  # ... and the index's WAL grows: kept free with the floor
        self.index_kind = index
        self.index_url = index_url
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._lock = threading.RLock()
        self._pending: set[str] = set()
        self._protected: Counter[str] = Counter()
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._queued_bytes = 0  # snapshot bytes of the jobs in the queue or being written
        self._thread: threading.Thread | None = None
        self._closed = False
        self._n = _Counters()
        self._foreign: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._idx: Index | None = None  # request side
        self._widx: Index | None = None  # writer thread (and start/close)
        self._last_upkeep = 0.0
        self._last_heartbeat = 0.0
        self._final_usage: dict[str, tuple[int, int]] = {}

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> DiskCache:
        """Open the index, reconcile it with the folder (cleaning stray temp files),
        make room if over budget, start the writer thread."""
        assert self._thread is None, "DiskCache.start() called twice"
        self.root.mkdir(parents=True, exist_ok=True)
        if self._min_free_arg is None:
            self.min_free_bytes = default_min_free(self._disk_total(self.root))
        self._widx = self._open_index()
        self._idx = self._open_index()
        self._heartbeat()
        self._reconcile(clean_tmp=True)
        self._make_room(0)
        self._thread = threading.Thread(
            target=self._writer, name=f"disk-cache-{self.namespace[:8]}", daemon=True
        )
        self._thread.start()
        return self

    def _open_index(self) -> Index:
        """The one place the index's backend is chosen (`index`)."""
        if self.index_kind == "redis":
            from keepwarm.engine.cache.valkey_index import ValkeyIndex  # needs the redis client

            assert self.index_url is not None
            return ValkeyIndex(self.root, owner=self.owner, url=self.index_url)
        return CacheIndex(self.root, owner=self.owner)

    def close(self) -> None:
        """Drain the queue (every accepted save is written), then stop the writer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._widx is not None:
            self._guard("index", self._widx.leave)
            self._widx.close()
        if self._idx is not None:
            with contextlib.suppress(*INDEX_ERRORS):
                self._final_usage = self._idx.usage().by_namespace  # stats() after close
            self._idx.close()

    def __enter__(self) -> DiskCache:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Wait until every accepted save is written (or failed)."""
        self._queue.join()

    # ---- public API ------------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        return self._path(self.namespace, key)

    def contains(self, key: str) -> bool:
        """True when the key is stored or being written by any process (a save would be
        a no-op). An index query; without a usable index, the file's presence."""
        path = self._path(self.namespace, key)
        with self._lock:
            if key in self._pending:
                return True
        try:
            row = self._ridx().get(self.namespace, key)
        except INDEX_ERRORS as e:
            self._error("index", e)
            with contextlib.suppress(OSError):
                return stat.S_ISREG(os.lstat(path).st_mode)
            return False
        return row is not None and row.state in (LIVE, WRITING)

    def known_lengths(self) -> set[int]:
        """Token counts of this namespace's stored entries (probe candidates): one
        indexed query, cached until any process changes the index."""
        try:
            return set(self._ridx().lengths(self.namespace))
        except INDEX_ERRORS as e:
            self._error("index", e)
            return set()

    def save(self, key: str, tokens: Sequence[int], snapshot: Snapshot, *, detached: bool = False) -> bool:
        """Queue `snapshot` (state after `tokens[:snapshot.position]`) under `key`, the key
        of exactly `tokens`. Returns True when accepted. False: refused (position past
        the key, larger than the whole budget), dropped (queue full or closed), or the
        key is already stored or pending. Copies the snapshot unless `detached`."""
        self._path(self.namespace, key)  # validates the key
        num_bytes = snapshot.num_bytes
        size = num_bytes + 4 * len(tokens)
        with self._lock:
            if snapshot.position > len(tokens):
                self._n.refused_saves += 1
                return False
            if size > self.budget_bytes:
                self._n.refused_saves += 1
                self._refused_for_space(
                    f"a {size}-byte snapshot is larger than the whole budget ({self.budget_bytes})"
                )
                return False
            if key in self._pending:
                return False
            over_bytes = (
                self.queue_bytes is not None
                and self._queued_bytes > 0
                and self._queued_bytes + num_bytes > self.queue_bytes
            )
            if self._closed or self._thread is None or self._queue.full() or over_bytes:
                self._n.dropped_saves += 1
                return False
            self._pending.add(key)
            self._queued_bytes += num_bytes
        queued = False
        try:
            if self._indexed(key):
                return False
            job = _Job(key, list(tokens), snapshot if detached else snapshot.detached())
            try:
                self._queue.put_nowait(job)
                queued = True
            except queue.Full:
                with self._lock:
                    self._n.dropped_saves += 1
                return False
        finally:
            if not queued:
                with self._lock:
                    self._pending.discard(key)
                    self._queued_bytes -= num_bytes
        return True

    def _indexed(self, key: str) -> bool:
        """True when any process stores or writes `key` (the index says so)."""
        try:
            return self._ridx().get(self.namespace, key) is not None
        except INDEX_ERRORS as e:
            self._error("index", e)
            return False

    def load(
        self,
        key: str,
        tokens: Sequence[int],
        validate: Callable[[Snapshot], None],
        alloc: Alloc | None = None,
    ) -> Snapshot | None:
        """The verified snapshot stored under `key` for exactly `tokens`, or None.

        `validate` raises ValueError (e.g. SnapshotMismatch) when the snapshot does
        not fit the model. Any bad file of ours is deleted and its reason counted;
        anything that is not ours is left alone; this never raises for a bad file.
        Without `alloc` the returned tensors are views into one CPU buffer."""
        path = self._path(self.namespace, key)
        with self._lock:
            if key in self._pending:
                self._n.misses += 1
                return None
            self._protected[key] += 1
        try:
            t0 = time.perf_counter()
            try:
                snapshot, _ = read_snapshot(
                    path, namespace=self.namespace, tokens=tokens, key=key, alloc=alloc, root=self.root
                )
            except FileNotFoundError:
                with self._lock:
                    self._n.misses += 1
                self._forget_missing(self.namespace, key)
                return None
            except SnapshotFileError as e:
                self._reject(self.namespace, key, e.reason, str(e))
                return None
            try:
                validate(snapshot)
            except ValueError as e:
                self._reject(self.namespace, key, "geometry", str(e))
                return None
            elapsed = time.perf_counter() - t0
            now = self._clock()
            try:
                size = os.lstat(path).st_size
            except OSError:
                size = 0
            with self._lock:
                self._n.hits += 1
                self._n.bytes_read += size
                self._n.read_seconds += elapsed
            adopt = Row(self.namespace, key, len(tokens), snapshot.position, size, now) if size else None
            try:
                self._ridx().record_hit(self.namespace, key, now, self.half_life_s, adopt)
            except INDEX_ERRORS as e:
                self._error("index", e)
            return snapshot
        finally:
            with self._lock:
                self._protected[key] -= 1
                if self._protected[key] <= 0:
                    del self._protected[key]

    def stored_tokens(self, key: str) -> list[int] | None:
        """The token ids `key`'s file was stored under (header + token tensor only), or
        None when there is no usable file."""
        try:
            return read_tokens(self.path_for(key), namespace=self.namespace, key=key, root=self.root)
        except (OSError, SnapshotFileError):
            return None

    @contextlib.contextmanager
    def protect(self, key: str) -> Iterator[None]:
        """Keep `key` from eviction by this process inside the block (e.g. while adopting it)."""
        with self._lock:
            self._protected[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._protected[key] -= 1
                if self._protected[key] <= 0:
                    del self._protected[key]

    def stats(self) -> DiskCacheStats:
        by_ns: dict[str, tuple[int, int]] = self._final_usage
        if not self._closed:
            try:
                by_ns = self._ridx().usage().by_namespace
            except INDEX_ERRORS as e:
                self._error("index", e)
        with self._lock:
            n = self._n
            return DiskCacheStats(
                num_entries=sum(c for c, _ in by_ns.values()),
                num_bytes=sum(b for _, b in by_ns.values()),
                bytes_by_namespace={ns: b for ns, (_, b) in by_ns.items()},
                saves=n.saves,
                dropped_saves=n.dropped_saves,
                refused_saves=n.refused_saves,
                refused_for_space=n.refused_for_space,
                write_errors=n.write_errors,
                enospc=n.enospc,
                evictions=n.evictions,
                hits=n.hits,
                misses=n.misses,
                rejected_by_reason=dict(n.rejected),
                foreign_by_kind=dict(self._foreign),
                garbage_rows=n.garbage_rows,
                errors_by_kind=dict(n.errors),
                bytes_read=n.bytes_read,
                read_seconds=n.read_seconds,
                pending=len(self._pending),
                budget_bytes=self.budget_bytes,
                min_free_bytes=self.min_free_bytes,
            )

    def entries(self) -> list[EntryInfo]:
        """Every indexed file, this namespace first, then by namespace and key."""
        now = self._clock()
        try:
            rows = self._ridx().rows()
        except INDEX_ERRORS as e:
            self._error("index", e)
            return []
        out = [
            EntryInfo(
                key=r.key,
                namespace=r.namespace,
                tokens=r.tokens,
                position=r.position,
                bytes=r.bytes,
                hits=r.hits,
                decayed_hits=decay(r.decayed, r.ref, now, self.half_life_s),
                last_used=max(r.last_used, r.created),
                created=r.created,
            )
            for r in rows
        ]
        return sorted(out, key=lambda i: (i.namespace != self.namespace, i.namespace, i.key))

    def clear(self, *, all_namespaces: bool = False) -> int:
        """Delete this namespace's files (every namespace's when asked) except pending
        and protected ones, hits included. Returns the number deleted."""
        idx = self._ridx()
        with self._lock:
            skip = self._pending | set(self._protected)
        rows = idx.rows(None if all_namespaces else self.namespace)
        keys = [(r.namespace, r.key) for r in rows if not (r.namespace == self.namespace and r.key in skip)]
        claimed = idx.claim_keys(keys, time.time())
        deleted = self._delete_claimed(idx, claimed, count=False)
        return deleted

    # ---- internals: paths, errors ----------------------------------------------------

    def _path(self, namespace: str, key: str) -> Path:
        if not NAME.fullmatch(key):
            raise ValueError(f"key {key!r} must be 4-128 chars of [0-9A-Za-z_-] (use prefix_key())")
        return self.root / namespace / key[:2] / f"{key}{SUFFIX}"

    def _ridx(self) -> Index:
        assert self._idx is not None, "DiskCache used before start()"
        return self._idx

    def _widx_(self) -> Index:
        assert self._widx is not None, "DiskCache used before start()"
        return self._widx

    def _once(self, kind: str, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        with self._lock:
            if kind in self._logged:
                return
            self._logged.add(kind)
        log.warning(msg, *args, exc_info=exc_info)

    def _error(self, where: str, e: BaseException) -> None:
        """Count an error this tier survives; the first of each kind is logged with its traceback."""
        kind = f"{where}:{type(e).__name__}"
        with self._lock:
            self._n.errors[kind] += 1
        self._once(
            f"error:{kind}",
            "disk cache (%s): %s: %s; the tier keeps working, further %s errors are only counted",
            where,
            type(e).__name__,
            e,
            kind,
            exc_info=e,
        )

    def _guard(self, where: str, fn: Callable[[], object]) -> bool:
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 - the writer and upkeep must survive anything
            self._error(where, e)
            return False

    def _refused_for_space(self, why: str) -> None:
        with self._lock:
            self._n.refused_for_space += 1
        self._once(
            "refused_for_space",
            "disk cache %s: not saving: %s (budget %d bytes, free-space floor %d bytes); further "
            "refusals are only counted (refused_for_space)",
            self.root,
            why,
            self.budget_bytes,
            self.min_free_bytes,
        )

    def _forget_missing(self, namespace: str, key: str) -> None:
        """A LIVE row whose file is gone (deleted by hand): drop it."""
        try:
            if not os.path.lexists(self._path(namespace, key)):
                self._ridx().remove([(namespace, key)])
        except INDEX_ERRORS as e:
            self._error("index", e)

    def _reject(self, namespace: str, key: str, reason: str, detail: str, *, count_miss: bool = True) -> bool:
        """A file that must not be adopted: deleted when it is ours (counted by reason),
        left alone otherwise; its row is dropped either way."""
        path = self._path(namespace, key)
        deleted = unlink_if_ours(path, root=self.root)
        with self._lock:
            if count_miss:
                self._n.misses += 1
            if deleted:
                self._n.rejected[reason] += 1
        if deleted:
            log.warning("disk cache: rejected and deleted %s (%s)", path.name, detail)
        else:
            self._once(
                f"foreign:{reason}", "disk cache: left alone %s, not a snapshot of ours (%s)", path, detail
            )
        try:
            self._ridx().remove([(namespace, key)], states=(LIVE,))
        except INDEX_ERRORS as e:
            self._error("index", e)
        return deleted

    # ---- internals: folder scan and reconcile -----------------------------------------

    def _scan(self) -> _Scan:
        """Walk the folder through directory fds without following any link."""
        out = _Scan()
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
    def _open_dir(name: str, dir_fd: int, out: _Scan) -> int | None:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except OSError:
            out.foreign["symlink"] += 1  # replaced by a link since it was listed
            return None

    def _scan_namespace(self, rfd: int, ns: str, out: _Scan) -> None:
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

    def _scan_file(self, ns: str, shard: str, f: os.DirEntry[str], out: _Scan) -> None:
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
            return not _pid_alive(int(pid_text))
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
        replaced: list[tuple[str, str]] = []
        for (ns, key), size in scan.files.items():
            r = by_key.get((ns, key))
            if r is not None and (r.state != LIVE or r.bytes == size):
                continue
            row = self._row_from_file(ns, key, size, foreign)
            if r is not None:
                replaced.append((ns, key))  # a LIVE row whose file changed size
            if row is not None:
                fresh.append(row)
        if replaced:
            idx.remove(replaced)
        if fresh:
            idx.insert(fresh)
        wall = time.time()
        gone = [
            (r.namespace, r.key)
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
                if pid is None or not _pid_alive(pid) or wall - mtime > self.stale_s:
                    unlink_tmp(path, root=self.root)
        with self._lock:
            self._foreign = foreign
        self._last_upkeep = time.monotonic()

    # ---- internals: budget and eviction ----------------------------------------------

    def _protected_keys(self) -> frozenset[str]:
        """Keys of this namespace never to evict now: pending and protected ones."""
        with self._lock:
            return frozenset(self._pending) | frozenset(self._protected)

    def _floor_deficit(self, incoming: int) -> int:
        """Bytes to free so `incoming` more bytes keep the free-space floor (≤ 0: none).
        The free-space query runs outside any lock (it may be slow on network disks)."""
        if self.min_free_bytes <= 0:
            return -(1 << 62)
        if incoming:  # what the file really takes: whole blocks, plus the index's growth
            incoming = -(-incoming // self.block_bytes) * self.block_bytes + self.index_slack
        return self.min_free_bytes - (self._disk_free(self.root) - incoming)

    def _claim(self, incoming: int, reserve: Row | None, floor_deficit: int | None = None) -> Claim:
        idx = self._widx_()
        return idx.claim(
            namespace=self.namespace,
            reserve=reserve,
            incoming=incoming,
            budget=self.budget_bytes,
            floor_deficit=self._floor_deficit(incoming) if floor_deficit is None else floor_deficit,
            protected=self._protected_keys(),
            now=self._clock(),
            wall=time.time(),
            half_life=self.half_life_s,
        )

    def _delete_claimed(self, idx: Index, victims: Sequence[Row], *, count: bool = True) -> int:
        """Delete the files of claimed evictions (ours only), then their rows."""
        deleted = 0
        for v in victims:
            if unlink_if_ours(self._path(v.namespace, v.key), root=self.root):
                deleted += 1
        idx.forget_evicted(victims)
        if count:
            with self._lock:
                self._n.evictions += deleted
        return deleted

    def _make_room(self, incoming: int) -> bool:
        """Evict until `incoming` more bytes fit budget and floor; False if they cannot."""
        claim = self._claim(incoming, None)
        if claim.status != "ok":
            return False
        self._delete_claimed(self._widx_(), claim.victims)
        return True

    # ---- internals: writer thread ----------------------------------------------------

    def _heartbeat(self) -> None:
        wall = time.time()
        self._widx_().heartbeat(self.namespace, wall + 3 * self.refresh_s + 30.0)
        self._last_heartbeat = time.monotonic()

    def _upkeep(self, *, idle: bool) -> None:
        """Heartbeat when due; reconcile when idle and due (or long overdue while busy)."""
        since = time.monotonic() - self._last_upkeep
        if time.monotonic() - self._last_heartbeat >= self.refresh_s:
            self._guard("heartbeat", self._heartbeat)
        if (idle and since >= self.refresh_s) or since >= 10 * self.refresh_s:
            if not self._guard("reconcile", lambda: self._reconcile(clean_tmp=False)):
                self._last_upkeep = time.monotonic()  # a failing reconcile is retried later

    def _writer(self) -> None:
        if self.writer_nice:
            self._guard("nice", self._lower_priority)
        while True:
            try:
                job = self._queue.get(timeout=self.refresh_s)
            except queue.Empty:
                self._upkeep(idle=True)
                continue
            if job is None:
                self._queue.task_done()
                return
            try:
                if not self._guard("write", lambda j=job: self._write(j)):  # type: ignore[misc]
                    with self._lock:
                        self._n.write_errors += 1
            finally:
                with self._lock:
                    self._pending.discard(job.key)
                    self._queued_bytes -= job.snapshot.num_bytes
                self._queue.task_done()
            self._upkeep(idle=self._queue.empty())

    def _lower_priority(self) -> None:
        """This thread only (Linux gives each thread its own nice value), and only ever
        lower (a higher nice value needs no privilege)."""
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < self.writer_nice:
            os.setpriority(os.PRIO_PROCESS, tid, self.writer_nice)

    def _write(self, job: _Job) -> None:
        idx = self._widx_()
        path = self._path(self.namespace, job.key)
        created = self._clock()
        encoded = encode_snapshot(
            namespace=self.namespace, key=job.key, tokens=job.tokens, snapshot=job.snapshot, created=created
        )
        reserve = Row(
            self.namespace,
            job.key,
            len(job.tokens),
            job.snapshot.position,
            encoded.size,
            created,
            state=WRITING,
            owner=self.owner,
            since=time.time(),
        )
        claim = self._claim(encoded.size, reserve)
        if claim.status == "exists":
            return  # stored, or being written by another process
        if claim.status == "no_room":
            with self._lock:
                self._n.refused_saves += 1
            self._refused_for_space(
                f"{encoded.size} bytes do not fit ({claim.need} bytes could not be freed: "
                "the rest is protected or being written)"
            )
            return
        self._delete_claimed(idx, claim.victims)
        outcome = "error"  # published | exists | full | blocked | error (the exception propagates)
        size: int | None = None
        try:
            for attempt in range(_ENOSPC_RETRIES + 1):
                try:
                    size = publish(path, encoded, fsync=self.fsync, root=self.root)
                    outcome = "exists" if size is None else "published"
                    break
                except OSError as e:
                    if e.errno not in _NO_ROOM:
                        raise
                    with self._lock:
                        self._n.enospc += 1
                    if attempt == _ENOSPC_RETRIES or not self._free_for_enospc(encoded.size):
                        outcome = "full"
                        break
        except SnapshotFileError as e:  # a link or a file where a folder of ours should be
            outcome = "blocked"
            self._once(f"publish:{e.reason}", "disk cache: cannot write under %s: %s", path.parent, e)
        finally:
            if outcome != "published":
                idx.release(self.namespace, job.key)
        if outcome == "published":
            assert size is not None
            idx.publish(self.namespace, job.key, size, time.time())
            with self._lock:
                self._n.saves += 1
        elif outcome == "full":
            with self._lock:
                self._n.refused_saves += 1
            self._refused_for_space(f"the disk is full (ENOSPC) even after evicting for {encoded.size} bytes")
        elif outcome == "exists":
            # Something was at the path without a row: index it when it is a snapshot of ours.
            with contextlib.suppress(OSError):
                row = self._row_from_file(self.namespace, job.key, os.lstat(path).st_size, Counter())
                if row is not None:
                    idx.insert([row])

    def _free_for_enospc(self, nbytes: int) -> bool:
        """The disk is fuller than its free-space figure said: evict `nbytes` more."""
        claim = self._claim(0, None, floor_deficit=nbytes)
        if claim.status != "ok" or not claim.victims:
            return False
        return self._delete_claimed(self._widx_(), claim.victims) > 0
