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
    proc = start_gateway(
        [dead_engine], valkey.url, logs, extra=["--max-body-bytes", "300000", "--max-messages", "8"]
    )
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
        "engines": [{"url": dead_engine, "healthy": False, "running": None, "waiting": None}],
        "redis": True,
        "redis_circuit": {"open": False, "trips": 0, "fast_failures": 0, "last_error": None},
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
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 300_001}]}
    err = error_of(chat(lonely_gateway, **big), 413)
    assert "300000 bytes" in err["message"] and "KEEPWARM_MAX_BODY_BYTES" in err["message"]

    # Without a Content-Length (chunked upload) the limit holds while reading.
    def chunks() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 30_001
        yield b'"}]}'

    r = httpx.post(lonely_gateway.url + "/v1/chat/completions", content=chunks(), headers=ALPHA, timeout=30)
    assert "300000 bytes" in error_of(r, 413)["message"]


@pytest.mark.parametrize("deep", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 40_000 + b"1" + b"}" * 40_000])
def test_deeply_nested_json_is_400_naming_the_limit(lonely_gateway: Proc, deep: bytes) -> None:
    # Was a RecursionError and a 500; now refused for its depth, alone or inside a valid request.
    for body in (deep, b'{"messages": [{"role": "user", "content": "x"}], "tools": ' + deep + b"}"):
        err = error_of(chat(lonely_gateway, body), 400)
        assert "nests deeper than 64 levels" in err["message"]
    # 64 levels are accepted (then refused for want of an engine): body, tools, tool, function,
    # parameters (5 levels) and 59 nested lists.
    tool = b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"function": {"name": "f", "parameters": {"x": '
    ok = tool + b"[" * 59 + b"]" * 59 + b"}}}]}"
    assert chat(lonely_gateway, ok).status_code == 503
    one_more = tool + b"[" * 60 + b"]" * 60 + b"}}}]}"
    assert "nests deeper than 64 levels" in error_of(chat(lonely_gateway, one_more), 400)["message"]


def test_too_many_messages_is_413_naming_the_limit(lonely_gateway: Proc) -> None:
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(9)]
    err = error_of(chat(lonely_gateway, model="m", messages=msgs), 413)
    assert err["param"] == "messages"
    assert "'messages' has 9 entries; the gateway accepts at most 8 (KEEPWARM_MAX_MESSAGES)" in err["message"]
    assert chat(lonely_gateway, model="m", messages=msgs[:8]).status_code == 503  # at the limit: accepted


@pytest.mark.parametrize(
    ("field", "value", "expect"),
    [
        ("seed", 2**64, "'seed' must be an integer in [-9223372036854775808, 9223372036854775807]"),
        ("seed", 2**63, "'seed' must be an integer in [-9223372036854775808, 9223372036854775807]"),
        ("seed", -(2**63) - 1, "'seed' must be an integer in"),
        ("seed", 1.5, "'seed' must be an integer in"),
        ("max_tokens", 0, "'max_tokens' must be an integer in [1, 2147483647], got 0"),
        ("max_tokens", 2**31, "'max_tokens' must be an integer in [1, 2147483647]"),
        ("max_tokens", "5", "'max_tokens' must be an integer in [1, 2147483647], got '5'"),
        ("max_completion_tokens", -1, "'max_completion_tokens' must be an integer in [1, 2147483647]"),
        ("temperature", -0.5, "'temperature' must be a number in [0, 100], got -0.5"),
        ("temperature", True, "'temperature' must be a number in [0, 100], got True"),
        ("top_p", 0, "'top_p' must be a number in (0, 1], got 0"),
        ("top_p", 1.01, "'top_p' must be a number in (0, 1]"),
        ("top_k", -1, "'top_k' must be an integer in [0, 2147483647]"),
        ("n", 0, "'n' must be an integer in [1, 128]"),
        ("presence_penalty", 2.5, "'presence_penalty' must be a number in [-2, 2]"),
        ("frequency_penalty", -3, "'frequency_penalty' must be a number in [-2, 2]"),
        ("top_logprobs", 21, "'top_logprobs' must be an integer in [0, 20]"),
    ],
)
def test_numeric_field_out_of_range_is_400_naming_it(lonely_gateway: Proc, field: str, value: object,
                                                     expect: str) -> None:  # fmt: skip
    for stream in (False, True):  # streamed or not: a 400 before any work, never a broken stream
        err = error_of(chat(lonely_gateway, model="m", messages=CHAT["messages"], stream=stream, **{field: value}),
                       400)  # fmt: skip
        assert err["param"] == field and expect in err["message"]


@pytest.mark.parametrize(
    ("body", "param", "expect"),
    [
        (b'{"messages": [{"role": "user"}], "prefix_cache": {"scope": "full", "window": -1}}',
         "prefix_cache.window", "'prefix_cache.window' must be an integer in [0, 2147483647]"),
        (b'{"messages": [{"role": "user"}], "extra": {"deep": [1, 36893488147419103232]}}',
         "extra.deep[1]", "'extra.deep[1]' is 36893488147419103232: numbers must fit in 64 bits"),
        (b'{"messages": [{"role": "user"}], "temperature": NaN}', None, "contains NaN, which is not JSON"),
        (b'{"messages": [{"role": "user"}], "top_p": Infinity}', None, "contains Infinity, which is not JSON"),
    ],
)  # fmt: skip
def test_every_other_number_is_bounded(
    lonely_gateway: Proc, body: bytes, param: str | None, expect: str
) -> None:
    err = error_of(chat(lonely_gateway, body), 400)
    assert err["param"] == param and expect in err["message"]


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
    redis_sync.set("keepwarm:stats:alpha:since", 123.5)
    body = httpx.get(lonely_gateway.url + "/v1/stats", headers=ALPHA).json()
    assert body["tenant"] == "alpha" and body["totals"]["requests"] == 0 and body["recent"] == []
    assert body["engines"] == [{"url": dead_engine, "healthy": False, "running": None, "waiting": None}]
    assert body["since"] == 123.5
    assert httpx.get(lonely_gateway.url + "/v1/sessions", headers=ALPHA).json() == {"tenant": "alpha",
                                                                                    "sessions": []}  # fmt: skip


def test_cache_endpoints_report_unreachable_engines(lonely_gateway: Proc, dead_engine: str) -> None:
    body = httpx.get(lonely_gateway.url + "/v1/cache", headers=ALPHA).json()
    assert body["entries"] == [] and len(body["engines"]) == 1
    assert body["engines"][0]["url"] == dead_engine and body["engines"][0]["error"].startswith("ConnectError")
    err = error_of(httpx.delete(lonely_gateway.url + "/v1/cache", headers=ALPHA), 403)
    assert "KEEPWARM_ADMIN_TENANTS lists who may: no tenant" in err["message"]


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
        assert r.json()["engines"][0]["error"].startswith("ConnectError")
    finally:
        gw.stop()
