"""The agent APIs' converters without processes: each request decoded and converted once into
the gateway's chat request, refused fields named, and engine chunk streams (including a
mid-stream failure) turned into each API's event sequence."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from keepwarm.api import messages_api, responses_api
from keepwarm.api.auth import Caller
from keepwarm.api.errors import ApiError
from keepwarm.engine.serving import wire


def _messages(body: dict[str, Any]) -> messages_api.MessagesRequest:
    return messages_api.MessagesBody.decode_bytes(None, json.dumps(body).encode())  # type: ignore[arg-type, no-any-return]


def _responses(body: dict[str, Any]) -> responses_api.ResponsesRequest:
    return responses_api.ResponsesBody.decode_bytes(None, json.dumps(body).encode())  # type: ignore[arg-type, no-any-return]


def test_messages_convert_blocks_tools_and_choices() -> None:
    req = _messages({
        "model": "default", "max_tokens": 64, "top_k": 5, "stop_sequences": ["END"], "temperature": 0.5,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
        "tools": [{"name": "get_time", "input_schema": {"type": "object"}, "description": "Time."}],
        "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u1"},
        "messages": [
            {"role": "user", "content": "Time in Oslo?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "t1", "name": "get_time",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "09:15"}]},
                                         {"type": "text", "text": "Thanks"}]},
        ],
    })  # fmt: skip
    chat = messages_api.to_chat(req)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[0].content == "Be brief.\nUse tools."
    call = chat.messages[2].tool_calls[0]  # type: ignore[index]
    assert call.id == "t1" and json.loads(call.function.arguments) == {"city": "Oslo"}  # type: ignore[arg-type]
    assert chat.messages[3].tool_call_id == "t1" and chat.messages[3].content == "09:15"
    assert isinstance(chat.tool_choice, wire.NamedToolChoice) and chat.tool_choice.function.name == "get_time"
    assert chat.parallel_tool_calls is False and chat.stop == ["END"] and chat.top_k == 5
    assert chat.user == "u1" and chat.prefix_cache is None and chat.max_tokens == 64
    any_choice = messages_api.to_chat(
        _messages({**_base(), "tools": req_tools(), "tool_choice": {"type": "any"}})
    )
    assert any_choice.tool_choice == "required"


def _base() -> dict[str, Any]:
    return {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


def req_tools() -> list[dict[str, Any]]:
    return [{"name": "f", "input_schema": {"type": "object"}}]


def test_messages_cache_control_maps_to_a_full_snapshot_and_reports_creation() -> None:
    req = _messages(
        {**_base(), "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}]}
    )
    chat = messages_api.to_chat(req)
    assert chat.prefix_cache is not None and chat.prefix_cache.scope == "full"
    usage = {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 60}}
    assert messages_api.usage_of(usage, True) == {"input_tokens": 0, "output_tokens": 3,
                                                  "cache_read_input_tokens": 60, "cache_creation_input_tokens": 40}  # fmt: skip
    assert messages_api.usage_of(usage, False)["input_tokens"] == 40


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"thinking": {"type": "enabled"}}, "thinking"),
        ({"service_tier": "auto"}, "service_tier"),
        ({"bogus": 1}, "bogus"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ],
)
def test_messages_refusals_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises((ApiError, wire.WireError)) as e:
        _messages({**_base(), **extra})
    assert (getattr(e.value, "param", None) or "").startswith(param), e.value


def test_responses_convert_items_and_formats() -> None:
    req = _responses({
        "model": "default", "instructions": "Be brief.", "max_output_tokens": 10, "seed": 3, "top_p": 0.5,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
        "input": [
            {"role": "user", "content": "Hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello",
                                                                  "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        ],
    })  # fmt: skip
    history = [wire.ChatMessage(role="user", content="Earlier")]
    chat = responses_api.to_chat(req, history, "s1")
    assert [m.role for m in chat.messages] == ["system", "user", "user", "assistant", "tool", "tool"]
    assert [c.id for c in chat.messages[3].tool_calls or []] == ["c1", "c2"] and chat.messages[
        3
    ].content == "Hello"
    assert chat.messages[5].content == "two" and chat.user == "s1"
    assert (
        isinstance(chat.response_format, wire.JsonSchemaFormat) and chat.seed == 3 and chat.max_tokens == 10
    )
    assert isinstance(chat.tool_choice, wire.NamedToolChoice) and chat.parallel_tool_calls is False


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["x"]}, "include"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ],
)
def test_responses_refusals_name_the_field(extra: dict[str, Any], param: str) -> None:
    with pytest.raises((ApiError, wire.WireError)) as e:
        _responses({"input": "Hi", **extra})
    assert (getattr(e.value, "param", None) or "").startswith(param), e.value


async def _chunks(items: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for i in items:
        yield i


def _events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for b in raw:
        head, data = b.decode().strip().split("\n", 1)
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


async def _collect(gen: AsyncIterator[bytes]) -> list[bytes]:
    return [b async for b in gen]


CHUNKS: list[dict[str, Any]] = [
    {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Let me "}}]},
    {"model": "m", "choices": [{"index": 0, "delta": {"content": "check."}}]},
    {"model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}}]},
    {"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"model": "m", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9,
                                            "prompt_tokens_details": {"cached_tokens": 40}}},
]  # fmt: skip


def test_messages_stream_events() -> None:
    events = _events(asyncio.run(_collect(messages_api.events_of(_chunks(CHUNKS), "m", False))))
    kinds = [k for k, _ in events]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]  # fmt: skip
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 1}'}
    assert events[8][1]["delta"]["stop_reason"] == "tool_use"
    assert (
        events[8][1]["usage"]["cache_read_input_tokens"] == 40 and events[8][1]["usage"]["input_tokens"] == 10
    )
    failed = [{"error": {"message": "engine failed mid-stream", "code": 502}}]
    kinds = [
        k for k, _ in _events(asyncio.run(_collect(messages_api.events_of(_chunks(failed), "m", False))))
    ]
    assert kinds == ["message_start", "error"]


def test_responses_stream_events() -> None:
    req = _responses({"input": "Hi", "store": False})
    turn = responses_api.Turn(req=req, caller=Caller("t", "salt"), session="s", history=[])
    store: Any = responses_api.Store(gw=None)  # type: ignore[arg-type]
    events = _events(asyncio.run(_collect(responses_api.events_of(turn, store, _chunks(CHUNKS), "m"))))
    kinds = [k for k, _ in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]  # fmt: skip
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert (
        final["output"][1]["call_id"] == "c1"
        and final["usage"]["input_tokens_details"]["cached_tokens"] == 40
    )
    failed = [{"error": {"message": "engine failed mid-stream", "code": 502}}]
    kinds = [
        k
        for k, _ in _events(asyncio.run(_collect(responses_api.events_of(turn, store, _chunks(failed), "m"))))
    ]
    assert kinds == ["response.created", "response.in_progress", "response.failed"]
