"""Playground: chat through the gateway and see each turn's timings and cache source."""

from __future__ import annotations

import secrets

import altair as alt
import pandas as pd
import streamlit as st

from keepwarm.ui import views
from keepwarm.ui.charts import SOURCE_SCALE
from keepwarm.ui.client import GatewayClient, GatewayDown, GatewayError
from keepwarm.ui.panel import show_failure

SESSION_KEY = "pg_session"
TURNS_KEY = "pg_turns"


def _new_conversation() -> None:
    st.session_state[SESSION_KEY] = "playground-" + secrets.token_hex(4)
    st.session_state[TURNS_KEY] = []


def _reply(text: str) -> None:
    """The reply exactly as generated (no Markdown/HTML interpretation: a tiny demo model's output
    would otherwise vanish or render as formatting)."""
    if text.strip():
        st.text(text)
    else:
        st.caption(f"(blank reply: {len(text)} whitespace characters)")


def render(client: GatewayClient) -> None:
    st.title("Playground")
    if SESSION_KEY not in st.session_state:
        _new_conversation()
    turns: list[views.PlaygroundTurn] = st.session_state[TURNS_KEY]
    top = st.columns([3, 1, 1])
    top[0].caption(
        f"session `{st.session_state[SESSION_KEY]}` · each turn resends the whole conversation, so turn 2 reuses turn 1's prefix"
    )
    max_tokens = top[1].number_input(
        "max tokens", min_value=1, max_value=4096, value=32, step=1, key="pg_max_tokens"
    )
    top[2].button("New conversation", on_click=_new_conversation)
    system = st.text_input("System prompt (optional)", key="pg_system")

    for i, t in enumerate(turns):
        with st.chat_message("user"):
            st.write(t.user)
        with st.chat_message("assistant"):
            _reply(t.reply)
            st.caption(views.turn_caption(t, turns[0] if i > 0 else None))

    prompt = st.chat_input("Send a message through the gateway")
    if prompt:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            m
            for t in turns
            for m in ({"role": "user", "content": t.user}, {"role": "assistant", "content": t.reply})
        ]
        messages.append({"role": "user", "content": prompt})
        with st.chat_message("user"):
            st.write(prompt)
        try:
            with st.spinner("waiting for the first token…"):
                reply = client.chat(
                    messages, session_id=st.session_state[SESSION_KEY], max_tokens=int(max_tokens)
                )
        except (GatewayDown, GatewayError) as e:
            show_failure(e)
            return
        turn = views.playground_turn(prompt, reply.text, reply.usage, reply.timings, reply.wall_ms)
        turns.append(turn)
        with st.chat_message("assistant"):
            _reply(turn.reply)
            st.caption(views.turn_caption(turn, turns[0] if len(turns) > 1 else None))

    if turns:
        st.subheader("Time to first token by turn")
        df = pd.DataFrame(
            [
                {"turn": i + 1, "TTFT (ms)": t.ttft_ms or 0.0, "cache": t.cache_source}
                for i, t in enumerate(turns)
            ]
        )
        st.altair_chart(
            alt.Chart(df, height=260)
            .mark_bar()
            .encode(
                x=alt.X("turn:O", axis=alt.Axis(labelAngle=0)),
                y="TTFT (ms):Q",
                color=alt.Color("cache:N", scale=SOURCE_SCALE),
                tooltip=["turn", "cache", "TTFT (ms)"],
            ),
            width="stretch",
        )
