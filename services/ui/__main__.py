"""Run the dashboard: `python -m keepwarm.ui --gateway URL --api-key KEY --port 8501`.

Execs `streamlit run app.py` headless; the settings travel as KEEPWARM_UI_* environment variables
(each flag also defaults from its variable, so a container can set env only).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from keepwarm.ui.settings import (
    DEFAULT_GATEWAY,
    DEFAULT_REFRESH_S,
    DEFAULT_TIMEOUT_S,
    ENV_API_KEY,
    ENV_GATEWAY,
    ENV_REFRESH_S,
    ENV_TIMEOUT_S,
    SettingsError,
    UiSettings,
)

APP = Path(__file__).with_name("app.py")


def _key_file(env: dict[str, str]) -> str:
    """The key in KEEPWARM_UI_API_KEY_FILE (compose: the one the gateway made on its first start)."""
    path = env.get("KEEPWARM_UI_API_KEY_FILE")
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        sys.exit(
            f"keepwarm.ui: cannot read KEEPWARM_UI_API_KEY_FILE={path} ({e.strerror}); set KEEPWARM_UI_API_KEY"
        )


def parse(argv: Sequence[str], env: dict[str, str]) -> tuple[UiSettings, str, int]:
    p = argparse.ArgumentParser(prog="python -m keepwarm.ui", description="keepwarm dashboard (Streamlit)")
    p.add_argument("--gateway", default=env.get(ENV_GATEWAY, DEFAULT_GATEWAY), help="gateway base URL")
    p.add_argument(
        "--api-key", default=env.get(ENV_API_KEY) or _key_file(env), help="gateway API key (Bearer)"
    )
    p.add_argument("--port", type=int, default=int(env.get("KEEPWARM_UI_PORT", "8501")))
    p.add_argument("--address", default=env.get("KEEPWARM_UI_ADDRESS", "127.0.0.1"), help="listen address")
    p.add_argument(
        "--refresh",
        type=float,
        default=float(env.get(ENV_REFRESH_S, DEFAULT_REFRESH_S)),
        help="auto-refresh seconds (0: off)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=float(env.get(ENV_TIMEOUT_S, DEFAULT_TIMEOUT_S)),
        help="timeout of each stats read, seconds",
    )
    a = p.parse_args(list(argv))
    if not 0 < a.port < 65536:
        p.error(f"--port {a.port} is not a TCP port (1-65535)")
    try:
        settings = UiSettings(
            gateway=a.gateway.rstrip("/"), api_key=a.api_key, refresh_s=a.refresh, timeout_s=a.timeout
        )
    except SettingsError as e:
        p.error(str(e))
    return settings, a.address, a.port


def streamlit_argv(address: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.headless=true",
        f"--server.address={address}",
        f"--server.port={port}",
        "--server.fileWatcherType=none",
        "--browser.gatherUsageStats=false",
        "--client.toolbarMode=minimal",
        "--theme.base=light",
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    env = dict(os.environ)
    settings, address, port = parse(sys.argv[1:] if argv is None else argv, env)
    env.update(settings.to_env())
    args = streamlit_argv(address, port)
    os.execve(args[0], args, env)


if __name__ == "__main__":
    main()
