"""Canned gateway answers shaped like the contract (/tmp/prompts/contracts.md), for view and page tests."""

from __future__ import annotations

from typing import Any

# A /v1/stats answer after three requests: one cold turn, then a memory hit and a disk hit.
STATS: dict[str, Any] = {
    "totals": {
        "requests": 3,
        "hits": 2,
        "hit_rate_requests": 2 / 3,
        "prompt_tokens": 300,
        "cached_tokens": 180,
        "hit_rate_tokens": 0.6,
        "prefill_seconds": 1.5,
        "prefill_saved_seconds": 0.9,
        "restore_seconds": 0.25,
        "restore_bytes": 50 * 1024 * 1024,
        "hits_by_tier": {"memory": 1, "disk": 1},
        "completion_tokens": 24,
        "drafted_tokens": 40,
        "accepted_tokens": 30,
    },
    "ttft_ms": {"cold": [400.0], "warm": [80.0, 120.0]},
    "recent": [
        {"ts": 1_700_000_030.0, "session": "s1", "tenant": "t", "engine": "http://e1", "prompt_tokens": 120,
         "cached_tokens": 100, "cache_source": "disk", "ttft_ms": 120.0, "prefill_ms": 20.0,
         "prefill_saved_ms": 500.0, "restore_ms": 90.0, "restored_tokens": 100, "completion_tokens": 8,
         "diverged_at": None},
        {"ts": 1_700_000_020.0, "session": "s1", "tenant": "t", "engine": "http://e1", "prompt_tokens": 100,
         "cached_tokens": 80, "cache_source": "memory", "ttft_ms": 80.0, "prefill_ms": 20.0,
         "prefill_saved_ms": 400.0, "restore_ms": 5.0, "restored_tokens": 80, "completion_tokens": 8,
         "diverged_at": None},
        {"ts": 1_700_000_010.0, "session": "s1", "tenant": "t", "engine": "http://e1", "prompt_tokens": 80,
         "cached_tokens": 0, "cache_source": "none", "ttft_ms": 400.0, "prefill_ms": 390.0,
         "prefill_saved_ms": 0.0, "restore_ms": 0.0, "restored_tokens": 0, "completion_tokens": 8,
         "diverged_at": None},
    ],
    "engines": [{"url": "http://e1", "healthy": True, "running": 0, "waiting": 0}],
    "since": 1_700_000_000.0,
}  # fmt: skip

EMPTY_STATS: dict[str, Any] = {
    "totals": {
        "requests": 0, "hits": 0, "hit_rate_requests": 0.0, "prompt_tokens": 0, "cached_tokens": 0,
        "hit_rate_tokens": 0.0, "prefill_seconds": 0.0, "prefill_saved_seconds": 0.0, "restore_seconds": 0.0,
        "restore_bytes": 0, "hits_by_tier": {"memory": 0, "disk": 0}, "completion_tokens": 0,
        "drafted_tokens": 0, "accepted_tokens": 0,
    },
    "ttft_ms": {"cold": [], "warm": []},
    "recent": [],
    "engines": [{"url": "http://e1", "healthy": True, "running": 0, "waiting": 0}],
    "since": 1_700_000_000.0,
}  # fmt: skip

# /health of a gateway over three engines, one of them down (its load unknown).
HEALTH: dict[str, Any] = {
    "status": "degraded",
    "engines": [
        {"url": "http://e1", "healthy": True, "running": 3, "waiting": 1},
        {"url": "http://e2", "healthy": True, "running": 2, "waiting": 0},
        {"url": "http://e3", "healthy": False, "running": None, "waiting": None},
    ],
    "redis": True,
    "redis_circuit": {"open": False, "trips": 0, "fast_failures": 0, "last_error": None},
}

SESSIONS: list[dict[str, Any]] = [
    {"id": "old", "engine": "http://e1", "key": "k0", "tokens": 40, "updated": 1_700_000_001.0, "turns": 1,
     "hits": 0, "last_ttft_ms": 300.0},
    {"id": "s1", "engine": "http://e1", "key": "k1", "tokens": 128, "updated": 1_700_000_030.0, "turns": 3,
     "hits": 2, "last_ttft_ms": 120.0},
]  # fmt: skip

# /v1/sessions/s1: turn 3 missed against the session's prefix at token 57.
TIMELINE: dict[str, Any] = {
    "session": {"id": "s1", "engine": "http://e1", "tokens": 128, "turns": 3, "hits": 1},
    "timeline": [
        {"ts": 1_700_000_030.0, "session": "s1", "tenant": "t", "engine": "http://e1", "prompt_tokens": 120,
         "cached_tokens": 40, "cache_source": "disk", "ttft_ms": 150.0, "prefill_ms": 60.0,
         "prefill_saved_ms": 200.0, "restore_ms": 30.0, "restored_tokens": 40, "completion_tokens": 8,
         "diverged_at": 57, "diverged_context": {"cached": "…you said blue", "prompt": "…you said green"}},
        {"ts": 1_700_000_010.0, "session": "s1", "tenant": "t", "engine": "http://e1", "prompt_tokens": 80,
         "cached_tokens": 0, "cache_source": "none", "ttft_ms": 400.0, "prefill_ms": 390.0,
         "prefill_saved_ms": 0.0, "restore_ms": 0.0, "restored_tokens": 0, "completion_tokens": 8,
         "diverged_at": None},
    ],
}  # fmt: skip

NS_A = "a" * 64
NS_B = "b" * 64

# /v1/cache as the gateway sends it: each engine's /v1/cache stats (the engine's real shape) and
# the top entries (ranked by hits, so not by size).
CACHE: dict[str, Any] = {
    "engines": [
        {
            "url": "http://e1",
            "healthy": True,
            "namespace": NS_A,
            "total_entries": 3,
            "stats": {
                "engine": {"requests": 3, "restore_bytes": 14000},
                "memory": {"entries": 2, "bytes": 4096, "budget_bytes": 8192, "hits": 1, "misses": 2,
                           "evictions": 0, "refused": 0},
                "disk": {
                    "num_entries": 3, "num_bytes": 3 * 1024 * 1024,
                    "bytes_by_namespace": {NS_A: 2 * 1024 * 1024, NS_B: 1024 * 1024},
                    "saves": 3, "dropped_saves": 0, "refused_saves": 0, "write_errors": 0, "evictions": 4,
                    "hits": 1, "misses": 2, "rejected_by_reason": {"corrupt": 1, "foreign": 2},
                    "bytes_read": 100 * 1024 * 1024, "read_seconds": 0.5, "pending": 0,
                    "budget_bytes": 12 * 1024 * 1024, "min_free_bytes": 0, "path": "/var/cache/keepwarm",
                    "free_bytes": 50 * 1024**3,
                },
            },
            "entries": [],  # filled below
        }
    ],
    "entries": [
        {"key": "k-big", "namespace": NS_A, "tokens": 128, "position": 120, "bytes": 9000, "hits": 3,
         "decayed_hits": 2.5, "last_used": 1_700_000_030.0, "created": 1_700_000_010.0, "engine": "http://e1"},
        {"key": "k-small", "namespace": NS_A, "tokens": 40, "position": 40, "bytes": 100, "hits": 2,
         "decayed_hits": 1.5, "last_used": 1_700_000_001.0, "created": 1_700_000_000.0, "engine": "http://e1"},
        {"key": "k-mid", "namespace": NS_B, "tokens": 80, "position": 80, "bytes": 5000, "hits": 0,
         "decayed_hits": 0.0, "last_used": 1_700_000_020.0, "created": 1_700_000_005.0, "engine": "http://e1"},
    ],
}  # fmt: skip
CACHE["engines"][0]["entries"] = list(CACHE["entries"])

# As the gateway answers: no `keepwarm` object (it strips the engine's).
CHAT_REPLY: dict[str, Any] = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1_700_000_040, "model": "demo",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 50, "completion_tokens": 2, "total_tokens": 52,
              "prompt_tokens_details": {"cached_tokens": 42},
              "timings": {"cache_source": "memory", "restored_tokens": 42, "restore_ms": 2.0,
                          "prefill_tokens": 8, "prefill_ms": 3.0, "decode_ms": 10.0, "ttft_ms": 12.0,
                          "prefill_saved_ms": 40.0, "decode_tokens_per_sec": 200.0}},
}  # fmt: skip
