"""Per-tenant request limit in Redis: a fixed window of `window_s` seconds,
aligned to the epoch, so every gateway process counts into the same window.

Key: P ratelimit:<tenant>:<window index>, INCR'd per request and expiring with
the window. A fixed window admits at most 2 x limit across a window boundary;
that is accepted for the simplicity of one INCR per request.
"""

from __future__ import annotations

import math

from redis.asyncio import Redis


class RateLimiter:
    def __init__(self, redis: Redis, *, prefix: str, limit: int, window_s: int) -> None:
        assert limit > 0 and window_s > 0
        self._r = redis
        self._p = prefix
        self.limit = limit
        self.window_s = window_s

    async def retry_after(self, tenant: str, now: float) -> int | None:
        """Counts one request; None when it is within the limit, else the whole
        seconds until the tenant's window resets (for Retry-After)."""
        window = int(now // self.window_s)
        key = f"{self._p}ratelimit:{tenant}:{window}"
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, self.window_s + 1)
            count, _ = await pipe.execute()
        if int(count) <= self.limit:
            return None
        return max(1, math.ceil((window + 1) * self.window_s - now))
