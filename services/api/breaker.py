"""A circuit breaker in front of Redis, so a dead or hung Redis costs a chat
request one short socket timeout once, then nothing.

Closed: calls go through. A connection error or timeout opens the circuit:
from then on every call fails at once with `RedisUnavailable` (a RedisError, so
callers degrade exactly as for a real failure) without touching the socket.
`watch(probe)` runs beside the gateway and is the half-open state: while the
circuit is open it sends one probe at a time, at most every `cooldown_s` (0.5 s
by default), and closes the circuit on the first answer, so no request ever
pays for finding out whether Redis is back, and a Redis that is back is used
again within one probe interval plus one round trip.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("keepwarm.api")
T = TypeVar("T")

# Failures that say "Redis is not answering", as opposed to a bad command.
_OUTAGE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)


class RedisUnavailable(RedisError):
    """The circuit is open: Redis was not answering a moment ago."""


@dataclass(frozen=True)
class BreakerState:
    open: bool
    trips: int  # closed -> open transitions since start
    fast_failures: int  # calls refused without touching Redis
    last_error: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "open": self.open,
            "trips": self.trips,
            "fast_failures": self.fast_failures,
            "last_error": self.last_error,
        }


class Breaker:
    def __init__(self, *, cooldown_s: float) -> None:
        assert cooldown_s > 0
        self.cooldown_s = cooldown_s
        self._open = False
        self._trips = 0
        self._fast = 0
        self._error: str | None = None

    @property
    def is_open(self) -> bool:
        return self._open

    def state(self) -> BreakerState:
        return BreakerState(self._open, self._trips, self._fast, self._error)

    async def call(self, coro: Awaitable[T]) -> T:
        """`await coro` unless the circuit is open (then RedisUnavailable, and
        `coro` is closed unstarted). An outage while awaiting opens the circuit."""
        if self._open:
            if isinstance(coro, Coroutine):
                coro.close()
            self._fast += 1
            raise RedisUnavailable(f"redis circuit open after: {self._error}")
        try:
            return await coro
        except _OUTAGE as e:
            self.trip(e)
            raise RedisUnavailable(f"{type(e).__name__}: {e}") from e

    def trip(self, error: BaseException) -> None:
        self._error = f"{type(error).__name__}: {error}"
        if not self._open:
            self._open = True
            self._trips += 1
            log.warning(
                "redis not answering (%s); sessions, stats and rate limits are off until it answers a ping",
                self._error,
            )

    def reset(self) -> None:
        if self._open:
            self._open = False
            log.info("redis answers again; sessions, stats and rate limits are back")

    async def watch(self, probe: Callable[[], Awaitable[Any]]) -> None:
        """Forever: while open, one probe every cooldown_s; close on an answer. Cancel to stop."""
        while True:
            await asyncio.sleep(self.cooldown_s)
            if not self._open:
                continue
            try:
                await probe()
            except (RedisError, *_OUTAGE) as e:
                self._error = f"{type(e).__name__}: {e}"
                continue
            except Exception:  # noqa: BLE001 - the watch must outlive a probe's bug; say so
                log.exception("redis probe failed unexpectedly; probing again in %.1f s", self.cooldown_s)
                continue
            self.reset()
