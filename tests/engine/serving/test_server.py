"""The engine HTTP service over loopback: metrics, SSE framing and keep-alives,
the cache admin API and input errors."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
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
        extra=["--keepalive-s", "0.02", "--max-context", "2048", "--max-seqs", "1", "--speculate", "off"],
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


@pytest.fixture(scope="module")
def spec_engine(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("engine-spec")
    proc = start_engine(tiny_dense_model, tmp / "cache", tmp / "logs")  # --speculate ngram: the default
    yield proc
    proc.stop()


def test_speculation_reports_drafts_per_reply_and_per_family_with_the_plain_replies(
    engine: Proc, spec_engine: Proc
) -> None:
    before = httpx.get(spec_engine.url + "/metrics").text
    drafted = accepted = 0
    for content, temp in (("the mill, the mill, the mill and the river " * 4, 0), ("say more", 0.8)):
        kw = {"max_tokens": 48, "temperature": temp, "seed": 5}
        spec = chat(spec_engine, content, **kw).json()
        assert spec["choices"][0]["message"] == chat(engine, content, **kw).json()["choices"][0]["message"]
        off = chat(spec_engine, content, speculate=False, **kw).json()
        assert off["choices"][0]["message"] == spec["choices"][0]["message"]
        assert off["usage"]["timings"]["drafted_tokens"] == 0
        t = spec["usage"]["timings"]
        assert 0 <= t["accepted_tokens"] <= t["drafted_tokens"]
        drafted, accepted = drafted + t["drafted_tokens"], accepted + t["accepted_tokens"]
    assert drafted > 0
    after = httpx.get(spec_engine.url + "/metrics").text
    (line,) = [x for x in after.splitlines() if x.startswith("keepwarm_spec_drafted_tokens_total{")]
    label = line[line.index("{") : line.index("}") + 1]  # the one model's family
    assert label == '{family="dense"}'
    for name, n in (
        ("keepwarm_spec_drafted_tokens_total", drafted),
        ("keepwarm_spec_accepted_tokens_total", accepted),
    ):
        assert metric(after, name + label) - metric(before, name + label) == n
    assert metric(after, "keepwarm_spec_acceptance_rate" + label) == pytest.approx(accepted / drafted)


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
        (
            {"messages": [{"role": "user", "content": "x"}], "speculate": "yes"},
            400,
            "speculate",
            "true or false",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "speculate": True},
            400,
            "speculate",
            "--speculate ngram",
        ),
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


# --- tools on a template that teaches no tool-call format (the generic format) -----------------------

# SmolLM2-Instruct's ChatML template: no tools in it.
PLAIN_CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Bounded arguments (an enum, a short string, a small integer, no extra keys): the random-weight
# model cannot write past max_tokens inside them.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "unit": {"enum": ["C", "F"]}},
                    "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "count", "description": "Count to n.",
     "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["n"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def plain_engine(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("engine-generic-tools")
    model = tmp / "model"
    shutil.copytree(tiny_dense_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = PLAIN_CHATML
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    proc = start_engine(model, tmp / "cache", tmp / "logs", extra=["--max-context", "2048"])
    yield proc
    proc.stop()


def tool_chat(engine: Proc, messages: list[dict], **kw: object) -> dict:
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 128, "temperature": 0, **kw}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_tool_choice_on_a_template_without_tools_uses_the_generic_format(plain_engine: Proc) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Oslo?"}]
    # "required": exactly one call (parallel calls off), arguments valid for its tool, the reply ended by EOS
    first = tool_chat(plain_engine, messages, tool_choice="required", parallel_tool_calls=False)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert first["usage"]["completion_tokens"] < 128
    # a named function
    named = tool_chat(plain_engine, messages, tool_choice={"type": "function", "function": {"name": "count"}})
    [call2] = named["choices"][0]["message"]["tool_calls"]
    assert named["choices"][0]["finish_reason"] == "tool_calls" and call2["function"]["name"] == "count"
    jsonschema.validate(json.loads(call2["function"]["arguments"]), SCHEMAS["count"])
    # streamed: the same call (greedy), whole in one delta
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 128, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream("POST", plain_engine.url + "/v1/chat/completions", json=body, timeout=120) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [d["choices"][0]["delta"] for d in data if d["choices"]]
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]) for c in streamed] == [(0, call["function"])]
    assert not any(d.get("content") for d in deltas)
    assert [d["choices"][0]["finish_reason"] for d in data if d["choices"][0]["finish_reason"]] == [
        "tool_calls"
    ]
    # /tokenize renders the chat with its tools as the chat request did
    tokenized = httpx.post(plain_engine.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tokenized["count"] == first["usage"]["prompt_tokens"]
    # the next turn (the call and its result in the history) restores the first turn's prompt
    history = [*messages, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "-3 C"}]
    second = tool_chat(plain_engine, history, max_tokens=4)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert second["usage"]["timings"]["cache_source"] == "memory"
