"""Cache and latency statistics in Redis, per tenant, so every gateway process
adds to the same counters and a gateway restart keeps them. Read back by
GET /v1/stats, which answers only about the caller's tenant.

Layout (P = config.redis_prefix, T = the tenant):
  P stats:T:totals      hash  integer counters (requests, hits, tokens, hits_memory, hits_disk,
                              restore_bytes) and float sums in ms (prefill_ms, prefill_saved_ms, restore_ms)
  P stats:T:since       str   unix time of the tenant's first counted request (SETNX)
  P stats:T:recent      list  JSON RequestRecords, newest first, at most recent_len
  P stats:T:ttft:cold   list  ttft_ms of requests with cache_source "none", newest first, at most ttft_len
  P stats:T:ttft:warm   list  ttft_ms of requests restored from memory or disk
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from keepwarm.api.record import RequestRecord

_INT_FIELDS = (
    "requests",
    "hits",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "restore_bytes",
    "hits_memory",
    "hits_disk",
    "drafted_tokens",
    "accepted_tokens",
)
_MS_FIELDS = ("prefill_ms", "prefill_saved_ms", "restore_ms")


class StatsStore:
    """`redis` must decode responses (decode_responses=True)."""

    def __init__(self, redis: Redis, *, prefix: str, recent_len: int, ttft_len: int) -> None:
        self._r = redis
        self._p = prefix
        self._recent_len = recent_len
        self._ttft_len = ttft_len

    def key(self, tenant: str, name: str) -> str:
        return f"{self._p}stats:{tenant}:{name}"

    async def record(self, rec: RequestRecord, row: str | None = None) -> None:
        """Counts one finished request for its tenant; `row`: the record already encoded
        (`rec.encoded()`, shared with the session timeline)."""
        t = rec.tenant
        totals = self.key(t, "totals")
        ttft = self.key(t, "ttft:warm" if rec.cache_source in ("memory", "disk") else "ttft:cold")
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.setnx(self.key(t, "since"), rec.ts)
            pipe.hincrby(totals, "requests", 1)
            pipe.hincrby(totals, "hits", 1 if rec.hit else 0)
            pipe.hincrby(totals, "prompt_tokens", rec.prompt_tokens)
            pipe.hincrby(totals, "cached_tokens", rec.cached_tokens)
            pipe.hincrby(totals, "completion_tokens", rec.completion_tokens)
            pipe.hincrby(totals, "restore_bytes", rec.restore_bytes)
            pipe.hincrby(totals, "drafted_tokens", rec.drafted_tokens)
            pipe.hincrby(totals, "accepted_tokens", rec.accepted_tokens)
            if rec.cache_source in ("memory", "disk"):
                pipe.hincrby(totals, f"hits_{rec.cache_source}", 1)
            pipe.hincrbyfloat(totals, "prefill_ms", rec.prefill_ms)
            pipe.hincrbyfloat(totals, "prefill_saved_ms", rec.prefill_saved_ms)
            pipe.hincrbyfloat(totals, "restore_ms", rec.restore_ms)
            pipe.lpush(self.key(t, "recent"), row if row is not None else rec.encoded())
            pipe.ltrim(self.key(t, "recent"), 0, self._recent_len - 1)
            pipe.lpush(ttft, rec.ttft_ms)
            pipe.ltrim(ttft, 0, self._ttft_len - 1)
            await pipe.execute()

    async def snapshot(self, tenant: str, engines: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The GET /v1/stats document of one tenant."""
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.key(tenant, "totals"))
            pipe.get(self.key(tenant, "since"))
            pipe.lrange(self.key(tenant, "recent"), 0, -1)
            pipe.lrange(self.key(tenant, "ttft:cold"), 0, -1)
            pipe.lrange(self.key(tenant, "ttft:warm"), 0, -1)
            raw, since, recent, cold, warm = await pipe.execute()
        ints = {f: int(raw.get(f, 0)) for f in _INT_FIELDS}
        ms = {f: float(raw.get(f, 0)) for f in _MS_FIELDS}
        requests, prompt = ints["requests"], ints["prompt_tokens"]
        return {
            "tenant": tenant,
            "totals": {
                "requests": requests,
                "hits": ints["hits"],
                "hit_rate_requests": ints["hits"] / requests if requests else 0.0,
                "prompt_tokens": prompt,
                "cached_tokens": ints["cached_tokens"],
                "hit_rate_tokens": ints["cached_tokens"] / prompt if prompt else 0.0,
                "prefill_seconds": ms["prefill_ms"] / 1000.0,
                "prefill_saved_seconds": ms["prefill_saved_ms"] / 1000.0,
                "restore_seconds": ms["restore_ms"] / 1000.0,
                "restore_bytes": ints["restore_bytes"],
                "hits_by_tier": {"memory": ints["hits_memory"], "disk": ints["hits_disk"]},
                "completion_tokens": ints["completion_tokens"],
                "drafted_tokens": ints["drafted_tokens"],
                "accepted_tokens": ints["accepted_tokens"],
            },
            "ttft_ms": {"cold": [float(v) for v in cold], "warm": [float(v) for v in warm]},
            "recent": [json.loads(r) for r in recent],
            "engines": list(engines),
            "since": float(since) if since is not None else time.time(),
        }
