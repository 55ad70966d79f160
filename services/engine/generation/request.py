"""What goes into the engine and what comes out of it, independent of HTTP."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from keepwarm.engine.cache.policy import Policy
from keepwarm.engine.cache.prefix_cache import SessionHint
from keepwarm.engine.generation.sampling import SamplingParams


class RequestError(ValueError):
    """Bad input; `status` is the HTTP status it maps to, the message says what to change."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class GenerateRequest:
    """Exactly one of `messages` (chat, rendered by the model's template) or
    `prompt_tokens` (raw ids) is set."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    messages: tuple[dict[str, Any], ...] | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    prompt_tokens: tuple[int, ...] | None = None
    policy: Policy | None = None  # None: the server's default policy
    cache_salt: str = ""
    session_hint: SessionHint | None = None
    request_id: str = ""


@dataclass(frozen=True)
class Timings:
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
    diverged_at: int | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 2)
        if d["diverged_at"] is None:
            del d["diverged_at"]
        return d


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # newly completed text (may be empty while a UTF-8 character or stop string is pending)


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
