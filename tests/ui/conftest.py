"""Fixtures for the dashboard tests: a real HTTP server answering with canned gateway JSON
(until the tests need the real gateway, see test_browser.py), and a URL nobody listens on."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class CannedGateway:
    """routes: (method, path) -> (status, JSON body). Everything it was asked is in `seen`."""

    url: str = ""
    routes: dict[tuple[str, str], tuple[int, Any]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)


def _handler(gw: CannedGateway) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            gw.seen.append(
                Seen(self.command, self.path, dict(self.headers.items()), json.loads(raw) if raw else None)
            )
            status, body = gw.routes.get(
                (self.command, self.path), (404, {"error": {"message": f"no route {self.path}", "code": 404}})
            )
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = _serve
        do_POST = _serve
        do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass

    return Handler


@pytest.fixture
def canned_gateway() -> Iterator[CannedGateway]:
    gw = CannedGateway()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(gw))
    gw.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield gw
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def closed_url() -> str:
    """An http URL on a loopback port that was just free: connecting is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
