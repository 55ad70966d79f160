"""What the disk tier's parts share (disk_cache.py, writer.py, reconcile.py, eviction.py): its
settings and state as typed attributes, its counters, the paths of entries, and the error and
log channels (an error the tier survives is counted by kind and logged once per kind)."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm.engine.cache.index import LIVE, NAME
from keepwarm.engine.cache.index_protocol import INDEX_ERRORS, Index
from keepwarm.engine.cache.snapshot_file import SUFFIX, unlink_if_ours
from keepwarm.engine.cache.write_job import WriteJob

log = logging.getLogger("keepwarm.engine.cache.disk_cache")  # one logger for the whole tier


@dataclass
class Counters:
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


class DiskState:
    """The disk tier's settings, state and shared helpers; DiskCache sets every attribute."""

    root: Path
    namespace: str
    budget_bytes: int
    min_free_bytes: int
    fsync: bool
    queue_bytes: int | None
    writer_nice: int
    half_life_s: float
    stale_s: float
    refresh_s: float
    block_bytes: int
    index_slack: int
    owner: str
    _clock: Callable[[], float]
    _disk_free: Callable[[Path], int]
    _lock: threading.RLock
    _pending: set[str]
    _protected: Counter[str]
    _queue: queue.Queue[WriteJob | None]
    _queued_bytes: int
    _n: Counters
    _foreign: Counter[str]
    _logged: set[str]
    _idx: Index | None
    _widx: Index | None
    _last_upkeep: float
    _last_heartbeat: float

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
        """A LIVE row whose file is gone (deleted by hand): drop it. The row is read before
        the file is looked for, so one published again after the look stays."""
        try:
            row = self._ridx().get(namespace, key)
            if row is not None and row.state == LIVE and not os.path.lexists(self._path(namespace, key)):
                self._ridx().remove([row])
        except INDEX_ERRORS as e:
            self._error("index", e)

    def _reject(self, namespace: str, key: str, reason: str, detail: str, *, count_miss: bool = True) -> bool:
        """A file that must not be adopted: deleted when it is ours (counted by reason),
        left alone otherwise; its row is dropped either way."""
        path = self._path(namespace, key)
        try:
            row = self._ridx().get(namespace, key)  # the publication whose file goes now
        except INDEX_ERRORS as e:
            self._error("index", e)
            row = None
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
        if row is not None and row.state == LIVE:
            try:
                self._ridx().remove([row])
            except INDEX_ERRORS as e:
                self._error("index", e)
        return deleted
