"""The gateway in front of a real engine process (tiny demo model), driven by the
official `openai` client and by raw HTTP: sessions and cache hits, streaming,
tenant salts, errors passed through, stats and sessions from Redis, cache admin."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from keepwarm.api.auth import tenant_salt
from tests.api.procs import (
    ENGINE_AUTH,
    ENGINE_TOKEN,
    TEST_SECRET,
    Proc,
    engine_cache_dir,
    start_gateway,
    wait_snapshot_file,
)

# The topic leads the system prompt, so conversations on different topics share no cached prefix.
SYSTEM = "You are a careful assistant. Answer briefly and name the sources you relied on."


def client(gw: Proc, key: str = "key-alpha", session: str | None = None) -> openai.OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120,
                         default_headers=headers)  # fmt: skip


def convo(topic: str, *turns: str) -> list[dict[str, str]]:
    msgs = [
        {"role": "system", "content": f"Topic: {topic}. {SYSTEM}"},
        {"role": "user", "content": f"Tell me about {topic}."},
    ]
    for i, t in enumerate(turns):
        msgs += [
            {"role": "assistant", "content": t},
            {"role": "user", "content": f"And then what, part {i}?"},
        ]
    return msgs


def usage_of(resp: Any) -> dict[str, Any]:
    return resp.usage.model_dump()


def ask(c: openai.OpenAI, msgs: list[dict[str, str]], **kw: Any) -> Any:
    return c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, **kw)


def wait_for(pred: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_models_through_the_gateway(gateway: Proc) -> None:
    assert [m.id for m in client(gateway).models.list().data] == ["tiny"]


def test_second_turn_hits_and_redis_holds_the_last_key(
    gateway: Proc, engine: Proc, redis_sync: redis.Redis
) -> None:
    c = client(gateway, session="two-turns")
    first = ask(c, convo("lighthouses"))
    u1 = usage_of(first)
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0
    assert u1["timings"]["cache_source"] == "none"
    assert "keepwarm" not in (first.model_extra or {})  # engine-internal: stripped by the gateway
    reply = first.choices[0].message.content
    second = ask(c, convo("lighthouses", reply))
    u2 = usage_of(second)
    assert u2["prompt_tokens_details"]["cached_tokens"] > 0
    assert u2["timings"]["cache_source"] in ("memory", "disk")
    assert u2["timings"]["restored_tokens"] == u2["prompt_tokens_details"]["cached_tokens"]
    # The session map, read straight from Redis.
    s = redis_sync.hgetall("keepwarm:session:alpha:two-turns")
    assert (s["turns"], s["hits"], s["engine"]) == ("2", "1", engine.url)
    assert s["key"] and int(s["tokens"]) >= u2["prompt_tokens"]  # continued checkpoint: prompt + reply
    assert float(s["last_ttft_ms"]) == u2["timings"]["ttft_ms"]
    assert 0 < redis_sync.ttl("keepwarm:session:alpha:two-turns") <= 7 * 24 * 3600
    # That key is a real file in the engine's disk cache.
    assert wait_snapshot_file(engine_cache_dir(engine), s["key"]).stat().st_size > 0
    # The gateway's session views.
    h = {"Authorization": "Bearer key-alpha"}
    listed = httpx.get(gateway.url + "/v1/sessions", headers=h).json()["sessions"]
    assert [x["id"] for x in listed] == ["two-turns"] and listed[0]["key"] == s["key"]
    one = httpx.get(gateway.url + "/v1/sessions/two-turns", headers=h).json()
    assert one["session"]["turns"] == 2
    assert [t["cached_tokens"] for t in one["timeline"]] == [u2["prompt_tokens_details"]["cached_tokens"], 0]
    # Another tenant does not see the session.
    assert httpx.get(gateway.url + "/v1/sessions/two-turns", headers={"Authorization": "Bearer key-beta"}
                     ).status_code == 404  # fmt: skip


def test_stats_follow_the_requests(gateway: Proc, redis_sync: redis.Redis) -> None:
    c = client(gateway)
    r1 = ask(c, convo("glaciers"), user="stats-user")  # session from `user`
    r2 = ask(c, convo("glaciers", r1.choices[0].message.content), user="stats-user")
    u1, u2 = usage_of(r1), usage_of(r2)
    stats = httpx.get(gateway.url + "/v1/stats", headers={"Authorization": "Bearer key-alpha"}).json()
    assert stats["tenant"] == "alpha"
    t = stats["totals"]
    cached = u2["prompt_tokens_details"]["cached_tokens"]
    assert (t["requests"], t["hits"], t["hit_rate_requests"]) == (2, 1, 0.5)
    assert t["prompt_tokens"] == u1["prompt_tokens"] + u2["prompt_tokens"]
    assert t["cached_tokens"] == cached and t["hit_rate_tokens"] == cached / t["prompt_tokens"]
    assert t["completion_tokens"] == u1["completion_tokens"] + u2["completion_tokens"]
    assert t["hits_by_tier"] == {"memory": 1, "disk": 0}
    assert t["prefill_seconds"] == pytest.approx(
        (u1["timings"]["prefill_ms"] + u2["timings"]["prefill_ms"]) / 1000
    )
    assert stats["ttft_ms"] == {"cold": [u1["timings"]["ttft_ms"]], "warm": [u2["timings"]["ttft_ms"]]}
    newest = stats["recent"][0]
    assert (newest["session"], newest["tenant"], newest["cache_source"], newest["cached_tokens"]) == (
        "stats-user",
        "alpha",
        "memory",
        cached,
    )
    assert [r["session"] for r in stats["recent"]] == ["stats-user", "stats-user"]
    (row,) = stats["engines"]  # running/waiting: the engine's figures at the gateway's last poll
    assert (row["url"], row["healthy"]) == (stats["recent"][0]["engine"], True)
    assert row.keys() == {"url", "healthy", "running", "waiting"} and row["running"] >= 0 <= row["waiting"]


def test_streaming_passes_through_and_matches_non_streaming(gateway: Proc, redis_sync: redis.Redis) -> None:
    msgs = convo("river deltas")
    plain = ask(client(gateway, session="plain"), msgs)
    chunks = list(ask(client(gateway, session="streamed"), msgs, stream=True,
                      stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    final = chunks[-1]
    assert final.choices == [] and "keepwarm" not in (final.model_extra or {})
    u = final.usage.model_dump()
    # Same prompt as `plain`, same tenant: the whole prompt is restored.
    assert u["prompt_tokens"] == plain.usage.prompt_tokens
    assert u["timings"]["cache_source"] == "memory" and u["prompt_tokens_details"]["cached_tokens"] > 0
    assert redis_sync.hget("keepwarm:session:alpha:streamed", "turns") == "1"
    # Raw bytes: SSE framing kept, keepwarm object gone, [DONE] last; the usage chunk only when
    # asked for, though the gateway records every streamed turn.
    for include_usage in (True, False):
        body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0, "stream": True,
                **({"stream_options": {"include_usage": True}} if include_usage else {})}  # fmt: skip
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer key-alpha", "X-Session-Id": "raw"}) as r:  # fmt: skip
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = r.read()
        assert b'"keepwarm"' not in raw and (b'"usage"' in raw) == include_usage
        assert "\n\n\n" not in raw.decode()
        events = [e for e in raw.decode().split("\n\n") if e.strip()]
        assert all(e.startswith(("data: ", ":")) for e in events)
        assert events[-1] == "data: [DONE]"
    assert redis_sync.hget("keepwarm:session:alpha:raw", "turns") == "2"


def test_tenant_salt_comes_from_the_key_not_the_client(gateway: Proc, redis_sync: redis.Redis) -> None:
    msgs = convo("the tides of a distant bay")
    alpha, beta = client(gateway), client(gateway, key="key-beta")
    # alpha warms the prompt, trying to pick a salt and a hint of its own: both dropped.
    ask(alpha, msgs, extra_body={"cache_salt": "mine", "session_hint": {"key": "forged", "tokens": 3}})
    # beta sends alpha's real salt: overridden by beta's, so no hit on alpha's prefix.
    spoof = ask(beta, msgs, extra_body={"cache_salt": tenant_salt(TEST_SECRET.encode(), "alpha")})
    assert usage_of(spoof)["prompt_tokens_details"]["cached_tokens"] == 0
    # alpha again, no session: its own earlier prefix hits (alpha's salt was used, not "mine").
    again = ask(alpha, msgs)
    assert usage_of(again)["prompt_tokens_details"]["cached_tokens"] > 0


def test_engine_errors_pass_through(gateway: Proc) -> None:
    c = client(gateway)
    with pytest.raises(openai.BadRequestError) as bad:
        ask(c, convo("x"), extra_body={"max_tokens": 0})
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    long = [{"role": "user", "content": " ".join(f"word{i}" for i in range(600))}]
    with pytest.raises(openai.APIStatusError) as big:
        ask(c, long)
    assert big.value.status_code == 413
    assert "max_context 512" in big.value.body["message"] and big.value.body["param"] == "messages"


def test_client_disconnect_cancels_the_engine(gateway: Proc, engine: Proc) -> None:
    def completion_tokens() -> float:
        text = httpx.get(engine.url + "/metrics", headers=ENGINE_AUTH).text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("keepwarm_completion_tokens"))  # fmt: skip

    before = completion_tokens()
    body = {"model": "tiny", "messages": convo("a very long story"), "max_tokens": 400, "temperature": 0,
            "stream": True, "speculate": False}  # fmt: skip  (one token per step: it cannot end first)
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": "Bearer key-alpha"}) as r:  # fmt: skip
        assert r.status_code == 200
        next(r.iter_raw())  # the first chunk is out: generation is under way, nothing buffered
    # The gateway closed its upstream request; the engine stops well short of 400 tokens.
    wait_for(lambda: httpx.get(engine.url + "/health").json()["queue_depth"] == 0, what="engine idle")
    assert completion_tokens() - before < 400


def test_cache_admin_through_the_gateway(
    gateway: Proc, engine: Proc, valkey: Proc, logs: Path, redis_sync: redis.Redis
) -> None:
    """Last in this module: it empties the shared engine's cache."""
    c = client(gateway, session="admin")
    ask(c, convo("comets"))
    key = redis_sync.hget("keepwarm:session:alpha:admin", "key")
    h = {"Authorization": "Bearer key-alpha"}

    def listed() -> dict[str, Any] | None:
        body = httpx.get(gateway.url + "/v1/cache", params={"top": 3}, headers=h).json()
        return body if body["entries"] else None

    body = wait_for(listed, what="entries in GET /v1/cache")
    assert body["tenant"] == "alpha"
    [row] = body["engines"]
    assert (row["url"], row["healthy"]) == (engine.url, True) and "error" not in row
    # A tenant sees the shared capacity only: no per-request counters, no paths.
    assert row["namespace"] and set(row["stats"]) == {"memory", "disk"}
    assert set(row["stats"]["disk"]) <= {"num_entries", "num_bytes", "budget_bytes", "min_free_bytes",
                                         "free_bytes", "evictions"}  # fmt: skip
    # Its own entries only: every listed key is one the engine reported for alpha.
    own = set(redis_sync.zrange("keepwarm:cachekeys:alpha", 0, -1))
    assert key in own and row["total_entries"] >= 1 and 1 <= len(row["entries"]) <= 3
    assert {e["key"] for e in row["entries"]} <= own
    assert all(e["engine"] == engine.url for e in body["entries"])
    hits = [(e["hits"], e["last_used"]) for e in body["entries"]]
    assert hits == sorted(hits, reverse=True)  # most hit first
    # Clearing the shared cache is for admin tenants only, and none is configured here.
    refused = httpx.delete(gateway.url + "/v1/cache", headers=h)
    assert refused.status_code == 403 and "KEEPWARM_ADMIN_TENANTS" in refused.json()["error"]["message"]
    admin_gw = start_gateway([engine.url], valkey.url, logs, engine_token=ENGINE_TOKEN,
                             extra=["--admin-tenants", "alpha"])  # fmt: skip
    try:
        everything = httpx.get(admin_gw.url + "/v1/cache", params={"top": 1000}, headers=h).json()
        [admin_row] = everything["engines"]
        assert "engine" in admin_row["stats"]  # the admin sees every figure
        deleted = httpx.delete(admin_gw.url + "/v1/cache", headers=h).json()
        assert deleted["deleted"] >= admin_row["total_entries"] >= row["total_entries"]
        assert deleted["engines"] == [{"url": engine.url, "deleted": deleted["deleted"]}]
        assert httpx.get(admin_gw.url + "/v1/cache", headers=h).json()["entries"] == []
    finally:
        admin_gw.stop()
    # The session still names the deleted key: the next turn simply misses.
    again = ask(c, convo("comets"))
    assert usage_of(again)["timings"]["cache_source"] == "none"
