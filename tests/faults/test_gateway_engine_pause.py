"""An engine paused (SIGSTOP) behind the gateway: its socket still accepts, nothing
answers. A request waiting on it moves to the other engine as soon as the health
poller gives the paused one up (or, with the poller silent, when the read timeout
fires) instead of hanging or failing; the answer is the one the paused engine
would have given; the paused engine, resumed, is healthy and idle again."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.procs import ENGINE_TOKEN, GatewayStack, Proc, shared_demo_model, start_gateway, start_stack

ALPHA = {"Authorization": "Bearer key-alpha"}


def chat(gw: str, session: str, stream: bool = False) -> tuple[str, httpx.Response]:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "Name three rivers of the north."}]}  # fmt: skip
    r = httpx.post(
        gw + "/v1/chat/completions", json=body, timeout=60, headers={**ALPHA, "X-Session-Id": session}
    )
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["choices"][0]["message"]["content"]), r
    assert r.text.rstrip().endswith("data: [DONE]")
    parts = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in parts if p.get("choices")), r


def session_engine(gw: str, sid: str) -> str:
    return str(httpx.get(gw + f"/v1/sessions/{sid}", headers=ALPHA).json()["session"]["engine"])


def wait_for(pred: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    s = start_stack(tmp_path_factory.mktemp("engine-pause"), model, engines=2,
                    gateway_extra=["--health-interval", "0.5", "--health-timeout", "1"])  # fmt: skip
    yield s
    s.stop()


def by_url(stack: GatewayStack, url: str) -> tuple[Proc, Proc]:
    a, b = stack.engines
    return (a, b) if a.url == url else (b, a)


def test_paused_engine_fails_over_before_any_byte(stack: GatewayStack) -> None:
    gw = stack.gateway.url
    reference, _ = chat(gw, "paused")
    paused, other = by_url(stack, session_engine(gw, "paused"))
    paused.pause()
    try:
        # The session prefers the paused engine, which the gateway still believes healthy:
        # the request goes there, waits, and moves on once three probes have timed out.
        text, _ = chat(gw, "paused")
        assert text == reference and session_engine(gw, "paused") == other.url
        streamed, r = chat(gw, "paused", stream=True)
        assert streamed == reference and r.headers["content-type"].startswith("text/event-stream")
        engines = {e["url"]: e["healthy"] for e in httpx.get(gw + "/health").json()["engines"]}
        assert engines == {paused.url: False, other.url: True}
    finally:
        paused.resume()
    wait_for(lambda: all(e["healthy"] for e in httpx.get(gw + "/health").json()["engines"]), "both healthy")
    # The abandoned request was cancelled when the gateway closed it: the engine is idle again.
    wait_for(lambda: httpx.get(paused.url + "/health").json()["queue_depth"] == 0, "the resumed engine idle")


def test_read_timeout_fails_over_when_the_poller_is_silent(stack: GatewayStack) -> None:
    # No polls after start: only the request's own read timeout can tell the engine hangs.
    gw2 = start_gateway([e.url for e in stack.engines], stack.valkey.url, stack.gateway.log.parent,
                        engine_token=ENGINE_TOKEN,
                        extra=["--health-interval", "3600", "--read-timeout", "2"])  # fmt: skip
    try:
        reference, _ = chat(gw2.url, "silent")
        paused, other = by_url(stack, session_engine(gw2.url, "silent"))
        paused.pause()
        try:
            text, _ = chat(gw2.url, "silent")  # was a 500: httpx.ReadTimeout
            assert text == reference and session_engine(gw2.url, "silent") == other.url
            health = {e["url"]: e["healthy"] for e in httpx.get(gw2.url + "/health").json()["engines"]}
            assert health == {paused.url: False, other.url: True}  # marked down by the timeout itself
            assert chat(gw2.url, "silent", stream=True)[0] == reference
        finally:
            paused.resume()
        wait_for(
            lambda: httpx.get(paused.url + "/health").json()["queue_depth"] == 0, "the resumed engine idle"
        )
    finally:
        gw2.stop()
