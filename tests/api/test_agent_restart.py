"""The acceptance of the agent APIs across an engine restart (the real default model): two steps
of a tool loop, the engine stopped and started again on the same port and disk cache, and the
third step restores its prefix from disk (the session's timeline says `disk`) with >= 90 % of
its input cached; once through the Responses API (chained by previous_response_id) and once
through the Messages API (the official clients)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.agent_fixtures import KEY, MODEL, SYSTEM, TIME_PARAMS, WEATHER_PARAMS, start, stop, tool_result
from tests.api.procs import (
    ENGINE_TOKEN,
    GatewayStack,
    Proc,
    engine_cache_dir,
    start_engine,
    wait_snapshot_file,
)

AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = "What is the weather in Paris, and what time is it there?"


@pytest.fixture
def stack(smollm2_model: Path, valkey: Proc, tmp_path: Path) -> Iterator[GatewayStack]:
    s = start(smollm2_model, valkey, tmp_path)
    yield s
    stop(s)


def restart_engine(stack: GatewayStack, session: str) -> None:
    """Waits for the session's last snapshot on disk, then stops the engine and starts a new one on
    the same port and cache directory; returns once the gateway sees it healthy."""
    gw = stack.gateway.url
    found = httpx.get(f"{gw}/v1/sessions/{session}", headers=AUTH, timeout=30).json()["session"]
    old = stack.engines[0]
    cache = engine_cache_dir(old)
    wait_snapshot_file(cache, found["key"], timeout=60)
    old.stop()
    port = int(old.url.rsplit(":", 1)[1])
    model = Path(old.argv[old.argv.index("--model") + 1])
    stack.engines[0] = start_engine(model, cache, old.log.parent, port=port, token=ENGINE_TOKEN,
                                    extra=["--max-context", "4096"])  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = httpx.get(gw + "/health", timeout=10).json()
        if health["engines"] and all(e["healthy"] for e in health["engines"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"the gateway did not see the restarted engine: {health}")


def last_turn(stack: GatewayStack, session: str) -> dict[str, Any]:
    r = httpx.get(f"{stack.gateway.url}/v1/sessions/{session}", headers=AUTH, timeout=30).json()
    turn: dict[str, Any] = r["timeline"][0]
    return turn


def test_responses_loop_restores_from_disk_after_an_engine_restart(stack: GatewayStack) -> None:
    client = openai.OpenAI(base_url=stack.gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    tools: list[Any] = [
        {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
         "parameters": WEATHER_PARAMS},
        {"type": "function", "name": "get_time", "description": "The current local time in a city.",
         "parameters": TIME_PARAMS},
    ]  # fmt: skip
    common: dict[str, Any] = {"model": MODEL, "instructions": SYSTEM, "tools": tools, "temperature": 0,
                              "max_output_tokens": 96, "parallel_tool_calls": False}  # fmt: skip
    r = client.responses.create(input=QUESTION, tool_choice="required", **common)
    session = r.id  # a chain without X-Session-Id is the session of its first response
    for step in (1, 2):
        [call] = [o for o in r.output if o.type == "function_call"]
        output = tool_result(call.name, json.loads(call.arguments))
        if step == 2:
            restart_engine(stack, session)
        r = client.responses.create(
            previous_response_id=r.id, tool_choice="required" if step == 1 else "none",
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}], **common,
        )  # fmt: skip
    assert r.usage is not None
    cached, total = r.usage.input_tokens_details.cached_tokens, r.usage.input_tokens
    print("responses after restart:", {"input": total, "cached_tokens": cached})
    assert cached >= 0.9 * total
    assert last_turn(stack, session)["cache_source"] == "disk"


def test_messages_loop_restores_from_disk_after_an_engine_restart(stack: GatewayStack) -> None:
    import anthropic

    client: Any = anthropic.Anthropic(base_url=stack.gateway.url, api_key=KEY, max_retries=0, timeout=300)
    tools = [
        {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "input_schema": WEATHER_PARAMS,
        },
        {"name": "get_time", "description": "The current local time in a city.", "input_schema": TIME_PARAMS},
    ]
    session = "messages-restart"
    common: dict[str, Any] = {"model": MODEL, "system": SYSTEM, "tools": tools, "max_tokens": 96,
                              "extra_body": {"temperature": 0}, "extra_headers": {"X-Session-Id": session}}  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    r = client.messages.create(messages=messages, tool_choice={"type": "any"}, **common)
    for step in (1, 2):
        [call] = [b for b in r.content if b.type == "tool_use"]
        messages += [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": tool_result(call.name, call.input)}]},
        ]  # fmt: skip
        if step == 2:
            restart_engine(stack, session)
        r = client.messages.create(
            messages=messages, tool_choice={"type": "any" if step == 1 else "none"}, **common
        )
    u = r.usage
    total = u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0)
    print("messages after restart:", {"input": total, "cache_read_input_tokens": u.cache_read_input_tokens})
    assert u.cache_read_input_tokens >= 0.9 * total
    assert last_turn(stack, session)["cache_source"] == "disk"
