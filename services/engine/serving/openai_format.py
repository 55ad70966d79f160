"""OpenAI Chat Completions / Completions on the engine: request bodies decoded
into typed wire models (serving/wire.py) and turned into a GenerateRequest, every
field honoured or refused with a 400 naming it; replies shaped into response and
stream-chunk bodies, with tool calls (serving/tool_calls.py) and reasoning
(serving/reasoning.py) parsed out of the model's text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from keepwarm.engine.cache.prefix_cache import SessionHint
from keepwarm.engine.generation.cache_policy import Policy, PolicyError, policy_for_request
from keepwarm.engine.generation.request import (
    Constraint,
    FinishEvent,
    GenerateRequest,
    RequestError,
    TokenEvent,
)
from keepwarm.engine.generation.sampling import SamplingError, SamplingParams
from keepwarm.engine.serving import wire
from keepwarm.engine.serving.reasoning import ReasoningParser
from keepwarm.engine.serving.tool_calls import ParsedToolCall, ToolCallParser

# Request fields whose effect lives in the batched sampler, which does not implement them yet:
# any value but the neutral one is refused (400 naming the field). Remove a name once it is honoured.
SAMPLER_PENDING: frozenset[str] = frozenset()  # every sampler feature is implemented


@dataclass(frozen=True)
class ReplyShape:
    """How the model's text becomes a message: which tool-call convention to parse (None:
    plain text), whether to keep only the first call, whether `<think>` blocks are split out."""

    tool_format: str | None = None
    first_call_only: bool = False
    reasoning: bool = False
    starts_in_reasoning: bool = False


@dataclass(frozen=True)
class ChatCall:
    request: GenerateRequest
    stream: bool
    include_usage: bool
    tools_enabled: bool  # tools given and tool_choice is not "none": parse calls out of the reply
    parallel_tool_calls: bool = True


@dataclass(frozen=True)
class CompletionCall:
    request: GenerateRequest
    stream: bool
    include_usage: bool
    prompt_text: str | None = None  # None: the prompt came as token ids
    extra: dict[str, Any] = field(default_factory=dict)


def _wire(raw: bytes, kind: type[wire.T]) -> wire.T:
    try:
        return wire.decode(raw, kind)
    except wire.WireError as e:
        raise RequestError(str(e), status=e.status, param=e.param) from None


def _refuse_pending(body: Any, names: tuple[str, ...]) -> None:
    neutral: dict[str, Any] = {
        "n": (None, 1),
        "logprobs": (None, False, 0),
        "top_logprobs": (None, 0),
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "repetition_penalty": (None, 1, 1.0),
        "logit_bias": (None,),
    }
    for name in names:
        if name not in neutral:
            continue
        value = getattr(body, name, None)
        if value in neutral[name] or (name == "logit_bias" and value == {}):
            continue
        raise RequestError(
            f"{name} is not supported on /v1/completions; use /v1/chat/completions, "
            f"or remove it or send its default",
            param=name,
        )


def _max_tokens(value: int | None, param: str, limit: int, default: int) -> int:
    n = default if value is None else value
    if not 1 <= n <= limit:
        raise RequestError(f"{param} must be in 1..{limit}, got {n}", param=param)
    return n


def _sampling(body: wire.SamplingFields, max_tokens: int) -> SamplingParams:
    stop = body.stop
    stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            stop=stops,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
    except SamplingError as e:
        raise RequestError(str(e), param=e.param) from e


def _cache_fields(
    body: wire.SamplingFields, default_policy: Policy, trusted: bool
) -> tuple[Policy, str, SessionHint | None]:
    pc = body.prefix_cache
    try:
        policy = policy_for_request(default_policy, pc.scope if pc else None, pc.window if pc else None)
    except PolicyError as e:
        raise RequestError(str(e), param="prefix_cache") from e
    if not trusted:  # cache_salt and session_hint are the gateway's to set, never a client's
        return policy, "", None
    hint = body.session_hint
    return policy, body.cache_salt or "", SessionHint(hint.key, hint.tokens) if hint else None


def _stream_flags(body: wire.SamplingFields) -> tuple[bool, bool]:
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options")
    return body.stream, bool(body.stream_options and body.stream_options.include_usage)


def _message_dict(i: int, m: wire.ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it (transformers' shape)."""
    where = f"messages[{i}]"
    if m.tool_calls is not None and m.role != "assistant":
        raise RequestError(
            f"{where}.tool_calls is only allowed on assistant messages", param=f"{where}.tool_calls"
        )
    if m.tool_call_id is not None and m.role != "tool":
        raise RequestError(
            f"{where}.tool_call_id is only allowed on tool messages", param=f"{where}.tool_call_id"
        )
    if m.annotations:
        raise RequestError(
            f"{where}.annotations are not supported; remove them", param=f"{where}.annotations"
        )
    if m.refusal is not None and m.role != "assistant":
        raise RequestError(f"{where}.refusal is only allowed on assistant messages", param=f"{where}.refusal")
    if isinstance(m.content, list):
        parts = []
        for j, part in enumerate(m.content):
            if not isinstance(part, wire.TextPart):
                raise RequestError(
                    f"{where}.content[{j}] is {type(part).__name__}: only text parts are supported",
                    param=f"{where}.content",
                )
            parts.append(part.text)
        content = "".join(parts)
    else:
        content = m.content if m.content is not None else (m.refusal or "")
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        msg["tool_calls"] = [
            {
                **({"id": c.id} if c.id is not None else {}),
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in m.tool_calls
        ]
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    return msg


def _constraint(body: wire.ChatCompletionRequest, tools: tuple[dict[str, Any], ...]) -> Constraint | None:
    rf = body.response_format
    tc = body.tool_choice
    if tc is not None and tc != "none" and not tools:
        raise RequestError("tool_choice needs a non-empty tools list", param="tool_choice")
    if isinstance(tc, wire.NamedToolChoice) and tc.function.name not in {
        t["function"]["name"] for t in tools
    }:
        raise RequestError(
            f"tool_choice names {tc.function.name!r}, which is not in tools",
            param="tool_choice.function.name",
        )
    tool_constraint = None
    if tc == "required":
        tool_constraint = Constraint("tool_required", tools=tools)
    elif isinstance(tc, wire.NamedToolChoice):
        tool_constraint = Constraint("tool_named", tools=tools, tool_name=tc.function.name)
    format_constraint = None
    if isinstance(rf, wire.JsonObjectFormat):
        format_constraint = Constraint("json_object")
    elif isinstance(rf, wire.JsonSchemaFormat):
        spec = rf.json_schema
        format_constraint = Constraint("json_schema", schema=spec.schema or {}, strict=bool(spec.strict))
    if tool_constraint and format_constraint:
        raise RequestError(
            "response_format and a forced tool_choice cannot both constrain one reply; send one",
            param="response_format",
        )
    chosen = tool_constraint or format_constraint
    if chosen is not None:
        param = "tool_choice" if tool_constraint else "response_format"
        if param in SAMPLER_PENDING:
            instead = (
                "send tool_choice auto or none"
                if tool_constraint
                else "send response_format text or leave it out"
            )
            raise RequestError(
                f"{param} ({chosen.kind}) needs constrained decoding, which this engine does not run yet; {instead}",
                param=param,
            )
    return chosen


def _sampler_fields(body: Any) -> dict[str, Any]:
    return {
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "speculate": body.speculate,
    }


def parse_chat_request(
    raw: bytes | wire.ChatCompletionRequest,
    max_tokens_limit: int,
    default_policy: Policy,
    trusted: bool = True,
) -> ChatCall:
    """`raw`: the body's bytes or the body already decoded. `trusted` is False for bodies that
    came from clients directly: cache_salt and session_hint are only honoured from the gateway."""
    body = raw if isinstance(raw, wire.ChatCompletionRequest) else _wire(raw, wire.ChatCompletionRequest)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        param = "max_completion_tokens"
        if body.max_tokens != body.max_completion_tokens:
            raise RequestError(
                "send max_completion_tokens or max_tokens, not both with different values", param=param
            )
    max_tokens = _max_tokens(
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        "max_tokens",
        max_tokens_limit,
        256,
    )
    if body.top_logprobs and not body.logprobs:
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    stream, include_usage = _stream_flags(body)
    messages = tuple(_message_dict(i, m) for i, m in enumerate(body.messages))
    tools = tuple(
        {"type": "function", "function": {k: v for k, v in _plain(t.function).items() if v is not None}}
        for t in body.tools or ()
    )
    if body.tools is not None and not body.tools:
        raise RequestError("tools must not be empty; leave it out instead", param="tools")
    constraint = _constraint(body, tools)
    policy, salt, hint = _cache_fields(body, default_policy, trusted)
    req = GenerateRequest(
        sampling=_sampling(body, max_tokens),
        messages=messages,
        tools=tools or None,
        policy=policy,
        cache_salt=salt,
        session_hint=hint,
        chat_template_kwargs=dict(body.chat_template_kwargs) if body.chat_template_kwargs else None,
        constraint=constraint,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        logit_bias=tuple((_token_id(k), float(v)) for k, v in (body.logit_bias or {}).items()),
        **_sampler_fields(body),
        n=body.n or 1,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
    )
    return ChatCall(
        request=req,
        stream=stream,
        include_usage=include_usage,
        tools_enabled=bool(tools) and body.tool_choice != "none",
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )


def _token_id(key: str) -> int:
    if not key.isdigit():
        raise RequestError(
            f"logit_bias keys are token ids written as strings, got {key!r}", param="logit_bias"
        )
    return int(key)


def _plain(s: Any) -> dict[str, Any]:
    out = msgspec.to_builtins(s)
    assert isinstance(out, dict)
    return out


def parse_completion_request(
    raw: bytes | wire.CompletionRequest, max_tokens_limit: int, default_policy: Policy, trusted: bool = True
) -> CompletionCall:
    """Legacy completions: `prompt` as text (tokenized by the caller) or token ids; `raw` as
    bytes or already decoded."""
    body = raw if isinstance(raw, wire.CompletionRequest) else _wire(raw, wire.CompletionRequest)
    max_tokens = _max_tokens(body.max_tokens, "max_tokens", max_tokens_limit, 16)  # OpenAI's default
    _refuse_pending(body, ("n", "logprobs"))
    stream, include_usage = _stream_flags(body)
    policy, salt, hint = _cache_fields(body, default_policy, trusted)
    text = body.prompt if isinstance(body.prompt, str) else None
    if text is not None and not text:
        raise RequestError("prompt must not be empty", param="prompt")
    req = GenerateRequest(
        sampling=_sampling(body, max_tokens),
        prompt_tokens=None if text is not None else tuple(body.prompt),  # type: ignore[arg-type]
        policy=policy,
        cache_salt=salt,
        session_hint=hint,
        logit_bias=tuple((_token_id(k), float(v)) for k, v in (body.logit_bias or {}).items()),
        **_sampler_fields(body),
    )
    return CompletionCall(request=req, stream=stream, include_usage=include_usage, prompt_text=text)


# --- replies ---------------------------------------------------------------------------------


class ReplyParser:
    """One per choice: the model's text, fed as it streams, split into reasoning, content and
    tool calls. `feed(text)` / `finish()` return the Delta to send (None when nothing is certain yet)."""

    def __init__(self, shape: ReplyShape) -> None:
        self.shape = shape
        self._reasoning = ReasoningParser(shape.starts_in_reasoning) if shape.reasoning else None
        self._tools = ToolCallParser(shape.tool_format, shape.first_call_only) if shape.tool_format else None
        self.reasoning_text = ""
        self.content_text = ""
        self.calls: list[ParsedToolCall] = []

    def _delta(self, reasoning: str, content: str, calls: list[ParsedToolCall]) -> wire.Delta | None:
        self.reasoning_text += reasoning
        self.content_text += content
        first = len(self.calls)
        self.calls.extend(calls)
        if not (reasoning or content or calls):
            return None
        return wire.Delta(
            reasoning_content=reasoning or wire.UNSET,
            content=content or wire.UNSET,
            tool_calls=[
                wire.ToolCallDelta(
                    index=first + k,
                    id=c.id,
                    type="function",
                    function=wire.ToolCallFunctionDelta(name=c.name, arguments=c.arguments),
                )
                for k, c in enumerate(calls)
            ]
            or wire.UNSET,
        )

    def _split(self, reasoning: str, content: str) -> wire.Delta | None:
        calls: list[ParsedToolCall] = []
        if self._tools is not None and content:
            content, calls = self._tools.feed(content)
        return self._delta(reasoning, content, calls)

    def feed(self, text: str) -> wire.Delta | None:
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text)
        else:
            reasoning, content = "", text
        return self._split(reasoning, content)

    def finish(self) -> wire.Delta | None:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        calls: list[ParsedToolCall] = []
        if self._tools is not None:
            if content:
                content, calls = self._tools.feed(content)
            more, last = self._tools.finish()
            content, calls = content + more, calls + last
        return self._delta(reasoning, content, calls)

    def finish_reason(self, engine_reason: str) -> str:
        # A reply that stopped normally after calling tools finished for the tools (as OpenAI reports it).
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def message(self) -> wire.AssistantMessage:
        return wire.AssistantMessage(
            role="assistant",
            content=self.content_text if (self.content_text or not self.calls) else None,
            reasoning_content=self.reasoning_text or wire.UNSET,
            tool_calls=[
                wire.ToolCallOut(id=c.id, function=wire.ToolCallFunction(name=c.name, arguments=c.arguments))
                for c in self.calls
            ]
            or wire.UNSET,
        )


def usage(ev: FinishEvent) -> wire.Usage:
    return wire.Usage(
        prompt_tokens=ev.prompt_tokens,
        completion_tokens=ev.completion_tokens,
        total_tokens=ev.prompt_tokens + ev.completion_tokens,
        prompt_tokens_details=wire.PromptTokensDetails(cached_tokens=ev.cached_tokens),
        timings=ev.timings.rounded(),
    )


def keepwarm_info(ev: FinishEvent, namespace: str) -> wire.KeepwarmInfo:
    return wire.KeepwarmInfo(prefix_key=ev.prefix_key, prefix_tokens=ev.prefix_tokens, namespace=namespace)


class LogprobWriter:
    """TokenEvents' log probabilities in OpenAI's shape (token text and its UTF-8 bytes)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def entry(self, ev: TokenEvent) -> wire.TokenLogprob:
        assert ev.logprob is not None
        text = self._text(ev.token_id)
        return wire.TokenLogprob(
            token=text,
            logprob=ev.logprob,
            bytes=list(text.encode()),
            top_logprobs=[
                wire.TopLogprob(token=(t := self._text(i)), logprob=lp, bytes=list(t.encode()))
                for i, lp in ev.top_logprobs
            ],
        )


def total_usage(finishes: list[FinishEvent]) -> wire.Usage:
    """Usage of a request: the prompt once, every choice's completion tokens."""
    first = min(finishes, key=lambda f: f.index)
    completion = sum(f.completion_tokens for f in finishes)
    return wire.Usage(
        prompt_tokens=first.prompt_tokens,
        completion_tokens=completion,
        total_tokens=first.prompt_tokens + completion,
        prompt_tokens_details=wire.PromptTokensDetails(cached_tokens=first.cached_tokens),
        timings=first.timings.rounded(),
    )


def completion_body(
    rid: str,
    model: str,
    ev: FinishEvent | list[FinishEvent],
    namespace: str,
    shape: ReplyShape | None = None,
    tokens: dict[int, list[TokenEvent]] | None = None,
    logprobs: LogprobWriter | None = None,
) -> bytes:
    """The non-streaming chat completion for finished replies (one per choice); `tokens`
    with `logprobs`: each choice's token events, for its `logprobs`."""
    finishes = sorted(ev if isinstance(ev, list) else [ev], key=lambda f: f.index)
    choices = []
    for fin in finishes:
        parser = ReplyParser(shape or ReplyShape())
        parser.feed(fin.text)
        parser.finish()
        lps = None
        if logprobs is not None and tokens is not None:
            lps = wire.ChoiceLogprobs(
                content=[logprobs.entry(t) for t in tokens.get(fin.index, []) if t.logprob is not None]
            )
        choices.append(
            wire.Choice(
                index=fin.index,
                message=parser.message(),
                finish_reason=parser.finish_reason(fin.finish_reason),
                logprobs=lps,
                stop_reason=wire.UNSET if fin.stop is None else fin.stop,
            )
        )
    first = finishes[0]
    body = wire.ChatCompletion(
        id=rid,
        created=int(time.time()),
        model=model,
        choices=choices,
        usage=total_usage(finishes),
        keepwarm=keepwarm_info(first, namespace),
    )
    return wire.encode(body)


class ChunkWriter:
    """The SSE chunks of one streamed chat completion, in OpenAI's order: a role chunk per
    choice, content / reasoning / tool-call deltas, each choice's finish chunk, then — only
    when the client asked with stream_options.include_usage — one chunk with `choices: []`
    and the usage of all choices."""

    def __init__(
        self,
        rid: str,
        model: str,
        shape: ReplyShape,
        include_usage: bool,
        num_choices: int = 1,
        logprobs: LogprobWriter | None = None,
    ) -> None:
        self.rid = rid
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.parsers = [ReplyParser(shape) for _ in range(num_choices)]
        self.parser = self.parsers[0]
        self.logprobs = logprobs
        self.finishes: list[FinishEvent] = []
        self.pending: dict[int, list[wire.TokenLogprob]] = {}  # logprobs of text not sent yet

    def _chunk(
        self, delta: wire.Delta, finish: str | None = None, index: int = 0, stop: str | None = None
    ) -> bytes:
        lps = self.pending.pop(index, None)
        return wire.encode(
            wire.ChatCompletionChunk(
                id=self.rid,
                created=self.created,
                model=self.model,
                choices=[
                    wire.ChunkChoice(
                        index=index,
                        delta=delta,
                        finish_reason=finish,
                        logprobs=wire.ChoiceLogprobs(content=lps) if lps else None,
                        stop_reason=wire.UNSET if stop is None else stop,
                    )
                ],
            )
        )

    def start(self) -> bytes:
        """The role chunk of choice 0."""
        return self._chunk(wire.Delta(role="assistant", content=""))

    def starts(self) -> list[bytes]:
        """The role chunk of every choice."""
        return [
            self._chunk(wire.Delta(role="assistant", content=""), index=i) for i in range(len(self.parsers))
        ]

    def token(self, ev: TokenEvent) -> bytes | None:
        if self.logprobs is not None and ev.logprob is not None:
            self.pending.setdefault(ev.index, []).append(self.logprobs.entry(ev))
        if not ev.text:
            return None
        delta = self.parsers[ev.index].feed(ev.text)
        return self._chunk(delta, index=ev.index) if delta is not None else None

    def text(self, text: str) -> bytes | None:
        delta = self.parser.feed(text)
        return self._chunk(delta) if delta is not None else None

    def finish(self, ev: FinishEvent, namespace: str) -> list[bytes]:
        """The chunks that end choice `ev.index`; after the last choice, the usage chunk."""
        out = []
        parser = self.parsers[ev.index]
        delta = parser.finish()
        if delta is not None:
            out.append(self._chunk(delta, index=ev.index))
        out.append(
            self._chunk(wire.Delta(), parser.finish_reason(ev.finish_reason), index=ev.index, stop=ev.stop)
        )
        self.finishes.append(ev)
        if self.include_usage and len(self.finishes) == len(self.parsers):
            first = min(self.finishes, key=lambda f: f.index)
            out.append(
                wire.encode(
                    wire.ChatCompletionChunk(
                        id=self.rid,
                        created=self.created,
                        model=self.model,
                        choices=[],
                        usage=total_usage(self.finishes),
                        keepwarm=keepwarm_info(first, namespace),
                    )
                )
            )
        return out

    @property
    def done(self) -> bool:
        return len(self.finishes) == len(self.parsers)


def text_completion_body(rid: str, model: str, ev: FinishEvent, namespace: str) -> bytes:
    return wire.encode(
        wire.Completion(
            id=rid,
            created=int(time.time()),
            model=model,
            choices=[wire.CompletionChoice(index=0, text=ev.text, finish_reason=ev.finish_reason)],
            usage=usage(ev),
            keepwarm=keepwarm_info(ev, namespace),
        )
    )


def text_completion_chunk(
    rid: str, model: str, created: int, text: str, finish: str | None, ev: FinishEvent | None = None,
    namespace: str = "", include_usage: bool = False,
) -> bytes:  # fmt: skip
    """A streamed completions chunk; with `ev`, the usage chunk (choices: [])."""
    choices = [] if ev is not None else [wire.CompletionChoice(index=0, text=text, finish_reason=finish)]
    return wire.encode(
        wire.Completion(
            id=rid,
            created=created,
            model=model,
            choices=choices,
            usage=usage(ev) if ev is not None else wire.UNSET,
            keepwarm=keepwarm_info(ev, namespace) if ev is not None else wire.UNSET,
        )
    )
