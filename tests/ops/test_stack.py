"""The local stack runner behind ops/up, as a user drives it: start (with a saved
API key that starts with '-'), the README's curl example, a killed Valkey and a
killed engine restarted in place with sessions kept, Ctrl-C stops every child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _children_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def _children(pid: int) -> dict[int, str]:
    """Direct children of `pid` -> their command line (NUL-separated argv joined by spaces)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    cmdlines = {}
    for child in map(int, out):
        try:
            cmdlines[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass
    return cmdlines


def _wait(pred: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_stack_serves_restarts_what_dies_keeps_sessions_and_ctrl_c_stops_everything(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    state = tmp_path / "cache" / "keepwarm" / "state"
    state.mkdir(parents=True)
    # 1 key in 64 that secrets.token_urlsafe makes starts with '-': once passed as `--api-key -...`.
    key = "-dash-first-key-0123456789"
    (state / "api-key").write_text(key)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "KEEPWARM_DTYPE": "float32",
           "KEEPWARM_REDIS_COOLDOWN": "0.5"}  # fmt: skip
    for name in ("REDIS_URL", "KEEPWARM_SECRET", "KEEPWARM_ENGINE_TOKEN", "KEEPWARM_API_KEYS"):
        env.pop(name, None)
    log = tmp_path / "stack.log"  # a file, not a pipe: children write logs for as long as they run
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "ops/stack.py", "--model", str(tiny_dense_model),
             "--gateway-port", "0", "--engine-port", "0", "--dashboard-port", "0"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def lines() -> list[str]:
        return log.read_text(errors="replace").splitlines()

    try:
        _wait(lambda: proc.poll() is not None or any(ln.startswith("api key:") for ln in lines()),
              "the stack to start", 300)  # fmt: skip
        by_prefix = {ln.split(":", 1)[0]: ln.split(": ", 1)[1] for ln in lines()
                     if ln.startswith(("gateway:", "api key:", "dashboard:"))}  # fmt: skip
        assert set(by_prefix) == {"gateway", "api key", "dashboard"}, "\n".join(lines()[-30:])
        url = by_prefix["gateway"]
        assert by_prefix["api key"] == key
        h = {"Authorization": f"Bearer {key}", "X-Session-Id": "demo"}

        def chat(content: str = "Hello!") -> httpx.Response:
            body = {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60, headers=h)

        r = chat()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        assert r.json()["usage"]["completion_tokens"] >= 1

        children = _children(proc.pid)
        assert len(children) == 4, children  # valkey, engine, gateway, dashboard
        # No secret on any command line: the key, the salt secret and the engine token go by environment.
        secrets = [key, (state / "secret").read_text().strip(), (state / "engine-token").read_text().strip()]
        assert not [c for c in children.values() for s in secrets if s in c]
        # The engine answers only the gateway.
        engine_pid = next(p for p, c in children.items() if "keepwarm.engine" in c)
        engine_port = children[engine_pid].split("--port ", 1)[1].split()[0]
        assert httpx.get(f"http://127.0.0.1:{engine_port}/v1/models").status_code == 401

        # Valkey dies: restarted on its port from its append-only file; the session is still there.
        valkey_pid = next(p for p, c in children.items() if "valkey" in c and "keepwarm" not in c)
        os.kill(valkey_pid, signal.SIGKILL)
        _wait(lambda: any("valkey exited with code -9; restarting it in 1 s" in ln for ln in lines()),
              "the valkey restart notice")  # fmt: skip
        _wait(lambda: any(ln.startswith("[keepwarm] valkey restarted") for ln in lines()), "valkey restarted")
        _wait(lambda: httpx.get(f"{url}/health").json()["redis"], "the gateway to see redis again")
        assert chat("And again?").status_code == 200
        session = httpx.get(f"{url}/v1/sessions/demo", headers=h).json()["session"]
        assert session["turns"] == 2  # the first turn survived the restart

        # The engine dies: restarted in place, the gateway serves again.
        os.kill(engine_pid, signal.SIGKILL)
        _wait(lambda: any("engine exited with code -9; restarting it in 1 s" in ln for ln in lines()),
              "the engine restart notice")  # fmt: skip
        _wait(lambda: any(ln.startswith("[keepwarm] engine restarted") for ln in lines()), "engine restarted")

        def served() -> bool:
            r = chat("Still there?")
            assert r.status_code in (200, 503), r.text  # 503 "no healthy engine" until it is back
            return r.status_code == 200

        _wait(served, "the gateway to serve again", 180)
        assert proc.poll() is None  # the stack never stopped

        children = _children(proc.pid)
        assert len(children) == 4, children
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 15
        while _children_alive(list(children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _children_alive(list(children)) == []
    finally:
        if (
            proc.poll() is None
        ):  # a failed assertion: stop the stack the way Ctrl-C does, so no child is orphaned
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
