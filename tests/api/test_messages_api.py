"""Anthropic's Messages API on the gateway, with the official `anthropic` client against a real
gateway + engine (the default real model, SmolLM2-135M-Instruct) + Valkey over loopback:
messages.create and messages.stream, a 3-step tool loop whose later steps restore >= 90 % of
their input from the cache, count_tokens, and errors in Anthropic's envelope."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.agent_fixtures import KEY, MODEL, SYSTEM, TIME_PARAMS, WEATHER_PARAMS, start, stop, tool_result
from tests.api.procs import GatewayStack, Proc

anthropic = pytest.importorskip("anthropic")

TOOLS = [
    {"name": "get_weather", "description": "The current weather in a city.", "input_schema": WEATHER_PARAMS},
    {"name": "get_time", "description": "The current local time in a city.", "input_schema": TIME_PARAMS},
]
T0 = {"temperature": 0}  # the client no longer has sampling parameters: sent as extra fields
FIGURES: list[dict[str, int]] = []  # the tool loop's usage, printed for the report


@pytest.fixture(scope="module")
def stack(
    smollm2_model: Path, valkey: Proc, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayStack]:
    s = start(smollm2_model, valkey, tmp_path_factory.mktemp("messages"))
    yield s
    stop(s)


@pytest.fixture
def client(stack: GatewayStack) -> Any:
    return anthropic.Anthropic(base_url=stack.gateway.url, api_key=KEY, max_retries=0, timeout=300)


def _input(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0))


def test_create_answers_in_text(client: Any) -> None:
    r = client.messages.create(model=MODEL, max_tokens=32, extra_body=T0,
                               messages=[{"role": "user", "content": "What is the capital of France?"}])  # fmt: skip
    assert r.type == "message" and r.role == "assistant"
    assert r.content[0].type == "text" and "Paris" in r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.output_tokens > 0 and _input(r.usage) > 0


def test_a_stop_sequence_is_named_as_the_stop_reason(client: Any) -> None:
    """At temperature 0 the model answers 'The capital of France is Paris.': stopped at
    'Paris', the text ends before it and the stop names it, streamed or not."""
    ask = dict(model=MODEL, max_tokens=32, extra_body=T0, stop_sequences=["Mars", "Paris"],
               messages=[{"role": "user", "content": "What is the capital of France?"}])  # fmt: skip
    r = client.messages.create(**ask)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "Paris")
    assert r.content[0].text.endswith("is ") and "Paris" not in r.content[0].text
    with client.messages.stream(**ask) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Paris")
    assert final.content[0].text == r.content[0].text
    plain = client.messages.create(**{**ask, "stop_sequences": ["Mars"]})
    assert (plain.stop_reason, plain.stop_sequence) == ("end_turn", None)


def test_stream_event_sequence(stack: GatewayStack, client: Any) -> None:
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body=T0,
                                messages=[{"role": "user", "content": "Say hello."}]) as s:  # fmt: skip
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert final.content[0].type == "text" and final.content[0].text
    assert final.usage.output_tokens > 0 and _input(final.usage) > 0
    # the raw wire: named SSE events
    raw = httpx.post(stack.gateway.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=300, json={
        "model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "Hi"}]})  # fmt: skip
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.startswith("event: message_start\ndata: ")


def test_tool_loop_of_three_steps_restores_its_prefix(client: Any) -> None:
    """call (any) -> result -> call (streamed, any) -> result -> answer; each step after the first
    reads >= 90 % of its input from the cache, and the figure grows every step."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris, and what time is it there?"}
    ]
    common: dict[str, Any] = {"model": MODEL, "system": SYSTEM, "tools": TOOLS, "extra_body": T0,
                              "max_tokens": 96, "metadata": {"user_id": "messages-loop"}}  # fmt: skip
    usages = []
    for step in range(3):
        if step == 0:
            r = client.messages.create(messages=messages, tool_choice={"type": "any"}, **common)
        elif step == 1:
            with client.messages.stream(messages=messages, tool_choice={"type": "tool", "name": "get_time"},
                                        **common) as s:  # fmt: skip
                r = s.get_final_message()
        else:
            r = client.messages.create(messages=messages, tool_choice={"type": "none"}, **common)
        usages.append(r.usage)
        if step < 2:
            assert r.stop_reason == "tool_use", r
            [call] = [b for b in r.content if b.type == "tool_use"]
            assert call.name in ("get_weather", "get_time") and isinstance(call.input, dict)
            if step == 1:
                assert call.name == "get_time"
            messages += [
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": call.id,
                            "content": tool_result(call.name, call.input),
                        }
                    ],
                },  # fmt: skip
            ]
        else:
            assert r.content and r.content[0].type == "text" and r.stop_reason in ("end_turn", "max_tokens")
    for u in usages:
        FIGURES.append({"input": _input(u), "cache_read_input_tokens": u.cache_read_input_tokens})
    print("messages tool loop:", json.dumps(FIGURES))
    for prev, u in zip(usages, usages[1:], strict=False):
        assert u.cache_read_input_tokens >= 0.9 * _input(u), (u, FIGURES)
        assert u.cache_read_input_tokens > prev.cache_read_input_tokens, FIGURES


def test_cache_control_reports_created_tokens(client: Any) -> None:
    system = [
        {"type": "text", "text": SYSTEM + " Cache-control test.", "cache_control": {"type": "ephemeral"}}
    ]
    msgs = [{"role": "user", "content": "Hi"}]
    first = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=msgs)
    assert first.usage.cache_creation_input_tokens > 0
    again = client.messages.create(model=MODEL, max_tokens=4, system=system, messages=msgs)
    assert again.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens * 0.9


def test_count_tokens_matches_the_prompt(client: Any) -> None:
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, tools=TOOLS, messages=msgs)
    r = client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, tools=TOOLS, messages=msgs)
    assert counted.input_tokens == _input(r.usage) > 100


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"temperature": 3}, "temperature"),
    ],
)
def test_refused_fields_in_anthropic_envelope(stack: GatewayStack, body: dict[str, Any], field: str) -> None:
    full = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **body}
    r = httpx.post(stack.gateway.url + "/v1/messages", json=full, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]


def test_auth_errors_in_anthropic_envelope(stack: GatewayStack) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    for headers in ({}, {"x-api-key": "nope"}):
        r = httpx.post(stack.gateway.url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    bearer = httpx.post(stack.gateway.url + "/v1/messages", json=body, timeout=300,
                        headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert bearer.status_code == 200, bearer.text
    bad = anthropic.Anthropic(base_url=stack.gateway.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
