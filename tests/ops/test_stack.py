"""The local stack runner behind ops/up, as a user drives it: start, the README's
curl example, Ctrl-C stops every child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


def test_stack_answers_the_readme_example_and_ctrl_c_stops_everything(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "KEEPWARM_DTYPE": "float32"}
    env.pop("REDIS_URL", None)
    log = tmp_path / "stack.log"  # a file, not a pipe: children write logs for as long as they run
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "ops/stack.py", "--model", str(tiny_dense_model), "--no-dashboard",
             "--gateway-port", "0", "--engine-port", "0"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        lines: list[str] = []
        while time.monotonic() < deadline and proc.poll() is None:
            lines = log.read_text(errors="replace").splitlines()
            if any(line.startswith("api key:") for line in lines):
                break
            time.sleep(0.2)
        by_prefix = {
            ln.split(":", 1)[0]: ln.split(": ", 1)[1]
            for ln in lines
            if ln.startswith(("gateway:", "api key:"))
        }
        assert set(by_prefix) == {"gateway", "api key"}, "\n".join(lines[-30:])
        url, key = by_prefix["gateway"], by_prefix["api key"]
        assert (tmp_path / "cache" / "keepwarm" / "state" / "api-key").read_text().strip() == key

        body = {"model": "keepwarm", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {key}", "X-Session-Id": "demo"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        assert r.json()["usage"]["completion_tokens"] >= 1

        children = [
            int(p)
            for p in subprocess.run(
                ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
            ).stdout.split()
        ]
        assert len(children) == 3  # valkey, engine, gateway
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 15
        while _children_alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _children_alive(children) == []
    finally:
        if proc.poll() is None:
            proc.kill()
