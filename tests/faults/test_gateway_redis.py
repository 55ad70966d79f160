"""Valkey paused (SIGSTOP: sockets open, nobody answering) and killed behind a
gateway: every chat still answers, with the same text as with Redis up; the
circuit breaker spares every request after the first the socket timeout; what
was written before the fault is still there after it (append-only file); a chat
sent one second after Redis is back is recorded again (the breaker's half-open
probe, every 0.5 s by default, on fresh connections)."""

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
# Redis back -> sessions recorded again within this (the bound; the probe runs every 0.5 s).
BACK_WITHIN_S = 1.0


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


def session_turns(gw: str, sid: str) -> int:
    r = httpx.get(gw + f"/v1/sessions/{sid}", headers=ALPHA, timeout=PATIENCE_S)
    return int(r.json()["session"]["turns"]) if r.status_code == 200 else 0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    # The gateway's defaults: Redis timeout 0.5 s, a probe every 0.5 s while the circuit is open.
    s = start_stack(tmp_path_factory.mktemp("redis-faults"), model, persist_valkey=True)
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
    time.sleep(BACK_WITHIN_S)
    # No wait for the gateway to notice: this chat's turn is recorded (before, the circuit stayed
    # open for its 5 s cooldown and the turn was lost).
    assert chat(gw, "owls", "ref-owls") == reference["owls"]
    assert health(gw)["redis_circuit"]["open"] is False
    # Written before the pause, still there; the turns served during it were not recorded.
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
    time.sleep(BACK_WITHIN_S)
    # Recorded at once: the probe reconnected (every pooled connection died with the old server).
    assert chat(gw, "tides", "kill-me") == first
    assert health(gw)["redis"] is True
    assert session_turns(gw, "kill-me") == 2  # the turn before the crash survived it, this one added
