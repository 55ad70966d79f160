"""A bounded load run through the gateway with clients that leave mid-stream:
every answer that completes equals the cache-off answer for its prompt (no
neighbour, restore or cancel changes a token), every cancelled generation stops
early, nothing is recorded for it, and the engine ends idle with nothing stuck."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.api.procs import ENGINE_AUTH, GatewayStack, shared_demo_model, start_stack

ALPHA = {"Authorization": "Bearer key-alpha"}
TOPICS = ("harbours", "glaciers", "orchards", "comets")
MAX_TOKENS = 10
CANCELLED_MAX_TOKENS = 300


def body(topic: str, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, **kw,
            "messages": [{"role": "system", "content": "Answer in one line."},
                         {"role": "user", "content": f"Tell me about {topic}."}]}  # fmt: skip


def headers(session: str) -> dict[str, str]:
    return {**ALPHA, "X-Session-Id": session}


def plain(gw: str, topic: str, session: str, **kw: Any) -> str:
    r = httpx.post(gw + "/v1/chat/completions", json=body(topic, **kw), headers=headers(session), timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def streamed(gw: str, topic: str, session: str) -> str:
    text = []
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body(topic, stream=True),
                      headers=headers(session), timeout=120) as r:  # fmt: skip
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]"
    for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            text += [c["delta"].get("content") or "" for c in chunk.get("choices", [])]
    return "".join(text)


def cancelled(gw: str, topic: str, session: str) -> int:
    """Reads until the first content arrives, then leaves; the bytes seen."""
    # one token per step (no drafts): the reply cannot end before the client leaves
    b = body(topic, stream=True, max_tokens=CANCELLED_MAX_TOKENS, ignore_eos=True, speculate=False)
    with httpx.stream(
        "POST", gw + "/v1/chat/completions", json=b, headers=headers(session), timeout=120
    ) as r:
        assert r.status_code == 200
        seen = 0
        for chunk in r.iter_raw():
            seen += len(chunk)
            if b'"content":"' in chunk and b'"content":""' not in chunk:
                break
    return seen


def metric(engine: str, name: str) -> float:
    text = httpx.get(engine + "/metrics", headers=ENGINE_AUTH).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + "_total"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    s = start_stack(tmp_path_factory.mktemp("load"), model)
    yield s
    s.stop()


def test_load_with_cancels_loses_and_corrupts_nothing(stack: GatewayStack) -> None:
    gw, engine = stack.gateway.url, stack.engines[0].url
    # The cache-off answers, one at a time.
    reference = {t: plain(gw, t, f"ref-{t}", prefix_cache={"scope": "off"}) for t in TOPICS}
    tokens_before = metric(engine, "keepwarm_completion_tokens")
    jobs = [(i, TOPICS[i % len(TOPICS)], ("plain", "stream", "cancel")[i % 3]) for i in range(12)]

    def run(job: tuple[int, str, str]) -> tuple[str, Any]:
        i, topic, kind = job
        session = f"load-{i}"
        if kind == "plain":
            return kind, plain(gw, topic, session)
        if kind == "stream":
            return kind, streamed(gw, topic, session)
        return kind, cancelled(gw, topic, session)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    completed = [(job, out) for job, (kind, out) in zip(jobs, results, strict=True) if kind != "cancel"]
    assert len(completed) == 8
    for (_, topic, _), text in completed:
        assert text == reference[topic]  # cache on, batched with neighbours: the cache-off answer
    assert all(out > 0 for kind, out in results if kind == "cancel")

    deadline = time.monotonic() + 60
    while httpx.get(engine + "/health").json()["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(engine + "/health").json()["queue_depth"] == 0  # nothing stuck
    generated = metric(engine, "keepwarm_completion_tokens") - tokens_before
    assert generated < 8 * MAX_TOKENS + 4 * CANCELLED_MAX_TOKENS  # the cancelled ones stopped early
    # Recorded: the references and the completed requests, each in its session; nothing for a cancel.
    stats = httpx.get(gw + "/v1/stats", headers=ALPHA).json()
    assert stats["totals"]["requests"] == len(TOPICS) + len(completed)
    for i, _, kind in jobs:
        r = httpx.get(gw + f"/v1/sessions/load-{i}", headers=ALPHA)
        assert (r.status_code, r.json()["session"]["turns"] if r.status_code == 200 else 0) == (
            (404, 0) if kind == "cancel" else (200, 1)
        )
    # Still serving, still the same answer.
    assert plain(gw, TOPICS[0], "after") == reference[TOPICS[0]]
