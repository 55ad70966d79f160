"""The RAM tier: an LRU of snapshots in front of the disk cache (docs/architecture.md, 'RAM tier').

Keys are the same prefix keys as on disk (prefix_key.prefix_key), values the key's
token ids and a snapshot that aliases no live state. The budget counts snapshot
tensor bytes (`Snapshot.num_bytes`); an entry larger than the whole budget is
refused rather than flushing everything else. Thread-safe: the scheduler and
the HTTP side may both touch it. A caller that got a snapshot keeps it alive by
reference even if the entry is evicted meanwhile.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from keepwarm.engine.cache.snapshot import Snapshot


@dataclass(frozen=True)
class MemoryCacheStats:
    entries: int
    bytes: int
    budget_bytes: int
    hits: int
    misses: int
    evictions: int
    refused: int


class MemoryCache:
    """Byte-budgeted LRU: key -> (tokens, detached Snapshot)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 (0 disables the RAM tier), got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[tuple[int, ...], Snapshot]] = OrderedDict()  # LRU first
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._refused = 0

    def get(self, key: str) -> tuple[list[int], Snapshot] | None:
        """(tokens, snapshot) and mark the entry most recently used; None on a miss."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self._misses += 1
                return None
            self._items.move_to_end(key)
            self._hits += 1
            return list(item[0]), item[1]

    def put(self, key: str, tokens: Sequence[int], snapshot: Snapshot, *, detached: bool = False) -> bool:
        """Store a copy of `snapshot` (no copy when the caller says it is `detached`),
        evicting least recently used entries to fit. False when it is larger than the
        whole budget (counted as refused). Re-putting a stored key only refreshes it."""
        size = snapshot.num_bytes
        if snapshot.position > len(tokens):
            raise ValueError(
                f"snapshot covers {snapshot.position} positions but the key has {len(tokens)} tokens"
            )
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return True
            if size > self.budget_bytes:
                self._refused += 1
                return False
        snap = snapshot if detached else snapshot.detached()  # the copy runs outside the lock
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return True
            while self._bytes + size > self.budget_bytes:
                _, (_, old) = self._items.popitem(last=False)
                self._bytes -= old.num_bytes
                self._evictions += 1
            self._items[key] = (tuple(tokens), snap)
            self._bytes += size
            return True

    def remove(self, key: str) -> bool:
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return False
            self._bytes -= item[1].num_bytes
            return True

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._items)

    def token_counts(self) -> set[int]:
        """The distinct key lengths held (probe candidates); no LRU or hit-count effect."""
        with self._lock:
            return {len(tokens) for tokens, _ in self._items.values()}

    def tokens(self, key: str) -> list[int] | None:
        """The tokens `key` was stored under, without counting a hit or touching LRU order."""
        with self._lock:
            item = self._items.get(key)
            return None if item is None else list(item[0])

    def stats(self) -> MemoryCacheStats:
        with self._lock:
            return MemoryCacheStats(
                entries=len(self._items),
                bytes=self._bytes,
                budget_bytes=self.budget_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                refused=self._refused,
            )
