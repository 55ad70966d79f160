"""Two tenants attacking each other's data through every gateway endpoint, and the
engine port attacked directly: nothing of alpha's is shown to beta, nothing of
alpha's is touched by beta, and no miss is explained against another tenant's key.
One real Valkey, one real engine (answering only the gateway's token), one gateway
with no admin tenant (as ops/up leaves it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from keepwarm.api.auth import tenant_salt
from tests.api.procs import (
    ENGINE_AUTH,
    TEST_SECRET,
    GatewayStack,
    engine_cache_dir,
    shared_demo_model,
    start_stack,
    wait_snapshot_file,
)

ALPHA = {"Authorization": "Bearer key-alpha"}
BETA = {"Authorization": "Bearer key-beta"}
SECRET_TOPIC = "the combination of the alpha vault"
SESSION = "alpha-private-session"


def convo(*replies: str) -> list[dict[str, str]]:
    msgs = [
        {"role": "system", "content": f"Topic: {SECRET_TOPIC}. Answer briefly."},
        {"role": "user", "content": f"Tell me about {SECRET_TOPIC}."},
    ]
    for i, r in enumerate(replies):
        msgs += [{"role": "assistant", "content": r}, {"role": "user", "content": f"More, part {i}?"}]
    return msgs


def chat(url: str, headers: dict[str, str], msgs: list[dict[str, str]], session: str | None = None,
         **extra: Any) -> dict[str, Any]:  # fmt: skip
    h = {**headers, **({"X-Session-Id": session} if session else {})}
    body = {"model": "tiny", "messages": msgs, "max_tokens": 6, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=h, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    s = start_stack(tmp_path_factory.mktemp("tenants"), model)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def alpha_data(stack: GatewayStack) -> dict[str, Any]:
    """Alpha's two-turn session, its last prefix key and that key's file on disk."""
    gw = stack.gateway.url
    first = chat(gw, ALPHA, convo(), SESSION)
    second = chat(gw, ALPHA, convo(first["choices"][0]["message"]["content"]), SESSION)
    r = redis.Redis.from_url(stack.valkey.url, decode_responses=True)
    session = r.hgetall(f"keepwarm:session:alpha:{SESSION}")
    r.close()
    assert session["turns"] == "2" and session["key"]
    path = wait_snapshot_file(engine_cache_dir(stack.engines[0]), session["key"])
    return {"session": session, "file": path, "reply": first["choices"][0]["message"]["content"],
            "second": second}  # fmt: skip


def cache_files(stack: GatewayStack) -> set[Path]:
    return set(engine_cache_dir(stack.engines[0]).rglob("*.safetensors"))


def test_beta_reads_nothing_of_alpha(stack: GatewayStack, alpha_data: dict[str, Any]) -> None:
    gw = stack.gateway.url
    key = alpha_data["session"]["key"]
    for path in ("/v1/stats", "/v1/sessions", "/v1/cache", "/v1/cache?top=1000"):
        r = httpx.get(gw + path, headers=BETA, timeout=30)
        assert r.status_code == 200, r.text
        text = r.text
        # Not alpha's tenant name, session id, prefix key, nor any of its numbers by record.
        assert "alpha" not in text and SESSION not in text and key not in text, (path, text[:500])
    stats = httpx.get(gw + "/v1/stats", headers=BETA).json()
    assert stats["tenant"] == "beta" and stats["totals"]["requests"] == 0 and stats["recent"] == []
    assert stats["ttft_ms"] == {"cold": [], "warm": []}
    assert httpx.get(gw + "/v1/sessions", headers=BETA).json() == {"tenant": "beta", "sessions": []}
    cache = httpx.get(gw + "/v1/cache?top=1000", headers=BETA).json()
    assert cache["entries"] == [] and [row["total_entries"] for row in cache["engines"]] == [0]
    # The engine row carries only shared capacity figures: no traffic counters, no paths.
    row_stats = cache["engines"][0]["stats"]
    assert set(row_stats) == {"memory", "disk"} and "path" not in json.dumps(row_stats)
    # The one session id alpha uses is simply not found for beta.
    missing = httpx.get(gw + f"/v1/sessions/{SESSION}", headers=BETA)
    assert missing.status_code == 404
    # Alpha, for contrast, sees its own.
    mine = httpx.get(gw + "/v1/cache?top=1000", headers=ALPHA).json()
    assert key in {e["key"] for e in mine["entries"]}
    assert httpx.get(gw + f"/v1/sessions/{SESSION}", headers=ALPHA).json()["session"]["turns"] == 2


def test_beta_cannot_clear_or_touch_alphas_cache(stack: GatewayStack, alpha_data: dict[str, Any]) -> None:
    gw = stack.gateway.url
    before = cache_files(stack)
    assert alpha_data["file"] in before
    for headers in (BETA, ALPHA):  # no tenant is admin unless KEEPWARM_ADMIN_TENANTS names it
        r = httpx.delete(gw + "/v1/cache", headers=headers)
        assert r.status_code == 403 and "KEEPWARM_ADMIN_TENANTS" in r.json()["error"]["message"]
    assert cache_files(stack) >= before  # nothing deleted (the writer may have added)
    # Alpha's next turn still restores its own prefix.
    third = chat(gw, ALPHA, convo(alpha_data["reply"]), SESSION)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_beta_cannot_hit_or_probe_alphas_prompts(stack: GatewayStack, alpha_data: dict[str, Any]) -> None:
    gw = stack.gateway.url
    key, tokens = alpha_data["session"]["key"], int(alpha_data["session"]["tokens"])
    # Same session id, same prompt, alpha's salt and alpha's key forged in the body.
    forged = chat(gw, BETA, convo(alpha_data["reply"]), SESSION,
                  cache_salt=tenant_salt(TEST_SECRET.encode(), "alpha"),
                  session_hint={"key": key, "tokens": tokens})  # fmt: skip
    t = forged["usage"]["timings"]
    assert forged["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and t["cache_source"] == "none"
    assert "diverged_at" not in t
    # Beta's session is its own; alpha's is untouched.
    r = redis.Redis.from_url(stack.valkey.url, decode_responses=True)
    try:
        assert r.hget(f"keepwarm:session:beta:{SESSION}", "turns") == "1"
        assert r.hget(f"keepwarm:session:alpha:{SESSION}", "key") != r.hget(f"keepwarm:session:beta:{SESSION}",
                                                                            "key")  # fmt: skip
    finally:
        r.close()
    stats = httpx.get(gw + "/v1/stats", headers=BETA).json()
    assert [x["tenant"] for x in stats["recent"]] == ["beta"]


def test_the_engine_answers_only_the_gateway(stack: GatewayStack, alpha_data: dict[str, Any]) -> None:
    engine = stack.engines[0].url
    before = cache_files(stack)
    body = {"model": "tiny", "messages": convo(), "max_tokens": 2, "cache_salt": "x"}
    for auth in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": "Basic abc"}):
        calls = [
            httpx.post(engine + "/v1/chat/completions", json=body, headers=auth),
            httpx.get(engine + "/v1/cache", headers=auth),
            httpx.delete(engine + "/v1/cache", headers=auth),
            httpx.get(engine + "/v1/models", headers=auth),
            httpx.get(engine + "/metrics", headers=auth),
        ]
        for r in calls:
            assert r.status_code == 401, (r.request.method, r.request.url, r.text)
            assert "KEEPWARM_ENGINE_TOKEN" in r.json()["error"]["message"]
    assert httpx.get(engine + "/health").status_code == 200  # probes need no token
    assert cache_files(stack) >= before


def test_a_miss_is_never_explained_against_another_salt(
    stack: GatewayStack, alpha_data: dict[str, Any]
) -> None:
    """Even a request that does carry the engine token (a gateway bug, a leaked token)
    gets no `diverged_at` for a key made with another tenant's salt: no prompt oracle."""
    engine = stack.engines[0].url
    key, tokens = alpha_data["session"]["key"], int(alpha_data["session"]["tokens"])
    msgs = convo(alpha_data["reply"])
    msgs[-1] = {"role": "user", "content": "A different question entirely?"}  # diverges inside the prefix

    def probe(salt: str) -> dict[str, Any]:
        body = {"model": "tiny", "messages": msgs, "max_tokens": 2, "temperature": 0, "cache_salt": salt,
                "session_hint": {"key": key, "tokens": tokens}}  # fmt: skip
        r = httpx.post(engine + "/v1/chat/completions", json=body, headers=ENGINE_AUTH, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["timings"]

    # With alpha's own salt the miss is explained (the control: the probe would work) ...
    own = probe(tenant_salt(TEST_SECRET.encode(), "alpha"))
    assert isinstance(own.get("diverged_at"), int) and 0 < own["diverged_at"] < tokens
    # ... with beta's salt, or any other, it is not.
    for salt in (tenant_salt(TEST_SECRET.encode(), "beta"), "", "guess"):
        assert "diverged_at" not in probe(salt)
