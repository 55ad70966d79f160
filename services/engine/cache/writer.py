"""The disk tier's one background writer thread: takes queued saves, claims room and a
reservation in the index, publishes each file atomically, retries a full disk (ENOSPC) after
eviction, and keeps the index up (heartbeat, reconcile while idle). It cannot die: any error
is counted by kind and logged once per kind (disk_cache.py's docstring, 'Writes').
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
import time
from collections import Counter

from keepwarm.engine.cache.eviction import Eviction
from keepwarm.engine.cache.index import WRITING, Row
from keepwarm.engine.cache.reconcile import Reconcile
from keepwarm.engine.cache.snapshot_error import SnapshotFileError
from keepwarm.engine.cache.snapshot_file import encode_snapshot, publish
from keepwarm.engine.cache.write_job import WriteJob

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_ENOSPC_RETRIES = 3


class Writer(Eviction, Reconcile):
    """The writer thread's loop and one write."""

    _last_upkeep: float  # DiskState's (mypy sees keepwarm.* imports as Any)

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

    def _write(self, job: WriteJob) -> None:
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
