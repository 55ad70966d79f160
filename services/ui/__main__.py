"""Run the dashboard: `python -m keepwarm.ui --gateway URL --api-key KEY --port 8501`.

Execs `streamlit run app.py` headless; the settings travel as KEEPWARM_UI_* environment variables
(each flag also reads its variable, so a container can set env only: `--help` lists them).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from keepwarm import settings as kw_settings
from keepwarm.ui.settings import SettingsError, UiSettings

APP = Path(__file__).with_name("app.py")


def parse(argv: Sequence[str], env: Mapping[str, str]) -> tuple[UiSettings, str, int]:
    """Flags > KEEPWARM_UI_* variables > defaults; a bad value exits 2 naming it."""
    p = argparse.ArgumentParser(prog="python -m keepwarm.ui", description="keepwarm dashboard (Streamlit)")
    kw_settings.add_arguments(p, UiSettings)
    a = p.parse_args(list(argv))
    try:
        settings = kw_settings.load(UiSettings, a, env)
    except SettingsError as e:
        p.error(str(e))
    return settings, settings.address, settings.port


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
