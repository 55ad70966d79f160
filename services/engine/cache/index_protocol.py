"""What the disk cache (disk_cache.py) needs of its index, whichever backend holds it.

Two implementations, chosen by the engine's `--cache-index` setting:

  - `sqlite` (index.py, CacheIndex): a SQLite database in the cache folder, for a folder
    used by the processes of one host (its WAL index lives in shared memory, per host);
  - `redis` (valkey_index.py, ValkeyIndex): a Valkey (or Redis) server at
    `--cache-index-url`, for a folder shared by engines on several hosts (a ReadWriteMany
    volume). Every multi-key decision is one Lua script there.

Both keep the same rows (index.Row), states (LIVE, WRITING, EVICTING) and semantics: see
CacheIndex's methods for what each one does. An index operation that cannot reach its
backend raises one of INDEX_ERRORS; the disk cache counts it (`errors_by_kind`) and serves
on without the index (a lookup is a miss, a save is not written).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from keepwarm.engine.cache.index import LIVE, Claim, Row, Usage


class IndexDown(Exception):
    """The index's server cannot be reached, timed out or refused a command: this operation
    did nothing that the caller can rely on (a script either ran whole or not at all)."""


INDEX_KINDS = ("sqlite", "redis")  # the engine's --cache-index: index.py, valkey_index.py
INDEX_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error, IndexDown)


class Index(Protocol):
    """One process's handle on the folder's index (CacheIndex's methods, same meaning)."""

    owner: str

    def get(self, namespace: str, key: str) -> Row | None: ...

    def rows(self, namespace: str | None = None, states: Sequence[int] = (LIVE,)) -> list[Row]: ...

    def lengths(self, namespace: str) -> frozenset[int]: ...

    def usage(self) -> Usage: ...

    def record_hit(
        self, namespace: str, key: str, t: float, half_life: float, adopt: Row | None = None
    ) -> bool: ...

    def claim(
        self,
        *,
        namespace: str,
        reserve: Row | None,
        incoming: int,
        budget: int,
        floor_deficit: int,
        protected: Collection[str],
        now: float,
        wall: float,
        half_life: float,
    ) -> Claim: ...

    def claim_keys(self, keys: Iterable[tuple[str, str]], wall: float) -> list[Row]: ...

    def forget_evicted(self, rows: Iterable[Row]) -> None: ...

    def publish(self, namespace: str, key: str, nbytes: int, wall: float) -> None: ...

    def release(self, namespace: str, key: str) -> None: ...

    def insert(self, rows: Iterable[Row]) -> None: ...

    def remove(self, rows: Iterable[Row]) -> None: ...

    def all_rows(self) -> tuple[list[Row], int]: ...

    def drop_garbage(self) -> int: ...

    def resolve(self, row: Row, *, exists: bool, size: int | None) -> None: ...

    def heartbeat(self, namespace: str, expires: float) -> None: ...

    def leave(self) -> None: ...

    def close(self) -> None: ...
