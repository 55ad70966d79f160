"""OpenAI's Responses API on the gateway, with the official `openai` client against a real
gateway + engine (the default real model, SmolLM2-135M-Instruct) + Valkey over loopback:
responses.create streaming and not, a 3-step function-tool loop chained by
previous_response_id whose later steps restore >= 90 % of their input from the cache,
text.format json_schema, stored responses (GET, DELETE, per tenant) and refused fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.api.agent_fixtures import KEY, MODEL, SYSTEM, TIME_PARAMS, WEATHER_PARAMS, start, stop, tool_result
from tests.api.procs import GatewayStack, Proc

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
     "parameters": WEATHER_PARAMS, "strict": True},
    {"type": "function", "name": "get_time", "description": "The current local time in a city.",
     "parameters": TIME_PARAMS, "strict": True},
]  # fmt: skip
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
FIGURES: list[dict[str, int]] = []


@pytest.fixture(scope="module")
def stack(
    smollm2_model: Path, valkey: Proc, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayStack]:
    s = start(smollm2_model, valkey, tmp_path_factory.mktemp("responses"))
    yield s
    stop(s)


@pytest.fixture
def client(stack: GatewayStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def test_create_answers_in_text(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=32,
                                temperature=0, extra_body={"seed": 7})  # fmt: skip
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    assert r.usage is not None and r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.input_tokens_details.cached_tokens == 0
    again = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=32,
                                    temperature=0)  # fmt: skip
    assert again.output_text == r.output_text
    assert (
        again.usage is not None and again.usage.input_tokens_details.cached_tokens == again.usage.input_tokens
    )


def test_stream_event_sequence(client: openai.OpenAI) -> None:
    events: list[Any] = list(client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0,
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert "response.output_text.delta" in kinds and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and final.usage is not None and final.usage.output_tokens > 0
    if kinds[-1] == "response.incomplete":
        assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"


def test_tool_loop_of_three_steps_chained_by_previous_response_id(client: openai.OpenAI) -> None:
    """call (required) -> result -> call (streamed, named) -> result -> answer, each step sending only
    its new items; each step after the first reads >= 90 % of its input from the cache, growing."""
    common: dict[str, Any] = {"model": MODEL, "instructions": SYSTEM, "tools": TOOLS, "temperature": 0,
                              "max_output_tokens": 96, "parallel_tool_calls": False}  # fmt: skip
    first = client.responses.create(input="What is the weather in Paris, and what time is it there?",
                                    tool_choice="required", **common)  # fmt: skip
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name in ("get_weather", "get_time")
    args = json.loads(call.arguments)
    responses = [first]
    # step 2, streamed: a named function, its arguments streamed as deltas
    stream = client.responses.create(
        previous_response_id=first.id,
        stream=True,
        tool_choice={"type": "function", "name": "get_time"},
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": tool_result(call.name, args)}
        ],
        **common,
    )
    events: list[Any] = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed", kinds
    second = events[-1].response
    [call2] = [o for o in second.output if o.type == "function_call"]
    assert call2.name == "get_time"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call2.arguments and "city" in json.loads(call2.arguments)
    responses.append(second)
    third = client.responses.create(
        previous_response_id=second.id, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call2.call_id,
                "output": tool_result(call2.name, json.loads(call2.arguments))}],
        **common,
    )  # fmt: skip
    assert third.output_text and not [o for o in third.output if o.type == "function_call"]
    responses.append(third)
    usages = [r.usage for r in responses]
    FIGURES.extend({"input": u.input_tokens, "cached_tokens": u.input_tokens_details.cached_tokens}
                   for u in usages if u is not None)  # fmt: skip
    print("responses tool loop:", json.dumps(FIGURES))
    for prev, u in zip(usages, usages[1:], strict=False):
        assert u is not None and prev is not None
        assert u.input_tokens_details.cached_tokens >= 0.9 * u.input_tokens, FIGURES
        assert u.input_tokens_details.cached_tokens > prev.input_tokens_details.cached_tokens, FIGURES


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL, input="Which city is the capital of France? Answer in JSON.", temperature=0,
        max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
    )  # fmt: skip
    value = json.loads(r.output_text)
    jsonschema.validate(value, ANSWER_SCHEMA)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_stored_responses_get_delete_and_tenants(stack: GatewayStack, client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, metadata={"run": "x"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"run": "x"}
    other = openai.OpenAI(base_url=stack.gateway.url + "/v1", api_key="key-beta", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="Hi", max_output_tokens=4, previous_response_id=r.id)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ],
)
def test_refused_fields_are_named(stack: GatewayStack, body: dict[str, Any], field: str) -> None:
    full = {"model": MODEL, "input": "Hi", **body}
    r = httpx.post(stack.gateway.url + "/v1/responses", json=full, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["type"] == "invalid_request_error"
        and field in err["message"]
        and err["param"].startswith(field[:5])
    )
