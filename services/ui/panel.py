"""What every dashboard page shares: auto-refreshing bodies and turning gateway failures into messages."""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from keepwarm.ui.client import GatewayDown, GatewayError


def show_failure(e: GatewayDown | GatewayError) -> None:
    """A clear message instead of a traceback, saying what to do about it."""
    if isinstance(e, GatewayDown):
        st.error(
            f"Gateway unreachable: {e.gateway} did not answer ({e.reason}). "
            "Start the gateway, or point the dashboard at it with --gateway URL.",
            icon="🔌",
        )
    elif e.status == 401 or e.status == 403:
        st.error(
            f"The gateway refused the dashboard's API key (HTTP {e.status}: {e.message}). "
            "Pass a valid key with --api-key (or KEEPWARM_UI_API_KEY).",
            icon="🔑",
        )
    elif e.status == 404:
        st.error(
            f"The gateway has no {e.path} endpoint (HTTP 404: {e.message}); is --gateway pointing at a keepwarm gateway?",
            icon="❓",
        )
    else:
        st.error(f"The gateway answered {e.path} with HTTP {e.status}: {e.message}", icon="⚠️")


def live(body: Callable[[], None], refresh_s: float, key: str) -> None:
    """Run `body` now and, when refresh_s > 0, again every refresh_s seconds without rerunning the page."""
    if refresh_s > 0:
        st.fragment(body, run_every=refresh_s, key=key)()
    else:
        body()
