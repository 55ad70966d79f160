"""Sessions: each conversation's prefix, turns and hits; one session's timeline; where misses diverged."""

from __future__ import annotations

import datetime as dt

import altair as alt
import pandas as pd
import streamlit as st

from keepwarm.ui import views
from keepwarm.ui.charts import SOURCE_SCALE
from keepwarm.ui.client import GatewayClient, GatewayDown, GatewayError
from keepwarm.ui.panel import live, show_failure

SELECT_KEY = "sessions_selected"


def render(client: GatewayClient, refresh_s: float) -> None:
    st.title("Sessions")
    live(lambda: _body(client), refresh_s, key="sessions")


def _when(ts: float | None) -> str:
    return "–" if not ts else dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def _body(client: GatewayClient) -> None:
    try:
        rows = views.session_rows(client.sessions())
    except (GatewayDown, GatewayError) as e:
        show_failure(e)
        return
    if not rows:
        st.info(
            "No sessions yet. A session is named by the X-Session-Id header (or the `user` field) of a "
            "chat request; its turns show up here."
        )
        return
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "session": r.session,
                    "last prefix (tokens)": r.prefix_tokens,
                    "turns": r.turns,
                    "hits": r.hits,
                    "last TTFT (ms)": None if r.last_ttft_ms is None else round(r.last_ttft_ms, 1),
                    "engine": r.engine,
                    "updated": _when(r.updated),
                }
                for r in rows
            ]
        ),
        hide_index=True,
    )
    ids = [r.session for r in rows]
    chosen = st.selectbox("Session timeline", ids, key=SELECT_KEY)
    if chosen:
        _timeline(client, chosen)


def _timeline(client: GatewayClient, session: str) -> None:
    try:
        info, turns = views.session_timeline(client.session(session))
    except (GatewayDown, GatewayError) as e:
        show_failure(e)
        return
    if not turns:
        st.caption(f"No turns recorded for {session} (its timeline may have expired).")
        return
    hits = sum(1 for t in turns if t.cached_tokens > 0)
    st.markdown(f"**{session}** — {len(turns)} turns, {hits} served from cache")
    df = pd.DataFrame(
        [
            {
                "turn": t.turn,
                "time": _when(t.ts),
                "cache": t.cache_source,
                "prompt tokens": t.prompt_tokens,
                "reused tokens": t.cached_tokens,
                "TTFT (ms)": round(t.ttft_ms, 1),
                "prefill (ms)": round(t.prefill_ms, 1),
                "restore (ms)": round(t.restore_ms, 1),
                "prefill saved (ms)": round(t.prefill_saved_ms, 1),
                "reply tokens": t.completion_tokens,
                "diverged at": None if t.divergence is None else t.divergence.position,
                "engine": t.engine,
            }
            for t in turns
        ]
    )
    st.dataframe(df, hide_index=True)
    chart = (
        alt.Chart(df, height=260)
        .mark_bar()
        .encode(
            x=alt.X("turn:O", title="turn", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("TTFT (ms):Q"),
            color=alt.Color("cache:N", scale=SOURCE_SCALE),
            tooltip=["turn", "cache", "prompt tokens", "reused tokens", "TTFT (ms)"],
        )
    )
    st.altair_chart(chart, width="stretch")
    for t in turns:
        d = t.divergence
        if d is None:
            continue
        st.warning(
            f"Turn {t.turn}: the prompt diverged from the session's cached prefix at token {d.position} "
            f"(tokens 0–{max(d.position - 1, 0)} matched; {t.cached_tokens} of {t.prompt_tokens} reused).",
            icon="✂️",
        )
        for name, text in d.context.items():
            st.caption(name)
            st.code(text, language=None)
    if info:
        with st.expander("Session record"):
            st.json(info)
