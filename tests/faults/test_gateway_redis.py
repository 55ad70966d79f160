"""Valkey paused (SIGSTOP: sockets open, nobody answering) and killed behind a
gateway: every chat still answers, with the same text as with Redis up; the
circuit breaker spares every request after the first the socket timeout; what
was written before the fault is still there after it (append-only file)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.procs import GatewayStack, shared_demo_model, start_stack, start_valkey

ALPHA = {"Authorization": "Bearer key-alpha"}
# A client that gives up long before the old behaviour (5 s socket timeout, retried) would answer.
PATIENCE_S = 4.0


def chat(gw: str, topic: str, session: str, stream: bool = False) -> str:
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}  # fmt: skip
    r = httpx.post(gw + "/v1/chat/completions", json=body, timeout=PATIENCE_S,
                   headers={**ALPHA, "X-Session-Id": session})  # fmt: skip
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["choices"][0]["message"]["content"])
    assert r.text.rstrip().endswith("data: [DONE]")
    parts = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(p["choices"][0]["delta"].get("content") or "" for p in parts if p.get("choices"))


def health(gw: str) -> dict[str, Any]:
    return httpx.get(gw + "/health", timeout=PATIENCE_S).json()


def wait_redis(gw: str, up: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health(gw)["redis"] is up:
            return
        time.sleep(0.1)
    raise AssertionError(f"the gateway never saw redis {'up' if up else 'down'}")


def session_turns(gw: str, sid: str) -> int:
    r = httpx.get(gw + f"/v1/sessions/{sid}", headers=ALPHA, timeout=PATIENCE_S)
    return int(r.json()["session"]["turns"]) if r.status_code == 200 else 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    # Default Redis timeout (0.5 s); a short cooldown so recovery is seen quickly.
    s = start_stack(tmp_path_factory.mktemp("redis-faults"), model, persist_valkey=True,
                    gateway_env={"KEEPWARM_REDIS_COOLDOWN": "0.3"})  # fmt: skip
    yield s
    s.stop()


def test_paused_valkey_costs_one_timeout_then_nothing(stack: GatewayStack) -> None:
    gw = stack.gateway.url
    reference = {t: chat(gw, t, f"ref-{t}") for t in ("owls", "moss")}
    assert session_turns(gw, "ref-owls") == 1
    stack.valkey.pause()
    try:
        answers = []
        for i in range(6):  # each within PATIENCE_S; before, each Redis call waited 5 s and was retried
            topic = ("owls", "moss")[i % 2]
            answers.append((topic, chat(gw, topic, f"ref-{topic}", stream=bool(i % 3 == 2))))
        assert all(text == reference[topic] for topic, text in answers)  # nothing lost: same answers
        circuit = health(gw)["redis_circuit"]
        # One trip; every later Redis call of every chat refused at once, without a socket wait.
        assert circuit["open"] is True and circuit["trips"] == 1
        assert circuit["fast_failures"] >= 5 * 3  # session read + session, key and stats writes
        err = httpx.get(gw + "/v1/stats", headers=ALPHA, timeout=PATIENCE_S)
        assert err.status_code == 503 and "redis is not reachable" in err.json()["error"]["message"]
    finally:
        stack.valkey.resume()
    wait_redis(gw, up=True)
    assert health(gw)["redis_circuit"]["open"] is False
    # Written before the pause, still there; the turns served during it were not recorded.
    assert session_turns(gw, "ref-owls") == 1
    assert chat(gw, "owls", "ref-owls") == reference["owls"]
    assert session_turns(gw, "ref-owls") == 2


def test_killed_valkey_restarted_keeps_sessions(stack: GatewayStack) -> None:
    gw = stack.gateway.url
    first = chat(gw, "tides", "kill-me")
    assert session_turns(gw, "kill-me") == 1
    workdir = stack.valkey.log.parent
    port = int(stack.valkey.url.rsplit(":", 1)[1].split("/")[0])
    stack.valkey.kill()
    assert chat(gw, "tides", "kill-me") == first  # served without Redis
    assert health(gw)["redis"] is False
    stack.valkey = start_valkey(workdir, port=port, persist=True)  # same port, same append-only file
    wait_redis(gw, up=True)
    assert session_turns(gw, "kill-me") == 1  # the turn written before the crash survived it
    assert chat(gw, "tides", "kill-me") == first
    assert session_turns(gw, "kill-me") == 2
