"""Each dashboard page rendered by Streamlit's AppTest against a real HTTP server (canned gateway
JSON) and against a closed port."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest
from ui_payloads import CACHE, CHAT_REPLY, EMPTY_STATS, HEALTH, SESSIONS, STATS, TIMELINE


def _page(name: str, gateway: str, refresh_s: float = 0.0) -> None:
    """AppTest script: runs one page module's render against `gateway` (imports inside: AppTest
    runs this function's source as a script)."""
    import importlib

    from keepwarm.ui.client import GatewayClient
    from keepwarm.ui.settings import UiSettings

    client = GatewayClient(UiSettings(gateway=gateway, api_key="sk-ui", refresh_s=refresh_s, timeout_s=2.0))
    page = importlib.import_module(f"keepwarm.ui.page_{name}")
    if name == "playground":
        page.render(client)
    else:
        page.render(client, refresh_s)


def _run(name: str, gateway: str, refresh_s: float = 0.0) -> AppTest:
    at = AppTest.from_function(_page, args=(name, gateway, refresh_s), default_timeout=30)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


@pytest.mark.parametrize("name", ["overview", "sessions", "cache"])
def test_gateway_down_is_a_message(name: str, closed_url: str) -> None:
    at = _run(name, closed_url)
    (err,) = at.error
    assert err.value.startswith(f"Gateway unreachable: {closed_url} did not answer")
    assert "--gateway" in err.value


def test_bad_key_is_a_message(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/stats")] = (
        401,
        {"error": {"message": "unknown API key", "code": 401}},
    )
    canned_gateway.routes[("GET", "/health")] = (200, HEALTH)
    at = _run("overview", canned_gateway.url)
    (err,) = at.error
    assert "refused the dashboard's API key (HTTP 401: unknown API key)" in err.value
    # /health needs no key: the engines' load still shows, the cache figures do not.
    assert _metrics(at) == {"Sequences running": "5", "Sequences waiting": "1", "Engines serving": "2/3"}


def test_overview_concurrency_without_health_is_a_message(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/stats")] = (200, STATS)
    canned_gateway.routes[("GET", "/health")] = (503, {"error": {"message": "starting", "code": 503}})
    at = _run("overview", canned_gateway.url)
    (err,) = at.error
    assert err.value == "The gateway answered /health with HTTP 503: starting"
    assert _metrics(at)["Requests"] == "3" and "Sequences running" not in _metrics(at)


@pytest.mark.parametrize("refresh_s", [0.0, 5.0])
def test_overview_figures(canned_gateway, refresh_s: float) -> None:
    canned_gateway.routes[("GET", "/v1/stats")] = (200, STATS)
    canned_gateway.routes[("GET", "/health")] = (200, HEALTH)
    at = _run("overview", canned_gateway.url, refresh_s)
    m = _metrics(at)
    assert m["Requests"] == "3"
    assert m["Hit rate (requests)"] == "66.7%"
    assert m["Hit rate (tokens)"] == "60.0%"
    assert m["Tokens reused"] == "180"
    assert m["Prefill saved"] == "900.0 ms"
    assert m["Prefill done"] == "1.50 s"
    assert m["Restore bandwidth"] == "200.0 MiB/s"
    assert (m["Hits from memory"], m["Hits from disk"]) == ("1", "1")
    assert m["Warm TTFT speedup"] == "4.0×"
    assert m["Engines healthy"] == "1/1"
    assert (m["Draft acceptance"], m["Tokens drafted"], m["Tokens accepted"]) == ("75.0%", "40", "30")
    assert not at.info  # there is data: no "no requests yet" banner
    assert (m["Sequences running"], m["Sequences waiting"], m["Engines serving"]) == ("5", "1", "2/3")
    per_engine = at.table[0].value
    assert per_engine.to_dict("index") == {
        "http://e1": {"state": "healthy", "running": "3", "waiting": "1"},
        "http://e2": {"state": "healthy", "running": "2", "waiting": "0"},
        "http://e3": {"state": "down", "running": "–", "waiting": "–"},
    }
    summary = at.table[1].value
    assert list(summary.index) == ["cold", "warm"]
    assert summary.loc["warm", "p50 ms"] == "100.0" and summary.loc["cold", "requests"] == 1


def test_overview_with_no_data_yet(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/stats")] = (200, EMPTY_STATS)
    canned_gateway.routes[("GET", "/health")] = (200, {"status": "ok", "engines": EMPTY_STATS["engines"]})
    at = _run("overview", canned_gateway.url)
    assert at.info[0].value.startswith("No requests yet")
    assert (_metrics(at)["Sequences running"], _metrics(at)["Sequences waiting"]) == ("0", "0")
    m = _metrics(at)
    assert (m["Requests"], m["Hit rate (requests)"], m["Restore bandwidth"]) == ("0", "–", "–")


def test_sessions_table_timeline_and_divergence(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/sessions")] = (200, SESSIONS)
    canned_gateway.routes[("GET", "/v1/sessions/s1")] = (200, TIMELINE)
    at = _run("sessions", canned_gateway.url)
    table = at.dataframe[0].value
    assert list(table["session"]) == ["s1", "old"]
    assert list(table["last prefix (tokens)"]) == [128, 40]
    assert at.selectbox[0].value == "s1"
    timeline = at.dataframe[1].value
    assert list(timeline["cache"]) == ["none", "disk"] and list(timeline["TTFT (ms)"]) == [400.0, 150.0]
    (warn,) = at.warning
    assert warn.value.startswith("Turn 2: the prompt diverged from the session's cached prefix at token 57")
    assert [c.value for c in at.code] == ["…you said blue", "…you said green"]
    # Choosing the other session fetches its timeline.
    canned_gateway.routes[("GET", "/v1/sessions/old")] = (200, [])
    at.selectbox[0].select("old").run()
    assert any(c.value == "No turns recorded for old (its timeline may have expired)." for c in at.caption)


def test_sessions_empty(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/sessions")] = (200, [])
    at = _run("sessions", canned_gateway.url)
    assert at.info[0].value.startswith("No sessions yet")


def test_cache_page_and_confirmed_clear(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/cache?top=200")] = (200, CACHE)
    canned_gateway.routes[("DELETE", "/v1/cache")] = (200, {"deleted": 3})
    at = _run("cache", canned_gateway.url)
    m = _metrics(at)
    assert [
        m[k] for k in ("Entries", "On disk", "Budget", "Free disk", "Evictions", "Disk read bandwidth")
    ] == [
        "3",
        "3.0 MiB",
        "12.0 MiB",
        "50.0 GiB",
        "4",
        "200.0 MiB/s",
    ]
    assert at.progress[0].value == 25  # percent of the byte budget
    rejected = at.table[1].value
    assert rejected.to_dict()["files"] == {"corrupt": 1, "foreign": 2}
    largest = at.dataframe[0].value
    assert list(largest["key"]) == ["k-big", "k-mid", "k-small"]
    button = at.button[0]
    assert button.label == "Clear cache" and button.disabled  # nothing deleted without confirming
    assert not [s for s in canned_gateway.seen if s.method == "DELETE"]
    at.checkbox[0].check().run()
    assert not at.button[0].disabled
    at.button[0].click().run()
    assert at.success[0].value == "Deleted 3 cached entries."
    assert [s.path for s in canned_gateway.seen if s.method == "DELETE"] == ["/v1/cache"]


def test_playground_sends_the_conversation(canned_gateway) -> None:
    canned_gateway.routes[("POST", "/v1/chat/completions")] = (200, CHAT_REPLY)
    at = _run("playground", canned_gateway.url)
    at.chat_input[0].set_value("hi").run()
    assert not at.exception
    captions = [c.value for c in at.caption]
    assert any(c.startswith("cache: memory · 42/50 prompt tokens reused · TTFT 12.0 ms") for c in captions)
    at.chat_input[0].set_value("and again").run()
    posts = [s for s in canned_gateway.seen if s.method == "POST"]
    assert len(posts) == 2
    assert posts[1].body["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "and again"},
    ]
    assert posts[0].headers["X-Session-Id"] == posts[1].headers["X-Session-Id"]
    assert posts[0].headers["X-Session-Id"].startswith("playground-")


def test_playground_gateway_down(closed_url: str) -> None:
    at = _run("playground", closed_url)
    at.chat_input[0].set_value("hi").run()
    assert at.error[0].value.startswith("Gateway unreachable")


def test_cache_page_empty_and_memory_only(canned_gateway) -> None:
    canned_gateway.routes[("GET", "/v1/cache?top=200")] = (200, {"engines": [], "entries": []})
    at = _run("cache", canned_gateway.url)
    assert at.info[0].value == "No engine reported a cache yet."
    assert any(c.value.startswith("The cache is empty") for c in at.caption)
    memory_only = {
        "engines": [
            {
                "url": "http://m",
                "namespace": "n",
                "stats": {"memory": {"entries": 1, "bytes": 8}, "disk": None},
            }
        ],
        "entries": [],
    }
    canned_gateway.routes[("GET", "/v1/cache?top=200")] = (200, memory_only)
    at = _run("cache", canned_gateway.url)
    assert at.info[0].value == "This engine keeps no disk cache (memory only)."
    assert {m.label: m.value for m in at.metric} == {"Memory tier": "8 B"}
