"""The engine HTTP service over loopback: metrics, SSE framing and keep-alives,
the cache admin API and input errors."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.procs import Proc, start_engine

SYSTEM = "You are a patient assistant who answers about a small village and its river. " * 2


@pytest.fixture(scope="module")
def engine(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("engine-server")
    proc = start_engine(
        tiny_dense_model,
        tmp / "cache",
        tmp / "logs",
        # one sequence at a time, so that a second request waits in the queue
        extra=["--keepalive-s", "0.02", "--max-context", "2048", "--max-seqs", "1"],
    )
    yield proc
    proc.stop()


def chat(engine: Proc, content: str, **kw: object) -> httpx.Response:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
            "max_tokens": 6, "temperature": 0, **kw}  # fmt: skip
    return httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)


def metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
              line.startswith(name + "{")]  # fmt: skip
    assert values, f"{name} missing from /metrics"
    return sum(values)


def test_metrics_count_requests_hits_and_ttft(engine: Proc) -> None:
    before = httpx.get(engine.url + "/metrics").text
    first = chat(engine, "metrics please").json()
    second = chat(engine, "metrics please").json()
    assert first["usage"]["timings"]["cache_source"] == "none"
    assert second["usage"]["timings"]["cache_source"] == "memory"
    after = httpx.get(engine.url + "/metrics").text
    assert metric(after, "keepwarm_requests_total") - metric(before, "keepwarm_requests_total") == 2
    assert metric(after, "keepwarm_ttft_seconds_count") - metric(before, "keepwarm_ttft_seconds_count") == 2
    hits = 'keepwarm_cache_hits_total{tier="memory"}'
    assert metric(after, hits) - metric(before, hits) == 1
    cached = 'keepwarm_cached_prompt_tokens_total{tier="memory"}'
    assert (
        metric(after, cached) - metric(before, cached)
        == second["usage"]["prompt_tokens_details"]["cached_tokens"]
    )
    assert metric(after, "keepwarm_queue_depth") == 0
    assert metric(after, "keepwarm_disk_cache_entries") >= 1
    assert "keepwarm_disk_cache_rejected_files" in after


def test_stream_sends_keepalives_while_queued_then_usage_and_done(engine: Proc) -> None:
    # A long request holds the only running slot (--max-seqs 1): the stream below waits.
    blocker = threading.Thread(
        target=chat, args=(engine, "a long story"), kwargs={"max_tokens": 800, "ignore_eos": True}
    )
    blocker.start()
    deadline = time.monotonic() + 60
    while httpx.get(engine.url + "/health").json()["queue_depth"] < 1:  # the blocker holds the worker
        assert time.monotonic() < deadline, "the blocking request never reached the engine"
        time.sleep(0.005)
    lines: list[str] = []
    body = {"messages": [{"role": "user", "content": "stream me"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", engine.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    blocker.join()
    assert ": keep-alive" in lines
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]"
    assert data[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [d for d in data if d["choices"] and d["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] in ("stop", "length")
    usage = data[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert usage["keepwarm"]["namespace"] and "prefix_key" in usage["keepwarm"]


def test_cache_admin_lists_and_clears(engine: Proc) -> None:
    chat(engine, "fill the cache")
    info = httpx.get(engine.url + "/v1/cache").json()
    assert info["entries"] and all(e["namespace"] == info["namespace"] for e in info["entries"])
    disk = info["stats"]["disk"]
    assert disk["num_entries"] >= len(info["entries"]) and disk["free_bytes"] > 0
    deleted = httpx.delete(engine.url + "/v1/cache").json()["deleted"]
    assert deleted >= len(info["entries"])
    assert httpx.get(engine.url + "/v1/cache").json()["entries"] == []
    again = chat(engine, "fill the cache").json()
    assert again["usage"]["timings"]["cache_source"] == "none"


@pytest.mark.parametrize(
    "body,status,param,words",
    [
        ({"messages": []}, 400, "messages", "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "one of system"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens", "1..4096"),
        (
            {"messages": [{"role": "user", "content": "x"}], "prefix_cache": {"scope": "most"}},
            400,
            "prefix_cache",
            "accepted: off, full, auto",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            "temperature",
            "a number",
        ),
        ({"messages": [{"role": "user", "content": "word " * 2500}]}, 413, "messages", "max_context 2048"),
    ],
)
def test_bad_input_names_the_field(engine: Proc, body: dict, status: int, param: str, words: str) -> None:
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"] and err["code"] == status


def test_malformed_json_is_400(engine: Proc) -> None:
    r = httpx.post(engine.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
