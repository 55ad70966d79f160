"""Eviction: the budget and the free-space floor kept by claiming victims in the shared index
and deleting their files (ours only); also what a full disk (ENOSPC) frees before a retry
(docs/architecture.md, 'Disk tier'; disk_cache.py's docstring, 'Budget').
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from keepwarm.engine.cache.disk_state import DiskState
from keepwarm.engine.cache.index import Claim, Row
from keepwarm.engine.cache.index_protocol import Index
from keepwarm.engine.cache.snapshot_file import unlink_if_ours

FLOOR_FRACTION = 0.05  # default free-space floor: this share of the volume ...
FLOOR_CAP = 1 << 30  # ... at most this many bytes


def disk_free(path: Path) -> int:
    return shutil.disk_usage(path).free


def disk_total(path: Path) -> int:
    return shutil.disk_usage(path).total


def default_min_free(total_bytes: int) -> int:
    """The default free-space floor of a volume: 5% of it, at most 1 GiB."""
    return min(int(total_bytes * FLOOR_FRACTION), FLOOR_CAP)


class Eviction(DiskState):
    """Room for incoming bytes, made by claiming and deleting victims."""

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

    def _free_for_enospc(self, nbytes: int) -> bool:
        """The disk is fuller than its free-space figure said: evict `nbytes` more."""
        claim = self._claim(0, None, floor_deficit=nbytes)
        if claim.status != "ok" or not claim.victims:
            return False
        return self._delete_claimed(self._widx_(), claim.victims) > 0
