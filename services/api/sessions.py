"""Sessions in Redis: session -> {engine, key, tokens, ...} plus a timeline.

Layout (P = config.redis_prefix, default "keepwarm:"; sessions are per tenant,
so two tenants may use the same session id without seeing each other):
  P session:<tenant>:<id>   hash  engine, key, tokens, updated, created, turns, hits, last_ttft_ms
  P timeline:<tenant>:<id>  list  JSON RequestRecords, newest first, at most timeline_len
  P sessions:<tenant>       zset  id scored by `updated` (for listing)
All three expire session_ttl seconds after the session's last turn.

`key`/`tokens` are the engine's `keepwarm.prefix_key` / `prefix_tokens` of the
last turn; the gateway sends them back as `session_hint` on the next turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio import Redis

from keepwarm.api.errors import ApiError
from keepwarm.api.record import RequestRecord

MAX_SESSION_ID = 128


def check_session_id(sid: str, where: str) -> str:
    """A session id as given, or a 400 naming `where` it came from."""
    if not sid or len(sid) > MAX_SESSION_ID or not sid.isprintable():
        raise ApiError(400, f"{where} must be 1-{MAX_SESSION_ID} printable characters", param=where)
    return sid


@dataclass(frozen=True)
class Session:
    id: str
    engine: str
    key: str | None  # last prefix key; None until an engine reported one
    tokens: int
    updated: float
    created: float
    turns: int
    hits: int
    last_ttft_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "engine": self.engine,
            "key": self.key,
            "tokens": self.tokens,
            "updated": self.updated,
            "created": self.created,
            "turns": self.turns,
            "hits": self.hits,
            "last_ttft_ms": self.last_ttft_ms,
        }


def _session(sid: str, h: dict[str, str]) -> Session:
    return Session(
        id=sid,
        engine=h.get("engine", ""),
        key=h.get("key") or None,
        tokens=int(h.get("tokens", 0)),
        updated=float(h.get("updated", 0)),
        created=float(h.get("created", 0)),
        turns=int(h.get("turns", 0)),
        hits=int(h.get("hits", 0)),
        last_ttft_ms=float(h.get("last_ttft_ms", 0)),
    )


class SessionStore:
    """`redis` must decode responses (decode_responses=True)."""

    def __init__(self, redis: Redis, *, prefix: str, ttl_s: int, timeline_len: int) -> None:
        self._r = redis
        self._p = prefix
        self._ttl = ttl_s
        self._timeline_len = timeline_len

    def hash_key(self, tenant: str, sid: str) -> str:
        return f"{self._p}session:{tenant}:{sid}"

    def timeline_key(self, tenant: str, sid: str) -> str:
        return f"{self._p}timeline:{tenant}:{sid}"

    def index_key(self, tenant: str) -> str:
        return f"{self._p}sessions:{tenant}"

    async def get(self, tenant: str, sid: str) -> Session | None:
        h = cast("dict[str, str]", await self._r.hgetall(self.hash_key(tenant, sid)))
        return _session(sid, h) if h else None

    async def record_turn(
        self,
        tenant: str,
        sid: str,
        rec: RequestRecord,
        prefix_key: str | None,
        prefix_tokens: int,
        row: str | None = None,
    ) -> None:
        """One finished turn: the session's engine, last key (kept when the
        engine left none this turn), counters and timeline, TTLs refreshed. `row`: the record
        already encoded (`rec.encoded()`, shared with the stats list)."""
        hk, tk, ik = self.hash_key(tenant, sid), self.timeline_key(tenant, sid), self.index_key(tenant)
        fields: dict[Any, str | int | float] = {
            "engine": rec.engine,
            "updated": rec.ts,
            "last_ttft_ms": rec.ttft_ms,
        }
        if prefix_key:
            fields["key"] = prefix_key
            fields["tokens"] = prefix_tokens
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hsetnx(hk, "created", rec.ts)
            pipe.hset(hk, mapping=fields)
            pipe.hincrby(hk, "turns", 1)
            pipe.hincrby(hk, "hits", 1 if rec.hit else 0)
            pipe.expire(hk, self._ttl)
            pipe.lpush(tk, row if row is not None else rec.encoded())
            pipe.ltrim(tk, 0, self._timeline_len - 1)
            pipe.expire(tk, self._ttl)
            pipe.zadd(ik, {sid: rec.ts})
            pipe.zremrangebyscore(ik, "-inf", rec.ts - self._ttl)
            pipe.expire(ik, self._ttl)
            await pipe.execute()

    async def latest(self, tenant: str, limit: int = 100) -> list[Session]:
        """The tenant's sessions, most recently updated first."""
        ids = cast("list[str]", await self._r.zrevrange(self.index_key(tenant), 0, limit - 1))
        if not ids:
            return []
        async with self._r.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hgetall(self.hash_key(tenant, sid))
            hashes = await pipe.execute()
        # A hash that expired before its index entry was reaped is skipped.
        return [_session(sid, h) for sid, h in zip(ids, hashes, strict=True) if h]

    async def timeline(self, tenant: str, sid: str) -> list[RequestRecord]:
        rows = await self._r.lrange(self.timeline_key(tenant, sid), 0, -1)
        return [RequestRecord.from_dict(json.loads(r)) for r in rows]
