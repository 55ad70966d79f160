"""The gateway client against a real HTTP server and a closed port."""

from __future__ import annotations

import pytest
from ui_payloads import CHAT_REPLY, STATS

from keepwarm.ui.client import GatewayClient, GatewayDown, GatewayError
from keepwarm.ui.settings import SettingsError, UiSettings


def _client(url: str, key: str = "sk-test") -> GatewayClient:
    return GatewayClient(UiSettings(gateway=url, api_key=key, refresh_s=0, timeout_s=2.0))


def test_closed_port_raises_gateway_down(closed_url: str) -> None:
    with pytest.raises(GatewayDown) as e:
        _client(closed_url).stats()
    assert e.value.gateway == closed_url
    assert "not reachable" in str(e.value) and "ConnectError" in e.value.reason


def test_reads_send_the_key_and_return_json(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/stats")] = (200, STATS)
    canned_gateway.routes[("GET", "/v1/sessions/a%2Fb")] = (200, {"timeline": []})
    c = _client(canned_gateway.url)
    assert c.stats() == STATS
    assert c.session("a/b") == {"timeline": []}  # the id is path-escaped
    assert [s.headers["Authorization"] for s in canned_gateway.seen] == ["Bearer sk-test"] * 2


def test_error_status_carries_the_gateways_message(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/stats")] = (
        401,
        {"error": {"message": "unknown API key", "type": "auth", "param": None, "code": 401}},
    )
    with pytest.raises(GatewayError) as e:
        _client(canned_gateway.url, key="wrong").stats()
    assert (e.value.status, e.value.message, e.value.path) == (401, "unknown API key", "/v1/stats")


def test_unknown_path_is_a_404_error(canned_gateway) -> None:
    with pytest.raises(GatewayError) as e:
        _client(canned_gateway.url).cache()
    assert e.value.status == 404


def test_chat_posts_session_and_parses_timings(canned_gateway) -> None:
    canned_gateway.routes[("POST", "/v1/chat/completions")] = (200, CHAT_REPLY)
    msgs = [{"role": "user", "content": "hi"}]
    reply = _client(canned_gateway.url).chat(msgs, session_id="pg-1", max_tokens=7)
    assert reply.text == "hello there" and reply.finish_reason == "stop"
    assert reply.timings["cache_source"] == "memory" and reply.timings["ttft_ms"] == 12.0
    assert reply.usage["prompt_tokens_details"]["cached_tokens"] == 42 and reply.wall_ms > 0
    (seen,) = canned_gateway.seen
    assert seen.headers["X-Session-Id"] == "pg-1"
    assert seen.body == {"model": "default", "messages": msgs, "max_tokens": 7, "temperature": 0.0}


def test_clear_cache_returns_deleted_count(canned_gateway) -> None:
    canned_gateway.routes[("DELETE", "/v1/cache")] = (200, {"deleted": 5})
    assert _client(canned_gateway.url).clear_cache() == 5


def test_settings_reject_bad_values() -> None:
    with pytest.raises(SettingsError, match="not an http"):
        UiSettings(gateway="localhost:8000", api_key="", refresh_s=1, timeout_s=1)
    with pytest.raises(SettingsError, match="negative"):
        UiSettings(gateway="http://x", api_key="", refresh_s=-1, timeout_s=1)
    with pytest.raises(SettingsError, match="KEEPWARM_UI_REFRESH_S"):
        UiSettings.from_env({"KEEPWARM_UI_REFRESH_S": "soon"})
    s = UiSettings.from_env({"KEEPWARM_UI_GATEWAY": "http://gw:9/", "KEEPWARM_UI_API_KEY": "k"})
    assert (s.gateway, s.api_key, s.refresh_s, s.timeout_s) == ("http://gw:9", "k", 5.0, 5.0)
    assert UiSettings.from_env(s.to_env()) == s
