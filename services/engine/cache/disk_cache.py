"""The persistent prefix cache: snapshot files under one folder (docs/architecture.md, 'Disk tier').

This file is the tier's API (start/close, contains, save, load, stats, entries, clear); its
parts each have their own file: writer.py (the writer thread, ENOSPC retries), reconcile.py
(the folder scan and index upkeep), eviction.py (budget and free-space floor), disk_state.py
(the settings, counters and error channels they share). The paragraphs below describe the
tier as a whole.

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
import logging
import os
import queue
import secrets
import socket
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from keepwarm.engine.cache.disk_state import Counters
from keepwarm.engine.cache.eviction import default_min_free, disk_free, disk_total
from keepwarm.engine.cache.index import LIVE, NAME, WRITING, CacheIndex, Row, decay
from keepwarm.engine.cache.index_protocol import INDEX_ERRORS, INDEX_KINDS, Index
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_error import SnapshotFileError
from keepwarm.engine.cache.snapshot_file import (
    Alloc,
    read_snapshot,
    read_tokens,
)
from keepwarm.engine.cache.write_job import WriteJob
from keepwarm.engine.cache.writer import Writer

log = logging.getLogger(__name__)  # disk_state.py logs under this name too

HALF_LIFE_S = 6 * 3600.0


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


class DiskCache(Writer):
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
        disk_free: Callable[[Path], int] = disk_free,
        disk_total: Callable[[Path], int] = disk_total,
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
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=queue_size)
        self._queued_bytes = 0  # snapshot bytes of the jobs in the queue or being written
        self._thread: threading.Thread | None = None
        self._closed = False
        self._n = Counters()
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
            job = WriteJob(key, list(tokens), snapshot if detached else snapshot.detached())
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
