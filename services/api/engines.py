"""The engines the gateway routes to: health, affinity order, failover.

Health comes from polling GET /health (a background task, every
`interval_s`) and from requests themselves: a connection error marks an engine
down at once. An engine is healthy when /health answers 200 with status "ok".
A slow /health (busy CPU) is only held against an engine after
`timeouts_to_down` consecutive timeouts, so a long prefill does not flap it;
a paused or hung engine is down after that many probe timeouts, and every
request still waiting on it is told at once (`lost(url)`), so it can fail over
instead of waiting out its read timeout.

Each engine's served models come from its GET /v1/models, read when it first
answers /health and again whenever /health reports another model or namespace
(a restart on another checkpoint); an engine whose /v1/models fails is down
(a wrong engine token shows here). The last-known models of a down engine are
kept, so a request for them is a 503 (retry), not a 404 (no such model).

Routing order for a request: only engines serving the requested model; among
them the session's engine first when it is healthy (its memory tier holds the
session's state), then every other healthy one by rendezvous hash of the
affinity key (session id, else tenant), so a new session lands on a stable
engine and a failed engine's sessions spread evenly.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("keepwarm.api")


@dataclass
class EngineHealth:
    """Mutable view of one engine; owned by its EnginePool."""

    url: str
    healthy: bool = False
    checked: float = 0.0  # unix time of the last probe
    error: str | None = None  # why it is down
    timeouts: int = 0  # consecutive probe timeouts
    queue_depth: int = 0
    model: str = ""
    namespace: str = ""
    # Served models by id, as the engine's /v1/models lists them (kept while it is down).
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Set when the engine goes down; replaced by a fresh one when it is healthy again.
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    def public(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy}


def _rank(url: str, affinity: str) -> bytes:
    return hashlib.blake2b(f"{affinity}\0{url}".encode(), digest_size=8).digest()


class EnginePool:
    def __init__(
        self,
        urls: Sequence[str],
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        probe_timeout_s: float = 2.0,
        timeouts_to_down: int = 3,
    ) -> None:
        assert urls, "an EnginePool needs at least one engine"
        self._engines = {u: EngineHealth(url=u) for u in urls}
        self._client = client
        self._interval = interval_s
        self._probe_timeout = probe_timeout_s
        self._timeouts_to_down = timeouts_to_down

    @property
    def urls(self) -> list[str]:
        return list(self._engines)

    def health(self, url: str) -> EngineHealth:
        return self._engines[url]

    def status(self) -> list[dict[str, Any]]:
        return [e.public() for e in self._engines.values()]

    def any_healthy(self) -> bool:
        return any(e.healthy for e in self._engines.values())

    async def probe(self, url: str) -> bool:
        e = self._engines[url]
        e.checked = time.time()
        try:
            r = await self._client.get(f"{url}/health", timeout=self._probe_timeout)
            body = r.json() if r.status_code == 200 else {}
        except httpx.TimeoutException:
            e.timeouts += 1
            if e.timeouts >= self._timeouts_to_down:
                self._set(e, False, f"/health timed out {e.timeouts} times in a row")
            return e.healthy
        except (httpx.HTTPError, ValueError) as exc:
            self._set(e, False, f"{type(exc).__name__}: {exc}")
            return False
        e.timeouts = 0
        if not isinstance(body, dict) or body.get("status") != "ok":
            self._set(e, False, f"/health answered HTTP {r.status_code}")
            return False
        e.queue_depth = int(body.get("queue_depth") or 0)
        model, namespace = str(body.get("model") or ""), str(body.get("namespace") or "")
        if not e.healthy or model != e.model or namespace != e.namespace or model not in e.models:
            problem = await self._read_models(e)
            if problem is not None:
                self._set(e, False, problem)
                return False
        e.model, e.namespace = model, namespace
        self._set(e, True, None)
        return True

    async def _read_models(self, e: EngineHealth) -> str | None:
        """Refreshes `e.models` from the engine's /v1/models; why not, when it fails."""
        try:
            r = await self._client.get(f"{e.url}/v1/models", timeout=self._probe_timeout)
            data = r.json().get("data") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            return f"/v1/models failed: {type(exc).__name__}: {exc}"
        if r.status_code != 200:
            return f"/v1/models answered HTTP {r.status_code} (is KEEPWARM_ENGINE_TOKEN the engines' token?)"
        cards = {m["id"]: m for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)}
        if not cards:
            return "/v1/models lists no model"
        e.models = cards
        return None

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(u) for u in self._engines))

    async def run(self) -> None:
        """Polls every engine forever; cancel the task to stop it."""
        while True:
            try:
                await self.probe_all()
            except Exception:  # noqa: BLE001 - the poller must outlive any single bad probe
                log.exception("engine health poll failed")
            await asyncio.sleep(self._interval)

    def lost(self, url: str) -> asyncio.Event:
        """An event set as soon as `url` is marked down (the one current now)."""
        return self._engines[url].lost

    def mark_down(self, url: str, reason: str) -> None:
        self._set(self._engines[url], False, reason)

    def _set(self, e: EngineHealth, healthy: bool, error: str | None) -> None:
        if e.healthy != healthy:
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "engine %s is now %s%s",
                e.url,
                "healthy" if healthy else "down",
                f" ({error})" if error else "",
            )
        if healthy and not e.healthy:
            e.lost = asyncio.Event()
        elif not healthy:
            e.lost.set()
        e.healthy = healthy
        e.error = error

    def served(self) -> dict[str, list[dict[str, Any]]]:
        """Every model a healthy engine serves, with each such engine's card for it."""
        out: dict[str, list[dict[str, Any]]] = {}
        for e in self._engines.values():
            if e.healthy:
                for name, card in e.models.items():
                    out.setdefault(name, []).append(card)
        return out

    def known(self, model: str) -> bool:
        """Whether any engine, healthy or not, served `model` when last asked."""
        return any(model in e.models for e in self._engines.values())

    def candidates(self, affinity: str, preferred: str | None = None, model: str | None = None) -> list[str]:
        """Healthy engines (serving `model`, when given) in the order to try them; empty when none."""
        healthy = [u for u, e in self._engines.items() if e.healthy and (model is None or model in e.models)]
        healthy.sort(key=lambda u: _rank(u, affinity))
        if preferred in healthy:
            healthy.remove(preferred)
            healthy.insert(0, preferred)
        return healthy
