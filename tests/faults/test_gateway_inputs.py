"""Bounded input against a real engine: a body the gateway refuses never costs
the engine any work (no request counted, no token prefilled), streamed or not,
and the widest values it accepts do work end to end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.procs import ENGINE_AUTH, GatewayStack, shared_demo_model, start_stack

ALPHA = {"Authorization": "Bearer key-alpha"}
MESSAGES = [{"role": "user", "content": "Say something."}]


def metrics(engine: str) -> dict[str, float]:
    text = httpx.get(engine + "/metrics", headers=ENGINE_AUTH).text
    out: dict[str, float] = {}
    for name in ("keepwarm_requests", "keepwarm_prompt_tokens", "keepwarm_prefill_tokens"):
        out[name] = sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "_total"))
    return out


def post(gw: str, content: bytes | None = None, **kw: Any) -> httpx.Response:
    if content is not None:
        return httpx.post(gw + "/v1/chat/completions", content=content, timeout=60,
                          headers={**ALPHA, "content-type": "application/json"})  # fmt: skip
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kw}
    return httpx.post(gw + "/v1/chat/completions", json=body, headers=ALPHA, timeout=60)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    s = start_stack(tmp_path_factory.mktemp("inputs"), model, gateway_extra=["--max-messages", "64"])
    yield s
    s.stop()


def test_refused_bodies_cost_the_engine_nothing(stack: GatewayStack) -> None:
    gw, engine = stack.gateway.url, stack.engines[0].url
    before = metrics(engine)
    refusals = [
        (post(gw, seed=2**64), 400, "seed"),  # was a 500 after the prefill had run
        (post(gw, seed=2**64, stream=True), 400, "seed"),  # was a 200 with an error mid-stream, no [DONE]
        (post(gw, temperature=-1, stream=True), 400, "temperature"),
        (post(gw, max_tokens=2**40), 400, "max_tokens"),
        (post(gw, messages=MESSAGES * 65), 413, "messages"),
        (
            post(
                gw,
                b'{"messages": [{"role": "user", "content": "x"}], "t": '
                + b"[" * 100_000
                + b"]" * 100_000
                + b"}",
            ),
            400,
            None,
        ),  # fmt: skip
    ]
    for r, status, param in refusals:
        assert r.status_code == status, r.text
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["param"] == param
    assert metrics(engine) == before  # not one request reached the engine


def test_the_widest_accepted_values_work(stack: GatewayStack) -> None:
    gw = stack.gateway.url
    for seed in (2**63 - 1, -(2**63), 0):
        r = post(gw, seed=seed, temperature=1.0)
        assert r.status_code == 200, r.text
    r = post(gw, messages=[{"role": "user", "content": "x"}] * 64)  # at the message-count limit
    assert r.status_code == 200, r.text
