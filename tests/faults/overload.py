"""Many chat clients against a gateway for a bounded time, as an operator's load test would run
them: half stream, two thirds keep a session (multi-turn), a 429 is waited out for its
Retry-After. Every answer is classified (status, stream complete or not); beside them a sampler
polls the engines' /health so each 429 can be set against the real wait for queue room.

Used by tests/faults/test_gateway_overload.py; `python tests/faults/overload.py GATEWAY ENGINE`
runs it against a live stack and prints the tally (for tracing by hand)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

ALPHA = {"Authorization": "Bearer key-alpha"}
TOPICS = ("harbours", "glaciers", "orchards", "comets", "lanterns", "ferries")


@dataclass(frozen=True)
class Answer:
    client: int
    stream: bool
    status: int
    complete: bool  # 200 and, streamed, ended with a finish_reason and [DONE]
    start: float  # monotonic
    end: float
    retry_after: float | None  # a 429's Retry-After header, seconds
    error: str  # the body's error message, for anything but 200


@dataclass
class Tally:
    answers: list[Answer] = field(default_factory=list)
    # (monotonic time, waiting) as each engine's /health said, in order
    waiting: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    health_s: list[float] = field(default_factory=list)  # engine /health round trips

    def statuses(self) -> Counter[int]:
        return Counter(a.status for a in self.answers)

    def incomplete_streams(self) -> list[Answer]:
        return [a for a in self.answers if a.stream and a.status == 200 and not a.complete]

    def summary(self) -> dict[str, Any]:
        slow = sorted(self.health_s)
        return {
            "answers": len(self.answers),
            "statuses": dict(sorted(self.statuses().items())),
            "incomplete_streams": len(self.incomplete_streams()),
            "errors": sorted({a.error for a in self.answers if a.status >= 500})[:5],
            "health_p50_s": slow[len(slow) // 2] if slow else None,
            "health_max_s": slow[-1] if slow else None,
        }


def _body(client: int, turn: int, stream: bool, max_tokens: int) -> dict[str, Any]:
    topic = TOPICS[(client + turn) % len(TOPICS)]
    # one token per step (no drafts): a steady drain rate, so the queue fills and Retry-After holds
    return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": stream, "speculate": False,
            "messages": [{"role": "system", "content": "Answer in one line."},
                         {"role": "user", "content": f"Tell me about {topic}, part {turn}."}]}  # fmt: skip


def _one(
    http: httpx.Client, gw: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, bool, Any, str]:
    """(status, complete, Retry-After, error message) of one request."""
    if not body["stream"]:
        r = http.post(gw + "/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200:
            return r.status_code, False, r.headers.get("retry-after"), _message(r.text)
        finish = r.json()["choices"][0].get("finish_reason")
        return 200, finish in ("stop", "length"), None, ""
    with http.stream("POST", gw + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            text = r.read().decode(errors="replace")
            return r.status_code, False, r.headers.get("retry-after"), _message(text)
        finish, done = None, False
        try:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError:
            return 200, False, None, "stream broken"
        return 200, done and finish in ("stop", "length"), None, ""


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


def run(gw: str, engines: list[str], *, clients: int = 30, seconds: float = 60.0,
        max_tokens: int = 12, engine_headers: dict[str, str] | None = None) -> Tally:  # fmt: skip
    tally = Tally(waiting={e: [] for e in engines})
    lock = threading.Lock()
    until = time.monotonic() + seconds
    stop = threading.Event()

    def client(i: int) -> None:
        stream = i % 2 == 0
        session = f"load-{i}" if i % 3 else None
        headers = {**ALPHA, **({"X-Session-Id": session} if session else {})}
        with httpx.Client(timeout=120) as http:
            turn = 0
            while time.monotonic() < until:
                t0 = time.monotonic()
                try:
                    status, complete, retry, error = _one(
                        http, gw, _body(i, turn, stream, max_tokens), headers
                    )
                except httpx.HTTPError as e:
                    status, complete, retry, error = 0, False, None, f"{type(e).__name__}: {e}"
                answer = Answer(i, stream, status, complete, t0, time.monotonic(),
                                float(retry) if retry is not None else None, error)  # fmt: skip
                with lock:
                    tally.answers.append(answer)
                if status == 429 and answer.retry_after is not None:
                    time.sleep(min(answer.retry_after, max(0.0, until - time.monotonic())))
                elif status == 200 and session:
                    turn += 1

    def sample() -> None:
        with httpx.Client(timeout=30, headers=engine_headers) as http:
            while not stop.is_set():
                for e in engines:
                    t0 = time.monotonic()
                    try:
                        body = http.get(e + "/health").json()
                    except httpx.HTTPError:
                        continue
                    t1 = time.monotonic()
                    with lock:
                        tally.health_s.append(t1 - t0)
                        tally.waiting[e].append((t1, int(body.get("waiting") or 0)))
                stop.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    sampler.join()
    return tally


if __name__ == "__main__":
    gw, *engine_urls = sys.argv[1:]
    print(json.dumps(run(gw, engine_urls).summary(), indent=1))
