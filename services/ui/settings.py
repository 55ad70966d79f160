"""The dashboard's settings: where the gateway is, which key to use, how often to refresh.

`python -m keepwarm.ui` passes its flags to the Streamlit script through these
environment variables (a Streamlit script has no argv of its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

ENV_GATEWAY = "KEEPWARM_UI_GATEWAY"
ENV_API_KEY = "KEEPWARM_UI_API_KEY"
ENV_REFRESH_S = "KEEPWARM_UI_REFRESH_S"
ENV_TIMEOUT_S = "KEEPWARM_UI_TIMEOUT_S"

DEFAULT_GATEWAY = "http://127.0.0.1:8000"
DEFAULT_REFRESH_S = 5.0
DEFAULT_TIMEOUT_S = 5.0


class SettingsError(ValueError):
    """A bad flag or environment value; the message names it and says what to use."""


@dataclass(frozen=True)
class UiSettings:
    gateway: str  # base URL, no trailing slash, e.g. http://127.0.0.1:8000
    api_key: str  # sent as `Authorization: Bearer <api_key>`; empty: no header
    refresh_s: float  # auto-refresh period of the live pages; 0 turns it off
    timeout_s: float  # per-request timeout for the stats/sessions/cache reads

    def __post_init__(self) -> None:
        parts = urlsplit(self.gateway)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise SettingsError(
                f"gateway URL {self.gateway!r} is not an http(s) URL; pass e.g. --gateway {DEFAULT_GATEWAY}"
            )
        if self.refresh_s < 0:
            raise SettingsError(f"refresh interval {self.refresh_s} is negative; use 0 (off) or more seconds")
        if self.timeout_s <= 0:
            raise SettingsError(f"timeout {self.timeout_s} must be > 0 seconds")

    @staticmethod
    def from_env(env: Mapping[str, str]) -> UiSettings:
        return UiSettings(
            gateway=env.get(ENV_GATEWAY, DEFAULT_GATEWAY).rstrip("/"),
            api_key=env.get(ENV_API_KEY, ""),
            refresh_s=_float(env, ENV_REFRESH_S, DEFAULT_REFRESH_S),
            timeout_s=_float(env, ENV_TIMEOUT_S, DEFAULT_TIMEOUT_S),
        )

    def to_env(self) -> dict[str, str]:
        return {
            ENV_GATEWAY: self.gateway,
            ENV_API_KEY: self.api_key,
            ENV_REFRESH_S: repr(self.refresh_s),
            ENV_TIMEOUT_S: repr(self.timeout_s),
        }


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number of seconds") from None
