"""The keepwarm dashboard (Streamlit entry point): `python -m keepwarm.ui` runs this file.

It reads only the gateway's public API (/health, /v1/stats, /v1/sessions, /v1/cache) and chats
through /v1/chat/completions; settings arrive through KEEPWARM_UI_* environment variables.
"""

from __future__ import annotations

import os

import streamlit as st

from keepwarm.ui import page_cache, page_overview, page_playground, page_sessions
from keepwarm.ui.client import GatewayClient, GatewayDown, GatewayError
from keepwarm.ui.settings import SettingsError, UiSettings

REFRESH_CHOICES = (0.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def _sidebar(client: GatewayClient, default_refresh: float) -> float:
    """Gateway health and the refresh interval; returns the chosen interval (0 = off)."""
    with st.sidebar:
        st.markdown(f"**Gateway** `{client.gateway}`")
        try:
            health = client.health()
            engines = health.get("engines") or []
            ok = sum(1 for e in engines if e.get("healthy"))
            status = str(health.get("status", "?"))
            (st.success if status == "ok" else st.warning)(f"{status} · {ok}/{len(engines)} engines healthy")
        except GatewayDown as e:
            st.error(f"unreachable ({e.reason})")
        except GatewayError as e:
            st.warning(f"/health: HTTP {e.status}")
        choices = sorted(set(REFRESH_CHOICES) | {default_refresh})
        return float(
            st.selectbox(
                "Auto-refresh",
                choices,
                index=choices.index(default_refresh),
                format_func=lambda s: "off" if s == 0 else f"every {s:g} s",
                key="refresh_s",
            )
        )


def main() -> None:
    st.set_page_config(page_title="keepwarm", page_icon=":material/local_fire_department:", layout="wide")
    try:
        settings = UiSettings.from_env(os.environ)
    except SettingsError as e:
        st.error(f"Dashboard misconfigured: {e}")
        st.stop()
    client = GatewayClient(settings)
    refresh_s = _sidebar(client, settings.refresh_s)

    def overview() -> None:
        page_overview.render(client, refresh_s)

    def sessions() -> None:
        page_sessions.render(client, refresh_s)

    def disk_cache() -> None:
        page_cache.render(client, refresh_s)

    def playground() -> None:
        page_playground.render(client)

    st.navigation(
        [
            st.Page(
                overview, title="Overview", icon=":material/insights:", url_path="overview", default=True
            ),
            st.Page(sessions, title="Sessions", icon=":material/forum:", url_path="sessions"),
            st.Page(disk_cache, title="Disk cache", icon=":material/storage:", url_path="cache"),
            st.Page(playground, title="Playground", icon=":material/chat:", url_path="playground"),
        ]
    ).run()


main()
