"""The engine's OpenAI wire format as typed msgspec Structs: request bodies
(chat completions, completions, tokenize, detokenize) and response bodies.

Decoding a body with `decode(raw, Type)` validates it in one pass; a failure
raises `WireError` whose `param` is the field's path (`messages[0].role`) and
whose message says what to send instead. Unknown fields are refused, never
ignored: fields the OpenAI API defines that keepwarm does not implement get a
message saying so (`UNSUPPORTED`), anything else is an unknown field.

Fields that are typed and validated here but whose effect lives in the sampler
(penalties, logit_bias, logprobs, n > 1, constrained decoding) are refused by the
request parser (openai_format) until the sampler implements them.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from litestar.dto import AbstractDTO
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import Reference, Schema
from litestar.plugins import OpenAPISchemaPlugin
from litestar.typing import FieldDefinition
from msgspec import UNSET, Meta, Struct, UnsetType

from keepwarm.engine.generation.field_ranges import (
    COMPLETION_LOGPROBS,
    LOGIT_BIAS,
    MAX_STOP,
    PREFIX_CACHE_RANGES,
    RANGES,
    TOKEN_ID,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_BODY_BYTES = 32 * 1024 * 1024  # the engine's one request-body limit (a 413 beyond)

# OpenAI request fields keepwarm does not implement: a 400 says so instead of "unknown field".
UNSUPPORTED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' field is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' field is not supported; send 'tool_choice'",
    "store": "stored completions are not supported",
    "metadata": "metadata is only stored with 'store', which is not supported",
    "service_tier": "service tiers are not supported",
    "reasoning_effort": "reasoning_effort is not supported; send chat_template_kwargs (e.g. enable_thinking)",
    "verbosity": "verbosity is not supported",
    "prompt_cache_key": "prompt_cache_key is not supported; the prefix cache keys on the prompt itself",
    "safety_identifier": "safety_identifier is not supported",
    "best_of": "best_of is not supported",
    "echo": "echo is not supported",
    "suffix": "suffix (insertion) is not supported",
}

# Allowed values of enum-like fields, by path with list indices written [*] (for error messages).
_CHOICES = {
    "messages[*].role": ROLES,
    "tool_choice": ("none", "auto", "required", "{type: function, function: {name}}"),
    "response_format.type": ("text", "json_object", "json_schema"),
    "messages[*].content[*].type": ("text",),
}

Name = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
TokenId = Annotated[int, Meta(**TOKEN_ID.bounds())]
NonNegInt = TokenId


def within(name: str) -> Meta:
    """The msgspec constraint of the field `name` (field_ranges.RANGES); the gateway's other APIs
    use it for the fields they share with chat completions."""
    return Meta(**RANGES[name].bounds())


class WireError(ValueError):
    """A body that does not fit its wire model; `param` is the offending field's path."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


# --- chat completions request --------------------------------------------------------------


class TextPart(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ImagePart(Struct, tag_field="type", tag="image_url"):
    image_url: Any = None


class AudioPart(Struct, tag_field="type", tag="input_audio"):
    input_audio: Any = None


class FilePart(Struct, tag_field="type", tag="file"):
    file: Any = None


class RefusalPart(Struct, tag_field="type", tag="refusal"):
    refusal: str = ""


ContentPart = TextPart | ImagePart | AudioPart | FilePart | RefusalPart


class FunctionCall(Struct, forbid_unknown_fields=True):
    name: str
    # OpenAI sends a JSON string; templates also take an object (transformers passes either through).
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Struct, forbid_unknown_fields=True):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(Struct, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # DeepSeek / llama.cpp name
    reasoning: str | None = None  # vLLM's newer name
    refusal: str | None = None
    # Response-only fields an SDK echoes back when a reply is appended to the history.
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


class FunctionDef(Struct, forbid_unknown_fields=True):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: Name


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    function: NamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(Struct, forbid_unknown_fields=True):
    name: Name
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class PrefixCacheOptions(Struct, forbid_unknown_fields=True):
    """keepwarm extension: the prefix-cache policy for this request
    (docs/architecture.md, 'Cache policies')."""

    scope: str | int | None = None
    window: Annotated[int, Meta(**PREFIX_CACHE_RANGES["window"].bounds())] | None = None


class SessionHintBody(Struct, forbid_unknown_fields=True):
    """keepwarm extension, set by the gateway only: the session's last prefix key."""

    key: str
    tokens: NonNegInt


StopList = Annotated[list[str], Meta(max_length=MAX_STOP)]
Stop = str | StopList | None


class SamplingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields chat completions and completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, within("max_tokens")] | None = None
    temperature: Annotated[float, within("temperature")] | None = None
    top_p: Annotated[float, within("top_p")] | None = None
    top_k: Annotated[int, within("top_k")] | None = None  # extension
    n: Annotated[int, within("n")] | None = None
    seed: Annotated[int, within("seed")] | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension
    presence_penalty: Annotated[float, within("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, within("frequency_penalty")] | None = None
    repetition_penalty: Annotated[float, within("repetition_penalty")] | None = None  # extension (vLLM)
    logit_bias: dict[str, Annotated[float, Meta(**LOGIT_BIAS.bounds())]] | None = None
    user: str | None = None
    # keepwarm extensions (docs/architecture.md, 'Wire extensions'); cache_salt and session_hint
    # are honoured from the gateway only
    prefix_cache: PrefixCacheOptions | None = None
    cache_salt: str | None = None
    session_hint: SessionHintBody | None = None
    speculate: bool | None = None  # false: no speculative decoding for this request (same reply)


class ChatCompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, within("max_completion_tokens")] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, within("top_logprobs")] | None = None
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM / llama.cpp)


class CompletionRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """Legacy completions: a raw prompt, text or token ids, no chat template."""

    prompt: str | Annotated[list[TokenId], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(**COMPLETION_LOGPROBS.bounds())] | None = None


# --- tokenize / detokenize ------------------------------------------------------------------


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Either `prompt` (raw text) or `messages` (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    add_special_tokens: bool | None = None  # prompt: default true; messages: the template adds them
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(Struct):
    prompt: str


# --- models ---------------------------------------------------------------------------------


class ModelCard(Struct):
    """One served model (GET /v1/models): OpenAI's fields plus the longest context it takes."""

    id: str
    created: int  # unix time the checkpoint was written (its config.json)
    owned_by: str
    max_model_len: int
    object: str = "model"
    family: str | UnsetType = UNSET  # engine only: the backend family that serves it
    residency: str | UnsetType = UNSET  # engine only: "loaded" (weights in memory) or "parked"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorDetail(Struct):
    message: str  # what to change
    type: str
    param: str | None  # the offending field's path, when one field is at fault
    code: int  # the HTTP status


class ErrorBody(Struct):
    """Every error either service answers with, its own or passed through."""

    error: ErrorDetail


# OpenAI-style `type` per HTTP status, for both services; any other status is "api_error".
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "api_error",
    503: "service_unavailable",
}


def error_body(message: str, status: int, param: str | None = None, type_: str | None = None) -> ErrorBody:
    """The one error envelope: `type` from ERROR_TYPES unless given (an engine's, passed on)."""
    kind = type_ or ERROR_TYPES.get(status, "api_error")
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=status))


_ERROR_WHEN = {
    400: "the body or a field is invalid; `param` names the field",
    401: "missing or wrong credentials",
    403: "not allowed for this caller",
    404: "no such model (the message lists the served ones) or route",
    413: "the body is too large",
    429: "queue full or rate limit reached; see Retry-After",
    503: "no engine can serve now; see Retry-After",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI response specs for the error statuses a handler answers with (all one shape)."""
    return {s: ResponseSpec(data_container=ErrorBody, description=_ERROR_WHEN[s]) for s in statuses}


# One name every keepwarm service accepts for "the model served here" when exactly one is served,
# so clients written before the served name is known (README, dashboard) need no configuration.
DEFAULT_MODEL = "default"


# --- responses ------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int


class Timings(Struct, frozen=True):
    """keepwarm's `usage.timings`, declared once: the engine fills it (generation/request.py's
    FinishEvent), the wire carries it `rounded()`, the gateway decodes it. Where the prompt's
    state came from and what each phase took, in milliseconds."""

    cache_source: str = "none"  # memory | disk | none
    restored_tokens: int = 0
    restore_ms: float = 0.0
    restore_bytes: int = 0
    prefill_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    ttft_ms: float = 0.0
    prefill_saved_ms: float = 0.0
    decode_tokens_per_sec: float = 0.0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified for this reply ...
    accepted_tokens: int = 0  # ... and kept (the reply is the same either way)
    diverged_at: int | UnsetType = UNSET  # where a restored prefix stopped matching the prompt

    def rounded(self) -> Timings:
        """The milliseconds and rates to 0.01, as sent."""
        floats = {f: round(v, 2) for f in self.__struct_fields__ if isinstance(v := getattr(self, f), float)}
        return msgspec.structs.replace(self, **floats)


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    timings: Timings  # keepwarm: cache source, restore / prefill / decode times


class KeepwarmInfo(Struct):
    """Engine-internal: the gateway reads and strips it (the clients' replies never carry it)."""

    prefix_key: str | None
    prefix_tokens: int
    namespace: str


class ToolCallFunction(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: ToolCallFunction
    type: str = "function"


class AssistantMessage(Struct):
    role: str
    content: str | None
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallOut] | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    """`logprobs` of a choice: one entry per generated token (log-softmax of the model's
    float32 logits, before penalties, bias or grammar masks)."""

    content: list[TokenLogprob]


class Choice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    # as vLLM's: the stop string (of the request's `stop`) that ended the reply; absent otherwise
    stop_reason: str | UnsetType = UNSET


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    keepwarm: KeepwarmInfo | UnsetType = UNSET  # the engine's; the gateway strips it
    object: str = "chat.completion"


class ToolCallFunctionDelta(Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ToolCallDelta(Struct):
    index: int
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET
    function: ToolCallFunctionDelta | UnsetType = UNSET


class Delta(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[ToolCallDelta] | UnsetType = UNSET


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: str | UnsetType = UNSET  # on the finishing chunk, as Choice.stop_reason


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    # only on the include_usage chunk; absent elsewhere (OpenAI sends null there when asked; SDKs read both
    # the same, and the gateway, which always asks, can pass chunks through untouched)
    usage: Usage | None | UnsetType = UNSET
    keepwarm: KeepwarmInfo | UnsetType = UNSET


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | UnsetType = UNSET  # as in ChatCompletionChunk
    keepwarm: KeepwarmInfo | UnsetType = UNSET


# --- decoding -------------------------------------------------------------------------------

T = TypeVar("T")
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"Object contains unknown field `(?P<name>[^`]+)`")
_EXPECTED = re.compile(r"Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`")
_KINDS = {
    "int": "an integer",
    "float": "a number",
    "number": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "a list",
    "object": "an object",
    "null": "null",
}


def _param(path: str) -> str:
    return path.lstrip(".")


def _describe_kinds(want: str) -> str:
    return " or ".join(_KINDS.get(k.strip(), k.strip()) for k in want.split("|"))


def decode(raw: bytes, kind: type[T]) -> T:
    """The body as a `kind`; raises WireError naming the field on any mismatch."""
    dec = _DECODERS.get(kind)
    if dec is None:
        dec = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        return dec.decode(raw)  # type: ignore[no-any-return]
    except msgspec.ValidationError as e:
        raise _wire_error(str(e)) from None
    except msgspec.DecodeError as e:
        raise WireError(f"the request body is not valid JSON ({e})") from None


def convert(obj: Any, kind: type[T]) -> T:
    """An already parsed body (plain JSON objects) as a `kind`: the checks and errors of `decode`,
    without parsing the bytes again."""
    try:
        return msgspec.convert(obj, kind)
    except msgspec.ValidationError as e:
        raise _wire_error(str(e)) from None


def _wire_error(text: str) -> WireError:
    m = _AT.match(text)
    assert m is not None  # the pattern matches any string
    msg, path = m.group("msg"), _param(m.group("path") or "")
    unknown = _UNKNOWN.search(msg)
    if unknown:
        name = unknown.group("name")
        field = f"{path}.{name}" if path else name
        why = UNSUPPORTED.get(name) if not path else None
        if why:
            return WireError(f"{field}: {why}; remove it", param=field)
        return WireError(f"unknown field {field!r}: keepwarm does not accept it; remove it", param=field)
    if msg.startswith("Object missing required field"):
        name = msg.rsplit("`", 2)[-2] if "`" in msg else ""
        field = f"{path}.{name}" if path and name else (name or path)
        return WireError(f"{field} is required", param=field or None)
    where = path or "the request body"
    generic = re.sub(r"\[\d+\]", "[*]", path)
    expected = _EXPECTED.search(msg)
    if expected:
        if not path:
            return WireError("the request body must be a JSON object", param=None)
        got = expected.group("got")
        return WireError(
            f"{where} must be {_describe_kinds(expected.group('want'))}, got {_KINDS.get(got, got)}",
            param=path,
        )
    if msg.startswith("Invalid enum value") or msg.startswith("Invalid value"):
        value = msg.split(" ", 3)[-1]
        allowed = _CHOICES.get(generic) or _CHOICES.get(re.sub(r"\.type$", "", generic))
        tail = f"; one of {', '.join(allowed)}" if allowed else ""
        if generic.endswith(".type") and generic[:-5] in _CHOICES:
            path = path[:-5]
        return WireError(f"{where}: {value} is not accepted{tail}", param=path or None)
    if msg.startswith("Expected"):
        # range / length constraints: "Expected `int` >= 1", "Expected `array` of length >= 1", ...
        words = msg.replace("Expected ", "", 1)
        words = re.sub(r"`(\w+)`", lambda k: _KINDS.get(k.group(1), k.group(1)), words)
        words = words.replace("a list of length >= 1", "a non-empty list")
        return WireError(f"{where} must be {words}", param=path or None)
    return WireError(f"{where}: {msg}", param=path or None)


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


# --- litestar: typed bodies, documented ------------------------------------------------------


class WireBody(AbstractDTO[T], Generic[T]):
    """A handler's `data` decoded by `decode` above (strict types, a WireError naming the field)
    instead of litestar's lenient conversion, and documented in the OpenAPI schema as its Struct.
    Use as `dto=WireBody[ChatCompletionRequest]` with `data: ChatCompletionRequest | None = None`
    (None: the body was empty). Subclasses may check the raw bytes first (`decode_bytes`)."""

    @classmethod
    def generate_field_definitions(cls, model_type: type[Any]) -> Generator[Any, None, None]:
        yield from ()

    @classmethod
    def detect_nested_field(cls, field_definition: FieldDefinition) -> bool:
        return False

    @classmethod
    def create_for_field_definition(cls, field_definition: FieldDefinition, handler_id: str,
                                    backend_cls: Any = None) -> None:  # fmt: skip
        return None  # no transfer model: decode_bytes below is the whole decoder

    @classmethod
    def create_openapi_schema(
        cls, field_definition: FieldDefinition, handler_id: str, schema_creator: Any
    ) -> Reference | Schema:
        schema: Reference | Schema = schema_creator.for_field_definition(
            FieldDefinition.from_annotation(cls.model_type)
        )
        return schema

    def decode_bytes(self, value: bytes) -> Any:
        return decode(value, self.model_type)

    def decode_builtins(self, value: dict[str, Any]) -> Any:
        return msgspec.convert(value, self.model_type)


class ClosedStructSchema(OpenAPISchemaPlugin):
    """Documents `forbid_unknown_fields` Structs as `additionalProperties: false` (litestar's own
    Struct schemas leave every object open), so a schema-driven client sends only known fields.
    Register with `Litestar(plugins=[ClosedStructSchema()])`."""

    def is_plugin_supported_field(self, field_definition: FieldDefinition) -> bool:
        return (
            not field_definition.is_union
            and field_definition.is_subclass_of(Struct)
            and bool(getattr(field_definition.type_, "__struct_config__", None))
            and field_definition.type_.__struct_config__.forbid_unknown_fields
        )

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: Any) -> Schema:
        from litestar._openapi.schema_generation.plugins import StructSchemaPlugin

        schema: Schema = StructSchemaPlugin().to_openapi_schema(field_definition, schema_creator)
        schema.additional_properties = False
        return schema
