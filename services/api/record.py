"""One finished request as the gateway remembers it: the row of /v1/stats
`recent` and of a session's timeline, built from the engine's `usage`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from keepwarm.engine.serving import wire


def _num(d: Mapping[str, Any], key: str, kind: type = float) -> Any:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return kind(0)
    return kind(v)


@dataclass(frozen=True)
class RequestRecord:
    ts: float
    session: str | None
    tenant: str
    engine: str
    prompt_tokens: int
    cached_tokens: int
    cache_source: str  # memory | disk | none
    ttft_ms: float
    prefill_ms: float
    prefill_saved_ms: float
    restore_ms: float
    restored_tokens: int
    completion_tokens: int
    diverged_at: int | None
    restore_bytes: int = 0  # counted when the engine reports timings.restore_bytes
    drafted_tokens: int = 0  # speculative decoding (timings.drafted_tokens / accepted_tokens)
    accepted_tokens: int = 0

    @property
    def hit(self) -> bool:
        return self.cached_tokens > 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def encoded(self) -> str:
        """The record as the JSON text Redis keeps (a session's timeline, the stats' recent list)."""
        return json.dumps(self.as_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestRecord:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def from_usage(
        cls,
        usage: wire.Usage | Mapping[str, Any],
        *,
        ts: float,
        session: str | None,
        tenant: str,
        engine: str,
    ) -> RequestRecord:
        """From an engine `usage` (the typed wire.Usage the gateway decoded, or its plain form);
        missing or mistyped numbers read as 0, a missing cache_source as "none" (the engine is
        trusted, not required)."""
        if isinstance(usage, wire.Usage):
            usage = msgspec.to_builtins(usage)
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, Mapping) else {}
        t = usage.get("timings")
        t = t if isinstance(t, Mapping) else {}
        source = t.get("cache_source")
        diverged = t.get("diverged_at")
        return cls(
            ts=ts,
            session=session,
            tenant=tenant,
            engine=engine,
            prompt_tokens=_num(usage, "prompt_tokens", int),
            cached_tokens=_num(details, "cached_tokens", int),
            cache_source=source if source in ("memory", "disk", "none") else "none",
            ttft_ms=_num(t, "ttft_ms"),
            prefill_ms=_num(t, "prefill_ms"),
            prefill_saved_ms=_num(t, "prefill_saved_ms"),
            restore_ms=_num(t, "restore_ms"),
            restored_tokens=_num(t, "restored_tokens", int),
            completion_tokens=_num(usage, "completion_tokens", int),
            diverged_at=int(diverged)
            if isinstance(diverged, int) and not isinstance(diverged, bool)
            else None,
            restore_bytes=_num(t, "restore_bytes", int),
            drafted_tokens=_num(t, "drafted_tokens", int),
            accepted_tokens=_num(t, "accepted_tokens", int),
        )
