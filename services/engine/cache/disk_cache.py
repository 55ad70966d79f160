"""The persistent prefix cache: snapshot files under one folder (DESIGN.md §2.4).

Layout: `<root>/<namespace>/<key[:2]>/<key>.safetensors` (snapshot_file.py), plus
per namespace `hits.log` and `hits.lock`.

Writes. `save` never blocks on disk: it marks the key *pending*, takes a
detached copy and hands it to ONE background writer thread through a bounded
queue (full queue: the save is dropped and counted). A pending key is a miss
for `load` (the half-written temp file is invisible anyway: files are published
by link, complete and fsynced) and is never saved twice. The guard refuses
snapshots covering more positions than their key has tokens, before any copy.

Reads. `load` verifies header, namespace, key, tokens, every checksum and then
the caller's geometry callback; any failure deletes the file and counts the
reason, and the call returns None. A missing file is a plain miss. Files that
another process published after our start are found by path (the index is a
budget/score view, not a gate).

Budget. One byte budget for everything under `root` (all namespaces) plus a
free-disk floor. Before each write the writer makes room for the exact file
size: first files of other namespaces (they can never be adopted by this
model; oldest first), then our entries by ascending score
`(decayed_hits + 1) * tokens / bytes`, ties oldest last-use first; hits decay
with a half-life. Pending keys and keys inside `protect(key)` (every `load`
protects its key while reading) are never evicted. A save that cannot fit is
refused, so a file is never stored and then immediately evicted.

Index. Rebuilt at start from headers only (no payload reads): a file with a bad
header, wrong version, wrong size, foreign namespace inside our folder, or a
position past its key is deleted right there. Other namespaces are only
stat-ed. Stray temp files are removed at start when their writer pid is dead
or they are older than `stale_tmp_s`. The index is refreshed (stat scan) before
evicting and every `refresh_s` while idle, so files of other processes sharing
the folder are budgeted too.

Hit ledger (survives restarts, safe for several processes on one folder).
`<namespace>/hits.log` is append-only text: `H <key> <time> <writer-id>` per
hit, and `S <key> <hits> <decayed> <ref> <last_used>` state lines written by
compaction. Appends take `flock(LOCK_SH)` on `hits.lock` and do one O_APPEND
write of one short line. At start the cache takes `flock(LOCK_EX)`, replays the
log, keeps the keys whose files exist, writes the compacted log to a temp file
and renames it over the old one; holding LOCK_EX means no append is in flight,
and later appends open the log by path, so none is lost. On refresh a process
reads the log's new tail (skipping its own writer id, already applied) or,
when the log's inode changed (someone compacted), replays it whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import re
import secrets
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_file import (
    SUFFIX,
    TMP_SUFFIX,
    Alloc,
    SnapshotFileError,
    encode_snapshot,
    publish,
    read_header,
    read_snapshot,
    tmp_writer_pid,
)

log = logging.getLogger(__name__)

HALF_LIFE_S = 6 * 3600.0
_NAME = re.compile(r"[0-9A-Za-z_-]{4,128}")
_LOG = "hits.log"
_LOCK = "hits.lock"
_LOG_COMPACT_BYTES = 8 << 20  # an idle writer compacts the hit log beyond this


@dataclass(frozen=True)
class EntryInfo:
    """One file in the cache folder. Other namespaces' files carry tokens=position=0
    (they are only stat-ed) and created=last_used=mtime."""

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
    """Counters since start. num_entries/num_bytes cover every namespace under the root
    (bytes_by_namespace splits them); `misses` counts every load returning None,
    rejections included."""

    num_entries: int
    num_bytes: int
    bytes_by_namespace: Mapping[str, int]
    saves: int
    dropped_saves: int
    refused_saves: int
    write_errors: int
    evictions: int
    hits: int
    misses: int
    rejected_by_reason: Mapping[str, int]
    bytes_read: int
    read_seconds: float
    pending: int


@dataclass
class _Entry:
    path: Path
    namespace: str
    key: str
    tokens: int
    position: int
    bytes: int
    created: float


@dataclass
class _Hits:
    """Hit state of one key: `decayed` is the decayed hit mass as of time `ref`."""

    hits: int = 0
    decayed: float = 0.0
    ref: float = 0.0
    last_used: float = 0.0

    def at(self, now: float, half_life: float) -> float:
        return self.decayed * 2.0 ** (-max(0.0, now - self.ref) / half_life)

    def hit(self, t: float, half_life: float) -> None:
        self.decayed = self.at(t, half_life) + 1.0
        self.ref = max(self.ref, t)
        self.hits += 1
        self.last_used = max(self.last_used, t)


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
    write_errors: int = 0
    evictions: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    rejected: Counter[str] = field(default_factory=Counter)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listdir(d: Path) -> list[Path]:
    """Children of `d`; empty when another process removed it meanwhile."""
    try:
        return list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


class _HitLedger:
    """The per-namespace append-only hit log (see the module docstring)."""

    def __init__(self, folder: Path, half_life: float) -> None:
        self.log_path = folder / _LOG
        self.lock_path = folder / _LOCK
        self.half_life = half_life
        self.writer_id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.state: dict[str, _Hits] = {}
        self._inode: int | None = None
        self._offset = 0

    @contextlib.contextmanager
    def _flock(self, mode: int) -> Iterator[None]:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    def _apply(self, line: str, skip_own: bool) -> None:
        parts = line.split()
        try:
            if parts[0] == "H" and len(parts) == 4:
                if skip_own and parts[3] == self.writer_id:
                    return
                self.state.setdefault(parts[1], _Hits()).hit(float(parts[2]), self.half_life)
            elif parts[0] == "S" and len(parts) == 6:
                self.state[parts[1]] = _Hits(int(parts[2]), float(parts[3]), float(parts[4]), float(parts[5]))
        except (ValueError, IndexError):
            pass  # a damaged line loses one hit's worth of score, nothing more

    def _read_from(self, offset: int) -> tuple[int | None, str, int]:
        """(inode, text of complete lines from `offset`, new offset)."""
        try:
            with open(self.log_path, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return None, "", 0
        end = data.rfind(b"\n") + 1  # an append in flight may show as a partial last line
        return inode, data[:end].decode("utf-8", "replace"), offset + end

    def reload(self) -> None:
        """Replay the whole log (start, or after another process compacted it)."""
        self.state = {}
        inode, text, offset = self._read_from(0)
        for line in text.splitlines():
            self._apply(line, skip_own=False)
        self._inode, self._offset = inode, offset

    def refresh(self) -> None:
        """Apply other processes' hits appended since the last read."""
        try:
            st = self.log_path.stat()
        except FileNotFoundError:
            return
        if st.st_ino != self._inode or st.st_size < self._offset:
            self.reload()
            return
        inode, text, offset = self._read_from(self._offset)
        if inode != self._inode:
            self.reload()
            return
        for line in text.splitlines():
            self._apply(line, skip_own=True)
        self._offset = offset

    def compact(self, keep: Callable[[str], bool]) -> None:
        """Rewrite the log as one state line per kept key (exclusive lock held)."""
        with self._flock(fcntl.LOCK_EX):
            for stale in self.log_path.parent.glob(f"{_LOG}.*.tmp"):
                stale.unlink(missing_ok=True)  # only a compaction (under LOCK_EX) makes these: a crashed one
            self.reload()
            self.state = {k: v for k, v in self.state.items() if keep(k)}
            tmp = self.log_path.with_name(f"{_LOG}.{self.writer_id}.tmp")
            with open(tmp, "w") as f:
                for k, h in sorted(self.state.items()):
                    f.write(f"S {k} {h.hits} {h.decayed!r} {h.ref!r} {h.last_used!r}\n")
            os.replace(tmp, self.log_path)
            st = self.log_path.stat()
            self._inode, self._offset = st.st_ino, st.st_size

    def size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def record(self, key: str, t: float) -> None:
        """Count a hit in memory and append it to the log."""
        self.state.setdefault(key, _Hits()).hit(t, self.half_life)
        line = f"H {key} {t!r} {self.writer_id}\n".encode()
        with self._flock(fcntl.LOCK_SH):
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def forget_all(self) -> None:
        with self._flock(fcntl.LOCK_EX):
            with contextlib.suppress(FileNotFoundError):
                self.log_path.unlink()
            self.state = {}
            self._inode, self._offset = None, 0


class DiskCache:
    """Snapshot files of one namespace under a shared, budgeted root (see module docstring)."""

    def __init__(
        self,
        root: Path,
        namespace: str,
        *,
        budget_bytes: int,
        min_free_bytes: int,
        queue_size: int = 4,
        fsync: bool = True,
        clock: Callable[[], float] = time.time,
        half_life_s: float = HALF_LIFE_S,
        stale_tmp_s: float = 60.0,
        refresh_s: float = 60.0,
        disk_free: Callable[[Path], int] = _disk_free,
    ) -> None:
        if not _NAME.fullmatch(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 4-128 chars of [0-9A-Za-z_-] (use namespace_id())"
            )
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        if min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0, got {min_free_bytes}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.root = Path(root)
        self.namespace = namespace
        self.folder = self.root / namespace
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.fsync = fsync
        self.half_life_s = half_life_s
        self.stale_tmp_s = stale_tmp_s
        self.refresh_s = refresh_s
        self._clock = clock
        self._disk_free = disk_free
        self._lock = threading.RLock()
        self._entries: dict[Path, _Entry] = {}
        self._pending: set[str] = set()
        self._protected: Counter[str] = Counter()
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._n = _Counters()
        self._ledger = _HitLedger(self.folder, half_life_s)

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> DiskCache:
        """Scan the folder (headers only), clean stray temp files, compact the hit log,
        make room if over budget, start the writer thread."""
        assert self._thread is None, "DiskCache.start() called twice"
        self.folder.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._scan(clean_tmp=True)
            self._ledger.compact(keep=lambda k: self._path(k) in self._entries)
        self._make_room(0)
        self._thread = threading.Thread(
            target=self._writer, name=f"disk-cache-{self.namespace[:8]}", daemon=True
        )
        self._thread.start()
        return self

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

    def __enter__(self) -> DiskCache:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Wait until every accepted save is written (or failed)."""
        self._queue.join()

    # ---- public API ------------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        return self._path(key)

    def contains(self, key: str) -> bool:
        """True when the key is stored or being written (a save would be a no-op)."""
        path = self._path(key)
        with self._lock:
            if key in self._pending or path in self._entries:
                return True
        return path.is_file()

    def save(self, key: str, tokens: Sequence[int], snapshot: Snapshot, *, detached: bool = False) -> bool:
        """Queue `snapshot` (state after `tokens[:snapshot.position]`) under `key`, the key
        of exactly `tokens`. Returns True when accepted. False: refused (position past
        the key, larger than the whole budget), dropped (queue full or closed), or the
        key is already stored or pending. Copies the snapshot unless `detached`."""
        path = self._path(key)
        with self._lock:
            if snapshot.position > len(tokens) or snapshot.num_bytes + 4 * len(tokens) > self.budget_bytes:
                self._n.refused_saves += 1
                return False
            if key in self._pending or path in self._entries:
                return False
            if self._closed or self._thread is None or self._queue.full():
                self._n.dropped_saves += 1
                return False
            self._pending.add(key)
        queued = False
        try:
            if path.exists():  # published by another process since our scan
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
        return True

    def load(
        self,
        key: str,
        tokens: Sequence[int],
        validate: Callable[[Snapshot], None],
        alloc: Alloc | None = None,
    ) -> Snapshot | None:
        """The verified snapshot stored under `key` for exactly `tokens`, or None.

        `validate` raises ValueError (e.g. SnapshotMismatch) when the snapshot does
        not fit the model. Any bad file is deleted and its reason counted; this never
        raises for a bad file. The returned tensors are views into one CPU buffer."""
        path = self._path(key)
        with self._lock:
            if key in self._pending:
                self._n.misses += 1
                return None
            self._protected[key] += 1
        try:
            t0 = time.perf_counter()
            try:
                snapshot, _ = read_snapshot(
                    path, namespace=self.namespace, tokens=tokens, key=key, alloc=alloc
                )
            except FileNotFoundError:
                with self._lock:
                    self._entries.pop(path, None)
                    self._n.misses += 1
                return None
            except SnapshotFileError as e:
                self._reject(path, e.reason, str(e))
                return None
            try:
                validate(snapshot)
            except ValueError as e:
                self._reject(path, "geometry", str(e))
                return None
            elapsed = time.perf_counter() - t0
            now = self._clock()
            size = path.stat().st_size if path.exists() else 0
            with self._lock:
                if path not in self._entries and size:
                    self._entries[path] = _Entry(
                        path, self.namespace, key, len(tokens), snapshot.position, size, now
                    )
                self._n.hits += 1
                self._n.bytes_read += size
                self._n.read_seconds += elapsed
                self._ledger.record(key, now)
            return snapshot
        finally:
            with self._lock:
                self._protected[key] -= 1
                if self._protected[key] <= 0:
                    del self._protected[key]

    @contextlib.contextmanager
    def protect(self, key: str) -> Iterator[None]:
        """Keep `key` from eviction inside the block (e.g. while adopting it)."""
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
        with self._lock:
            by_ns: Counter[str] = Counter()
            for e in self._entries.values():
                by_ns[e.namespace] += e.bytes
            return DiskCacheStats(
                num_entries=len(self._entries),
                num_bytes=sum(by_ns.values()),
                bytes_by_namespace=dict(by_ns),
                saves=self._n.saves,
                dropped_saves=self._n.dropped_saves,
                refused_saves=self._n.refused_saves,
                write_errors=self._n.write_errors,
                evictions=self._n.evictions,
                hits=self._n.hits,
                misses=self._n.misses,
                rejected_by_reason=dict(self._n.rejected),
                bytes_read=self._n.bytes_read,
                read_seconds=self._n.read_seconds,
                pending=len(self._pending),
            )

    def entries(self) -> list[EntryInfo]:
        """Every indexed file, this namespace first, then by namespace and key."""
        now = self._clock()
        with self._lock:
            out = []
            for e in self._entries.values():
                h = self._ledger.state.get(e.key) if e.namespace == self.namespace else None
                h = h or _Hits()
                out.append(
                    EntryInfo(
                        key=e.key,
                        namespace=e.namespace,
                        tokens=e.tokens,
                        position=e.position,
                        bytes=e.bytes,
                        hits=h.hits,
                        decayed_hits=h.at(now, self.half_life_s),
                        last_used=max(h.last_used, e.created),
                        created=e.created,
                    )
                )
        return sorted(out, key=lambda i: (i.namespace != self.namespace, i.namespace, i.key))

    def clear(self, *, all_namespaces: bool = False) -> int:
        """Delete this namespace's files (every namespace's when asked) except pending
        and protected ones, and forget their hits. Returns the number deleted."""
        with self._lock:
            victims = [
                e
                for e in self._entries.values()
                if (all_namespaces or e.namespace == self.namespace)
                and not (
                    e.namespace == self.namespace and (e.key in self._pending or e.key in self._protected)
                )
            ]
            for e in victims:
                self._delete(e.path)
            self._ledger.forget_all()
            return len(victims)

    # ---- internals -------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        if not _NAME.fullmatch(key):
            raise ValueError(f"key {key!r} must be 4-128 chars of [0-9A-Za-z_-] (use prefix_key())")
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def _delete(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._entries.pop(path, None)

    def _reject(self, path: Path, reason: str, detail: str) -> None:
        log.warning("disk cache: rejected %s (%s)", path.name, detail)
        with self._lock:
            self._delete(path)
            self._n.rejected[reason] += 1
            self._n.misses += 1

    def _scan(self, *, clean_tmp: bool) -> None:
        """Rebuild the index from the folder (lock held). Our namespace: headers only;
        others: stat only. Known files are not re-read."""
        seen: set[Path] = set()
        if not self.root.is_dir():
            self._entries.clear()
            return
        for ns_dir in _listdir(self.root):
            if not ns_dir.is_dir() or ns_dir.name.startswith("."):
                continue
            ours = ns_dir.name == self.namespace
            for shard in _listdir(ns_dir):
                if not shard.is_dir():
                    continue
                for f in _listdir(shard):
                    if f.name.endswith(TMP_SUFFIX):
                        if clean_tmp:
                            self._clean_tmp(f)
                        continue
                    if not f.name.endswith(SUFFIX):
                        continue
                    if f in self._entries:
                        seen.add(f)
                        continue
                    entry = self._index_file(f, ns_dir.name, ours)
                    if entry is not None:
                        self._entries[f] = entry
                        seen.add(f)
        for gone in [p for p in self._entries if p not in seen]:
            del self._entries[gone]

    def _index_file(self, f: Path, namespace: str, ours: bool) -> _Entry | None:
        try:
            if not ours:
                st = f.stat()
                return _Entry(f, namespace, f.name[: -len(SUFFIX)], 0, 0, st.st_size, st.st_mtime)
            header = read_header(f)
            header.check(namespace=self.namespace, key=f.name[: -len(SUFFIX)])
        except FileNotFoundError:
            return None
        except SnapshotFileError as e:
            self._reject(f, e.reason, str(e))
            return None
        return _Entry(
            f, namespace, header.key, header.key_tokens, header.position, header.file_bytes, header.created
        )

    def _clean_tmp(self, f: Path) -> None:
        try:
            age = time.time() - f.stat().st_mtime  # wall clock: mtimes are wall time
        except FileNotFoundError:
            return
        pid = tmp_writer_pid(f.name)
        if pid is None or not _pid_alive(pid) or age > self.stale_tmp_s:
            with contextlib.suppress(FileNotFoundError):
                f.unlink()

    def _need(self, incoming: int, free: int | None) -> int:
        """Bytes to evict so `incoming` more bytes fit the budget and the free-disk floor."""
        total = sum(e.bytes for e in self._entries.values())
        need = total + incoming - self.budget_bytes
        if free is not None:
            need = max(need, self.min_free_bytes - (free - incoming))
        return need

    def _victims(self) -> list[_Entry]:
        """Eviction order: other namespaces oldest first, then ours by ascending score."""
        now = self._clock()
        foreign = sorted(
            (e for e in self._entries.values() if e.namespace != self.namespace),
            key=lambda e: (e.created, e.key),
        )
        mine = []
        for e in self._entries.values():
            if e.namespace != self.namespace or e.key in self._pending or e.key in self._protected:
                continue
            h = self._ledger.state.get(e.key) or _Hits()
            score = (h.at(now, self.half_life_s) + 1.0) * e.tokens / max(e.bytes, 1)
            mine.append((score, max(h.last_used, e.created), e.key, e))
        mine.sort(key=lambda x: x[:3])
        return foreign + [m[3] for m in mine]

    def _make_room(self, incoming: int) -> bool:
        """Evict until `incoming` more bytes fit budget and floor; False if they cannot.
        The free-space query runs outside the lock (it may be slow on network disks)."""
        free = self._disk_free(self.root) if self.min_free_bytes > 0 else None
        with self._lock:
            if self._need(incoming, free) <= 0:
                return True
            self._scan(clean_tmp=False)  # budget what other processes wrote or removed
            self._ledger.refresh()
            need = self._need(incoming, free)
            for victim in self._victims():
                if need <= 0:
                    break
                self._delete(victim.path)
                need -= victim.bytes
                self._n.evictions += 1
            return need <= 0

    def _refresh(self) -> None:
        """Idle-time upkeep: pick up other processes' files and hits; compact a long log."""
        with self._lock:
            self._scan(clean_tmp=False)
            self._ledger.refresh()
            if self._ledger.size() > _LOG_COMPACT_BYTES:
                self._ledger.compact(keep=lambda k: self._path(k) in self._entries)

    def _writer(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=self.refresh_s)
            except queue.Empty:
                self._refresh()
                continue
            if job is None:
                self._queue.task_done()
                return
            try:
                self._write(job)
            except Exception:
                log.exception("disk cache: writing %s failed", job.key)
                with self._lock:
                    self._n.write_errors += 1
            finally:
                with self._lock:
                    self._pending.discard(job.key)
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        path = self._path(job.key)
        created = self._clock()
        encoded = encode_snapshot(
            namespace=self.namespace, key=job.key, tokens=job.tokens, snapshot=job.snapshot, created=created
        )
        if not self._make_room(encoded.size):
            with self._lock:
                self._n.refused_saves += 1
            return
        size = publish(path, encoded, fsync=self.fsync)
        if size is None:
            return  # another process published this key first
        with self._lock:
            self._entries[path] = _Entry(
                path, self.namespace, job.key, len(job.tokens), job.snapshot.position, size, created
            )
            self._n.saves += 1
