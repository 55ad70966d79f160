"""A client that leaves a non-streamed Messages or Responses call while it waits in the engine's
queue: the gateway sees it go, closes its upstream request, and the engine drops the waiting
sequence without ever running it; nothing is recorded for it. Real sockets over loopback: the
client's connection is closed at a chosen moment, not by a timeout racing generation."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.api.procs import ENGINE_AUTH, GatewayStack, shared_demo_model, start_stack

ALPHA = {"Authorization": "Bearer key-alpha"}
CALLS = {
    "/v1/messages": {
        "model": "tiny",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello there."}],
    },
    "/v1/responses": {"model": "tiny", "max_output_tokens": 8, "input": "Hello there."},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    # One running sequence at a time, and room for a long blocker.
    s = start_stack(tmp_path_factory.mktemp("bridge-disconnect"), model,
                    engine_extra=["--max-seqs", "1", "--max-context", "8192"])  # fmt: skip
    yield s
    s.stop()


def open_request(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> socket.socket:
    """A POST sent over a socket of its own; the caller closes the socket to leave."""
    u = urlsplit(url)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    )
    sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=30)
    sock.sendall(head.encode() + data)
    return sock


def health(engine: str) -> dict[str, Any]:
    return dict(httpx.get(engine + "/health", timeout=10).json())


def wait_until(pred: Callable[[dict[str, Any]], bool], engine: str, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        h = health(engine)
        if pred(h):
            return h
        assert time.monotonic() < deadline, f"{what}: {h}"
        time.sleep(0.01)


def admitted(engine: str) -> float:
    text = httpx.get(engine + "/metrics", headers=ENGINE_AUTH).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("keepwarm_requests_total"))


@pytest.mark.parametrize("path", sorted(CALLS))
def test_a_client_leaving_while_queued_is_never_served(stack: GatewayStack, path: str) -> None:
    gw, engine = stack.gateway.url, stack.engines[0].url
    before = admitted(engine)
    recorded = httpx.get(gw + "/v1/stats", headers=ALPHA).json()["totals"]["requests"]
    # A long reply, one token per step, holds the engine's only running slot (4,000 tokens: about
    # 1.3 s on a 2-core machine; the left call is dropped 20-30 ms after the client goes).
    blocker = open_request(engine, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "A long story."}], "max_tokens": 4000, "ignore_eos": True,
        "speculate": False}, ENGINE_AUTH)  # fmt: skip
    try:
        wait_until(lambda h: h["running"] == 1, engine, "the blocker never ran")
        call = open_request(gw, path, CALLS[path], ALPHA)
        wait_until(lambda h: h["waiting"] == 1, engine, "the bridged call never reached the engine's queue")
        call.close()  # the client leaves
        # The gateway closes its upstream request; the engine drops the sequence before it ran.
        h = wait_until(lambda h: h["waiting"] == 0, engine, "the left call is still queued")
        assert h["running"] == 1  # the blocker still holds the slot: the call was dropped, not served
    finally:
        blocker.close()
    wait_until(lambda h: h["queue_depth"] == 0, engine, "the engine never went idle")
    assert admitted(engine) - before == 1  # the blocker alone was admitted
    assert httpx.get(gw + "/v1/stats", headers=ALPHA).json()["totals"]["requests"] == recorded
