"""What goes into the engine and what comes out of it, independent of HTTP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keepwarm.engine.cache.prefix_cache import SessionHint
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.field_ranges import LOGIT_BIAS, RANGES, TOKEN_ID
from keepwarm.engine.generation.sampling import SamplingParams
from keepwarm.engine.serving.wire import Timings


class RequestError(ValueError):
    """Bad input; `status` is the HTTP status it maps to, the message says what to change."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """What constrained decoding must make the reply (built into a token matcher by
    generation/grammar.py): `json_object`, `json_schema` (`schema`, `strict`), or a tool
    call: `tool_required` (any of `tools`) / `tool_named` (`tool_name`)."""

    kind: str
    schema: dict[str, Any] | None = None
    strict: bool = False
    tools: tuple[dict[str, Any], ...] = ()
    tool_name: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "tool_required", "tool_named"):
            raise RequestError(f"unknown constraint kind {self.kind!r}", param="response_format")
        if self.kind == "json_schema" and not isinstance(self.schema, dict):
            raise RequestError(
                "response_format.json_schema.schema must be an object", param="response_format"
            )
        if self.kind in ("tool_required", "tool_named") and not self.tools:
            raise RequestError("tool_choice needs tools", param="tool_choice")
        if self.kind == "tool_named" and self.tool_name not in {t["function"]["name"] for t in self.tools}:
            raise RequestError(
                f"tool_choice names {self.tool_name!r}, which is not in tools", param="tool_choice"
            )


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of `messages` (chat, rendered by the model's template) or
    `prompt_tokens` (raw ids) is set.

    Fields from `n` down are sampler features: parsed and validated, but the request
    parser refuses values other than their defaults until the sampler implements them."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    prompt_tokens: tuple[int, ...] | None = None
    policy: Policy | None = None  # None: the server's default policy
    cache_salt: str = ""
    session_hint: SessionHint | None = None
    request_id: str = ""
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)
    n: int = 1  # choices sampled from one prefill
    logprobs: bool = False
    top_logprobs: int = 0  # 0..20, with logprobs
    presence_penalty: float = 0.0  # -2..2
    frequency_penalty: float = 0.0  # -2..2
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100)
    constraint: Constraint | None = None
    parallel_tool_calls: bool = True  # a tool_choice constraint may emit several calls
    speculate: bool | None = None  # speculative decoding: None the engine's --speculate, False off

    def __post_init__(self) -> None:
        for name in ("n", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            wrong = RANGES[name].refusal(name, getattr(self, name))
            if wrong is not None:
                raise RequestError(wrong, param=name)
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        for token, bias in self.logit_bias:
            if not TOKEN_ID.holds(token) or not LOGIT_BIAS.holds(bias):
                raise RequestError(
                    f"logit_bias maps token ids >= 0 to biases in {LOGIT_BIAS.interval()}, got {token}: {bias}",
                    param="logit_bias",
                )


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # newly completed text (may be empty while a UTF-8 character or stop string is pending)
    index: int = 0  # the choice (n > 1)
    logprob: float | None = None  # with `logprobs`: log p(token_id)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # with `top_logprobs`: (token id, log p), best first


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str  # stop | length | cancelled
    text: str  # the whole completion text
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: Timings
    prefix_key: str | None = None  # deepest key this request leaves for the session (continued checkpoint)
    prefix_tokens: int = 0
    index: int = 0  # the choice (n > 1); usage counts every choice's tokens on its own event
    stop: str | None = None  # the stop string that ended the reply (finish_reason "stop")
