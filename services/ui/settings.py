"""The dashboard's settings: where the gateway is, which key to use, how often to refresh, where
to listen; read by keepwarm.settings from flags and KEEPWARM_UI_* variables.

`python -m keepwarm.ui` passes them to the Streamlit script as those variables (`to_env`), since
a Streamlit script has no argv of its own; the script reads them back with `from_env`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from keepwarm import settings
from keepwarm.settings import SettingsError, setting

__all__ = ["DEFAULT_GATEWAY", "SettingsError", "UiSettings"]

DEFAULT_GATEWAY = "http://127.0.0.1:8000"


@dataclass(frozen=True)
class UiSettings:
    gateway: str = setting(
        DEFAULT_GATEWAY,
        env=("KEEPWARM_UI_GATEWAY",),
        parse=lambda text: text.rstrip("/"),
        help="gateway base URL",
    )  # no trailing slash
    api_key: str = setting(
        "",
        env=("KEEPWARM_UI_API_KEY",),
        file_env=("KEEPWARM_UI_API_KEY_FILE",),
        secret=True,
        default_text="(none: no Authorization header)",
        help="gateway API key, sent as `Authorization: Bearer`",
    )
    refresh_s: float = setting(
        5.0,
        flag="--refresh",
        env=("KEEPWARM_UI_REFRESH_S",),
        help="auto-refresh period of the live pages, seconds; 0 turns it off",
    )
    timeout_s: float = setting(
        5.0, flag="--timeout", env=("KEEPWARM_UI_TIMEOUT_S",), help="timeout of each stats read, seconds"
    )
    address: str = setting("127.0.0.1", env=("KEEPWARM_UI_ADDRESS",), help="listen address")
    port: int = setting(8501, env=("KEEPWARM_UI_PORT",), help="listen port")

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
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port {self.port} (KEEPWARM_UI_PORT) is not a TCP port: use 1-65535")

    @staticmethod
    def from_env(env: Mapping[str, str]) -> UiSettings:
        return settings.load(UiSettings, None, env)

    def to_env(self) -> dict[str, str]:
        return settings.to_env(self)
