"""The dashboard in a real browser over a real stack: Valkey, a tiny-model engine, the gateway and
`python -m keepwarm.ui`, all on loopback; headless Chromium (the system's, never downloaded) reads
the figures and uses the playground."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from keepwarm.ui import views
from tests.api.procs import (
    TEST_KEYS,
    Proc,
    free_port,
    make_demo_model,
    spawn,
    start_engine,
    start_gateway,
    start_valkey,
    wait_http,
)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
API_KEY = next(iter(TEST_KEYS))
SESSION = "browser-session-1"
UI_TIMEOUT_MS = 60_000  # a first Streamlit render plus gateway reads on a loaded 2-core machine

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"needs the system Chromium at {CHROMIUM}"
)


@dataclass
class Stack:
    gateway: Proc
    dashboard: Proc

    def gw(self, method: str, path: str, **kw: object) -> dict:
        headers = {"Authorization": f"Bearer {API_KEY}", "X-Session-Id": SESSION}
        r = httpx.request(method, self.gateway.url + path, headers=headers, timeout=120, **kw)  # type: ignore[arg-type]
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stack")
    procs: list[Proc] = []
    try:
        valkey = start_valkey(root / "valkey")
        procs.append(valkey)
        engine = start_engine(make_demo_model(root / "tiny"), root / "cache", root / "logs")
        procs.append(engine)
        gateway = start_gateway([engine.url], valkey.url, root / "logs")
        procs.append(gateway)
        port = free_port()
        argv = [sys.executable, "-m", "keepwarm.ui", "--gateway", gateway.url, "--api-key", API_KEY]
        argv += ["--port", str(port), "--refresh", "0"]
        dashboard = spawn(argv, f"http://127.0.0.1:{port}", root / "logs" / "dashboard.log")
        procs.append(dashboard)
        wait_http(dashboard, "/_stcore/health", timeout=60)
        yield Stack(gateway=gateway, dashboard=dashboard)
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    ctx = browser.new_context(viewport={"width": 1400, "height": 1600})
    p = ctx.new_page()
    p.set_default_timeout(UI_TIMEOUT_MS)
    yield p
    ctx.close()


def metric(page: Page, label: str) -> str:
    box = page.locator('[data-testid="stMetric"]').filter(
        has=page.locator('[data-testid="stMetricLabel"]', has_text=re.compile(f"^{re.escape(label)}$"))
    )
    return box.locator('[data-testid="stMetricValue"]').inner_text().strip()


def test_overview_sessions_and_cache_reflect_two_turns(stack: Stack, page: Page, tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper and the sea."}]
    first = stack.gw(
        "POST", "/v1/chat/completions", json={"model": "default", "messages": messages, "max_tokens": 8}
    )
    messages += [first["choices"][0]["message"], {"role": "user", "content": "What happened next?"}]
    second = stack.gw(
        "POST", "/v1/chat/completions", json={"model": "default", "messages": messages, "max_tokens": 8}
    )
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # turn 2 reused turn 1
    stats = stack.gw("GET", "/v1/stats")
    totals = stats["totals"]
    assert (totals["requests"], totals["hits"]) == (2, 1)

    # The gateway's engine figures are one health poll old: wait until it has seen the engine idle.
    deadline = time.monotonic() + 30
    while [(e["healthy"], e["running"], e["waiting"]) for e in stack.gw("GET", "/health")["engines"]] != [
        (True, 0, 0)
    ]:
        assert time.monotonic() < deadline, "the gateway never saw its engine idle"
        time.sleep(0.1)
    page.goto(stack.dashboard.url + "/")
    expect(page.get_by_text("Hit rate (requests)")).to_be_visible()
    assert metric(page, "Requests") == "2"
    assert metric(page, "Hit rate (requests)") == views.fmt_pct(totals["hit_rate_requests"]) == "50.0%"
    assert metric(page, "Hit rate (tokens)") == views.fmt_pct(totals["hit_rate_tokens"])
    assert metric(page, "Tokens reused") == f"{totals['cached_tokens']:,}"
    assert metric(page, "Prefill saved") == views.fmt_seconds(totals["prefill_saved_seconds"])
    # Concurrency, from the gateway's /health: nothing running now, the one engine serving.
    assert (metric(page, "Sequences running"), metric(page, "Sequences waiting")) == ("0", "0")
    assert metric(page, "Engines serving") == "1/1"
    expect(page.get_by_text("TTFT over time")).to_be_visible()
    page.wait_for_timeout(1000)  # let the charts draw before the picture
    page.screenshot(path=str(tmp_path / "overview.png"), full_page=True)

    page.goto(stack.dashboard.url + "/sessions")
    expect(page.get_by_text(f"{SESSION} — 2 turns, 1 served from cache")).to_be_visible()
    expect(page.get_by_test_id("stDataFrame")).to_have_count(2)  # the session list and the timeline
    page.wait_for_timeout(1500)  # the grids draw on a canvas after they attach
    page.screenshot(path=str(tmp_path / "sessions.png"), full_page=True)

    cache = stack.gw("GET", "/v1/cache?top=200")
    (engine,) = cache["engines"]
    page.goto(stack.dashboard.url + "/cache")
    expect(page.get_by_text("Largest entries")).to_be_visible()
    assert metric(page, "Entries") == str(engine["stats"]["disk"]["num_entries"])
    assert metric(page, "On disk") == views.fmt_bytes(engine["stats"]["disk"]["num_bytes"])
    page.screenshot(path=str(tmp_path / "cache.png"), full_page=True)


def test_playground_turns_show_timings(stack: Stack, page: Page, tmp_path: Path) -> None:
    page.goto(stack.dashboard.url + "/playground")
    box = page.get_by_test_id("stChatInputTextArea")
    captions = page.locator('[data-testid="stCaptionContainer"]', has_text="prompt tokens reused")
    box.fill("Describe a quiet morning in a small harbour town.")
    box.press("Enter")
    expect(captions).to_have_count(1, timeout=120_000)
    first = captions.nth(0).inner_text()
    assert re.search(r"TTFT [0-9.]+ ms", first), first
    box = page.get_by_test_id("stChatInputTextArea")
    box.fill("And in the evening?")
    box.press("Enter")
    expect(captions).to_have_count(2, timeout=120_000)
    second = captions.nth(1).inner_text()
    m = re.match(r"cache: (\w+) · (\d+)/(\d+) prompt tokens reused", second)
    assert m, second
    assert m.group(1) in ("memory", "disk") and int(m.group(2)) > 0, second  # turn 2 reused turn 1's prefix
    expect(page.get_by_test_id("stChatMessage")).to_have_count(4)  # two questions, two replies
    expect(page.get_by_text("Time to first token by turn")).to_be_visible()
    page.wait_for_timeout(1000)
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
