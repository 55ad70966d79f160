"""The whole app (navigation + sidebar) under AppTest, and the `python -m keepwarm.ui` launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from streamlit.testing.v1 import AppTest
from ui_payloads import STATS

import keepwarm.ui.__main__ as launcher

APP = str(Path(launcher.__file__).with_name("app.py"))


def _app(monkeypatch: pytest.MonkeyPatch, gateway: str) -> AppTest:
    monkeypatch.setenv("KEEPWARM_UI_GATEWAY", gateway)
    monkeypatch.setenv("KEEPWARM_UI_API_KEY", "sk-ui")
    monkeypatch.setenv("KEEPWARM_UI_REFRESH_S", "0")
    at = AppTest.from_file(APP, default_timeout=30)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_app_with_gateway_down(monkeypatch: pytest.MonkeyPatch, closed_url: str) -> None:
    at = _app(monkeypatch, closed_url)
    assert at.title[0].value == "Overview"
    assert at.sidebar.error[0].value.startswith("unreachable (ConnectError")
    assert at.main.error[0].value.startswith(f"Gateway unreachable: {closed_url}")
    assert at.sidebar.selectbox[0].value == 0.0


def test_app_overview_with_gateway(monkeypatch: pytest.MonkeyPatch, canned_gateway) -> None:
    canned_gateway.routes[("GET", "/health")] = (
        200,
        {"status": "ok", "engines": [{"url": "e", "healthy": True}]},
    )
    canned_gateway.routes[("GET", "/v1/stats")] = (200, STATS)
    at = _app(monkeypatch, canned_gateway.url)
    assert at.sidebar.success[0].value == "ok · 1/1 engines healthy"
    assert {m.label: m.value for m in at.metric}["Hit rate (requests)"] == "66.7%"
    health = [s for s in canned_gateway.seen if s.path == "/health"]
    assert health and "Authorization" in health[0].headers


def test_app_with_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    at = _app(monkeypatch, "not-a-url")
    assert at.error[0].value.startswith(
        "Dashboard misconfigured: gateway URL 'not-a-url' is not an http(s) URL"
    )


def test_launcher_flags_become_env() -> None:
    settings, address, port = launcher.parse(
        ["--gateway", "http://127.0.0.1:8000/", "--api-key", "k", "--port", "8600", "--refresh", "2"], {}
    )
    assert (address, port) == ("127.0.0.1", 8600)
    assert settings.to_env() == {
        "KEEPWARM_UI_GATEWAY": "http://127.0.0.1:8000",
        "KEEPWARM_UI_API_KEY": "k",
        "KEEPWARM_UI_REFRESH_S": "2.0",
        "KEEPWARM_UI_TIMEOUT_S": "5.0",
        "KEEPWARM_UI_ADDRESS": "127.0.0.1",
        "KEEPWARM_UI_PORT": "8600",
    }
    from_env, _, env_port = launcher.parse(
        [], {"KEEPWARM_UI_GATEWAY": "http://gw:1", "KEEPWARM_UI_PORT": "9"}
    )
    assert (from_env.gateway, env_port) == ("http://gw:1", 9)
    argv = launcher.streamlit_argv("0.0.0.0", 8600)
    assert argv[1:4] == ["-m", "streamlit", "run"] and argv[4] == APP
    assert (
        "--server.headless=true" in argv
        and "--server.port=8600" in argv
        and "--server.address=0.0.0.0" in argv
    )
    with pytest.raises(SystemExit):
        launcher.parse(["--gateway", "ftp://x"], {})


def test_launcher_serves_the_dashboard(closed_url: str) -> None:
    """`python -m keepwarm.ui` starts a headless Streamlit server that answers its health check."""
    port = int(closed_url.rsplit(":", 1)[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "keepwarm.ui", "--gateway", closed_url, "--api-key", "k", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "HOME": os.environ.get("HOME", "/tmp")},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{closed_url}/_stcore/health", timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                assert time.monotonic() < deadline, "dashboard did not start within 60 s"
                time.sleep(0.3)
        assert (r.status_code, r.text) == (200, "ok")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
