"""The dashboard's numbers, computed from contract-shaped gateway JSON."""

from __future__ import annotations

import pytest
from ui_payloads import CACHE, EMPTY_STATS, HEALTH, NS_A, NS_B, SESSIONS, STATS, TIMELINE

from keepwarm.ui import views


def test_overview_figures() -> None:
    ov = views.overview(STATS, now=1_700_000_000.0 + 1800.0)  # half an hour after the counters started
    assert ov.requests == 3 and ov.hits == 2
    assert ov.hit_rate_requests == pytest.approx(2 / 3)
    assert ov.hit_rate_tokens == pytest.approx(0.6)
    assert ov.cached_tokens == 180 and ov.prompt_tokens == 300
    assert ov.prefill_saved_seconds == pytest.approx(0.9)
    assert ov.saved_per_hour == pytest.approx(1.8)  # 0.9 s in 0.5 h
    assert ov.restore_bandwidth == pytest.approx(200 * 1024 * 1024)  # 50 MiB / 0.25 s
    assert ov.hits_by_tier == {"memory": 1, "disk": 1}
    assert (ov.engines_healthy, ov.engines_total) == (1, 1)
    assert ov.uptime_seconds == pytest.approx(1800.0)
    assert (ov.drafted_tokens, ov.accepted_tokens, ov.acceptance_rate) == (40, 30, 0.75)


def test_overview_with_no_data_yet() -> None:
    ov = views.overview(EMPTY_STATS, now=1_700_000_100.0)
    assert ov.requests == 0
    assert ov.hit_rate_requests is None and ov.hit_rate_tokens is None  # shown as "–", not 0%
    assert ov.restore_bandwidth is None and ov.acceptance_rate is None  # no draft yet: "–"
    assert ov.saved_per_hour == 0.0
    empty = views.overview({}, now=5.0)
    assert empty.uptime_seconds is None and empty.saved_per_hour is None and empty.engines_total == 0


def test_concurrency_per_engine_and_in_total() -> None:
    cc = views.concurrency(HEALTH)
    assert [(e.url, e.healthy, e.running, e.waiting) for e in cc.engines] == [
        ("http://e1", True, 3, 1),
        ("http://e2", True, 2, 0),
        ("http://e3", False, None, None),
    ]
    assert (cc.running, cc.waiting, cc.healthy) == (5, 1, 2)
    # An older gateway (no counts) or a stray figure for a down engine counts as unknown.
    old = views.concurrency({"engines": [{"url": "a", "healthy": True}, {"url": "b", "running": 4}, "junk"]})
    assert [(e.url, e.running, e.waiting) for e in old.engines] == [("a", None, None), ("b", None, None)]
    assert (old.running, old.waiting, old.healthy) == (0, 0, 1)
    assert views.concurrency({}) == views.Concurrency(engines=[], running=0, waiting=0, healthy=0)


def test_hit_rates_fall_back_to_counts() -> None:
    stats = {"totals": {"requests": 4, "hits": 1, "prompt_tokens": 200, "cached_tokens": 50}}
    ov = views.overview(stats, now=0.0)
    assert ov.hit_rate_requests == 0.25 and ov.hit_rate_tokens == 0.25


def test_ttft_over_time_is_oldest_first_and_labelled() -> None:
    pts = views.ttft_over_time(STATS["recent"])
    assert [(p.ts, p.kind, p.ttft_ms) for p in pts] == [
        (1_700_000_010.0, "cold", 400.0),
        (1_700_000_020.0, "warm", 80.0),
        (1_700_000_030.0, "warm", 120.0),
    ]


def test_ttft_histogram_shares_bins() -> None:
    bins = views.ttft_histogram({"cold": [100.0, 200.0], "warm": [0.0, 10.0, 200.0]}, bins=4)
    assert [(b.kind, b.lo_ms, b.hi_ms, b.count) for b in bins] == [
        ("cold", 0.0, 50.0, 0),
        ("cold", 50.0, 100.0, 0),
        ("cold", 100.0, 150.0, 1),
        ("cold", 150.0, 200.0, 1),  # the maximum lands in the last bin
        ("warm", 0.0, 50.0, 2),
        ("warm", 50.0, 100.0, 0),
        ("warm", 100.0, 150.0, 0),
        ("warm", 150.0, 200.0, 1),
    ]
    assert views.ttft_histogram({"cold": [], "warm": []}) == []
    one = views.ttft_histogram({"cold": [5.0], "warm": [5.0]}, bins=2)
    assert [(b.kind, b.count) for b in one] == [("cold", 1), ("cold", 0), ("warm", 1), ("warm", 0)]


def test_ttft_summary_and_speedup() -> None:
    summary = views.ttft_summary(STATS["ttft_ms"])
    cold, warm = summary
    assert (cold.kind, cold.count, cold.p50_ms, cold.mean_ms) == ("cold", 1, 400.0, 400.0)
    assert (warm.kind, warm.count, warm.p50_ms, warm.p95_ms, warm.mean_ms) == ("warm", 2, 100.0, 118.0, 100.0)
    assert views.warm_speedup(summary) == 4.0
    assert views.warm_speedup(views.ttft_summary({"cold": [1.0], "warm": []})) is None


def test_percentile() -> None:
    assert views.percentile([], 0.5) is None
    assert views.percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.5
    assert views.percentile([3.0, 1.0, 2.0, 4.0], 1.0) == 4.0
    assert views.percentile([7.0], 0.95) == 7.0


def test_session_rows_newest_first_from_any_shape() -> None:
    rows = views.session_rows(SESSIONS)
    assert [(r.session, r.prefix_tokens, r.turns, r.hits, r.last_ttft_ms, r.engine) for r in rows] == [
        ("s1", 128, 3, 2, 120.0, "http://e1"),
        ("old", 40, 1, 0, 300.0, "http://e1"),
    ]
    assert views.session_rows({"sessions": SESSIONS}) == rows
    keyed = {s["id"]: {k: v for k, v in s.items() if k != "id"} for s in SESSIONS}
    assert views.session_rows(keyed) == rows
    assert views.session_rows([]) == [] and views.session_rows({"sessions": []}) == []


def test_session_timeline_with_divergence() -> None:
    info, turns = views.session_timeline(TIMELINE)
    assert info["id"] == "s1"
    assert [(t.turn, t.cache_source, t.cached_tokens, t.ttft_ms) for t in turns] == [
        (1, "none", 0, 400.0),
        (2, "disk", 40, 150.0),
    ]
    assert turns[0].divergence is None
    d = turns[1].divergence
    assert d is not None and d.position == 57
    assert d.context == {"cached": "…you said blue", "prompt": "…you said green"}
    # A bare list of records, and a divergence with no text (the position alone is shown).
    info2, turns2 = views.session_timeline([{"ts": 1.0, "cache_source": "none", "diverged_at": 3}])
    assert info2 == {} and turns2[0].divergence == views.Divergence(position=3, context={})


def test_cache_view_reads_the_engines_stats() -> None:
    view = views.cache_view(CACHE, top=2)
    (e,) = view.engines
    assert e.engine == "http://e1" and e.namespace == NS_A and e.disk_enabled
    assert (e.entries, e.bytes, e.budget_bytes, e.evictions) == (3, 3 * 1024 * 1024, 12 * 1024 * 1024, 4)
    assert e.free_disk_bytes == 50 * 1024**3
    assert e.used_fraction == 0.25
    assert e.rejected == {"corrupt": 1, "foreign": 2}
    # The listing is complete (total_entries == 3), so entries per namespace are counted from it.
    assert e.namespaces == {NS_A: (2, 2 * 1024 * 1024), NS_B: (1, 1024 * 1024)}
    assert e.read_bandwidth == 200 * 1024 * 1024
    assert (e.memory_entries, e.memory_bytes, e.memory_budget_bytes) == (2, 4096, 8192)
    assert e.stats["disk.path"] == "/var/cache/keepwarm" and e.error == ""
    partial = {"engines": [{**CACHE["engines"][0], "total_entries": 10}], "entries": CACHE["entries"]}
    assert views.cache_view(partial).engines[0].namespaces == {
        NS_A: (None, 2 * 1024 * 1024),
        NS_B: (None, 1024 * 1024),
    }
    # The gateway ranks entries by hits; the page lists them by size, each key once.
    assert [(x.key, x.bytes) for x in view.largest] == [("k-big", 9000), ("k-mid", 5000)]


def test_cache_view_memory_only_and_unreachable_engines() -> None:
    payload = {
        "engines": [
            {"url": "http://m", "namespace": NS_A, "stats": {"engine": {}, "memory": {"entries": 0}, "disk": None},
             "total_entries": 0, "entries": []},
            {"url": "http://down", "healthy": False, "error": "ConnectError: refused", "entries": []},
        ],
        "entries": [],
    }  # fmt: skip
    mem, down = views.cache_view(payload).engines
    assert not mem.disk_enabled and mem.entries == 0 and mem.bytes is None and mem.rejected == {}
    assert down.error == "ConnectError: refused" and down.disk_enabled


def test_cache_view_single_engine_flat_stats() -> None:
    payload = {
        "namespace": NS_A,
        "stats": {"entries": 1, "bytes": 10, "budget_bytes": 0, "rejected": 2, "evictions": 0},
        "entries": [{"key": "k", "namespace": NS_A, "tokens": 4, "position": 4, "bytes": 10, "hits": 0}],
    }
    view = views.cache_view(payload)
    (e,) = view.engines
    assert (e.entries, e.bytes, e.evictions, e.used_fraction, e.read_bandwidth) == (1, 10, 0, None, None)
    assert e.rejected == {"all": 2}
    assert e.namespaces == {NS_A: (1, 10)}  # counted from the entries when stats have no breakdown
    assert [x.key for x in view.largest] == ["k"]
    assert views.cache_view({}) == views.CacheView(engines=[], largest=[])


def test_playground_turn_caption() -> None:
    usage = {"prompt_tokens": 50, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 42}}
    first = views.playground_turn(
        "hi",
        "yo",
        {"prompt_tokens": 30, "completion_tokens": 2},
        {"cache_source": "none", "ttft_ms": 60.0},
        90.0,
    )
    second = views.playground_turn(
        "more",
        "sure",
        usage,
        {
            "cache_source": "memory",
            "ttft_ms": 12.0,
            "prefill_ms": 3.0,
            "restore_ms": 2.0,
            "decode_tokens_per_sec": 200.0,
        },
        40.0,
    )
    assert views.turn_caption(first) == (
        "cache: none · 0/30 prompt tokens reused · TTFT 60.0 ms (prefill 0.0 ms, restore 0.0 ms) · 2 tokens · total 90 ms"
    )
    assert views.turn_caption(second, first) == (
        "cache: memory · 42/50 prompt tokens reused · TTFT 12.0 ms (prefill 3.0 ms, restore 2.0 ms) · 2 tokens"
        " · 200.0 tok/s · total 40 ms · 5.0× faster TTFT than turn 1"
    )


def test_formatting() -> None:
    assert views.fmt_bytes(None) == "–"
    assert views.fmt_bytes(512) == "512 B"
    assert views.fmt_bytes(1536) == "1.5 KiB"
    assert views.fmt_bytes(3 * 1024**3) == "3.0 GiB"
    assert views.fmt_seconds(0.0123) == "12.3 ms"
    assert views.fmt_seconds(1.5) == "1.50 s"
    assert views.fmt_seconds(600.0) == "10.0 min"
    assert views.fmt_seconds(7200.0) == "2.0 h"
    assert views.fmt_pct(2 / 3) == "66.7%" and views.fmt_pct(None) == "–"
