"""OpenAI's Responses API on the gateway: `POST /v1/responses` (streaming and not),
`GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`.

A request is decoded into the typed `ResponsesRequest` below (fields of the API keepwarm does
not implement refused naming them, see REFUSED; built-in tools refused naming their type) and
converted ONCE into the gateway's Chat Completions request (`to_chat`), which takes the same
path as `/v1/chat/completions` (chat_bridge: tenant salt, session -> prefix hint, routing,
failover):
  instructions                      -> a first system message (not carried to chained responses,
                                       as in OpenAI's API)
  previous_response_id              -> the stored conversation of that response (its input and
                                       output as chat messages) before this input
  input: text | items               -> user message | message items (user/system/developer/assistant),
                                       function_call -> an assistant tool call,
                                       function_call_output -> a `tool` message (tool_call_id = call_id)
  tools (function), tool_choice, parallel_tool_calls -> the same chat fields (forced choices are
                                       grammars); text.format json_schema / json_object -> response_format
  max_output_tokens, temperature, top_p, seed -> max_tokens, temperature, top_p, seed
The engine's reply (or chunk stream) is converted back into a Response object (or the Responses
event sequence: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta/.done, response.content_part.done,
response.function_call_arguments.delta/.done, response.output_item.done, response.completed or
response.incomplete; response.failed when the engine fails mid-stream). usage:
input_tokens_details.cached_tokens = keepwarm's cached (restored) tokens.

Storage (`store`, default true): Redis key `<prefix>response:<tenant>:<id>` holds the Response,
the conversation as chat messages (without the instructions) and the session, for
KEEPWARM_SESSION_TTL seconds; GET and DELETE see only the caller's tenant. Sessions: an
X-Session-Id header, else the chained response's session, else the new response's id, so a
chain of responses is one session whose last prefix key hints the engine (a cache hit).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.handlers import HTTPRouteHandler
from msgspec import Meta, Struct

from keepwarm.api import chat_bridge
from keepwarm.api.auth import Caller
from keepwarm.api.chat_body import bounded_body
from keepwarm.api.errors import ApiError
from keepwarm.api.sessions import check_session_id
from keepwarm.engine.serving import wire

if TYPE_CHECKING:
    from keepwarm.api.app import Gateway

REFUSED = {
    "background": "background responses are not supported; stream or wait for the answer",
    "reasoning": "reasoning controls are not supported by keepwarm's models",
    "include": "include (extra output data) is not supported",
    "truncation": "truncation is not supported; the prompt must fit the model's context",
    "service_tier": "service tiers are not supported",
    "prompt": "prompt templates are not supported; send input and instructions",
    "conversation": "conversations are not supported; chain responses with previous_response_id",
    "top_logprobs": "logprobs are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "prompt_cache_key": "prompt_cache_key is not supported; the prefix cache keys on the prompt itself",
    "prompt_cache_retention": "prompt_cache_retention is not supported; snapshots live in RAM and on disk",
    "prompt_cache_options": "prompt_cache_options is not supported",
    "safety_identifier": "safety_identifier is not supported",
    "user": "user is not supported; send the header X-Session-Id to name a session",
    "stream_options": "stream_options is not supported",
    "context_management": "context management is not supported",
    "access_programs": "access programs are not supported",
    "background_options": "background responses are not supported",
    "image": "image generation is not supported",
    "moderation": "moderation is not supported",
}

# --- the request ------------------------------------------------------------------------------


class InputText(Struct, tag_field="type", tag="input_text", forbid_unknown_fields=True):
    text: str


class OutputText(Struct, tag_field="type", tag="output_text", forbid_unknown_fields=True):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


ContentPart = InputText | OutputText


class MessageItem(Struct, tag_field="type", tag="message", forbid_unknown_fields=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Struct, tag_field="type", tag="function_call", forbid_unknown_fields=True):
    call_id: str
    name: wire.Name
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(
    Struct, tag_field="type", tag="function_call_output", forbid_unknown_fields=True
):
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(Struct, tag_field="type", tag="function", forbid_unknown_fields=True):
    name: wire.Name
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class FunctionChoice(Struct, tag_field="type", tag="function", forbid_unknown_fields=True):
    name: wire.Name


class FormatText(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class FormatJsonObject(Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class FormatJsonSchema(Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    name: wire.Name
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, forbid_unknown_fields=True):
    format: FormatText | FormatJsonObject | FormatJsonSchema | None = None


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | Annotated[list[Item], Meta(max_length=1000)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, wire.within("max_tokens")] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None  # the Responses API's own range
    top_p: Annotated[float, wire.within("top_p")] | None = None
    seed: Annotated[int, wire.within("seed")] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=128)] | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None


_FIELDS = frozenset(ResponsesRequest.__struct_fields__)


class ResponsesBody(wire.WireBody[ResponsesRequest]):
    """POST /v1/responses: bounded, refused fields named, message items without `type` typed
    as `message` (OpenAI's short form `{role, content}`), then decoded."""

    def decode_bytes(self, value: bytes) -> Any:
        bounded = bounded_body(value)
        body, parsed = bounded
        tools = body.get("tools")
        for i, t in enumerate(tools if isinstance(tools, list) else []):
            kind = t.get("type") if isinstance(t, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise ApiError(400, f"tools[{i}].type: built-in tool {kind!r} is not supported; only function "
                               "tools", param=f"tools[{i}].type")  # fmt: skip
        items = body.get("input")
        if isinstance(items, list):
            for item in items:
                if isinstance(item, dict) and "type" not in item and "role" in item:
                    item["type"] = "message"
            if not parsed:  # only json could read it: decode_bounded decodes these bytes for the error
                value = json.dumps(body).encode()
        return chat_bridge.decode_bounded(value, bounded, ResponsesRequest, _FIELDS, REFUSED)


# --- the conversion -------------------------------------------------------------------------


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def input_messages(req: ResponsesRequest) -> list[wire.ChatMessage]:
    """`input` as chat messages (function calls joined onto the assistant message before them)."""
    if isinstance(req.input, str):
        return [wire.ChatMessage(role="user", content=req.input)]
    out: list[wire.ChatMessage] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            out.append(wire.ChatMessage(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = wire.ToolCall(
                id=item.call_id, function=wire.FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                out[-1] = msgspec.structs.replace(last, tool_calls=[*(last.tool_calls or []), call])
            else:
                out.append(wire.ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(wire.ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output)))
    return out


def to_chat(
    req: ResponsesRequest, history: list[wire.ChatMessage], session: str
) -> wire.ChatCompletionRequest:
    """The one conversion into the gateway's chat request."""
    system = [wire.ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    tc = req.tool_choice
    choice: Any = (
        wire.NamedToolChoice(function=wire.NamedFunction(name=tc.name))
        if isinstance(tc, FunctionChoice)
        else tc
    )
    tools = [wire.Tool(function=wire.FunctionDef(name=t.name, description=t.description, parameters=t.parameters,
                                                 strict=t.strict)) for t in req.tools] if req.tools else None  # fmt: skip
    fmt: Any = None
    f = req.text.format if req.text else None
    if isinstance(f, FormatJsonSchema):
        spec = wire.JsonSchemaSpec(name=f.name, description=f.description, schema=f.schema, strict=f.strict)
        fmt = wire.JsonSchemaFormat(json_schema=spec)
    elif isinstance(f, FormatJsonObject):
        fmt = wire.JsonObjectFormat()
    messages = [*system, *history, *input_messages(req)]
    if not messages:
        raise ApiError(400, "'input' is empty and there is nothing to continue; send input", param="input")
    return wire.ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=fmt,
        user=session,
    )


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def usage_of(usage: Any) -> dict[str, Any]:
    u = chat_bridge.Usage.of(usage)
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _new_id("msg_"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text or
            status == "completed" else []}  # fmt: skip


def call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _new_id("fc_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


@dataclass
class Turn:
    """One Responses request while it runs: what it echoes, stores and continues."""

    req: ResponsesRequest
    caller: Caller
    session: str
    history: list[wire.ChatMessage]  # the chained conversation + this input (no instructions)
    id: str = field(default_factory=lambda: _new_id("resp_"))
    created: int = field(default_factory=lambda: int(time.time()))

    def response(self, model: str, status: str, output: list[dict[str, Any]], usage: Any) -> dict[str, Any]:
        req = self.req
        tc = req.tool_choice
        fmt = req.text.format if req.text and req.text.format else FormatText()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tool_choice": msgspec.to_builtins(tc) if tc is not None else "auto",
            "tools": msgspec.to_builtins(req.tools or []),
            "text": {"format": msgspec.to_builtins(fmt)},
            "store": req.store,
            "metadata": req.metadata or {},
            "usage": usage_of(usage) if usage is not None else None,
        }


def _assistant(output: list[dict[str, Any]]) -> wire.ChatMessage:
    text = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [wire.ToolCall(id=i["call_id"], function=wire.FunctionCall(name=i["name"], arguments=i["arguments"]))
             for i in output if i["type"] == "function_call"]  # fmt: skip
    return wire.ChatMessage(role="assistant", content=text or None, tool_calls=calls or None)


def output_of(data: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """An engine chat.completion's output items and the response status."""
    choice, msg = chat_bridge.first_choice(data)
    output: list[dict[str, Any]] = []
    if msg.get("content"):
        output.append(message_item(msg["content"]))
    for c in msg.get("tool_calls") or []:
        if isinstance(c, dict):
            fn = c.get("function") or {}
            output.append(
                call_item(c.get("id") or _new_id("call_"), fn.get("name", ""), chat_bridge.arguments_of(c))
            )
    return output, "incomplete" if choice.get("finish_reason") == "length" else "completed"


class Store:
    """Stored responses per tenant in Redis, with the session's TTL."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def key(self, tenant: str, rid: str) -> str:
        return f"{self.gw.config.redis_prefix}response:{tenant}:{rid}"

    async def save(self, turn: Turn, response: dict[str, Any]) -> None:
        if not turn.req.store:
            return
        output = response["output"]
        history = [*turn.history, _assistant(output)] if output else turn.history
        record = {"response": response, "messages": msgspec.to_builtins(history), "session": turn.session}
        await self.gw.redis_do(
            self.gw.redis.set(
                self.key(turn.caller.tenant, turn.id), json.dumps(record), ex=self.gw.config.session_ttl_s
            ),
            "response store",
        )

    async def load(self, tenant: str, rid: str, param: str) -> dict[str, Any]:
        raw = await self.gw.redis_call("stored responses", self.gw.redis.get(self.key(tenant, rid)))
        if raw is None:
            raise ApiError(404, f"no stored response {rid!r} for this tenant (never stored, deleted or expired)",
                           param=param)  # fmt: skip
        record = json.loads(raw)
        assert isinstance(record, dict)
        return record

    async def delete(self, tenant: str, rid: str) -> bool:
        return bool(await self.gw.redis_call("stored responses", self.gw.redis.delete(self.key(tenant, rid))))


async def events_of(
    turn: Turn, store: Store, chunks: AsyncIterator[dict[str, Any]], model: str
) -> AsyncIterator[bytes]:
    """The engine's chat chunks as the Responses event sequence (see the module doc)."""
    seq = 0

    def ev(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        return chat_bridge.sse(kind, {"type": kind, "sequence_number": seq - 1, **data})

    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None  # the item being streamed
    usage: Any = None
    finish: str | None = None

    def close() -> list[bytes]:
        nonlocal open_item
        if open_item is None:
            return []
        item, open_item = open_item, None
        idx = len(output)
        if item["type"] == "message":
            text = item["text"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            done = message_item(text, item_id=item["id"])
            out = [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text,
                      logprobs=[]),
                   ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
                   ev("response.output_item.done", output_index=idx, item=done)]  # fmt: skip
        else:
            done = call_item(item["call_id"], item["name"], item["arguments"], item_id=item["id"])
            out = [ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                      name=item["name"], arguments=item["arguments"]),
                   ev("response.output_item.done", output_index=idx, item=done)]  # fmt: skip
        output.append(done)
        return out

    yield ev("response.created", response=turn.response(model, "in_progress", [], None))
    yield ev("response.in_progress", response=turn.response(model, "in_progress", [], None))
    try:
        async for chunk in chunks:
            if isinstance(chunk.get("error"), dict):
                err = chunk["error"]
                failed = turn.response(model, "failed", output, None)
                failed["error"] = {
                    "code": "server_error",
                    "message": str(err.get("message") or "engine failed"),
                }
                yield ev("response.failed", response=failed)
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            if isinstance(chunk.get("model"), str):
                model = chunk["model"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {} if isinstance(choice, dict) else {}
                text = delta.get("content")
                if text:
                    if open_item is None or open_item["type"] != "message":
                        for b in close():
                            yield b
                        open_item = {"type": "message", "id": _new_id("msg_"), "text": ""}
                        idx = len(output)
                        yield ev("response.output_item.added", output_index=idx,
                                 item=message_item("", "in_progress", open_item["id"]))  # fmt: skip
                        yield ev("response.content_part.added", item_id=open_item["id"], output_index=idx,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                        "logprobs": []})  # fmt: skip
                    open_item["text"] += text
                    yield ev("response.output_text.delta", item_id=open_item["id"], output_index=len(output),
                             content_index=0, delta=text, logprobs=[])  # fmt: skip
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id") or open_item is None or open_item["type"] != "function_call":
                        for b in close():
                            yield b
                        open_item = {"type": "function_call", "id": _new_id("fc_"),
                                     "call_id": call.get("id") or _new_id("call_"), "name": fn.get("name", ""),
                                     "arguments": ""}  # fmt: skip
                        yield ev("response.output_item.added", output_index=len(output),
                                 item=call_item(open_item["call_id"], open_item["name"], "", "in_progress",
                                                open_item["id"]))  # fmt: skip
                    args = fn.get("arguments")
                    if args:
                        args = args if isinstance(args, str) else json.dumps(args)
                        open_item["arguments"] += args
                        yield ev("response.function_call_arguments.delta", item_id=open_item["id"],
                                 output_index=len(output), delta=args)  # fmt: skip
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    finish = choice["finish_reason"]
        for b in close():
            yield b
        status = "incomplete" if finish == "length" else "completed"
        final = turn.response(model, status, output, usage)
        await store.save(turn, final)
        yield ev(f"response.{status}", response=final)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


# --- the routes -----------------------------------------------------------------------------


def routes(gw: Gateway) -> list[HTTPRouteHandler]:
    """The routes, documented in the gateway's /schema."""
    store = Store(gw)

    async def admit(request: Request[Any, Any, Any]) -> None:
        caller = gw.auth.authenticate(request.headers.get("authorization"))
        await gw.check_rate(caller)
        request.state.caller = caller

    @post("/v1/responses", status_code=200, before_request=admit, dto=ResponsesBody, return_dto=None,
          responses=wire.error_responses(400, 401, 404, 413, 429, 503))  # fmt: skip
    async def create(request: Request[Any, Any, Any], data: ResponsesRequest | None = None) -> Response[Any]:
        """OpenAI Responses (SSE events with `stream: true`), on the Chat Completions path."""
        if data is None:
            raise ApiError(400, "request body is empty; send a JSON object")
        caller: Caller = request.state.caller
        model = await gw.served_model(data.model)  # 404 / 503 before anything is stored or streamed
        history: list[wire.ChatMessage] = []
        session: str | None = None
        if data.previous_response_id:
            record = await store.load(caller.tenant, data.previous_response_id, "previous_response_id")
            history = msgspec.convert(record.get("messages") or [], list[wire.ChatMessage])
            session = record.get("session") if isinstance(record.get("session"), str) else None
        if request.headers.get("x-session-id"):
            session = check_session_id(request.headers["x-session-id"], "X-Session-Id")
        turn = Turn(req=data, caller=caller, session="", history=[])
        turn.session = session or turn.id
        chat = to_chat(data, history, turn.session)
        turn.history = [m for m in chat.messages if not (data.instructions and m is chat.messages[0])]
        if data.stream:
            upstream = await chat_bridge.stream(gw, request, chat)
            return upstream.response(events_of(turn, store, upstream.chunks, model))
        try:
            reply = await chat_bridge.complete(gw, request, chat)
        except chat_bridge.ClientGone as gone:
            return gone.response
        output, status = output_of(reply)
        response = turn.response(str(reply.get("model") or model), status, output, reply.get("usage"))
        await store.save(turn, response)
        return Response(content=json.dumps(response).encode(), media_type="application/json")

    @get(
        "/v1/responses/{response_id:str}",
        responses=wire.error_responses(401, 404, 503),
    )
    async def retrieve(request: Request[Any, Any, Any], response_id: str) -> dict[str, Any]:
        """A stored response of the caller's tenant."""
        caller = gw.auth.authenticate(request.headers.get("authorization"))
        found = (await store.load(caller.tenant, response_id, "response_id"))["response"]
        assert isinstance(found, dict)
        return found

    @delete(
        "/v1/responses/{response_id:str}",
        status_code=200,
        responses=wire.error_responses(401, 404, 503),
    )
    async def remove(request: Request[Any, Any, Any], response_id: str) -> dict[str, Any]:
        """Deletes a stored response of the caller's tenant."""
        caller = gw.auth.authenticate(request.headers.get("authorization"))
        if not await store.delete(caller.tenant, response_id):
            raise ApiError(404, f"no stored response {response_id!r} for this tenant", param="response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    return [create, retrieve, remove]
