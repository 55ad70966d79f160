"""Disk cache: what each engine holds on disk, against its budget; the largest entries; clearing it."""

from __future__ import annotations

import datetime as dt

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from keepwarm.ui import views
from keepwarm.ui.client import GatewayClient, GatewayDown, GatewayError
from keepwarm.ui.panel import live, show_failure

CONFIRM_KEY = "cache_confirm_clear"


def render(client: GatewayClient, refresh_s: float) -> None:
    st.title("Disk cache")
    live(lambda: _body(client), refresh_s, key="cache")
    _clear(client)


def _when(ts: float | None) -> str:
    return "–" if not ts else dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _short(ident: str, n: int = 12) -> str:
    """Hash ids are 64 hex characters; their head identifies them on screen."""
    return ident if len(ident) <= n else ident[:n] + "…"


def _body(client: GatewayClient) -> None:
    try:
        view = views.cache_view(client.cache())
    except (GatewayDown, GatewayError) as e:
        show_failure(e)
        return
    if not view.engines:
        st.info("No engine reported a cache yet.")
    for engine in view.engines:
        _engine(engine)
    st.subheader("Largest entries")
    if not view.largest:
        st.caption("The cache is empty: entries appear after the first requests are served.")
        return
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "key": _short(en.key),
                    "tokens": en.tokens,
                    "position": en.position,
                    "size": views.fmt_bytes(en.bytes),
                    "hits": en.hits,
                    "last used": _when(en.last_used),
                    "created": _when(en.created),
                    "namespace": _short(en.namespace),
                    "engine": en.engine,
                }
                for en in view.largest
            ]
        ),
        hide_index=True,
    )


def _engine(e: views.EngineCache) -> None:
    st.subheader(f"Engine `{e.engine}`" if e.engine else "Engine")
    if e.namespace:
        st.caption(f"serving namespace {e.namespace}")
    if e.error:
        st.error(f"The gateway could not read this engine's cache: {e.error}")
        return
    if not e.disk_enabled:
        st.info("This engine keeps no disk cache (memory only).")
        if e.memory_bytes is not None:
            _memory_metric(st.container(), e)
    else:
        c = st.columns(4)
        c[0].metric("Entries", "–" if e.entries is None else f"{e.entries}")
        c[1].metric("On disk", views.fmt_bytes(e.bytes))
        c[2].metric("Budget", views.fmt_bytes(e.budget_bytes))
        c[3].metric("Free disk", views.fmt_bytes(e.free_disk_bytes))
        c = st.columns(4)
        c[0].metric("Evictions", "–" if e.evictions is None else f"{e.evictions}")
        c[1].metric(
            "Disk read bandwidth",
            "–" if e.read_bandwidth is None else f"{views.fmt_bytes(e.read_bandwidth)}/s",
            help="snapshot bytes read from disk / seconds spent reading them",
        )
        c[2].metric(
            "Rejected files",
            f"{sum(e.rejected.values())}",
            help="unreadable, foreign or corrupt files deleted",
        )
        if e.memory_bytes is not None:
            _memory_metric(c[3], e)
        frac = e.used_fraction
        if frac is not None:
            st.progress(min(frac, 1.0), text=f"{views.fmt_pct(frac)} of the byte budget used")
    left, right = st.columns(2)
    with left:
        st.markdown("**Namespaces**")
        if e.namespaces:
            st.table(
                pd.DataFrame(
                    [
                        {
                            "namespace": _short(ns),
                            "entries": "–" if n is None else str(n),
                            "size": views.fmt_bytes(b),
                            "served": "yes" if ns == e.namespace else "",
                        }
                        for ns, (n, b) in sorted(e.namespaces.items(), key=lambda kv: -kv[1][1])
                    ]
                ).set_index("namespace")
            )
        else:
            st.caption("none reported")
    with right:
        st.markdown("**Rejected files by reason**")
        if e.rejected:
            st.table(
                pd.DataFrame([{"reason": k, "files": v} for k, v in sorted(e.rejected.items())]).set_index(
                    "reason"
                )
            )
        else:
            st.caption("none")
    with st.expander("All cache stats"):
        st.table(
            pd.DataFrame([{"stat": k, "value": str(v)} for k, v in sorted(e.stats.items())]).set_index("stat")
        )


def _memory_metric(where: DeltaGenerator, e: views.EngineCache) -> None:
    where.metric(
        "Memory tier",
        views.fmt_bytes(e.memory_bytes),
        help=f"{e.memory_entries or 0} snapshots in RAM, budget {views.fmt_bytes(e.memory_budget_bytes)}",
    )


def _clear(client: GatewayClient) -> None:
    st.divider()
    st.subheader("Clear the cache")
    confirmed = st.checkbox(
        "I understand this deletes every cached prefix on every engine (memory and disk)", key=CONFIRM_KEY
    )
    if st.button("Clear cache", type="primary", disabled=not confirmed):
        try:
            deleted = client.clear_cache()
        except (GatewayDown, GatewayError) as e:
            show_failure(e)
            return
        st.success(f"Deleted {deleted} cached entries.")
