"""A stand-in for llama.cpp's `llama-server` in the `ops/bench peer` smoke test: it takes the
flags the bench passes, and answers the API the bench uses the way llama-server does (GET
/health, streamed POST /v1/chat/completions with `timings` and `usage` in the last chunk,
POST /slots/0?action=save|restore with a file in --slot-save-path). Its tokens are words
counted from the prompt; it models nothing about speed. Every request is logged (one JSON line
per request to the file named by PEER_STANDIN_LOG) so the test can check what the bench sent."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    for flag in ("-m", "-t", "-tb", "-c", "-np", "--host", "--port", "--slot-save-path", "-a"):
        p.add_argument(flag, required=True)
    p.add_argument("--no-webui", action="store_true")
    a = p.parse_args(argv)
    slots = Path(a.slot_save_path)
    assert Path(a.m).exists() and slots.is_dir()
    log = Path(os.environ["PEER_STANDIN_LOG"])
    state: dict[str, Any] = {"slot0": None}  # the last prompt slot 0 processed

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, status: int, obj: Any) -> None:
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            url = urlsplit(self.path)
            with open(log, "a") as f:
                f.write(json.dumps({"path": url.path, "query": url.query, "body": body}) + "\n")
            if url.path == "/slots/0":
                action = parse_qs(url.query)["action"][0]
                file = slots / body["filename"]
                if action == "save":
                    file.write_text(json.dumps(state["slot0"]))
                else:
                    state["slot0"] = json.loads(file.read_text())
                self._json(200, {"id_slot": 0, "filename": body["filename"]})
                return
            assert url.path == "/v1/chat/completions" and body["stream"] is True
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            state["slot0"] = [m["content"] for m in body["messages"]]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            t0 = time.perf_counter()
            n = int(body["max_tokens"])
            for i in range(n):
                time.sleep(0.002)
                self._chunk(
                    {"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
                )
            ms = (time.perf_counter() - t0) * 1000
            self._chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                         "usage": {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n},
                         "timings": {"prompt_n": prompt, "prompt_ms": max(ms, 0.001), "predicted_n": n}})  # fmt: skip
            self._raw(b"data: [DONE]\n\n")
            self._raw(b"")

        def _chunk(self, obj: dict[str, Any]) -> None:
            self._raw(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def _raw(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    ThreadingHTTPServer((a.host, int(a.port)), Handler).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
