"""Anthropic's Messages API on the gateway: `POST /v1/messages` (streaming and not) and
`POST /v1/messages/count_tokens`.

A request is decoded into the typed `MessagesRequest` below (every field Anthropic defines
that keepwarm does not implement refused naming it, see REFUSED) and converted ONCE into the
gateway's Chat Completions request (`to_chat`), which takes the same path as
`/v1/chat/completions` (chat_bridge: tenant salt, session -> prefix hint, routing, failover):
  system (string or text blocks)     -> a first system message
  user text / tool_result blocks     -> user messages / `tool` messages (tool_call_id = tool_use_id)
  assistant text / tool_use blocks   -> an assistant message with content and tool_calls
  tools[].input_schema               -> function tools; tool_choice auto/any/tool/none ->
                                        auto/required/named/none (disable_parallel_tool_use ->
                                        parallel_tool_calls false); forced choices are grammars
  max_tokens, stop_sequences, temperature, top_p, top_k -> the same sampling fields
  metadata.user_id                   -> the session (an X-Session-Id header wins)
  cache_control on any block         -> prefix_cache scope "full": the whole prompt is snapshotted,
                                        so every marked prefix is saved with it
The engine's chat reply (or chunk stream) is converted back into a Message (or Anthropic's
event sequence). usage: cache_read_input_tokens = keepwarm's cached (restored) tokens;
cache_creation_input_tokens = the tokens prefilled and saved for a request that marked
cache_control (0 otherwise); input_tokens = the rest, so the three add up to the prompt.

Auth: `x-api-key: <key>` or `Authorization: Bearer <key>`. Every error, the gateway's own
included (auth, rate limit, body bounds, engine errors), comes in Anthropic's envelope
`{"type": "error", "error": {"type", "message"}}` with the same HTTP status.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from litestar import Request, Response, post
from litestar.handlers import HTTPRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from msgspec import Meta, Struct

from keepwarm.api import chat_bridge
from keepwarm.api.errors import ApiError, handle_exception
from keepwarm.engine.serving import wire

if TYPE_CHECKING:
    from keepwarm.api.app import Gateway

# Fields of Anthropic's Messages API keepwarm does not implement.
REFUSED = {
    "thinking": "extended thinking is not supported",
    "service_tier": "service tiers are not supported",
    "container": "containers (code execution) are not supported",
    "mcp_servers": "MCP servers are not supported",
    "context_management": "context management is not supported",
    "output_format": "output_format is not supported; force a tool with tool_choice for structured output",
    "output_config": "output_config is not supported",
    "inference_geo": "inference_geo is not supported",
    "speed": "speed modes are not supported",
    "diagnostics": "diagnostics are not supported",
    "user_profile_id": "user profiles are not supported",
    "workspace_id": "workspaces are not supported; the API key names the tenant",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class AnthropicErrorDetail(Struct):
    type: str
    message: str


class AnthropicErrorBody(Struct):
    """Every error of the Messages routes (Anthropic's envelope)."""

    error: AnthropicErrorDetail
    type: str = "error"


def _error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    return {
        s: ResponseSpec(data_container=AnthropicErrorBody, description=_ANTHROPIC_TYPES[s]) for s in statuses
    }


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# --- the request ------------------------------------------------------------------------------


class CacheControl(Struct, forbid_unknown_fields=True):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(Struct, tag_field="type", tag="tool_use", forbid_unknown_fields=True):
    id: str
    name: wire.Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Struct, tag_field="type", tag="tool_result", forbid_unknown_fields=True):
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


Block = TextBlock | ToolUseBlock | ToolResultBlock


class InputMessage(Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(Struct, forbid_unknown_fields=True):
    name: wire.Name
    input_schema: dict[str, Any]
    description: str | None = None
    cache_control: CacheControl | None = None
    type: Literal["custom"] | None = None


class ChoiceAuto(Struct, tag_field="type", tag="auto", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = None


class ChoiceAny(Struct, tag_field="type", tag="any", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = None


class ChoiceTool(Struct, tag_field="type", tag="tool", forbid_unknown_fields=True):
    name: wire.Name
    disable_parallel_tool_use: bool | None = None


class ChoiceNone(Struct, tag_field="type", tag="none", forbid_unknown_fields=True):
    pass


ToolChoice = ChoiceAuto | ChoiceAny | ChoiceTool | ChoiceNone


class Metadata(Struct, forbid_unknown_fields=True):
    user_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None


class CountTokensRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[ToolDef], Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, wire.within("max_tokens")]
    stop_sequences: wire.StopList | None = None
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None  # the Messages API's own range
    top_p: Annotated[float, wire.within("top_p")] | None = None
    top_k: Annotated[int, wire.within("top_k")] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # top level: cache the whole prompt


_COUNT_FIELDS = frozenset(CountTokensRequest.__struct_fields__)
_MESSAGE_FIELDS = frozenset(MessagesRequest.__struct_fields__)


def _check_tools(raw: bytes) -> None:
    """Anthropic's server tools (web search, code execution, ...) refused naming them."""
    try:
        body = json.loads(raw)
    except ValueError:
        return
    tools = body.get("tools") if isinstance(body, dict) else None
    for i, t in enumerate(tools if isinstance(tools, list) else []):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in (None, "custom"):
            raise ApiError(
                400,
                f"tools[{i}].type: server tool {kind!r} is not supported; only client tools "
                "(name, description, input_schema)",
                param=f"tools[{i}].type",
            )


class MessagesBody(wire.WireBody[MessagesRequest]):
    def decode_bytes(self, value: bytes) -> Any:
        decoded = chat_bridge.decode_body(value, MessagesRequest, _MESSAGE_FIELDS, REFUSED)
        _check_tools(value)
        return decoded


class CountTokensBody(wire.WireBody[CountTokensRequest]):
    def decode_bytes(self, value: bytes) -> Any:
        decoded = chat_bridge.decode_body(value, CountTokensRequest, _COUNT_FIELDS, REFUSED)
        _check_tools(value)
        return decoded


# --- the conversion -------------------------------------------------------------------------


def _text_of(content: str | list[TextBlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(b.text for b in content)


def _uses_cache_control(req: CountTokensRequest) -> bool:
    blocks: list[Any] = [req] + (list(req.system) if isinstance(req.system, list) else [])
    blocks += list(req.tools or [])
    for m in req.messages:
        if isinstance(m.content, list):
            blocks += m.content
            blocks += [c for b in m.content if isinstance(b, ToolResultBlock) and isinstance(b.content, list)
                       for c in b.content]  # fmt: skip
    return any(getattr(b, "cache_control", None) is not None for b in blocks)


def chat_messages(req: CountTokensRequest) -> list[wire.ChatMessage]:
    """system + messages as Chat Completions messages."""
    out: list[wire.ChatMessage] = []
    if req.system is not None and _text_of(req.system):
        out.append(wire.ChatMessage(role="system", content=_text_of(req.system)))
    for m in req.messages:
        if isinstance(m.content, str):
            out.append(wire.ChatMessage(role=m.role, content=m.content))
            continue
        if m.role == "assistant":
            texts = [b.text for b in m.content if isinstance(b, TextBlock)]
            calls = [
                wire.ToolCall(id=b.id, function=wire.FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                for b in m.content
                if isinstance(b, ToolUseBlock)
            ]
            if any(isinstance(b, ToolResultBlock) for b in m.content):
                raise ApiError(400, "tool_result blocks belong in user messages", param="messages")
            out.append(
                wire.ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None)
            )
            continue
        pending: list[str] = []
        for b in m.content:
            if isinstance(b, TextBlock):
                pending.append(b.text)
            elif isinstance(b, ToolResultBlock):
                if pending:
                    out.append(wire.ChatMessage(role="user", content="\n".join(pending)))
                    pending = []
                text = _text_of(b.content)
                out.append(wire.ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                            content=f"Error: {text}" if b.is_error else text))  # fmt: skip
            else:
                raise ApiError(400, "tool_use blocks belong in assistant messages", param="messages")
        if pending:
            out.append(wire.ChatMessage(role="user", content="\n".join(pending)))
    return out


def chat_tools(req: CountTokensRequest) -> list[wire.Tool] | None:
    if not req.tools:
        return None
    return [
        wire.Tool(
            function=wire.FunctionDef(name=t.name, description=t.description, parameters=t.input_schema)
        )
        for t in req.tools
    ]


def to_chat(req: MessagesRequest) -> wire.ChatCompletionRequest:
    """The one conversion into the gateway's chat request."""
    choice: Any = None
    parallel: bool | None = None
    tc = req.tool_choice
    if isinstance(tc, ChoiceAuto):
        choice = "auto"
    elif isinstance(tc, ChoiceAny):
        choice = "required"
    elif isinstance(tc, ChoiceTool):
        choice = wire.NamedToolChoice(function=wire.NamedFunction(name=tc.name))
    elif isinstance(tc, ChoiceNone):
        choice = "none"
    if isinstance(tc, (ChoiceAuto, ChoiceAny, ChoiceTool)) and tc.disable_parallel_tool_use:
        parallel = False
    tools = chat_tools(req)
    if choice == "none" and tools is None:
        choice = None
    if choice is not None and tools is None:
        raise ApiError(400, "tool_choice needs 'tools'", param="tool_choice")
    return wire.ChatCompletionRequest(
        model=req.model,
        messages=chat_messages(req),
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences) if req.stop_sequences else None,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        user=req.metadata.user_id if req.metadata else None,
        prefix_cache=wire.PrefixCacheOptions(scope="full") if _uses_cache_control(req) else None,
    )


def usage_of(usage: Any, cache_control: bool) -> dict[str, int]:
    u = chat_bridge.Usage.of(usage)
    created = max(0, u.prompt_tokens - u.cached_tokens) if cache_control else 0
    return {
        "input_tokens": max(0, u.prompt_tokens - u.cached_tokens - created),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": created,
    }


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def stop_reason_of(finish_reason: Any, stop: str | None, tool_call: bool) -> str:
    """Anthropic's stop_reason: tool_use when the reply called a tool, stop_sequence when one of
    the request's stop_sequences ended it, else the finish reason's (end_turn, max_tokens)."""
    if tool_call:
        return "tool_use"
    if stop is not None and finish_reason == "stop":
        return "stop_sequence"
    return _STOP_REASONS.get(str(finish_reason), "end_turn")


def from_chat(data: dict[str, Any], model: str, cache_control: bool) -> dict[str, Any]:
    """An engine chat.completion as an Anthropic Message."""
    choice, msg = chat_bridge.first_choice(data)
    content: list[dict[str, Any]] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    calls = [c for c in msg.get("tool_calls") or [] if isinstance(c, dict)]
    for c in calls:
        fn = c.get("function") or {}
        content.append({"type": "tool_use", "id": c.get("id") or "toolu_" + secrets.token_hex(12),
                        "name": fn.get("name", ""),
                        "input": chat_bridge.parse_arguments(chat_bridge.arguments_of(c))})  # fmt: skip
    stop = choice.get("stop_reason") if isinstance(choice.get("stop_reason"), str) else None
    reason = stop_reason_of(choice.get("finish_reason"), stop, bool(calls))
    return {
        "id": _message_id(),
        "type": "message",
        "role": "assistant",
        "model": data.get("model") or model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop if reason == "stop_sequence" else None,
        "usage": usage_of(data.get("usage"), cache_control),
    }


async def events_of(
    chunks: AsyncIterator[dict[str, Any]], model: str, cache_control: bool
) -> AsyncIterator[bytes]:
    """An engine chat chunk stream as Anthropic's event sequence: message_start,
    content_block_start / content_block_delta / content_block_stop per text or tool_use
    block, message_delta (stop_reason, usage), message_stop; `error` if the engine failed."""
    sse = chat_bridge.sse
    yield sse("message_start", {"type": "message_start", "message": {
        "id": _message_id(), "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage_of(None, cache_control)}})  # fmt: skip
    index = -1
    open_kind: str | None = None
    finish: str | None = None
    stop: str | None = None
    usage: Any = None
    saw_call = False
    try:
        async for chunk in chunks:
            if isinstance(chunk.get("error"), dict):
                err = chunk["error"]
                yield sse("error", {"type": "error", "error": {
                    "type": _ANTHROPIC_TYPES.get(int(err.get("code") or 500), "api_error"),
                    "message": str(err.get("message") or "engine failed")}})  # fmt: skip
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta") or {}
                text = delta.get("content")
                if text:
                    if open_kind != "text":
                        if open_kind is not None:
                            yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
                        index += 1
                        open_kind = "text"
                        yield sse("content_block_start", {"type": "content_block_start", "index": index,
                                                          "content_block": {"type": "text", "text": ""}})  # fmt: skip
                    yield sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                      "delta": {"type": "text_delta", "text": text}})  # fmt: skip
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id") or open_kind != "tool":
                        if open_kind is not None:
                            yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
                        index += 1
                        open_kind = "tool"
                        saw_call = True
                        yield sse("content_block_start", {"type": "content_block_start", "index": index,
                                  "content_block": {"type": "tool_use",
                                                    "id": call.get("id") or "toolu_" + secrets.token_hex(12),
                                                    "name": fn.get("name", ""), "input": {}}})  # fmt: skip
                    args = fn.get("arguments")
                    if args:
                        yield sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                  "delta": {"type": "input_json_delta", "partial_json": args}})  # fmt: skip
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
                    if isinstance(choice.get("stop_reason"), str):
                        stop = choice["stop_reason"]
        if open_kind is not None:
            yield sse("content_block_stop", {"type": "content_block_stop", "index": index})
        reason = stop_reason_of(finish, stop, saw_call)
        yield sse("message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason,
                                              "stop_sequence": stop if reason == "stop_sequence" else None},
                                    "usage": usage_of(usage, cache_control)})  # fmt: skip
        yield sse("message_stop", {"type": "message_stop"})
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


# --- the routes -----------------------------------------------------------------------------


def anthropic_error(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Any error on these routes in Anthropic's envelope (same status and headers)."""
    plain = handle_exception(request, exc)
    try:
        body = json.loads(plain.content if isinstance(plain.content, (bytes, str)) else b"{}")
        message = str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = "error"
    status = plain.status_code
    envelope = {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
    }
    headers = {k: v for k, v in plain.headers.items() if k.lower() == "retry-after"}
    return Response(content=json.dumps(envelope).encode(), status_code=status, media_type="application/json",
                    headers=headers)  # fmt: skip


def routes(gw: Gateway) -> list[HTTPRouteHandler]:
    """The routes, documented in the gateway's /schema."""

    async def admit(request: Request[Any, Any, Any]) -> None:
        """x-api-key or Authorization: Bearer -> the caller (401), then its rate limit (429)."""
        key = request.headers.get("x-api-key")
        authorization = f"Bearer {key}" if key else request.headers.get("authorization")
        if not authorization:
            raise ApiError(
                401, "missing API key: send the header 'x-api-key: <key>' (or 'Authorization: Bearer <key>')"
            )
        caller = gw.auth.authenticate(authorization)
        await gw.check_rate(caller)
        request.state.caller = caller

    errors = _error_responses(400, 401, 404, 413, 429, 503)
    handlers: dict[int | type[Exception], Any] = {Exception: anthropic_error}

    @post("/v1/messages", status_code=200, before_request=admit, dto=MessagesBody, return_dto=None,
          responses=errors, exception_handlers=handlers)  # fmt: skip
    async def messages(request: Request[Any, Any, Any], data: MessagesRequest | None = None) -> Response[Any]:
        """Anthropic Messages (SSE events with `stream: true`), on the Chat Completions path."""
        if data is None:
            raise ApiError(400, "request body is empty; send a JSON object")
        model = await gw.served_model(data.model)
        chat = to_chat(data)
        cache_control = chat.prefix_cache is not None
        if data.stream:
            upstream = await chat_bridge.stream(gw, request, chat)
            return upstream.response(events_of(upstream.chunks, model, cache_control))
        try:
            reply = await chat_bridge.complete(gw, request, chat)
        except chat_bridge.ClientGone as gone:
            return gone.response
        return Response(content=json.dumps(from_chat(reply, model, cache_control)).encode(),
                        media_type="application/json")  # fmt: skip

    @post("/v1/messages/count_tokens", status_code=200, before_request=admit, dto=CountTokensBody,
          return_dto=None, responses=errors, exception_handlers=handlers)  # fmt: skip
    async def count_tokens(
        request: Request[Any, Any, Any], data: CountTokensRequest | None = None
    ) -> dict[str, int]:
        """The prompt's token count as the model's chat template renders it (tools included)."""
        if data is None:
            raise ApiError(400, "request body is empty; send a JSON object")
        body = wire.TokenizeRequest(model=data.model, messages=chat_messages(data), tools=chat_tools(data))
        answer = await gw.pass_through(request, body, "/tokenize")
        content = answer.content if isinstance(answer.content, (bytes, str)) else b"{}"
        count = json.loads(content).get("count")
        if not isinstance(count, int):
            raise ApiError(502, "engine returned no token count")
        return {"input_tokens": count}

    return [messages, count_tokens]
