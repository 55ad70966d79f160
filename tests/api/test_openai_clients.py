"""Agent frameworks as clients of the gateway (real engine and gateway processes on
loopback, the tiny random-weight demo model): langchain-openai's `ChatOpenAI` with
`bind_tools` and `with_structured_output`, and litellm, each running a short
tool-using loop (call -> tool result -> answer). The model's weights are random,
so every call and every structured reply here exists because the engine enforces
it by constrained decoding (tool_choice named / required, response_format
json_schema); the tools' arguments are enums and booleans and the tools strict
(no extra properties), and `parallel_tool_calls` is false where any number of calls
would be allowed, so a valid reply is short."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel

from tests.api.procs import ENGINE_TOKEN, Proc, start_engine, start_gateway

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm: no download at import

MODEL = "tiny"  # the session engine's served name
WEATHER = {"Paris": "light rain, 14 C", "Oslo": "snow, -3 C"}
QUESTION = [
    ("system", "You are a weather assistant. Use the tools."),
    ("user", "What is the weather in Oslo right now?"),
]


def get_weather(city: Literal["Paris", "Oslo"], metric: bool) -> str:
    """The current weather in a city."""
    return WEATHER[city] + ("" if metric else " (metric)")


def local_time(city: Literal["Paris", "Oslo"]) -> str:
    """The local time in a city."""
    return {"Paris": "09:15", "Oslo": "09:15"}[city]


class Forecast(BaseModel):
    """A forecast the assistant commits to."""

    city: Literal["Paris", "Oslo"]
    rain: bool
    level: Literal["low", "high"]


def run_tool(name: str, args: dict[str, Any]) -> str:
    return {"get_weather": get_weather, "local_time": local_time}[name](**args)


@pytest.fixture(scope="module")
def gateway(demo_model: Path, valkey: Proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """An engine with room for tool definitions in the prompt (the session engine has 512 tokens)."""
    root = tmp_path_factory.mktemp("clients")
    engine = start_engine(demo_model, root / "cache", root / "logs", token=ENGINE_TOKEN,
                          extra=["--max-context", "4096"])  # fmt: skip
    try:
        gw = start_gateway([engine.url], valkey.url, root / "logs", engine_token=ENGINE_TOKEN)
    except BaseException:
        engine.stop()
        raise
    yield gw
    gw.stop()
    engine.stop()


@pytest.fixture
def chat_model(gateway: Proc) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=gateway.url + "/v1", api_key="key-alpha", temperature=0,
                      max_tokens=96, max_retries=0, timeout=120)  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_langchain_bind_tools_loop(chat_model: Any, stream: bool) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    history: list[Any] = [SystemMessage(QUESTION[0][1]), HumanMessage(QUESTION[1][1])]
    # A named tool: the reply is that call, with arguments valid for its schema.
    with_tools = chat_model.bind_tools([get_weather, local_time], tool_choice="get_weather", strict=True)
    if stream:
        first: Any = None
        for chunk in with_tools.stream(history):
            first = chunk if first is None else first + chunk
    else:
        first = with_tools.invoke(history)
    assert isinstance(first, AIMessage) and len(first.tool_calls) == 1, first
    call = first.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    assert call["args"]["city"] in WEATHER and isinstance(call["args"]["metric"], bool)
    assert first.response_metadata.get("finish_reason") in ("stop", "tool_calls")
    history += [first, ToolMessage(run_tool(call["name"], call["args"]), tool_call_id=call["id"])]
    # Any tool ("required" from langchain's "any"), after the tool result in the history.
    second = chat_model.bind_tools(
        [get_weather, local_time], tool_choice="any", strict=True, parallel_tool_calls=False
    ).invoke(history)
    assert len(second.tool_calls) >= 1 and {c["name"] for c in second.tool_calls} <= {
        "get_weather",
        "local_time",
    }
    for c in second.tool_calls:
        history += [ToolMessage(run_tool(c["name"], c["args"]), tool_call_id=c["id"])]
    history.insert(len(history) - len(second.tool_calls), second)
    # The answer, tools off: plain text after the calls and their results.
    answer = chat_model.invoke(history)
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str) and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["output_tokens"] > 0


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model: Any, method: str) -> None:
    structured = chat_model.with_structured_output(Forecast, method=method, include_raw=True)
    out = structured.invoke([*QUESTION, ("user", "Give me the forecast for Paris.")])
    assert out["parsing_error"] is None, out
    forecast = out["parsed"]
    assert isinstance(forecast, Forecast) and forecast.city in WEATHER
    # A dict schema too (json_schema: the reply validates against it).
    schema = {"title": "Pick", "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
              "sure": {"type": "boolean"}}, "required": ["city", "sure"], "additionalProperties": False}  # fmt: skip
    picked = chat_model.with_structured_output(schema, method=method).invoke(QUESTION)
    assert set(picked) == {"city", "sure"} and picked["city"] in WEATHER and isinstance(picked["sure"], bool)


def test_litellm_tool_loop(gateway: Proc) -> None:
    import litellm

    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
         "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                        "metric": {"type": "boolean"}}, "required": ["city", "metric"],
                        "additionalProperties": False}}},
    ]  # fmt: skip
    common: dict[str, Any] = {"model": f"openai/{MODEL}", "api_base": gateway.url + "/v1", "api_key": "key-alpha",
                              "temperature": 0, "max_tokens": 96, "num_retries": 0, "timeout": 120}  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": r, "content": c} for r, c in QUESTION]
    first = litellm.completion(
        messages=messages, tools=tools, tool_choice="required", parallel_tool_calls=False, **common
    )
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and msg.tool_calls, first
    call = msg.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert (
        call.function.name == "get_weather" and args["city"] in WEATHER and isinstance(args["metric"], bool)
    )
    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": run_tool("get_weather", args)}]  # fmt: skip
    # Streamed, a named tool: the deltas carry `index`, litellm reassembles the call.
    chunks = list(litellm.completion(messages=messages, tools=tools, stream=True,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                     **common))  # fmt: skip
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages)
    again = rebuilt.choices[0].message.tool_calls[0]
    assert again.function.name == "get_weather" and json.loads(again.function.arguments)["city"] in WEATHER
    answer = litellm.completion(messages=messages, **common)
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.choices[0].finish_reason in ("stop", "length")
    # The answer's prompt is the whole loop (question, call, tool result) as the template renders it.
    rendered = httpx.post(gateway.url + "/tokenize", json={"model": MODEL, "messages": messages},
                          headers={"Authorization": "Bearer key-alpha"}, timeout=60)  # fmt: skip
    assert rendered.status_code == 200, rendered.text
    assert answer.usage.prompt_tokens == rendered.json()["count"]
