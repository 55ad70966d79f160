"""Which prefix-cache keys belong to which tenant, so GET /v1/cache can list a
tenant's own entries and nothing else.

An engine cannot tell: a key is a hash of (namespace, tenant salt, tokens), and
the salt never leaves the gateway. So the gateway remembers every prefix key an
engine reported for a tenant's request (`keepwarm.prefix_key`), newest last:
  P cachekeys:<tenant>   zset  key scored by the time it was last reported,
                               at most `max_keys` newest, expiring `ttl_s` after the last one
Listing only these keys can show less than the tenant owns (the engine also
keeps turn-boundary entries it did not report), never more.
"""

from __future__ import annotations

from typing import cast

from redis.asyncio import Redis


class TenantKeys:
    """`redis` must decode responses (decode_responses=True)."""

    def __init__(self, redis: Redis, *, prefix: str, ttl_s: int, max_keys: int = 10_000) -> None:
        assert ttl_s > 0 and max_keys > 0
        self._r = redis
        self._p = prefix
        self._ttl = ttl_s
        self._max = max_keys

    def zset_key(self, tenant: str) -> str:
        return f"{self._p}cachekeys:{tenant}"

    async def add(self, tenant: str, key: str, ts: float) -> None:
        zk = self.zset_key(tenant)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.zadd(zk, {key: ts})
            pipe.zremrangebyrank(zk, 0, -self._max - 1)
            pipe.expire(zk, self._ttl)
            await pipe.execute()

    async def of(self, tenant: str) -> set[str]:
        return set(cast("list[str]", await self._r.zrange(self.zset_key(tenant), 0, -1)))
