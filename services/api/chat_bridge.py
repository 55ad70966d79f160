"""The one path the other APIs (Responses, Anthropic Messages) take into the engines.

Each of those APIs converts its request ONCE into the gateway's typed Chat Completions
request (`wire.ChatCompletionRequest`) and hands it to `Gateway.generate`, so it gets the
same tenant salt, session -> prefix hint, engine routing, failover and usage records as
`/v1/chat/completions`. What comes back is the engine's chat reply: `complete` returns it
as a dict, `stream` yields its chunks as dicts (the usage chunk included, `keepwarm`
removed by the gateway) for the API's own converter to turn into its events.

Also here: the small pieces both converters share (body bounds and typed decoding with the
API's own list of refused fields, tool-argument parsing, the usage figures).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from litestar import Request
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.response import Stream

from keepwarm.api.chat_body import Bounded, bounded_body, typed_body
from keepwarm.api.errors import ApiError, client_closed
from keepwarm.engine.serving import wire

if TYPE_CHECKING:
    from keepwarm.api.app import Gateway

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def decode_body(raw: bytes, kind: type[T], known: frozenset[str], refused: Mapping[str, str]) -> T:
    """`raw` bounded like every gateway body (JSON only, depth, numbers), its top-level fields
    checked against this API's (`refused`: fields of the API keepwarm does not implement, each
    with the reason; anything else not `known` is an unknown field), then decoded into `kind`
    (a WireError naming the field for the rest)."""
    return decode_bounded(raw, bounded_body(raw), kind, known, refused)


def decode_bounded(
    raw: bytes, bounded: Bounded, kind: type[T], known: frozenset[str], refused: Mapping[str, str]
) -> T:
    """`decode_body` of a body already bounded (and parsed once) by `bounded_body`."""
    for name in bounded[0]:
        if name in refused:
            raise ApiError(400, f"{name}: {refused[name]}; remove it", param=name)
        if name not in known:
            raise ApiError(400, f"unknown field {name!r}: keepwarm does not accept it; remove it", param=name)
    return typed_body(raw, bounded, kind)


def arguments_of(call: Mapping[str, Any]) -> str:
    """A chat tool call's arguments as the JSON text the engine produced."""
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else {}
    args = fn.get("arguments") if isinstance(fn, Mapping) else None
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {})


def parse_arguments(text: str) -> dict[str, Any]:
    """A call's arguments as an object ({} when the model wrote none or not an object)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def first_choice(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A chat.completion's first choice and its message ({} for what is missing)."""
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    return choice, message if isinstance(message, dict) else {}


@dataclass(frozen=True)
class Usage:
    """The figures of an engine `usage` object both converters report."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @classmethod
    def of(cls, usage: Any) -> Usage:
        u = usage if isinstance(usage, Mapping) else {}
        details = u.get("prompt_tokens_details")
        details = details if isinstance(details, Mapping) else {}

        def num(d: Mapping[str, Any], k: str) -> int:
            v = d.get(k)
            return v if isinstance(v, int) and not isinstance(v, bool) else 0

        return cls(num(u, "prompt_tokens"), num(u, "completion_tokens"), num(details, "cached_tokens"))


class ClientGone(Exception):
    """The client left before a non-streaming answer came back (the gateway's 499)."""

    def __init__(self) -> None:
        super().__init__("client disconnected")
        self.response = client_closed()


async def complete(
    gw: Gateway, request: Request[Any, Any, Any], chat: wire.ChatCompletionRequest
) -> dict[str, Any]:
    """The engine's chat.completion for `chat` (stream off), through the gateway's path, as
    plain data for the converters (built from the gateway's decoded reply: no second parse)."""
    reply = await gw.complete(request, msgspec_replace(chat, stream=False, stream_options=None),
                              "/v1/chat/completions")  # fmt: skip
    if reply is None:  # the client left; nothing to convert
        raise ClientGone()
    data = msgspec.to_builtins(reply)
    assert isinstance(data, dict), "a wire model is an object"
    return data


@dataclass
class ChatStream:
    """The engine's chat chunks as dicts (an `{"error": ...}` dict when the engine failed
    mid-stream); `background` closes the upstream request and must run after the stream."""

    chunks: AsyncIterator[dict[str, Any]]
    background: BackgroundTask | BackgroundTasks | None

    def response(self, events: AsyncIterator[bytes]) -> Stream:
        """An SSE response of `events` that closes the upstream stream when it ends."""
        return Stream(
            events, media_type="text/event-stream", headers=dict(SSE_HEADERS), background=self.background
        )


async def stream(
    gw: Gateway, request: Request[Any, Any, Any], chat: wire.ChatCompletionRequest
) -> ChatStream:
    """The engine's chat.completion.chunk stream for `chat`, through the gateway's path
    (usage always requested: the converters report it)."""
    changed = msgspec_replace(chat, stream=True, stream_options=wire.StreamOptions(include_usage=True))
    response = await gw.generate(request, changed, "/v1/chat/completions")
    if not isinstance(response, Stream):
        raise ApiError(502, "engine did not stream its answer")
    return ChatStream(_sse_dicts(response.iterator), response.background)


async def _sse_dicts(source: Any) -> AsyncIterator[dict[str, Any]]:
    pending = b""
    try:
        async for piece in source:
            pending += piece if isinstance(piece, bytes) else str(piece).encode()
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                text = line[5:].strip()
                if not text or text == b"[DONE]":
                    continue
                try:
                    obj = json.loads(text)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    yield obj
    finally:
        closer = getattr(source, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


def msgspec_replace(obj: T, **changes: Any) -> T:
    return msgspec.structs.replace(obj, **changes)  # type: ignore[type-var]


def sse(event: str, data: Mapping[str, Any]) -> bytes:
    """One named server-sent event."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
