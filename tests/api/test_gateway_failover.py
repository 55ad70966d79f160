"""Engines dying, restarting and filling up under a real gateway: 503 while down,
a disk hit after a SIGKILL + restart on the same cache dir, failover to another
engine, a full engine queue answered 429 with Retry-After."""

from __future__ import annotations

import concurrent.futures
import functools
import re
from pathlib import Path
from typing import Any

import httpx
import redis

from tests.api.procs import ENGINE_TOKEN, Proc, free_port, wait_snapshot_file
from tests.api.procs import start_engine as _start_engine
from tests.api.procs import start_gateway as _start_gateway

# Every engine here answers only its gateway.
start_engine = functools.partial(_start_engine, token=ENGINE_TOKEN)
start_gateway = functools.partial(_start_gateway, engine_token=ENGINE_TOKEN)

ALPHA = {"Authorization": "Bearer key-alpha"}
# The topic leads the system prompt, so conversations on different topics share no cached prefix.
SYSTEM = "You are a careful assistant. Answer briefly and name the sources you relied on."


def chat(gw: Proc, topic: str, session: str | None = None, max_tokens: int = 6, **kw: Any) -> httpx.Response:
    msgs = [
        {"role": "system", "content": f"Topic: {topic}. {SYSTEM}"},
        {"role": "user", "content": f"Tell me about {topic}."},
    ]
    headers = {**ALPHA, **({"X-Session-Id": session} if session else {})}
    body = {"model": "tiny", "messages": msgs, "max_tokens": max_tokens, "temperature": 0, **kw}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def timings(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["timings"]


def test_engine_killed_then_restarted_serves_from_disk(
    demo_model: Path, tmp_path: Path, logs: Path, valkey: Proc, redis_sync: redis.Redis
) -> None:
    cache, port = tmp_path / "cache", free_port()
    engine = start_engine(demo_model, cache, logs, port=port)
    gw = start_gateway([engine.url], valkey.url, logs)
    try:
        assert timings(chat(gw, "volcanoes", "restart"))["cache_source"] == "none"
        key = redis_sync.hget("keepwarm:session:alpha:restart", "key")
        assert key
        # The background writer must have the session's snapshot on disk before the crash.
        wait_snapshot_file(cache, key)
        engine.kill()
        down = chat(gw, "volcanoes", "restart")
        assert down.status_code == 503 and down.json()["error"]["message"].startswith("no healthy engine")
        assert down.headers["retry-after"] == "1"
        health = httpx.get(gw.url + "/health").json()
        assert health["status"] == "degraded" and health["engines"] == [
            {"url": engine.url, "healthy": False, "running": None, "waiting": None}
        ]
        engine = start_engine(demo_model, cache, logs, port=port)
        # Same conversation, next turn: the memory tier died with the process, the disk did not.
        r = chat(gw, "volcanoes", "restart")
        t = timings(r)
        assert t["cache_source"] == "disk" and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        s = redis_sync.hgetall("keepwarm:session:alpha:restart")
        assert (s["turns"], s["hits"]) == ("2", "1")
        stats = httpx.get(gw.url + "/v1/stats", headers=ALPHA).json()
        assert stats["totals"]["hits_by_tier"] == {"memory": 0, "disk": 1}
    finally:
        gw.stop()
        engine.stop()


def test_failover_to_another_engine_before_any_byte(
    demo_model: Path, tmp_path: Path, logs: Path, valkey: Proc, redis_sync: redis.Redis
) -> None:
    procs = [
        start_engine(demo_model, tmp_path / "cache-a", logs),
        start_engine(demo_model, tmp_path / "cache-b", logs),
    ]
    # A poll that never comes: the gateway's view of the engines changes only through requests.
    gw = start_gateway([p.url for p in procs], valkey.url, logs, extra=["--health-interval", "3600"])
    procs.append(gw)
    try:
        assert chat(gw, "the moon", "fo").status_code == 200
        first = redis_sync.hget("keepwarm:session:alpha:fo", "engine")
        victim, survivor = (procs[0], procs[1]) if first == procs[0].url else (procs[1], procs[0])
        assert first == victim.url
        # The session's engine dies; the gateway still believes in it, gets a connect error, moves on.
        victim.kill()
        assert timings(chat(gw, "the moon", "fo"))["cache_source"] == "none"  # a different engine's cache
        assert redis_sync.hget("keepwarm:session:alpha:fo", "engine") == survivor.url
        health = httpx.get(gw.url + "/health").json()["engines"]
        assert {e["url"]: e["healthy"] for e in health} == {victim.url: False, survivor.url: True}
        # The victim comes back (the gateway does not know yet) and the survivor dies: a streamed
        # request fails on the survivor, the gateway probes again and finds the revived engine.
        port = int(victim.url.rsplit(":", 1)[1])
        revived = start_engine(demo_model, tmp_path / ("cache-a" if victim is procs[0] else "cache-b"), logs,
                               port=port)  # fmt: skip
        procs.append(revived)
        survivor.kill()
        r = chat(gw, "the moon", "fo", stream=True, stream_options={"include_usage": True})
        assert r.status_code == 200, r.text
        assert r.text.rstrip().endswith("data: [DONE]") and '"usage"' in r.text
        assert redis_sync.hget("keepwarm:session:alpha:fo", "engine") == revived.url
        assert redis_sync.hget("keepwarm:session:alpha:fo", "turns") == "3"
    finally:
        for p in reversed(procs):
            p.stop()


def test_full_engine_queue_is_429_with_retry_after_from_the_drain_rate(
    demo_model: Path, tmp_path: Path, logs: Path, valkey: Proc, redis_sync: redis.Redis
) -> None:
    # One sequence at a time and one waiting: the rest of 6 concurrent requests are refused.
    engine = start_engine(demo_model, tmp_path / "cache", logs,
                          env={"KEEPWARM_QUEUE_SIZE": "1", "KEEPWARM_MAX_SEQS": "1"})  # fmt: skip
    gw = start_gateway([engine.url], valkey.url, logs)
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            # one token per step (no drafts): the first request still runs when the others arrive
            futures = [pool.submit(chat, gw, f"slow topic {i}", None, 300, speculate=False) for i in range(6)]
            answers = [f.result() for f in futures]
        statuses = sorted(r.status_code for r in answers)
        assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}
        for refused in (r for r in answers if r.status_code == 429):
            err = refused.json()["error"]
            assert err["code"] == 429 and "queue is full" in err["message"]
            # Retry-After is the time until room (the requests ahead of it) at the measured drain rate (the
            # message shows the figures), or, before any request finished, the age of the busy spell.
            wait = int(refused.headers["retry-after"])
            assert f"retry after {wait} s" in err["message"]
            ahead = int(re.search(r"(\d+) requests ahead", err["message"]).group(1))
            assert ahead >= 1
            rate = re.search(r"draining at ([0-9.]+) requests/s", err["message"])
            if rate is not None:  # the message rounds the rate: within a second of it
                assert abs(wait - max(1.0, ahead / float(rate.group(1)))) <= 1
            else:
                assert "no drain rate measured yet" in err["message"]
    finally:
        gw.stop()
        engine.stop()


def test_redis_down_degrades_but_serves(engine: Proc, logs: Path) -> None:
    gw = start_gateway([engine.url], f"redis://127.0.0.1:{free_port()}/0", logs)
    try:
        r = chat(gw, "quiet harbours", "no-redis")
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        assert httpx.get(gw.url + "/health").json()["redis"] is False
        err = httpx.get(gw.url + "/v1/stats", headers=ALPHA).json()["error"]
        assert err["code"] == 503 and err["message"].startswith("stats unavailable: redis is not reachable")
    finally:
        gw.stop()
