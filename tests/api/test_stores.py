"""Sessions, stats, tenant cache keys, the rate limit and the Redis circuit
breaker against a real Valkey server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError

from keepwarm.api.breaker import Breaker, RedisUnavailable
from keepwarm.api.rate_limit import RateLimiter
from keepwarm.api.record import RequestRecord
from keepwarm.api.sessions import SessionStore
from keepwarm.api.stats import StatsStore
from keepwarm.api.tenant_keys import TenantKeys
from tests.api.procs import Proc, start_valkey

pytestmark = pytest.mark.anyio

USAGE = {
    "prompt_tokens": 100,
    "completion_tokens": 7,
    "total_tokens": 107,
    "prompt_tokens_details": {"cached_tokens": 64},
    "timings": {"cache_source": "disk", "restored_tokens": 64, "restore_ms": 3.5, "prefill_tokens": 36,
                "prefill_ms": 12.25, "decode_ms": 20.0, "ttft_ms": 16.0, "prefill_saved_ms": 30.5,
                "decode_tokens_per_sec": 350.0, "drafted_tokens": 9, "accepted_tokens": 6, "diverged_at": 80},
}  # fmt: skip


def record(
    ts: float, usage: dict = USAGE, session: str | None = "s1", tenant: str = "alpha"
) -> RequestRecord:
    return RequestRecord.from_usage(usage, ts=ts, session=session, tenant=tenant, engine="http://e1")


def test_record_from_usage() -> None:
    r = record(1000.0)
    assert r.as_dict() == {
        "ts": 1000.0, "session": "s1", "tenant": "alpha", "engine": "http://e1", "prompt_tokens": 100,
        "cached_tokens": 64, "cache_source": "disk", "ttft_ms": 16.0, "prefill_ms": 12.25,
        "prefill_saved_ms": 30.5, "restore_ms": 3.5, "restored_tokens": 64, "completion_tokens": 7,
        "diverged_at": 80, "restore_bytes": 0, "drafted_tokens": 9, "accepted_tokens": 6,
    }  # fmt: skip
    assert r.hit
    # A sparse or odd usage object reads as zeros and "none", never raises.
    cold = RequestRecord.from_usage({"prompt_tokens": 5, "timings": {"cache_source": "gpu", "ttft_ms": "x"}},
                                    ts=1.0, session=None, tenant="t", engine="e")  # fmt: skip
    assert (cold.prompt_tokens, cold.cached_tokens, cold.cache_source, cold.ttft_ms, cold.hit) == (5, 0, "none", 0.0,
                                                                                                  False)  # fmt: skip
    assert RequestRecord.from_dict(json.loads(json.dumps(r.as_dict()))) == r


async def test_session_turns_keep_last_key_and_timeline(valkey: Proc, redis_sync: redis.Redis) -> None:
    r = Redis.from_url(valkey.url, decode_responses=True)
    store = SessionStore(r, prefix="kw:", ttl_s=300, timeline_len=2)
    assert await store.get("alpha", "s1") is None
    cold = {**USAGE, "prompt_tokens_details": {"cached_tokens": 0}, "timings": {"cache_source": "none",
                                                                                 "ttft_ms": 40.0}}  # fmt: skip
    await store.record_turn("alpha", "s1", record(1000.0, cold), "key-1", 50)
    await store.record_turn("alpha", "s1", record(1001.0), "key-2", 120)
    # A turn that leaves no key keeps the previous one for the next hint.
    await store.record_turn("alpha", "s1", record(1002.0), None, 0)
    s = await store.get("alpha", "s1")
    assert s is not None
    assert s.as_dict() == {"id": "s1", "engine": "http://e1", "key": "key-2", "tokens": 120, "updated": 1002.0,
                           "created": 1000.0, "turns": 3, "hits": 2, "last_ttft_ms": 16.0}  # fmt: skip
    # Read directly: the layout the module docstring promises, with a TTL.
    assert redis_sync.hget("kw:session:alpha:s1", "key") == "key-2"
    assert 0 < redis_sync.ttl("kw:session:alpha:s1") <= 300
    assert 0 < redis_sync.ttl("kw:timeline:alpha:s1") <= 300
    timeline = await store.timeline("alpha", "s1")
    assert [t.ts for t in timeline] == [1002.0, 1001.0]  # bounded, newest first
    # Sessions are per tenant.
    assert await store.get("beta", "s1") is None
    await store.record_turn("alpha", "s2", record(1003.0, session="s2"), "key-9", 9)
    assert [x.id for x in await store.latest("alpha")] == ["s2", "s1"]
    assert await store.latest("beta") == []
    await r.aclose()


async def test_stats_totals_and_bounded_lists(valkey: Proc, redis_sync: redis.Redis) -> None:
    r = Redis.from_url(valkey.url, decode_responses=True)
    stats = StatsStore(r, prefix="kw:", recent_len=3, ttft_len=2)
    cold = {"prompt_tokens": 80, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0},
            "timings": {"cache_source": "none", "ttft_ms": 100.0, "prefill_ms": 90.0}}  # fmt: skip
    memory = {"prompt_tokens": 90, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 80},
              "timings": {"cache_source": "memory", "ttft_ms": 10.0, "prefill_ms": 4.0, "restore_ms": 1.0,
                          "prefill_saved_ms": 60.0, "restore_bytes": 4096}}  # fmt: skip
    await stats.record(record(900.0, memory, session="b1", tenant="beta"))
    for i, u in enumerate([cold, memory, USAGE, cold]):
        await stats.record(record(1000.0 + i, u))
    snap = await stats.snapshot("alpha", [{"url": "http://e1", "healthy": True}])
    assert snap["tenant"] == "alpha"
    assert snap["totals"] == {
        "requests": 4, "hits": 2, "hit_rate_requests": 0.5, "prompt_tokens": 350, "cached_tokens": 144,
        "hit_rate_tokens": 144 / 350, "prefill_seconds": (90.0 + 4.0 + 12.25 + 90.0) / 1000,
        "prefill_saved_seconds": (60.0 + 30.5) / 1000, "restore_seconds": (1.0 + 3.5) / 1000,
        "restore_bytes": 4096, "hits_by_tier": {"memory": 1, "disk": 1}, "completion_tokens": 20,
        "drafted_tokens": 9, "accepted_tokens": 6,
    }  # fmt: skip
    assert snap["ttft_ms"] == {"cold": [100.0, 100.0], "warm": [16.0, 10.0]}
    assert [x["ts"] for x in snap["recent"]] == [1003.0, 1002.0, 1001.0]
    assert snap["engines"] == [{"url": "http://e1", "healthy": True}]
    assert snap["since"] == 1000.0  # the tenant's first counted request
    # Per tenant: beta's one request is not in alpha's figures, and alpha's are not in beta's.
    assert {x["tenant"] for x in snap["recent"]} == {"alpha"}
    beta = await stats.snapshot("beta", [])
    assert (beta["totals"]["requests"], beta["since"], [x["session"] for x in beta["recent"]]) == (
        1,
        900.0,
        ["b1"],
    )
    assert beta["ttft_ms"] == {"cold": [], "warm": [10.0]}
    assert sorted(redis_sync.keys("kw:stats:*:totals")) == ["kw:stats:alpha:totals", "kw:stats:beta:totals"]
    await r.aclose()


async def test_empty_stats(valkey: Proc, redis_sync: redis.Redis) -> None:
    r = Redis.from_url(valkey.url, decode_responses=True)
    snap = await StatsStore(r, prefix="kw:", recent_len=3, ttft_len=2).snapshot("alpha", [])
    assert snap["totals"]["requests"] == 0 and snap["totals"]["hit_rate_tokens"] == 0.0
    assert (snap["recent"], snap["ttft_ms"]) == ([], {"cold": [], "warm": []})
    await r.aclose()


async def test_rate_limit_fixed_window(valkey: Proc, redis_sync: redis.Redis) -> None:
    r = Redis.from_url(valkey.url, decode_responses=True)
    limiter = RateLimiter(r, prefix="kw:", limit=2, window_s=10)
    assert await limiter.retry_after("alpha", 1000.0) is None
    assert await limiter.retry_after("alpha", 1003.0) is None
    assert await limiter.retry_after("alpha", 1006.2) == 4  # window [1000, 1010) is spent
    assert await limiter.retry_after("beta", 1006.2) is None  # per tenant
    assert await limiter.retry_after("alpha", 1010.0) is None  # next window
    assert 0 < redis_sync.ttl("kw:ratelimit:alpha:101") <= 11
    await r.aclose()


async def test_tenant_keys_are_per_tenant_and_bounded(valkey: Proc, redis_sync: redis.Redis) -> None:
    r = Redis.from_url(valkey.url, decode_responses=True)
    keys = TenantKeys(r, prefix="kw:", ttl_s=300, max_keys=3)
    for i in range(5):
        await keys.add("alpha", f"k{i}", 1000.0 + i)
    await keys.add("alpha", "k2", 2000.0)  # reported again: newest now
    await keys.add("beta", "b0", 1000.0)
    assert await keys.of("alpha") == {"k2", "k3", "k4"}  # the 3 most recently reported
    assert await keys.of("beta") == {"b0"} and await keys.of("gamma") == set()
    assert 0 < redis_sync.ttl("kw:cachekeys:alpha") <= 300
    await r.aclose()


async def test_breaker_opens_on_a_hung_redis_and_closes_when_it_answers(tmp_path: Path) -> None:
    server = start_valkey(tmp_path / "valkey")
    r = Redis.from_url(server.url, decode_responses=True, socket_timeout=0.2, socket_connect_timeout=0.2,
                       retry=Retry(NoBackoff(), 0))  # fmt: skip
    breaker = Breaker(cooldown_s=0.1)
    watcher = asyncio.create_task(breaker.watch(r.ping))
    try:
        assert await breaker.call(r.set("k", "v")) is True
        server.pause()
        with pytest.raises(RedisUnavailable, match="TimeoutError"):
            await breaker.call(r.get("k"))  # the one call that waits out the socket timeout
        state = breaker.state()
        assert (state.open, state.trips, state.fast_failures) == (True, 1, 0)
        assert state.last_error is not None and state.last_error.startswith("TimeoutError")
        for _ in range(50):  # refused without touching the socket
            with pytest.raises(RedisUnavailable, match="circuit open"):
                await breaker.call(r.get("k"))
        assert breaker.state().fast_failures == 50 and breaker.state().trips == 1
        server.resume()
        for _ in range(100):
            if not breaker.is_open:
                break
            await asyncio.sleep(0.05)
        assert not breaker.is_open  # the watcher's ping closed it
        assert await breaker.call(r.get("k")) == "v"
        # A command error is not an outage: it passes through and the circuit stays closed.
        with pytest.raises(ResponseError):
            await breaker.call(r.incr("k"))
        assert not breaker.is_open and breaker.state().trips == 1
    finally:
        watcher.cancel()
        server.resume()
        await r.aclose()
        server.stop()
