"""The gateway's own answers, with no engine able to serve: auth, validation,
size and rate limits, 503, the one error shape. A real gateway process, real Valkey."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.api.procs import Proc, free_port, start_gateway

ALPHA = {"Authorization": "Bearer key-alpha"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def dead_engine() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nobody listens here


@pytest.fixture(scope="module")
def lonely_gateway(dead_engine: str, valkey: Proc, logs: Path) -> Iterator[Proc]:
    proc = start_gateway([dead_engine], valkey.url, logs, extra=["--max-body-bytes", "2000"])
    yield proc
    proc.stop()


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]


def chat(gw: Proc, content: bytes | None = None, headers: dict | None = None, **kw: object) -> httpx.Response:
    body = content if content is not None else json.dumps(kw or CHAT).encode()
    h = {"content-type": "application/json", **ALPHA, **(headers or {})}
    return httpx.post(gw.url + "/v1/chat/completions", content=body, headers=h, timeout=30)


def test_health_reports_engines_without_auth(lonely_gateway: Proc, dead_engine: str) -> None:
    r = httpx.get(lonely_gateway.url + "/health")
    assert r.status_code == 200
    assert r.json() == {
        "status": "degraded",
        "engines": [{"url": dead_engine, "healthy": False}],
        "redis": True,
    }


@pytest.mark.parametrize(
    ("headers", "message"),
    [({"Authorization": ""}, "missing API key"), ({"Authorization": "Bearer wrong"}, "invalid API key")],
)
def test_bad_key_is_401(lonely_gateway: Proc, headers: dict, message: str) -> None:
    err = error_of(chat(lonely_gateway, headers=headers), 401)
    assert message in err["message"] and err["type"] == "authentication_error"
    for path in ("/v1/stats", "/v1/sessions", "/v1/models", "/v1/cache"):
        error_of(httpx.get(lonely_gateway.url + path, headers=headers), 401)


@pytest.mark.parametrize(
    ("content", "param", "message"),
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must be a JSON object"),
        (b'{"model": "m"}', "messages", "'messages' is required"),
        (b'{"messages": []}', "messages", "'messages' is required"),
        (b'{"messages": ["hi"]}', "messages[0].role", "messages[0] must be an object"),
        (b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream", "'stream' must be"),
        (b'{"messages": [{"role": "user", "content": "x"}], "user": 5}', "user", "'user' must be a string"),
    ],
)
def test_malformed_body_is_400_naming_the_field(
    lonely_gateway: Proc, content: bytes, param: str | None, message: str
) -> None:
    err = error_of(chat(lonely_gateway, content), 400)
    assert err["param"] == param and message in err["message"] and err["type"] == "invalid_request_error"


def test_bad_session_id_is_400(lonely_gateway: Proc) -> None:
    err = error_of(chat(lonely_gateway, headers={"X-Session-Id": "x" * 200}), 400)
    assert err["param"] == "X-Session-Id" and "1-128 printable characters" in err["message"]


def test_oversized_body_is_413_naming_the_limit(lonely_gateway: Proc) -> None:
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 3000}]}
    err = error_of(chat(lonely_gateway, **big), 413)
    assert "2000 bytes" in err["message"] and "KEEPWARM_MAX_BODY_BYTES" in err["message"]

    # Without a Content-Length (chunked upload) the limit holds while reading.
    def chunks() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 500
        yield b'"}]}'

    r = httpx.post(lonely_gateway.url + "/v1/chat/completions", content=chunks(), headers=ALPHA, timeout=30)
    assert "2000 bytes" in error_of(r, 413)["message"]


def test_no_healthy_engine_is_503(lonely_gateway: Proc, dead_engine: str) -> None:
    for stream in (False, True):
        r = chat(lonely_gateway, model="m", messages=CHAT["messages"], stream=stream)
        err = error_of(r, 503)
        assert err["message"].startswith("no healthy engine") and dead_engine in err["message"]
        assert r.headers["retry-after"] == "1"
    error_of(httpx.get(lonely_gateway.url + "/v1/models", headers=ALPHA), 503)


def test_unknown_route_and_session_use_the_error_shape(lonely_gateway: Proc) -> None:
    assert "no route for GET /v1/nope" in error_of(httpx.get(lonely_gateway.url + "/v1/nope"), 404)["message"]
    err = error_of(httpx.get(lonely_gateway.url + "/v1/sessions/ghost", headers=ALPHA), 404)
    assert "no session 'ghost'" in err["message"]
    assert "PUT is not allowed" in error_of(httpx.put(lonely_gateway.url + "/v1/stats"), 405)["message"]


def test_stats_answer_with_engines_and_zero_totals(lonely_gateway: Proc, redis_sync: redis.Redis,
                                                   dead_engine: str) -> None:  # fmt: skip
    redis_sync.set("keepwarm:stats:since", 123.5)
    body = httpx.get(lonely_gateway.url + "/v1/stats", headers=ALPHA).json()
    assert body["totals"]["requests"] == 0 and body["recent"] == []
    assert body["engines"] == [{"url": dead_engine, "healthy": False}]
    assert body["since"] == 123.5
    assert httpx.get(lonely_gateway.url + "/v1/sessions", headers=ALPHA).json() == {"tenant": "alpha",
                                                                                    "sessions": []}  # fmt: skip


def test_cache_endpoints_report_unreachable_engines(lonely_gateway: Proc, dead_engine: str) -> None:
    body = httpx.get(lonely_gateway.url + "/v1/cache", headers=ALPHA).json()
    assert body["entries"] == [] and len(body["engines"]) == 1
    assert body["engines"][0]["url"] == dead_engine and body["engines"][0]["error"].startswith("ConnectError")
    body = httpx.delete(lonely_gateway.url + "/v1/cache", headers=ALPHA).json()
    assert body["deleted"] == 0 and body["engines"][0]["error"].startswith("ConnectError")


def test_rate_limit_is_429_with_retry_after(dead_engine: str, valkey: Proc, logs: Path,
                                            redis_sync: redis.Redis) -> None:  # fmt: skip
    gw = start_gateway([dead_engine], valkey.url, logs, extra=["--rate-limit", "2", "--rate-window", "3600"])
    try:
        assert chat(gw).status_code == 503  # counted, then refused for want of an engine
        assert chat(gw).status_code == 503
        r = chat(gw)
        err = error_of(r, 429)
        assert "rate limit of 2 requests per 3600s" in err["message"] and err["type"] == "rate_limit_error"
        assert 1 <= int(r.headers["retry-after"]) <= 3600
        # Another tenant has its own budget.
        assert chat(gw, headers={"Authorization": "Bearer key-beta"}).status_code == 503
    finally:
        gw.stop()


def test_only_admin_tenants_may_clear_the_cache(dead_engine: str, valkey: Proc, logs: Path) -> None:
    gw = start_gateway([dead_engine], valkey.url, logs, extra=["--admin-tenants", "beta"])
    try:
        err = error_of(httpx.delete(gw.url + "/v1/cache", headers=ALPHA), 403)
        assert "KEEPWARM_ADMIN_TENANTS" in err["message"] and "'alpha'" in err["message"]
        r = httpx.delete(gw.url + "/v1/cache", headers={"Authorization": "Bearer key-beta"})
        assert r.status_code == 200 and r.json()["deleted"] == 0
    finally:
        gw.stop()
