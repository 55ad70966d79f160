"""The disk cache's index: one SQLite database in WAL mode per cache folder
(`<root>/index.sqlite3`), shared by every process using the folder. (For a folder shared by
several hosts the index lives in Valkey instead: valkey_index.py; index_protocol.py is the
interface both implement. The row model below is shared by both.)

It holds one row per snapshot file of every namespace: where it is, what it covers
(tokens, position), its size and creation time, and its hit statistics (count,
decayed hit mass, last use), plus one row per running engine (`engines`: which
namespaces are in use). Lookups query it instead of listing the folder; several
engines on one folder share hit statistics and one byte budget through it.

Row states: LIVE (a published file), WRITING (a reservation: a writer has
claimed the key and its bytes and is writing the file), EVICTING (an eviction
claimed by one process, which deletes the file and then the row). Claims are made
in one `BEGIN IMMEDIATE` transaction, so two processes never reserve the same key
or evict the same bytes twice, and the budget counts every writer's reservations.
A crashed process leaves WRITING/EVICTING rows; they are resolved once stale (the
disk cache's reconcile).

Trust. The database is a view of the folder, never an authority over it: rows are
validated when read (names, numbers), a garbage row is dropped, a path is always
derived from (namespace, key), and the files are checked before any deletion
(snapshot_file.unlink_if_ours). A missing, corrupt or foreign-schema database is
replaced by an empty one and refilled from the file headers (torn writes are
SQLite's: WAL frames are checksummed). The database, its -wal and -shm must be
regular files: a link there is refused (start fails naming it), never followed.
WAL needs shared memory; where the file system refuses it (some network file
systems), SQLite's default rollback journal is used instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sqlite3
import stat
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DB_NAME = "index.sqlite3"
SCHEMA_VERSION = 1
LIVE, WRITING, EVICTING = 0, 1, 2
NAME = re.compile(r"[0-9A-Za-z_-]{4,128}")
_TIMEOUT_S = 10.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    path TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    position INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    created REAL NOT NULL,
    state INTEGER NOT NULL,
    owner TEXT NOT NULL,
    since REAL NOT NULL,
    hits INTEGER NOT NULL,
    decayed REAL NOT NULL,
    ref REAL NOT NULL,
    last_used REAL NOT NULL,
    PRIMARY KEY (namespace, key)
) STRICT, WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_by_length ON entries (namespace, tokens) WHERE state = 0;
CREATE TABLE IF NOT EXISTS engines (
    id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    expires REAL NOT NULL
) STRICT;
"""
_COLUMNS = "namespace, key, path, tokens, position, bytes, created, state, owner, since, hits, decayed, ref, last_used"


class _NoRoom(Exception):
    def __init__(self, need: int) -> None:
        super().__init__(need)
        self.need = need


class IndexUnusable(Exception):
    """The index file cannot be used as it is (a link or folder where it should be)."""


def rel_path(namespace: str, key: str) -> str:
    """The file of (namespace, key), relative to the cache root."""
    return f"{namespace}/{key[:2]}/{key}.safetensors"


def decay(decayed: float, ref: float, now: float, half_life: float) -> float:
    """Decayed hit mass `decayed` (as of `ref`) seen at `now`."""
    return decayed * 2.0 ** (-max(0.0, now - ref) / half_life)


@dataclass(frozen=True)
class Row:
    namespace: str
    key: str
    tokens: int
    position: int
    bytes: int
    created: float
    state: int = LIVE
    owner: str = ""
    since: float = 0.0
    hits: int = 0
    decayed: float = 0.0
    ref: float = 0.0
    last_used: float = 0.0

    def score(self, now: float, half_life: float) -> float:
        """Eviction score: (decayed hits + 1) * tokens / bytes (higher stays)."""
        return (decay(self.decayed, self.ref, now, half_life) + 1.0) * self.tokens / max(self.bytes, 1)

    def values(self) -> tuple[object, ...]:
        return (
            self.namespace,
            self.key,
            rel_path(self.namespace, self.key),
            self.tokens,
            self.position,
            self.bytes,
            self.created,
            self.state,
            self.owner,
            self.since,
            self.hits,
            self.decayed,
            self.ref,
            self.last_used,
        )


def _count(v: object) -> int:
    """A database integer field: an int (not a bool) in [0, 2**62)."""
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62:
        return v
    raise ValueError(f"not a count: {v!r}")


def _time(v: object) -> float:
    """A database time or score field: a finite number."""
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    raise ValueError(f"not a finite number: {v!r}")


def valid_row(raw: Sequence[object]) -> Row | None:
    """A Row from a database row, or None when any field is garbage."""
    try:
        ns, key, path, tokens, position, nbytes, created, state, owner, since, hits, dec, ref, last = raw
        if not (isinstance(ns, str) and isinstance(key, str) and isinstance(owner, str)):
            return None
        if not (NAME.fullmatch(ns) and NAME.fullmatch(key) and path == rel_path(ns, key)):
            return None
        row = Row(ns, key, _count(tokens), _count(position), _count(nbytes), _time(created), _count(state),
                  owner, _time(since), _count(hits), _time(dec), _time(ref), _time(last))  # fmt: skip
        if row.state not in (LIVE, WRITING, EVICTING) or row.position > row.tokens or row.decayed < 0:
            return None
        return row
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Claim:
    """The outcome of `CacheIndex.claim`: `status` "ok" (victims marked EVICTING for
    this owner, the reservation made), "exists" (the key has a row: nothing done) or
    "no_room" (nothing done; `need` bytes could not be freed)."""

    status: str
    victims: tuple[Row, ...] = ()
    need: int = 0


@dataclass(frozen=True)
class Usage:
    """LIVE rows per namespace (count, bytes) and the bytes every row but EVICTING ones hold."""

    by_namespace: dict[str, tuple[int, int]]
    committed_bytes: int


def _check_regular(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise IndexUnusable(
            f"{path} is not a regular file (a link or a folder): remove it; the cache rebuilds its index"
        )


class CacheIndex:
    """One connection to the folder's index. Thread-safe (one lock); a process opens one
    per thread that must not wait on another's queries."""

    def __init__(self, root: Path, *, owner: str, timeout_s: float = _TIMEOUT_S) -> None:
        self.root = Path(root)
        self.path = self.root / DB_NAME
        self.owner = owner
        self._lock = threading.RLock()
        self._gen = 0  # bumped by this connection's own commits (data_version does not see them)
        self._lengths: dict[str, tuple[tuple[int, int], frozenset[int]]] = {}
        self.rebuilt = False  # the database was missing, damaged or foreign and started empty
        for suffix in ("", "-wal", "-shm"):
            _check_regular(self.path.with_name(DB_NAME + suffix))
        existed = self.path.exists()
        try:
            self._conn = self._open(timeout_s)
        except sqlite3.DatabaseError as e:
            log.warning("disk cache: index %s unusable (%s); starting an empty one", self.path, e)
            self._discard()
            self._conn = self._open(timeout_s)
            existed = False
        self.rebuilt = not existed or self.rebuilt

    # ---- connection ------------------------------------------------------------------

    def _open(self, timeout_s: float) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                log.warning("disk cache: index %s cannot use WAL here (journal mode %s)", self.path, mode)
            conn.execute("PRAGMA synchronous=NORMAL")
            # Keep the WAL small (the cache may live on a small volume): checkpoint every
            # 64 pages, truncate the file back to 1 MiB after a checkpoint.
            conn.execute("PRAGMA wal_autocheckpoint=64")
            conn.execute("PRAGMA journal_size_limit=1048576")
            ok = conn.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {ok}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION) or (
                version == SCHEMA_VERSION and not self._schema_ok(conn)
            ):
                log.warning("disk cache: index %s has another schema (%s); rebuilding it", self.path, version)
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("DROP TABLE IF EXISTS entries")
                conn.execute("DROP TABLE IF EXISTS engines")
                conn.execute("COMMIT")
                self.rebuilt = True
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _schema_ok(conn: sqlite3.Connection) -> bool:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(entries)")]
        return cols == [c.strip() for c in _COLUMNS.split(",")]

    def _discard(self) -> None:
        """Remove a damaged database (regular files only) so an empty one replaces it."""
        for suffix in ("", "-wal", "-shm"):
            p = self.path.with_name(DB_NAME + suffix)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISREG(os.lstat(p).st_mode):
                    p.unlink()
        self.rebuilt = True

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One IMMEDIATE transaction: the folder-wide write lock is held from its start,
        so what it reads is what it changes."""
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            self._gen += 1

    def _rows(self, sql: str, args: Iterable[object] = ()) -> tuple[list[Row], int]:
        """Valid rows of a SELECT of every column, and how many garbage rows it returned."""
        good, bad = [], 0
        for raw in self._conn.execute(sql, tuple(args)):
            row = valid_row(raw)
            if row is None:
                bad += 1
            else:
                good.append(row)
        return good, bad

    # ---- reads -----------------------------------------------------------------------

    def get(self, namespace: str, key: str) -> Row | None:
        with self._lock:
            rows, _ = self._rows(
                f"SELECT {_COLUMNS} FROM entries WHERE namespace=? AND key=?", (namespace, key)
            )
        return rows[0] if rows else None

    def rows(self, namespace: str | None = None, states: Sequence[int] = (LIVE,)) -> list[Row]:
        marks = ",".join("?" * len(states))
        sql = f"SELECT {_COLUMNS} FROM entries WHERE state IN ({marks})"
        args: list[object] = list(states)
        if namespace is not None:
            sql += " AND namespace=?"
            args.append(namespace)
        with self._lock:
            return self._rows(sql, args)[0]

    def lengths(self, namespace: str) -> frozenset[int]:
        """Distinct token counts of LIVE entries of `namespace`: cached until any
        process commits a change (PRAGMA data_version) or this connection does."""
        with self._lock:
            version = (int(self._conn.execute("PRAGMA data_version").fetchone()[0]), self._gen)
            cached = self._lengths.get(namespace)
            if cached is not None and cached[0] == version:
                return cached[1]
            found = frozenset(
                int(t)
                for (t,) in self._conn.execute(
                    "SELECT DISTINCT tokens FROM entries WHERE namespace=? AND state=0", (namespace,)
                )
                if isinstance(t, int) and t >= 0
            )
            self._lengths[namespace] = (version, found)
            return found

    def usage(self) -> Usage:
        with self._lock:
            by_ns = {
                str(ns): (int(n), int(b or 0))
                for ns, n, b in self._conn.execute(
                    "SELECT namespace, COUNT(*), SUM(bytes) FROM entries WHERE state=0 GROUP BY namespace"
                )
            }
            (committed,) = self._conn.execute(
                "SELECT COALESCE(SUM(bytes), 0) FROM entries WHERE state<>2"
            ).fetchone()
        return Usage(by_ns, int(committed))

    # ---- writes ----------------------------------------------------------------------

    def record_hit(
        self, namespace: str, key: str, t: float, half_life: float, adopt: Row | None = None
    ) -> bool:
        """Count a hit at time `t`. Without a row, insert `adopt` (a file found by path:
        its hit is its first) when given. False when no row was there or made."""
        with self._write() as c:
            row = _one(
                self._rows(f"SELECT {_COLUMNS} FROM entries WHERE namespace=? AND key=?", (namespace, key))
            )
            if row is None:
                if adopt is None:
                    return False
                c.execute(f"INSERT OR IGNORE INTO entries ({_COLUMNS}) VALUES ({_marks()})", adopt.values())
                row = adopt
                if row.state != LIVE:
                    return True
            c.execute(
                "UPDATE entries SET hits=?, decayed=?, ref=?, last_used=? WHERE namespace=? AND key=?",
                (
                    row.hits + 1,
                    decay(row.decayed, row.ref, t, half_life) + 1.0,
                    max(row.ref, t),
                    max(row.last_used, t),
                    namespace,
                    key,
                ),
            )
            return True

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
    ) -> Claim:
        """Make room for `incoming` bytes in one transaction: bytes to free are the budget
        excess (every LIVE and WRITING row counts) or `floor_deficit`, whichever is
        larger. Victims, in order: LIVE entries of namespaces no running engine uses
        (oldest first), then LIVE entries of every namespace in use, `protected` ones
        excepted (keys of `namespace`), by ascending score, least recently used first. They are marked
        EVICTING for this owner and `reserve` (a WRITING row) is inserted, all or
        nothing. The caller deletes the victims' files, then `forget_evicted`."""
        try:
            return self._claim(
                namespace, reserve, incoming, budget, floor_deficit, protected, now, wall, half_life
            )
        except _NoRoom as e:
            return Claim("no_room", need=e.need)

    def _claim(
        self,
        namespace: str,
        reserve: Row | None,
        incoming: int,
        budget: int,
        floor_deficit: int,
        protected: Collection[str],
        now: float,
        wall: float,
        half_life: float,
    ) -> Claim:
        with self._write() as c:
            if (
                reserve is not None
                and c.execute(
                    "SELECT 1 FROM entries WHERE namespace=? AND key=?", (reserve.namespace, reserve.key)
                ).fetchone()
            ):
                return Claim("exists")
            (committed,) = c.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries WHERE state<>2").fetchone()
            need = max(int(committed) + incoming - budget, floor_deficit)
            victims: list[Row] = []
            if need > 0:
                active = {namespace} | {
                    str(ns)
                    for (ns,) in c.execute("SELECT DISTINCT namespace FROM engines WHERE expires>?", (wall,))
                }
                live, bad = self._rows(f"SELECT {_COLUMNS} FROM entries WHERE state=0")
                if bad:
                    self._drop_garbage(c)
                idle = sorted(
                    (r for r in live if r.namespace not in active), key=lambda r: (r.created, r.key)
                )
                used = sorted(
                    (
                        r
                        for r in live
                        if r.namespace in active and not (r.namespace == namespace and r.key in protected)
                    ),
                    key=lambda r: (r.score(now, half_life), max(r.last_used, r.created), r.key),
                )
                for r in idle + used:
                    if need <= 0:
                        break
                    victims.append(r)
                    need -= r.bytes
                if need > 0:
                    raise _NoRoom(need)  # rolls the transaction back: nothing claimed
                c.executemany(
                    "UPDATE entries SET state=2, owner=?, since=? WHERE namespace=? AND key=? AND state=0",
                    [(self.owner, wall, v.namespace, v.key) for v in victims],
                )
            if reserve is not None:
                c.execute(f"INSERT INTO entries ({_COLUMNS}) VALUES ({_marks()})", reserve.values())
            return Claim("ok", tuple(victims), need)

    def claim_keys(self, keys: Iterable[tuple[str, str]], wall: float) -> list[Row]:
        """Mark these LIVE entries EVICTING for this owner (e.g. clearing a namespace);
        the rows actually claimed."""
        out = []
        with self._write() as c:
            for ns, key in keys:
                row = _one(
                    self._rows(
                        f"SELECT {_COLUMNS} FROM entries WHERE namespace=? AND key=? AND state=0", (ns, key)
                    )
                )
                if row is not None:
                    c.execute(
                        "UPDATE entries SET state=2, owner=?, since=? WHERE namespace=? AND key=?",
                        (self.owner, wall, ns, key),
                    )
                    out.append(row)
        return out

    def forget_evicted(self, rows: Iterable[Row]) -> None:
        """Drop the rows of evictions this owner claimed (their files are gone)."""
        with self._write() as c:
            c.executemany(
                "DELETE FROM entries WHERE namespace=? AND key=? AND state=2 AND owner=?",
                [(r.namespace, r.key, self.owner) for r in rows],
            )

    def publish(self, namespace: str, key: str, nbytes: int, wall: float) -> None:
        """This owner's reservation became a published file of `nbytes`."""
        with self._write() as c:
            c.execute(
                "UPDATE entries SET state=0, bytes=?, owner='', since=? "
                "WHERE namespace=? AND key=? AND state=1 AND owner=?",
                (nbytes, wall, namespace, key, self.owner),
            )

    def release(self, namespace: str, key: str) -> None:
        """Drop this owner's reservation (the write failed or was refused)."""
        with self._write() as c:
            c.execute(
                "DELETE FROM entries WHERE namespace=? AND key=? AND state=1 AND owner=?",
                (namespace, key, self.owner),
            )

    def insert(self, rows: Iterable[Row]) -> None:
        """Rows for files found in the folder (no row yet): kept when one appeared meanwhile."""
        with self._write() as c:
            c.executemany(
                f"INSERT OR IGNORE INTO entries ({_COLUMNS}) VALUES ({_marks()})", [r.values() for r in rows]
            )

    def remove(self, rows: Iterable[Row]) -> None:
        """Drop these LIVE rows (their files are gone or bad), each only while it is the
        publication it was read as (`created` and `since`): a row that another process
        published again meanwhile, its file on disk, stays."""
        with self._write() as c:
            c.executemany(
                "DELETE FROM entries WHERE namespace=? AND key=? AND state=0 AND created=? AND since=?",
                [(r.namespace, r.key, r.created, r.since) for r in rows],
            )

    def all_rows(self) -> tuple[list[Row], int]:
        """Every valid row in any state, and the number of garbage rows (for reconcile)."""
        with self._lock:
            return self._rows(f"SELECT {_COLUMNS} FROM entries")

    def drop_garbage(self) -> int:
        with self._write() as c:
            return self._drop_garbage(c)

    def _drop_garbage(self, c: sqlite3.Connection) -> int:
        """Delete every row that does not validate; the number deleted."""
        bad = [
            (raw[0], raw[1]) for raw in c.execute(f"SELECT {_COLUMNS} FROM entries") if valid_row(raw) is None
        ]
        c.executemany("DELETE FROM entries WHERE namespace IS ? AND key IS ?", bad)
        return len(bad)

    def resolve(self, row: Row, *, exists: bool, size: int | None) -> None:
        """Settle a stale WRITING/EVICTING row (its owner is gone): LIVE again when its
        file is there with the size it claims... or gone otherwise."""
        with self._write() as c:
            if exists and size is not None:
                c.execute(
                    "UPDATE entries SET state=0, bytes=?, owner='', since=0 WHERE namespace=? AND key=? AND state=? AND owner=?",
                    (size, row.namespace, row.key, row.state, row.owner),
                )
            else:
                c.execute(
                    "DELETE FROM entries WHERE namespace=? AND key=? AND state=? AND owner=?",
                    (row.namespace, row.key, row.state, row.owner),
                )

    def heartbeat(self, namespace: str, expires: float) -> None:
        """This owner runs an engine of `namespace` until at least `expires` (wall time)."""
        with self._write() as c:
            c.execute(
                "INSERT INTO engines (id, namespace, expires) VALUES (?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET namespace=excluded.namespace, expires=excluded.expires",
                (self.owner, namespace, expires),
            )
            c.execute("DELETE FROM engines WHERE expires < ?", (expires - 7 * 86400,))

    def leave(self) -> None:
        with self._write() as c:
            c.execute("DELETE FROM engines WHERE id=?", (self.owner,))


def _marks() -> str:
    return ",".join("?" * len(_COLUMNS.split(",")))


def _one(found: tuple[list[Row], int]) -> Row | None:
    rows, _ = found
    return rows[0] if rows else None
