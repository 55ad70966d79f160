"""Numbers the dashboard shows, computed from the gateway's JSON: pure functions, no Streamlit.

Input shapes are the gateway's contract (/health, /v1/stats, /v1/sessions, /v1/sessions/{id},
/v1/cache). Missing fields read as zero/empty so a fresh stack with no traffic
renders as "no data yet" rather than failing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CACHE_SOURCES_WARM = ("memory", "disk")


# ---------------------------------------------------------------- formatting


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "–"
    step = 1024.0
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < step or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= step
    raise AssertionError("unreachable")


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if abs(s) < 1.0:
        return f"{s * 1000:.1f} ms"
    if abs(s) < 120.0:
        return f"{s:.2f} s"
    if abs(s) < 7200.0:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def fmt_pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


# ---------------------------------------------------------------- overview


@dataclass(frozen=True)
class Overview:
    requests: int
    hits: int
    hit_rate_requests: float | None  # None until the first request
    prompt_tokens: int
    cached_tokens: int  # tokens reused (not prefilled) over all requests
    hit_rate_tokens: float | None
    prefill_seconds: float  # prefill actually done
    prefill_saved_seconds: float
    saved_per_hour: float | None  # prefill_saved_seconds per hour since `since`; None with no uptime
    restore_seconds: float
    restore_bytes: int
    restore_bandwidth: float | None  # bytes/s; None before any timed restore
    hits_by_tier: dict[str, int]
    completion_tokens: int
    uptime_seconds: float | None
    engines_total: int
    engines_healthy: int
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified ...
    accepted_tokens: int = 0  # ... and kept

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens; None before any draft."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None


def overview(stats: Mapping[str, Any], now: float) -> Overview:
    """`now` is unix time (the caller passes time.time()) so per-hour figures are testable."""
    t = stats.get("totals") or {}
    requests = int(t.get("requests", 0))
    hits = int(t.get("hits", 0))
    prompt_tokens = int(t.get("prompt_tokens", 0))
    cached_tokens = int(t.get("cached_tokens", 0))
    saved = float(t.get("prefill_saved_seconds", 0.0))
    restore_s = float(t.get("restore_seconds", 0.0))
    restore_b = int(t.get("restore_bytes", 0))
    since = stats.get("since")
    uptime = max(0.0, now - float(since)) if since else None
    engines = stats.get("engines") or []
    return Overview(
        requests=requests,
        hits=hits,
        hit_rate_requests=_rate(t.get("hit_rate_requests"), hits, requests),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        hit_rate_tokens=_rate(t.get("hit_rate_tokens"), cached_tokens, prompt_tokens),
        prefill_seconds=float(t.get("prefill_seconds", 0.0)),
        prefill_saved_seconds=saved,
        saved_per_hour=saved * 3600.0 / uptime if uptime else None,
        restore_seconds=restore_s,
        restore_bytes=restore_b,
        restore_bandwidth=restore_b / restore_s if restore_s > 0 and restore_b > 0 else None,
        hits_by_tier={str(k): int(v) for k, v in (t.get("hits_by_tier") or {}).items()},
        completion_tokens=int(t.get("completion_tokens", 0)),
        uptime_seconds=uptime,
        engines_total=len(engines),
        engines_healthy=sum(1 for e in engines if e.get("healthy")),
        drafted_tokens=int(t.get("drafted_tokens", 0)),
        accepted_tokens=int(t.get("accepted_tokens", 0)),
    )


@dataclass(frozen=True)
class EngineLoad:
    """One engine's row of the gateway's /health: sequences running and waiting there."""

    url: str
    healthy: bool
    running: int | None  # None while the engine is down (nothing known)
    waiting: int | None


@dataclass(frozen=True)
class Concurrency:
    engines: list[EngineLoad]
    running: int  # over the healthy engines
    waiting: int
    healthy: int


def concurrency(health: Mapping[str, Any]) -> Concurrency:
    """Per-engine and total sequences from the gateway's /health `engines` list (each engine's
    running and waiting sequences as the gateway last polled them)."""
    rows = []
    for e in health.get("engines") or []:
        if not isinstance(e, Mapping):
            continue
        healthy = bool(e.get("healthy"))
        rows.append(
            EngineLoad(
                url=str(e.get("url") or "?"),
                healthy=healthy,
                running=_count(e.get("running")) if healthy else None,
                waiting=_count(e.get("waiting")) if healthy else None,
            )
        )
    return Concurrency(
        engines=rows,
        running=sum(r.running or 0 for r in rows),
        waiting=sum(r.waiting or 0 for r in rows),
        healthy=sum(1 for r in rows if r.healthy),
    )


def _count(v: Any) -> int | None:
    """A sequence count as the gateway sent it; None when absent (an older gateway) or not a count."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _rate(given: Any, num: int, den: int) -> float | None:
    """The gateway's own ratio when it sent one, else num/den; None while den is 0 (no data yet)."""
    if den <= 0:
        return None
    if isinstance(given, (int, float)) and math.isfinite(given):
        return float(given)
    return num / den


def is_warm(record: Mapping[str, Any]) -> bool:
    return record.get("cache_source") in CACHE_SOURCES_WARM


@dataclass(frozen=True)
class TtftPoint:
    ts: float
    ttft_ms: float
    kind: str  # "cold" | "warm"
    session: str


def ttft_over_time(recent: Sequence[Mapping[str, Any]]) -> list[TtftPoint]:
    """Oldest first (the gateway sends newest first)."""
    pts = [
        TtftPoint(
            ts=float(r.get("ts", 0.0)),
            ttft_ms=float(r.get("ttft_ms", 0.0)),
            kind="warm" if is_warm(r) else "cold",
            session=str(r.get("session") or ""),
        )
        for r in recent
    ]
    return sorted(pts, key=lambda p: p.ts)


@dataclass(frozen=True)
class HistBin:
    kind: str
    lo_ms: float
    hi_ms: float
    count: int


def ttft_histogram(ttft: Mapping[str, Sequence[float]], bins: int = 12) -> list[HistBin]:
    """Shared bins over cold and warm TTFTs so the two distributions are comparable.
    Returns bins * kinds rows (zero counts included); [] when there is no value at all."""
    assert bins >= 1
    values = {k: [float(v) for v in ttft.get(k) or []] for k in ("cold", "warm")}
    everything = values["cold"] + values["warm"]
    if not everything:
        return []
    lo, hi = min(everything), max(everything)
    width = (hi - lo) / bins if hi > lo else 1.0
    out: list[HistBin] = []
    for kind, vs in values.items():
        counts = [0] * bins
        for v in vs:
            counts[min(bins - 1, int((v - lo) / width))] += 1
        out += [HistBin(kind, lo + i * width, lo + (i + 1) * width, c) for i, c in enumerate(counts)]
    return out


@dataclass(frozen=True)
class TtftSummary:
    kind: str
    count: int
    p50_ms: float | None
    p95_ms: float | None
    mean_ms: float | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    assert 0.0 <= q <= 1.0
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    i = int(math.floor(pos))
    j = min(i + 1, len(s) - 1)
    return s[i] + (s[j] - s[i]) * (pos - i)


def ttft_summary(ttft: Mapping[str, Sequence[float]]) -> list[TtftSummary]:
    out = []
    for kind in ("cold", "warm"):
        vs = [float(v) for v in ttft.get(kind) or []]
        out.append(
            TtftSummary(
                kind=kind,
                count=len(vs),
                p50_ms=percentile(vs, 0.5),
                p95_ms=percentile(vs, 0.95),
                mean_ms=sum(vs) / len(vs) if vs else None,
            )
        )
    return out


def warm_speedup(summary: Sequence[TtftSummary]) -> float | None:
    """Median cold TTFT / median warm TTFT; None until both exist."""
    by = {s.kind: s for s in summary}
    cold, warm = by["cold"].p50_ms, by["warm"].p50_ms
    if cold is None or warm is None or warm <= 0:
        return None
    return cold / warm


# ---------------------------------------------------------------- sessions


@dataclass(frozen=True)
class SessionRow:
    session: str
    engine: str
    prefix_tokens: int  # the session's last prefix length (the key the gateway hints next turn)
    turns: int
    hits: int
    last_ttft_ms: float | None
    updated: float | None  # unix time


def session_rows(payload: Any) -> list[SessionRow]:
    """Most recently updated first. Accepts a list, `{"sessions": [...]}` or `{id: {...}}`."""
    items: list[tuple[str, Mapping[str, Any]]] = []
    if isinstance(payload, Mapping) and isinstance(payload.get("sessions"), (list, Mapping)):
        payload = payload["sessions"]
    if isinstance(payload, Mapping):
        items = [(str(k), v) for k, v in payload.items() if isinstance(v, Mapping)]
    elif isinstance(payload, list):
        items = [(_session_id(v), v) for v in payload if isinstance(v, Mapping)]
    rows = [
        SessionRow(
            session=sid,
            engine=str(v.get("engine") or ""),
            prefix_tokens=int(v.get("tokens") or v.get("prefix_tokens") or 0),
            turns=int(v.get("turns") or 0),
            hits=int(v.get("hits") or 0),
            last_ttft_ms=_opt_float(v.get("last_ttft_ms")),
            updated=_opt_float(v.get("updated")),
        )
        for sid, v in items
    ]
    return sorted(rows, key=lambda r: -(r.updated or 0.0))


def _session_id(v: Mapping[str, Any]) -> str:
    for k in ("id", "session", "session_id"):
        if v.get(k):
            return str(v[k])
    return ""


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True)
class Divergence:
    """Where a turn's prompt stopped matching the session's last cached prefix."""

    position: int  # token index of the first differing token (tokens [0, position) matched)
    context: dict[str, str]  # text around the position when the gateway sends it ({} otherwise)


@dataclass(frozen=True)
class TimelineTurn:
    turn: int  # 1-based, oldest first
    ts: float
    engine: str
    prompt_tokens: int
    cached_tokens: int
    cache_source: str
    ttft_ms: float
    prefill_ms: float
    restore_ms: float
    prefill_saved_ms: float
    completion_tokens: int
    divergence: Divergence | None


def session_timeline(payload: Any) -> tuple[dict[str, Any], list[TimelineTurn]]:
    """(session info, turns oldest first) from /v1/sessions/{id}: a list of records, or an
    object with the records under "timeline" (or "records"/"recent") and the info beside them."""
    records: list[Mapping[str, Any]] = []
    info: dict[str, Any] = {}
    if isinstance(payload, list):
        records = [r for r in payload if isinstance(r, Mapping)]
    elif isinstance(payload, Mapping):
        for k in ("timeline", "records", "recent"):
            if isinstance(payload.get(k), list):
                records = [r for r in payload[k] if isinstance(r, Mapping)]
                break
        nested = payload.get("session")
        if isinstance(nested, Mapping):
            info = dict(nested)
        else:
            info = {k: v for k, v in payload.items() if not isinstance(v, (list, Mapping))}
    ordered = sorted(records, key=lambda r: float(r.get("ts", 0.0)))
    turns = []
    for i, r in enumerate(ordered, start=1):
        turns.append(
            TimelineTurn(
                turn=i,
                ts=float(r.get("ts", 0.0)),
                engine=str(r.get("engine") or ""),
                prompt_tokens=int(r.get("prompt_tokens", 0)),
                cached_tokens=int(r.get("cached_tokens", 0)),
                cache_source=str(r.get("cache_source") or "none"),
                ttft_ms=float(r.get("ttft_ms", 0.0)),
                prefill_ms=float(r.get("prefill_ms", 0.0)),
                restore_ms=float(r.get("restore_ms", 0.0)),
                prefill_saved_ms=float(r.get("prefill_saved_ms", 0.0)),
                completion_tokens=int(r.get("completion_tokens", 0)),
                divergence=divergence(r),
            )
        )
    return info, turns


def divergence(record: Mapping[str, Any]) -> Divergence | None:
    """None unless the record carries `diverged_at`. Text around the position is read from
    `diverged_context` (a string, or an object of named strings) when the gateway provides it."""
    pos = record.get("diverged_at")
    if pos is None:
        return None
    raw = record.get("diverged_context")
    if isinstance(raw, Mapping):
        context = {str(k): str(v) for k, v in raw.items()}
    elif isinstance(raw, str) and raw:
        context = {"text": raw}
    else:
        context = {}
    return Divergence(position=int(pos), context=context)


# ---------------------------------------------------------------- disk cache


@dataclass(frozen=True)
class CacheEntry:
    key: str
    namespace: str
    tokens: int
    position: int
    bytes: int
    hits: int
    last_used: float | None
    created: float | None
    engine: str


@dataclass(frozen=True)
class EngineCache:
    engine: str  # the engine's URL ("" when the gateway sent one unnamed cache object)
    namespace: str  # the namespace the engine serves
    disk_enabled: bool  # False when the engine reports "disk": null (memory-only)
    entries: int | None
    bytes: int | None
    budget_bytes: int | None
    free_disk_bytes: int | None
    evictions: int | None
    rejected: dict[str, int]  # reason -> files rejected (and deleted) for it
    namespaces: dict[str, tuple[int | None, int]]  # namespace -> (entries when known, bytes)
    read_bandwidth: float | None  # disk bytes read / seconds reading, bytes/s
    memory_entries: int | None
    memory_bytes: int | None
    memory_budget_bytes: int | None
    stats: dict[str, Any]  # every scalar stat, flattened with dotted keys, for the raw table
    error: str  # non-empty when the gateway could not read this engine's cache

    @property
    def used_fraction(self) -> float | None:
        if self.bytes is None or not self.budget_bytes:
            return None
        return self.bytes / self.budget_bytes


@dataclass(frozen=True)
class CacheView:
    engines: list[EngineCache]
    largest: list[CacheEntry]  # biggest first


# Candidate names for each figure, first match wins: the engine's /v1/cache `stats` is
# {"engine": {...}, "memory": {...}|null, "disk": {num_entries, num_bytes, budget_bytes, free_bytes,
# evictions, rejected_by_reason, bytes_by_namespace, bytes_read, read_seconds, ...}|null};
# flat spellings are accepted too.
_ENTRIES = ("disk.num_entries", "disk.entries", "disk_entries", "num_entries", "entries")
_BYTES = ("disk.num_bytes", "disk.bytes", "disk_bytes", "num_bytes", "bytes")
_BUDGET = ("disk.budget_bytes", "disk_budget_bytes", "budget_bytes")
_FREE = ("disk.free_bytes", "disk.free_disk_bytes", "free_disk_bytes", "free_bytes")
_EVICTIONS = ("disk.evictions", "disk_evictions", "evictions")
_REJECTED = ("disk.rejected_by_reason", "disk.rejected", "rejected_by_reason", "rejected")
_NAMESPACES = ("disk.bytes_by_namespace", "disk.namespaces", "bytes_by_namespace", "namespaces")
_READ_BYTES = ("disk.bytes_read", "bytes_read")
_READ_SECONDS = ("disk.read_seconds", "read_seconds")


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"disk": {"bytes": 3}} -> {"disk.bytes": 3}; lists are dropped (they are not figures)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, name + "."))
        elif not isinstance(v, list):
            out[name] = v
    return out


def _pick_num(flat: Mapping[str, Any], names: Sequence[str]) -> float | None:
    for n in names:
        v = flat.get(n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _pick_int(flat: Mapping[str, Any], names: Sequence[str]) -> int | None:
    v = _pick_num(flat, names)
    return None if v is None else int(v)


def _pick_nested(stats: Mapping[str, Any], names: Sequence[str]) -> Any:
    for n in names:
        node: Any = stats
        for part in n.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is not None:
            return node
    return None


def cache_view(payload: Mapping[str, Any], top: int = 20) -> CacheView:
    """Accepts the gateway's `{"engines": [{url, namespace, stats, total_entries, entries, error?}],
    "entries": [...]}` or a single engine's `{namespace, stats, entries}`."""
    raw_engines = payload.get("engines")
    if not isinstance(raw_engines, list):
        raw_engines = [payload] if ("stats" in payload or "namespace" in payload) else []
    engines: list[EngineCache] = []
    entries: list[CacheEntry] = []
    for e in raw_engines:
        if not isinstance(e, Mapping):
            continue
        url = str(e.get("url") or e.get("engine") or "")
        raw_stats = e.get("stats")
        stats: Mapping[str, Any] = raw_stats if isinstance(raw_stats, Mapping) else {}
        own_entries = [_entry(x, url) for x in e.get("entries") or [] if isinstance(x, Mapping)]
        entries += own_entries
        engines.append(_engine_cache(url, str(e.get("namespace") or ""), stats, e, own_entries))
    if isinstance(payload.get("entries"), list) and "engines" in payload:
        entries += [
            _entry(x, str(x.get("engine") or "")) for x in payload["entries"] if isinstance(x, Mapping)
        ]
    # One entry may be listed twice (per engine and in the gateway's top list): keep one per key.
    unique = {en.key: en for en in entries}
    largest = sorted(unique.values(), key=lambda en: (-en.bytes, en.key))[:top]
    return CacheView(engines=engines, largest=largest)


def _engine_cache(
    url: str, namespace: str, stats: Mapping[str, Any], row: Mapping[str, Any], entries: list[CacheEntry]
) -> EngineCache:
    flat = flatten(stats)
    rejected_raw = _pick_nested(stats, _REJECTED)
    if isinstance(rejected_raw, Mapping):
        rejected = {str(k): int(v) for k, v in rejected_raw.items() if isinstance(v, (int, float))}
    elif isinstance(rejected_raw, (int, float)):
        rejected = {"all": int(rejected_raw)}
    else:
        rejected = {}
    namespaces: dict[str, tuple[int | None, int]] = {}
    ns_raw = _pick_nested(stats, _NAMESPACES)
    if isinstance(ns_raw, Mapping):
        for ns, v in ns_raw.items():
            if isinstance(v, Mapping):
                namespaces[str(ns)] = (int(v.get("entries", 0)), int(v.get("bytes", 0)))
            elif isinstance(v, (int, float)):
                namespaces[str(ns)] = (None, int(v))
        if entries and row.get("total_entries") == len(entries):
            # The listing is the whole cache: count each namespace's entries from it.
            for ns, (_, b) in list(namespaces.items()):
                namespaces[ns] = (sum(1 for en in entries if en.namespace == ns), b)
    elif entries:
        counted: dict[str, tuple[int, int]] = {}
        for en in entries:
            n, b = counted.get(en.namespace, (0, 0))
            counted[en.namespace] = (n + 1, b + en.bytes)
        namespaces = dict(counted)
    read_b, read_s = _pick_num(flat, _READ_BYTES), _pick_num(flat, _READ_SECONDS)
    entries_n = _pick_int(flat, _ENTRIES)
    if entries_n is None and isinstance(row.get("total_entries"), int):
        entries_n = int(row["total_entries"])
    return EngineCache(
        engine=url,
        namespace=namespace,
        disk_enabled=not ("disk" in stats and stats["disk"] is None),
        entries=entries_n,
        bytes=_pick_int(flat, _BYTES),
        budget_bytes=_pick_int(flat, _BUDGET),
        free_disk_bytes=_pick_int(flat, _FREE),
        evictions=_pick_int(flat, _EVICTIONS),
        rejected=rejected,
        namespaces=namespaces,
        read_bandwidth=read_b / read_s if read_b and read_s else None,
        memory_entries=_pick_int(flat, ("memory.entries",)),
        memory_bytes=_pick_int(flat, ("memory.bytes",)),
        memory_budget_bytes=_pick_int(flat, ("memory.budget_bytes",)),
        stats=flat,
        error=str(row.get("error") or ""),
    )


def _entry(x: Mapping[str, Any], engine: str) -> CacheEntry:
    return CacheEntry(
        key=str(x.get("key") or ""),
        namespace=str(x.get("namespace") or ""),
        tokens=int(x.get("tokens", 0)),
        position=int(x.get("position", 0)),
        bytes=int(x.get("bytes", 0)),
        hits=int(x.get("hits", 0)),
        last_used=_opt_float(x.get("last_used")),
        created=_opt_float(x.get("created")),
        engine=engine,
    )


# ---------------------------------------------------------------- playground


@dataclass(frozen=True)
class PlaygroundTurn:
    user: str
    reply: str
    cache_source: str
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    prefill_ms: float | None
    restore_ms: float | None
    prefill_saved_ms: float | None
    decode_tokens_per_sec: float | None
    completion_tokens: int
    wall_ms: float


def playground_turn(
    user: str, reply: str, usage: Mapping[str, Any], timings: Mapping[str, Any], wall_ms: float
) -> PlaygroundTurn:
    details = usage.get("prompt_tokens_details") or {}
    return PlaygroundTurn(
        user=user,
        reply=reply,
        cache_source=str(timings.get("cache_source") or "none"),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens", 0)),
        ttft_ms=_opt_float(timings.get("ttft_ms")),
        prefill_ms=_opt_float(timings.get("prefill_ms")),
        restore_ms=_opt_float(timings.get("restore_ms")),
        prefill_saved_ms=_opt_float(timings.get("prefill_saved_ms")),
        decode_tokens_per_sec=_opt_float(timings.get("decode_tokens_per_sec")),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        wall_ms=wall_ms,
    )


def turn_caption(turn: PlaygroundTurn, first: PlaygroundTurn | None = None) -> str:
    """One line under a reply, e.g.
    'cache: disk · 42/50 prompt tokens reused · TTFT 12.0 ms (prefill 3.0 ms, restore 2.0 ms) · 8 tokens · total 40 ms'.
    With `first` (the session's first turn) a faster TTFT adds '· 5.0× faster TTFT than turn 1'."""
    parts = [
        f"cache: {turn.cache_source}",
        f"{turn.cached_tokens}/{turn.prompt_tokens} prompt tokens reused",
    ]
    if turn.ttft_ms is not None:
        parts.append(
            f"TTFT {turn.ttft_ms:.1f} ms (prefill {turn.prefill_ms or 0.0:.1f} ms, restore {turn.restore_ms or 0.0:.1f} ms)"
        )
    parts.append(f"{turn.completion_tokens} tokens")
    if turn.decode_tokens_per_sec:
        parts.append(f"{turn.decode_tokens_per_sec:.1f} tok/s")
    parts.append(f"total {turn.wall_ms:.0f} ms")
    if (
        first is not None
        and first is not turn
        and first.ttft_ms
        and turn.ttft_ms
        and turn.ttft_ms < first.ttft_ms
    ):
        parts.append(f"{first.ttft_ms / turn.ttft_ms:.1f}× faster TTFT than turn 1")
    return " · ".join(parts)
