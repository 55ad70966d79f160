"""The disk cache's index in Valkey (or Redis), for a cache folder that engines on several
hosts share (a ReadWriteMany volume, where SQLite's WAL, whose shared-memory index is per
host, cannot be used): `--cache-index redis --cache-index-url redis://HOST:6379/1`.

Same rows, states and meaning as the SQLite index (index.py, CacheIndex; the interface is
index_protocol.Index). Every key carries the folder's identity, a random id written once
into `<root>/index.id` (created with a link, so the first process wins and every other one,
on any host, reads the same id), as a hash tag: `keepwarm:cache:{<id>}:...`. Two folders
never share keys on one server; the copy of a folder shares its original's keys until its
`index.id` is deleted (a new id is then made, and the old keys are left to whoever owns them).

Keys (P = `keepwarm:cache:{<id>}`):
  P:rows:<namespace>   hash: snapshot key -> its row, a JSON array
                       [tokens, position, bytes, created, state, owner, since, hits,
                        decayed, ref, last_used] (numbers written with 17 significant digits)
  P:namespaces         set: the namespaces with a rows hash
  P:usage              hash: `committed` (bytes of every row but EVICTING ones),
                       `n:<namespace>` / `b:<namespace>` (LIVE rows and their bytes)
  P:version            counter, bumped by every row change (lengths() caches on it)
  P:engines            hash: owner -> namespace of each running engine
  P:expiry             sorted set: owner -> wall time its heartbeat expires

Atomicity. Every change is one Lua script (EVALSHA, loaded again after a server restart):
what it reads is what it changes, with no other client in between, exactly like one
`BEGIN IMMEDIATE` transaction of the SQLite index. `claim` reads the committed bytes, picks
victims (namespaces without a live engine first, oldest first; then by ascending decayed
score), marks them EVICTING and inserts the reservation in one script; `publish`, `release`,
`resolve`, `forget_evicted` act only when the row is still in the state and owner the
caller expects; `P:usage` is kept by the same scripts that change rows. Nothing is read in
Python and written back. A script either runs whole or not at all: a connection lost
mid-call leaves the index as before or as after, never half-changed.

Trust. Rows are validated when read (index.valid_row) and in every script (a row that does
not decode, or has a name no snapshot may have, is skipped, never a victim, and dropped by
drop_garbage, which then counts P:usage again from the rows); paths are derived from
(namespace, key), files are checked before deletion (the disk cache's unlink_if_ours).

Valkey down. Every operation raises IndexDown (index_protocol.INDEX_ERRORS) after at most
`timeout_s`; after a connection error the index fails fast for `retry_s` before trying the
server again, so requests do not each wait for a dead server. The disk cache counts these
errors and serves on: lookups are misses (no disk hits), saves are not written (the budget
cannot be enforced without the index). A stale reservation or eviction left by an error or a
crash is settled by a later reconcile. Opening the index needs the server: the engine does not
start without it (the error names --cache-index-url). A server that restarts empty is
refilled from the files' headers by the next reconcile (every refresh_s while idle), so keep
it persistent (the Kubernetes stack's Valkey uses an append-only file).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis

from keepwarm.engine.cache.index import (
    LIVE,
    Claim,
    IndexUnusable,
    Row,
    Usage,
    rel_path,
    valid_row,
)
from keepwarm.engine.cache.index_protocol import IndexDown

ID_NAME = "index.id"  # not a namespace name (the folder scan skips names with a dot)
_ID = re.compile(r"[0-9a-f]{32}")
_TIMEOUT_S = 2.0
_RETRY_S = 5.0
T = TypeVar("T")

# ---- Lua ------------------------------------------------------------------------------
# Every script gets the key prefix P as ARGV[1] and builds its key names from it (one
# standalone server: the hash tag keeps every key of a folder in one cluster slot too).

_LIB = r"""
local P = ARGV[1]
local USAGE, NSSET, VERSION = P .. ':usage', P .. ':namespaces', P .. ':version'
local ENGINES, EXPIRY = P .. ':engines', P .. ':expiry'
local LIMIT = 4611686018427387904
local function rkey(ns) return P .. ':rows:' .. ns end
local function num(v) return string.format('%.17g', v) end
local function int(v) return string.format('%d', v) end

-- A row from its JSON text, or false when it is garbage (index.valid_row's number rules).
local function dec(s)
  if type(s) ~= 'string' then return false end
  local ok, r = pcall(cjson.decode, s)
  if not ok or type(r) ~= 'table' or #r ~= 11 or type(r[6]) ~= 'string' then return false end
  for i = 1, 11 do
    if i ~= 6 then
      local v = r[i]
      if type(v) ~= 'number' or v ~= v or v == math.huge or v == -math.huge then return false end
    end
  end
  for _, i in ipairs({1, 2, 3, 5, 8}) do
    local v = r[i]
    if v < 0 or v >= LIMIT or math.floor(v) ~= v then return false end
  end
  if r[5] > 2 or r[2] > r[1] or r[9] < 0 then return false end
  return r
end

-- A namespace or key name (index.NAME).
local function named(s)
  return #s >= 4 and #s <= 128 and string.find(s, '^[%w_%-]+$') ~= nil
end

local function enc(r)
  return '[' .. table.concat({int(r[1]), int(r[2]), int(r[3]), num(r[4]), int(r[5]), cjson.encode(r[6]),
    num(r[7]), int(r[8]), num(r[9]), num(r[10]), num(r[11])}, ',') .. ']'
end

local function copy(r)
  local c = {}
  for i = 1, 11 do c[i] = r[i] end
  return c
end

-- nil: no row; false: a garbage row; else the row.
local function get(ns, key)
  local raw = redis.call('HGET', rkey(ns), key)
  if not raw then return nil end
  return dec(raw)
end

local function account(ns, r, sign)
  if not r then return end
  if r[5] ~= 2 then redis.call('HINCRBY', USAGE, 'committed', int(sign * r[3])) end
  if r[5] == 0 then
    redis.call('HINCRBY', USAGE, 'n:' .. ns, sign)
    redis.call('HINCRBY', USAGE, 'b:' .. ns, int(sign * r[3]))
  end
end

-- Count P:usage again from every row (after garbage was dropped).
local function recount()
  redis.call('DEL', USAGE)
  local committed = 0
  for _, ns in ipairs(redis.call('SMEMBERS', NSSET)) do
    local flat = redis.call('HGETALL', rkey(ns))
    local n, b = 0, 0
    for i = 1, #flat, 2 do
      local r = dec(flat[i + 1])
      if r and named(ns) and named(flat[i]) then
        if r[5] ~= 2 then committed = committed + r[3] end
        if r[5] == 0 then n, b = n + 1, b + r[3] end
      end
    end
    if n > 0 then redis.call('HSET', USAGE, 'n:' .. ns, int(n), 'b:' .. ns, int(b)) end
  end
  redis.call('HSET', USAGE, 'committed', int(committed))
end

-- Replace row `old` (nil/false: none counted) of (ns, key) by `new` (nil: delete it).
local function put(ns, key, old, new)
  account(ns, old, -1)
  if new then
    redis.call('HSET', rkey(ns), key, enc(new))
    redis.call('SADD', NSSET, ns)
    account(ns, new, 1)
  else
    redis.call('HDEL', rkey(ns), key)
    if redis.call('HLEN', rkey(ns)) == 0 then redis.call('SREM', NSSET, ns) end
  end
  redis.call('INCR', VERSION)
end
"""

_SCRIPTS = {
    # ns, key, t, half_life, adopt row ('' for none) -> 1 when a row was there or made
    "record_hit": r"""
local ns, key, t, hl = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local r = get(ns, key)
if r == false then return 0 end
if r == nil then
  if ARGV[6] == '' then return 0 end
  local a = dec(ARGV[6])
  if not a then return redis.error_reply('record_hit: the adopted row does not decode') end
  put(ns, key, nil, a)
  if a[5] ~= 0 then return 1 end
  r = a
end
local n = copy(r)
n[8] = r[8] + 1
n[9] = r[9] * 2 ^ (-math.max(0, t - r[10]) / hl) + 1
n[10] = math.max(r[10], t)
n[11] = math.max(r[11], t)
put(ns, key, r, n)
return 1
""",
    # ns, incoming, budget, floor_deficit, now, wall, half_life, owner, reserve ns, reserve key
    # ('' for none), reserve row, count of protected keys, protected keys...
    # -> {'exists', '0'} | {'no_room', need} | {'ok', need, victim ns, key, row, ...}
    "claim": r"""
local ns = ARGV[2]
local incoming, budget, floor = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now, wall, hl, owner = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local rns, rk = ARGV[10], ARGV[11]
local reserve = nil
if rk ~= '' then
  if redis.call('HEXISTS', rkey(rns), rk) == 1 then return {'exists', '0'} end
  reserve = dec(ARGV[12])
  if not reserve then return redis.error_reply('claim: the reservation row does not decode') end
end
local committed = tonumber(redis.call('HGET', USAGE, 'committed') or '0')
local need = math.max(committed + incoming - budget, floor)
local victims = {}
if need > 0 then
  local active = {[ns] = true}
  local owners = redis.call('ZRANGEBYSCORE', EXPIRY, '(' .. ARGV[7], '+inf')
  for _, o in ipairs(owners) do
    local v = redis.call('HGET', ENGINES, o)
    if v then active[v] = true end
  end
  local prot = {}
  for i = 14, 13 + tonumber(ARGV[13]) do prot[ARGV[i]] = true end
  local idle, used = {}, {}
  for _, vns in ipairs(redis.call('SMEMBERS', NSSET)) do
    local flat = redis.call('HGETALL', rkey(vns))
    for i = 1, #flat, 2 do
      local r = dec(flat[i + 1])
      if r and r[5] == 0 and named(vns) and named(flat[i]) then
        local c = {ns = vns, key = flat[i], r = r}
        if not active[vns] then
          idle[#idle + 1] = c
        elseif not (vns == ns and prot[flat[i]]) then
          c.score = (r[9] * 2 ^ (-math.max(0, now - r[10]) / hl) + 1) * r[1] / math.max(r[3], 1)
          c.last = math.max(r[11], r[4])
          used[#used + 1] = c
        end
      end
    end
  end
  table.sort(idle, function(a, b)
    if a.r[4] ~= b.r[4] then return a.r[4] < b.r[4] end
    if a.key ~= b.key then return a.key < b.key end
    return a.ns < b.ns
  end)
  table.sort(used, function(a, b)
    if a.score ~= b.score then return a.score < b.score end
    if a.last ~= b.last then return a.last < b.last end
    if a.key ~= b.key then return a.key < b.key end
    return a.ns < b.ns
  end)
  for _, list in ipairs({idle, used}) do
    for _, c in ipairs(list) do
      if need <= 0 then break end
      victims[#victims + 1] = c
      need = need - c.r[3]
    end
  end
  if need > 0 then return {'no_room', int(need)} end
  for _, c in ipairs(victims) do
    local n = copy(c.r)
    n[5], n[6], n[7] = 2, owner, wall
    put(c.ns, c.key, c.r, n)
  end
end
if reserve then put(rns, rk, nil, reserve) end
local out = {'ok', int(need)}
for _, c in ipairs(victims) do
  out[#out + 1] = c.ns
  out[#out + 1] = c.key
  out[#out + 1] = enc(c.r)
end
return out
""",
    # owner, wall, ns, key, ... -> ns, key, row of each LIVE row now EVICTING for owner
    "claim_keys": r"""
local out = {}
for i = 4, #ARGV, 2 do
  local ns, key = ARGV[i], ARGV[i + 1]
  local r = get(ns, key)
  if r and r[5] == 0 then
    local n = copy(r)
    n[5], n[6], n[7] = 2, ARGV[2], tonumber(ARGV[3])
    put(ns, key, r, n)
    out[#out + 1] = ns
    out[#out + 1] = key
    out[#out + 1] = enc(r)
  end
end
return out
""",
    # owner, ns, key, ... -> rows deleted (EVICTING ones of owner only)
    "forget_evicted": r"""
local n = 0
for i = 3, #ARGV, 2 do
  local r = get(ARGV[i], ARGV[i + 1])
  if r and r[5] == 2 and r[6] == ARGV[2] then
    put(ARGV[i], ARGV[i + 1], r, nil)
    n = n + 1
  end
end
return n
""",
    # ns, key, bytes, wall, owner -> 1 when owner's reservation became LIVE
    "publish": r"""
local r = get(ARGV[2], ARGV[3])
if not (r and r[5] == 1 and r[6] == ARGV[6]) then return 0 end
local n = copy(r)
n[5], n[3], n[6], n[7] = 0, tonumber(ARGV[4]), '', tonumber(ARGV[5])
put(ARGV[2], ARGV[3], r, n)
return 1
""",
    # ns, key, owner -> 1 when owner's reservation was dropped
    "release": r"""
local r = get(ARGV[2], ARGV[3])
if not (r and r[5] == 1 and r[6] == ARGV[4]) then return 0 end
put(ARGV[2], ARGV[3], r, nil)
return 1
""",
    # ns, key, row, ... -> rows inserted (a key with a row, garbage included, is kept)
    "insert": r"""
local n = 0
for i = 2, #ARGV, 3 do
  if redis.call('HEXISTS', rkey(ARGV[i]), ARGV[i + 1]) == 0 then
    local r = dec(ARGV[i + 2])
    if r then
      put(ARGV[i], ARGV[i + 1], nil, r)
      n = n + 1
    end
  end
end
return n
""",
    # ns, key, created, since, ... -> rows deleted (each only while LIVE and the same
    # publication: its created and since)
    "remove": r"""
local n = 0
for i = 2, #ARGV, 4 do
  local r = get(ARGV[i], ARGV[i + 1])
  if r and r[5] == 0 and r[4] == tonumber(ARGV[i + 2]) and r[7] == tonumber(ARGV[i + 3]) then
    put(ARGV[i], ARGV[i + 1], r, nil)
    n = n + 1
  end
end
return n
""",
    # ns, key, raw, ... -> rows deleted (each only while its text is still `raw`); P:usage is
    # then counted again (a garbage row's bytes may have been counted before it went bad)
    "drop_garbage": r"""
local n = 0
for i = 2, #ARGV, 3 do
  if redis.call('HGET', rkey(ARGV[i]), ARGV[i + 1]) == ARGV[i + 2] then
    put(ARGV[i], ARGV[i + 1], nil, nil)
    n = n + 1
  end
end
recount()
return n
""",
    # ns, key, state, owner, exists (0/1), size -> 1 when the row was settled
    "resolve": r"""
local r = get(ARGV[2], ARGV[3])
if not (r and r[5] == tonumber(ARGV[4]) and r[6] == ARGV[5]) then return 0 end
if ARGV[6] == '1' then
  local n = copy(r)
  n[5], n[3], n[6], n[7] = 0, tonumber(ARGV[7]), '', 0
  put(ARGV[2], ARGV[3], r, n)
else
  put(ARGV[2], ARGV[3], r, nil)
end
return 1
""",
    # owner, ns, expires
    "heartbeat": r"""
redis.call('HSET', ENGINES, ARGV[2], ARGV[3])
redis.call('ZADD', EXPIRY, ARGV[4], ARGV[2])
for _, o in ipairs(redis.call('ZRANGEBYSCORE', EXPIRY, '-inf', '(' .. num(tonumber(ARGV[4]) - 7 * 86400))) do
  redis.call('HDEL', ENGINES, o)
  redis.call('ZREM', EXPIRY, o)
end
return 1
""",
    # owner
    "leave": r"""
redis.call('HDEL', ENGINES, ARGV[2])
redis.call('ZREM', EXPIRY, ARGV[2])
return 1
""",
    # ns ('' for every namespace) -> ns, key, raw row, ... (one consistent read)
    "dump": r"""
local out = {}
local list = {ARGV[2]}
if ARGV[2] == '' then list = redis.call('SMEMBERS', NSSET) end
for _, ns in ipairs(list) do
  local flat = redis.call('HGETALL', rkey(ns))
  for i = 1, #flat, 2 do
    out[#out + 1] = ns
    out[#out + 1] = flat[i]
    out[#out + 1] = flat[i + 1]
  end
end
return out
""",
}


# ---- rows as JSON ----------------------------------------------------------------------


def encode_row(r: Row) -> str:
    """A row's value in P:rows:<namespace> (namespace and key are its hash and field)."""
    fields = (r.tokens, r.position, r.bytes, r.created, r.state, r.owner, r.since, r.hits)
    return json.dumps([*fields, r.decayed, r.ref, r.last_used], separators=(",", ":"))


def decode_row(namespace: str, key: str, raw: object) -> Row | None:
    """The row stored as `raw`, or None when anything in it is garbage."""
    if not isinstance(raw, str):
        return None
    try:
        values = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(values, list) or len(values) != 11:
        return None
    return valid_row((namespace, key, rel_path(namespace, key), *values))


# ---- the folder's identity -------------------------------------------------------------


def folder_id(root: Path) -> str:
    """The cache folder's id (`<root>/index.id`), made on first use: written to a temp
    file, then linked into place, so concurrent first users (any host) agree on one."""
    path = Path(root) / ID_NAME
    try:
        return _read_id(path)
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".{ID_NAME}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            os.write(fd, f"{secrets.token_hex(16)}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails when another process linked its id first: that one counts
        except FileExistsError:
            pass
        else:
            dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
    finally:
        tmp.unlink(missing_ok=True)
    return _read_id(path)


def _read_id(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a link
        raise IndexUnusable(f"{path} is not a regular file ({e.strerror}): remove it") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IndexUnusable(f"{path} is not a regular file: remove it")
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    if not _ID.fullmatch(text):
        raise IndexUnusable(
            f"{path} does not hold a cache folder id (32 hex digits): remove it; a new id is made "
            "and the index is refilled from the files"
        )
    return text


def redacted(url: str) -> str:
    """`url` without its password (for messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


# ---- the index -------------------------------------------------------------------------


class ValkeyIndex:
    """One process's connection to the folder's index in Valkey (thread-safe: the client's
    connection pool). Opening it reads or makes the folder id and needs the server up."""

    def __init__(
        self,
        root: Path,
        *,
        owner: str,
        url: str,
        timeout_s: float = _TIMEOUT_S,
        retry_s: float = _RETRY_S,
    ) -> None:
        self.root = Path(root)
        self.owner = owner
        self.where = f"{redacted(url)} (--cache-index-url)"
        self.retry_s = retry_s
        self.folder_id = folder_id(self.root)
        self.prefix = f"keepwarm:cache:{{{self.folder_id}}}"
        try:
            self._r = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
            )
        except ValueError as e:
            raise IndexDown(f"cache index {self.where}: {e}") from e
        self._scripts = {name: self._r.register_script(_LIB + src) for name, src in _SCRIPTS.items()}
        self._lock = threading.Lock()
        self._lengths: dict[str, tuple[object, frozenset[int]]] = {}
        self._down_until = 0.0
        self._call(self._r.ping)

    # ---- plumbing --------------------------------------------------------------------

    def _call(self, fn: Callable[[], T]) -> T:
        """`fn()` against the server; any failure is IndexDown. After a connection error
        the server is not tried again for `retry_s` (each call fails at once)."""
        if time.monotonic() < self._down_until:
            raise IndexDown(f"cache index {self.where} unreachable (retried every {self.retry_s:g} s)")
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._down_until = time.monotonic() + self.retry_s
            raise IndexDown(f"cache index {self.where}: {type(e).__name__}: {e}") from e
        except redis.RedisError as e:
            raise IndexDown(f"cache index {self.where}: {type(e).__name__}: {e}") from e

    def _run(self, name: str, *args: str | int | float) -> Any:
        script = self._scripts[name]
        return self._call(lambda: script(keys=[], args=[self.prefix, *args]))

    def _key(self, suffix: str) -> str:
        return f"{self.prefix}:{suffix}"

    def _decoded(self, flat: Sequence[str]) -> tuple[list[Row], list[tuple[str, str, str]]]:
        """Rows from a dump's (ns, key, raw) triples, and the garbage triples."""
        good: list[Row] = []
        bad: list[tuple[str, str, str]] = []
        for i in range(0, len(flat), 3):
            ns, key, raw = flat[i], flat[i + 1], flat[i + 2]
            row = decode_row(ns, key, raw)
            if row is None:
                bad.append((ns, key, raw))
            else:
                good.append(row)
        return good, bad

    def close(self) -> None:
        self._r.close()

    # ---- reads -----------------------------------------------------------------------

    def get(self, namespace: str, key: str) -> Row | None:
        raw = self._call(lambda: self._r.hget(self._key(f"rows:{namespace}"), key))
        return decode_row(namespace, key, raw)

    def rows(self, namespace: str | None = None, states: Sequence[int] = (LIVE,)) -> list[Row]:
        good, _ = self._decoded(self._run("dump", namespace or ""))
        return [r for r in good if r.state in states]

    def lengths(self, namespace: str) -> frozenset[int]:
        """Distinct token counts of LIVE entries of `namespace`: cached until any process
        changes a row (P:version)."""
        version = self._call(lambda: self._r.get(self._key("version")))
        with self._lock:
            cached = self._lengths.get(namespace)
            if cached is not None and cached[0] == version:
                return cached[1]
        good, _ = self._decoded(self._run("dump", namespace))
        found = frozenset(r.tokens for r in good if r.state == LIVE)
        with self._lock:
            self._lengths[namespace] = (version, found)
        return found

    def usage(self) -> Usage:
        raw = self._call(lambda: self._r.hgetall(self._key("usage")))
        fields = {str(k): str(v) for k, v in raw.items()}
        by_ns: dict[str, tuple[int, int]] = {}
        for name, value in fields.items():
            if name.startswith("n:") and int(value) > 0:
                ns = name[2:]
                by_ns[ns] = (int(value), int(fields.get(f"b:{ns}", 0)))
        return Usage(by_ns, int(fields.get("committed", 0)))

    def all_rows(self) -> tuple[list[Row], int]:
        """Every valid row in any state, and the number of garbage rows (for reconcile)."""
        good, bad = self._decoded(self._run("dump", ""))
        return good, len(bad)

    # ---- writes ----------------------------------------------------------------------

    def record_hit(
        self, namespace: str, key: str, t: float, half_life: float, adopt: Row | None = None
    ) -> bool:
        """Count a hit at time `t`. Without a row, insert `adopt` (a file found by path:
        its hit is its first) when given. False when no row was there or made."""
        adopted = "" if adopt is None else encode_row(adopt)
        return bool(self._run("record_hit", namespace, key, t, half_life, adopted))

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
        """CacheIndex.claim, in one script (see the module docstring)."""
        keep = sorted(protected)
        out = self._run(
            "claim",
            namespace,
            incoming,
            budget,
            floor_deficit,
            now,
            wall,
            half_life,
            self.owner,
            "" if reserve is None else reserve.namespace,
            "" if reserve is None else reserve.key,
            "" if reserve is None else encode_row(reserve),
            len(keep),
            *keep,
        )
        status, need = str(out[0]), int(out[1])
        if status == "exists":
            return Claim("exists")
        if status == "no_room":
            return Claim("no_room", need=need)
        victims, _ = self._decoded(out[2:])
        return Claim("ok", tuple(victims), need)

    def claim_keys(self, keys: Iterable[tuple[str, str]], wall: float) -> list[Row]:
        """Mark these LIVE entries EVICTING for this owner; the rows actually claimed."""
        pairs = [part for ns_key in keys for part in ns_key]
        if not pairs:
            return []
        claimed, _ = self._decoded(self._run("claim_keys", self.owner, wall, *pairs))
        return claimed

    def forget_evicted(self, rows: Iterable[Row]) -> None:
        pairs = [part for r in rows for part in (r.namespace, r.key)]
        if pairs:
            self._run("forget_evicted", self.owner, *pairs)

    def publish(self, namespace: str, key: str, nbytes: int, wall: float) -> None:
        self._run("publish", namespace, key, nbytes, wall, self.owner)

    def release(self, namespace: str, key: str) -> None:
        self._run("release", namespace, key, self.owner)

    def insert(self, rows: Iterable[Row]) -> None:
        triples = [part for r in rows for part in (r.namespace, r.key, encode_row(r))]
        if triples:
            self._run("insert", *triples)

    def remove(self, rows: Iterable[Row]) -> None:
        """CacheIndex.remove: each LIVE row only while it is the publication it was read as."""
        quads = [part for r in rows for part in (r.namespace, r.key, repr(r.created), repr(r.since))]
        if quads:
            self._run("remove", *quads)

    def drop_garbage(self) -> int:
        """Delete every row that does not validate (unless it changed meanwhile); the number deleted."""
        _, bad = self._decoded(self._run("dump", ""))
        if not bad:
            return 0
        return int(self._run("drop_garbage", *[part for triple in bad for part in triple]))

    def resolve(self, row: Row, *, exists: bool, size: int | None) -> None:
        """Settle a stale WRITING/EVICTING row (its owner is gone): LIVE again when its
        file is there with `size`, gone otherwise; only while the row is as `row` says."""
        size = size if exists and size is not None else None
        live = int(size is not None)
        self._run("resolve", row.namespace, row.key, row.state, row.owner, live, size or 0)

    def heartbeat(self, namespace: str, expires: float) -> None:
        self._run("heartbeat", self.owner, namespace, expires)

    def leave(self) -> None:
        self._run("leave", self.owner)
