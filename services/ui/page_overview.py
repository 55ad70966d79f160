"""Overview: is the prefix cache paying off? Hit rates, prefill time saved, TTFT cold vs warm; and how
busy the engines are: sequences running and waiting, per engine and in total (the gateway's /health)."""

from __future__ import annotations

import time

import altair as alt
import pandas as pd
import streamlit as st

from keepwarm.ui import views
from keepwarm.ui.charts import KIND_SCALE
from keepwarm.ui.client import GatewayClient, GatewayDown, GatewayError
from keepwarm.ui.panel import live, show_failure


def render(client: GatewayClient, refresh_s: float) -> None:
    st.title("Overview")
    live(lambda: _body(client), refresh_s, key="overview")


def _body(client: GatewayClient) -> None:
    try:
        stats = client.stats()
    except GatewayDown as e:
        show_failure(e)
        return
    except GatewayError as e:  # e.g. Redis down (503) or a bad key: the engines' load still shows
        show_failure(e)
        stats = None
    if stats is not None:
        _cache_figures(stats)
    _concurrency(client)
    if stats is not None:
        _ttft_charts(stats, views.ttft_summary(stats.get("ttft_ms") or {}))


def _cache_figures(stats: dict) -> None:
    ov = views.overview(stats, now=time.time())
    if ov.requests == 0:
        st.info(
            "No requests yet. Send a chat completion through the gateway (or use the Playground): "
            "the figures below fill in as turns arrive."
        )

    c = st.columns(4)
    c[0].metric(
        "Requests", f"{ov.requests}", help="chat completions through the gateway since the counters started"
    )
    c[1].metric(
        "Hit rate (requests)",
        views.fmt_pct(ov.hit_rate_requests),
        help=f"{ov.hits} of {ov.requests} requests reused a cached prefix",
    )
    c[2].metric(
        "Hit rate (tokens)",
        views.fmt_pct(ov.hit_rate_tokens),
        help="prompt tokens restored from cache / all prompt tokens",
    )
    c[3].metric("Tokens reused", f"{ov.cached_tokens:,}", help=f"of {ov.prompt_tokens:,} prompt tokens")

    c = st.columns(4)
    c[0].metric(
        "Prefill saved",
        views.fmt_seconds(ov.prefill_saved_seconds),
        help="measured cold prefill time for the reused tokens minus restore time",
    )
    c[1].metric(
        "Prefill saved per hour",
        views.fmt_seconds(ov.saved_per_hour) if ov.saved_per_hour is not None else "–",
        help=f"since the counters started {views.fmt_seconds(ov.uptime_seconds)} ago",
    )
    c[2].metric(
        "Prefill done", views.fmt_seconds(ov.prefill_seconds), help="prefill the engines actually computed"
    )
    c[3].metric(
        "Restore bandwidth",
        f"{views.fmt_bytes(ov.restore_bandwidth)}/s" if ov.restore_bandwidth is not None else "–",
        help=f"{views.fmt_bytes(ov.restore_bytes)} restored in {views.fmt_seconds(ov.restore_seconds)}",
    )

    c = st.columns(4)
    tiers = ov.hits_by_tier
    c[0].metric("Hits from memory", f"{tiers.get('memory', 0)}")
    c[1].metric("Hits from disk", f"{tiers.get('disk', 0)}")
    summary = views.ttft_summary(stats.get("ttft_ms") or {})
    speed = views.warm_speedup(summary)
    c[2].metric(
        "Warm TTFT speedup", f"{speed:.1f}×" if speed else "–", help="median cold TTFT / median warm TTFT"
    )
    c[3].metric("Engines healthy", f"{ov.engines_healthy}/{ov.engines_total}")

    c = st.columns(4)
    c[0].metric(
        "Draft acceptance",
        views.fmt_pct(ov.acceptance_rate),
        help="speculative decoding (--speculate ngram): drafted tokens the model's own choice confirmed",
    )
    c[1].metric("Tokens drafted", f"{ov.drafted_tokens:,}")
    c[2].metric("Tokens accepted", f"{ov.accepted_tokens:,}", help="generated without a step of their own")


def _concurrency(client: GatewayClient) -> None:
    st.subheader("Concurrency")
    try:
        health = client.health()
    except (GatewayDown, GatewayError) as e:
        show_failure(e)
        return
    cc = views.concurrency(health)
    c = st.columns(4)
    c[0].metric("Sequences running", f"{cc.running}", help="generating now, over every healthy engine")
    c[1].metric(
        "Sequences waiting", f"{cc.waiting}", help="queued for admission (an engine's --max-seqs or memory)"
    )
    c[2].metric("Engines serving", f"{cc.healthy}/{len(cc.engines)}")
    if not cc.engines:
        st.caption("The gateway reports no engine.")
        return
    st.table(
        pd.DataFrame(
            [
                {
                    "engine": e.url,
                    "state": "healthy" if e.healthy else "down",
                    "running": _n(e.running),
                    "waiting": _n(e.waiting),
                }
                for e in cc.engines
            ]
        ).set_index("engine")
    )


def _ttft_charts(stats: dict, summary: list[views.TtftSummary]) -> None:
    left, right = st.columns(2)
    with left:
        st.subheader("TTFT over time")
        pts = views.ttft_over_time(stats.get("recent") or [])
        if not pts:
            st.caption("No requests yet.")
        else:
            df = pd.DataFrame([p.__dict__ for p in pts])
            df["time"] = pd.to_datetime(df["ts"], unit="s")
            chart = (
                alt.Chart(df)
                .mark_circle(size=60)
                .encode(
                    x=alt.X("time:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S")),
                    y=alt.Y("ttft_ms:Q", title="TTFT (ms)"),
                    color=alt.Color("kind:N", scale=KIND_SCALE, title="cache"),
                    tooltip=["session", "kind", alt.Tooltip("ttft_ms:Q", format=".1f")],
                )
            )
            st.altair_chart(chart, width="stretch")
    with right:
        st.subheader("TTFT distribution")
        bins = views.ttft_histogram(stats.get("ttft_ms") or {})
        if not bins:
            st.caption("No requests yet.")
        else:
            df = pd.DataFrame([b.__dict__ for b in bins])
            chart = (
                alt.Chart(df)
                .mark_bar(opacity=0.7)
                .encode(
                    x=alt.X("lo_ms:Q", bin="binned", title="TTFT (ms)"),
                    x2="hi_ms:Q",
                    y=alt.Y("count:Q", stack=None, title="requests"),
                    color=alt.Color("kind:N", scale=KIND_SCALE, title="cache"),
                )
            )
            st.altair_chart(chart, width="stretch")
        st.table(
            pd.DataFrame(
                [
                    {
                        "cache": s.kind,
                        "requests": s.count,
                        "p50 ms": _ms(s.p50_ms),
                        "p95 ms": _ms(s.p95_ms),
                        "mean ms": _ms(s.mean_ms),
                    }
                    for s in summary
                ]
            ).set_index("cache")
        )


def _n(v: int | None) -> str:
    return "–" if v is None else str(v)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f}"
