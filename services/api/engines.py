"""The engines the gateway routes to: discovery, health, load, affinity order, failover.

Discovery. `KEEPWARM_ENGINES` lists engine base URLs; an entry `dns+http://NAME:PORT`
stands for every IPv4 address (A record) NAME resolves to, each one engine
`http://ADDRESS:PORT`. Names are resolved again before every health poll, so
replicas that appear (`docker compose up --scale engine=N`, a headless Service)
join at the next poll, and an address that leaves the answer leaves the pool: it
is marked down first, so a request waiting on it fails over at once. A failed
lookup keeps the addresses of the last answer (they are probed as usual); a name
that no longer exists (NXDOMAIN) has no engines.

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

Load is what the engine's /health reports, `running` + `waiting` sequences, plus
the requests this gateway opened to it since that answer minus those that ended
since (`begin` / `Ticket.close`), so a burst of new sessions between two polls
spreads instead of piling onto the engine that was idle at the last poll.

Routing order for a request: only engines serving the requested model; among
them the session's engine first when it is healthy (its memory tier holds the
session's state), then every other healthy one by ascending load, ties broken by
rendezvous hash of the affinity key (session id, else tenant) -- the same order
in every gateway for the same loads -- so a new session goes to the least
loaded engine and a failed engine's sessions spread over the survivors.

What is per gateway process, by nature: health, load and the resolved
addresses are each gateway's own observation of the engines (two gateways may
see a load figure one poll apart; the session's engine, once chosen, is in
Redis and every gateway follows it).
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

log = logging.getLogger("keepwarm.api")

DNS_PREFIX = "dns+"

# (host, port) -> the host's IPv4 addresses; raises socket.gaierror (or OSError) like getaddrinfo.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """The A records of `host` through the system resolver (/etc/hosts, the container's DNS)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
    )
    return [str(info[4][0]) for info in infos]


class EngineSourceError(ValueError):
    """A KEEPWARM_ENGINES entry that is neither a base URL nor a dns+ name; the message says why."""


@dataclass(frozen=True)
class DnsName:
    """`dns+SCHEME://HOST:PORT`: every A record of HOST is an engine SCHEME://ADDRESS:PORT."""

    source: str  # the entry as configured
    scheme: str
    host: str
    port: int

    def url(self, address: str) -> str:
        return f"{self.scheme}://{address}:{self.port}"


def parse_engine(entry: str) -> str | DnsName:
    """A configured engine: its base URL, or the DnsName a `dns+` entry stands for."""
    text = entry.removeprefix(DNS_PREFIX)
    if not text.startswith(("http://", "https://")):
        raise EngineSourceError(
            f"engine URL {entry!r} must start with http:// or https:// (a base URL), or dns+http:// "
            "(dns+http://NAME:PORT: every address NAME resolves to)"
        )
    if text == entry:
        return entry
    parts = urlsplit(text)
    if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.username:
        raise EngineSourceError(f"engine {entry!r}: a dns+ entry is dns+http://NAME:PORT, nothing more")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise EngineSourceError(f"engine {entry!r}: the port is not a number in 1-65535") from None
    return DnsName(source=entry, scheme=parts.scheme, host=parts.hostname, port=port)


@dataclass
class EngineHealth:
    """Mutable view of one engine; owned by its EnginePool."""

    url: str
    healthy: bool = False
    checked: float = 0.0  # unix time of the last probe
    error: str | None = None  # why it is down
    timeouts: int = 0  # consecutive probe timeouts
    queue_depth: int = 0
    running: int = 0  # sequences running, as the last /health said
    waiting: int = 0  # sequences waiting to be admitted, as the last /health said
    inflight: int = 0  # requests this gateway has open to the engine now
    inflight_at_probe: int = 0  # `inflight` when the last /health answered
    model: str = ""
    namespace: str = ""
    # Served models by id, as the engine's /v1/models lists them (kept while it is down).
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Set when the engine goes down; replaced by a fresh one when it is healthy again.
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    def load(self) -> int:
        """Sequences on the engine now, as far as this gateway can tell (see the module docstring)."""
        return max(0, self.running + self.waiting + self.inflight - self.inflight_at_probe)

    def public(self) -> dict[str, Any]:
        """The engine's row in /health and /v1/stats; running/waiting are None while it is down."""
        return {
            "url": self.url,
            "healthy": self.healthy,
            "running": self.running if self.healthy else None,
            "waiting": self.waiting if self.healthy else None,
        }


class Ticket:
    """One request open to an engine, counted in its load until `close()` (idempotent)."""

    def __init__(self, engine: EngineHealth) -> None:
        self._engine: EngineHealth | None = engine
        engine.inflight += 1

    def close(self) -> None:
        if self._engine is not None:
            self._engine.inflight -= 1
            self._engine = None


def _rank(url: str, affinity: str) -> bytes:
    return hashlib.blake2b(f"{affinity}\0{url}".encode(), digest_size=8).digest()


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


class EnginePool:
    def __init__(
        self,
        engines: Sequence[str],
        client: httpx.AsyncClient,
        *,
        interval_s: float,
        probe_timeout_s: float = 2.0,
        timeouts_to_down: int = 3,
        resolver: Resolver = system_resolver,
    ) -> None:
        assert engines, "an EnginePool needs at least one engine"
        parsed = [parse_engine(e) for e in engines]
        self._static = [p for p in parsed if isinstance(p, str)]
        self._names = [p for p in parsed if isinstance(p, DnsName)]
        # The addresses each name resolved to last (sorted); a name not resolved yet has none.
        self._resolved: dict[str, list[str]] = {n.source: [] for n in self._names}
        self._dns_error: dict[str, str] = {}
        self._engines = {u: EngineHealth(url=u) for u in self._static}
        self._client = client
        self._interval = interval_s
        self._probe_timeout = probe_timeout_s
        self._timeouts_to_down = timeouts_to_down
        self._resolver = resolver

    @property
    def urls(self) -> list[str]:
        return list(self._engines)

    def health(self, url: str) -> EngineHealth:
        """The engine's view; for an engine no longer in the pool, a down one saying so."""
        found = self._engines.get(url)
        return found if found is not None else EngineHealth(url=url, error="no longer in the pool")

    def status(self) -> list[dict[str, Any]]:
        return [e.public() for e in self._engines.values()]

    def any_healthy(self) -> bool:
        return any(e.healthy for e in self._engines.values())

    def problems(self) -> list[str]:
        """Why requests find no engine: each engine's error and each name that resolves to nothing."""
        out = [f"{e.url}: {e.error or 'down'}" for e in self._engines.values() if not e.healthy]
        for n in self._names:
            if not self._resolved[n.source]:
                out.append(f"{n.source}: {self._dns_error.get(n.source) or 'resolves to no address'}")
        return out

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
        e.queue_depth = _count(body.get("queue_depth"))
        e.running, e.waiting = _count(body.get("running")), _count(body.get("waiting"))
        e.inflight_at_probe = e.inflight
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

    async def resolve(self) -> None:
        """Looks every dns+ name up again and makes the pool match: static URLs first, then each
        name's addresses in address order; an engine that left is marked down, then dropped."""
        if not self._names:
            return
        answers = await asyncio.gather(*(self._lookup(n) for n in self._names))
        for n, addresses in zip(self._names, answers, strict=True):
            if addresses is not None:
                if addresses != self._resolved[n.source]:
                    log.info("%s resolves to %s", n.source, ", ".join(addresses) or "no address")
                self._resolved[n.source] = addresses
        wanted = list(dict.fromkeys([*self._static, *(u for n in self._names for u in self._urls_of(n))]))
        for url, e in self._engines.items():
            if url not in wanted:
                self._set(e, False, "no longer resolved")
        self._engines = {u: self._engines.get(u) or EngineHealth(url=u) for u in wanted}

    def _urls_of(self, n: DnsName) -> list[str]:
        return [n.url(a) for a in self._resolved[n.source]]

    async def _lookup(self, n: DnsName) -> list[str] | None:
        """The name's IPv4 addresses, sorted; [] when it does not exist; None when the lookup failed."""
        try:
            found = await asyncio.wait_for(self._resolver(n.host, n.port), timeout=self._probe_timeout)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                self._dns_error[n.source] = f"{n.host} does not resolve ({exc.strerror})"
                return []
            self._note_dns_error(n, f"lookup of {n.host} failed: {exc.strerror}")
            return None
        except (OSError, TimeoutError) as exc:
            self._note_dns_error(n, f"lookup of {n.host} failed: {type(exc).__name__}: {exc}")
            return None
        self._dns_error.pop(n.source, None)
        return sorted(set(found), key=ipaddress.IPv4Address)

    def _note_dns_error(self, n: DnsName, why: str) -> None:
        if self._dns_error.get(n.source) != why:
            log.warning("%s: %s; keeping its last addresses", n.source, why)
        self._dns_error[n.source] = why

    async def probe_all(self) -> None:
        await self.resolve()
        await asyncio.gather(*(self.probe(u) for u in list(self._engines)))

    async def run(self) -> None:
        """Polls every engine forever; cancel the task to stop it."""
        while True:
            try:
                await self.probe_all()
            except Exception:  # noqa: BLE001 - the poller must outlive any single bad probe
                log.exception("engine health poll failed")
            await asyncio.sleep(self._interval)

    def lost(self, url: str) -> asyncio.Event:
        """An event set as soon as `url` is marked down (the one current now; already set for an
        engine no longer in the pool)."""
        e = self._engines.get(url)
        if e is None:
            gone = asyncio.Event()
            gone.set()
            return gone
        return e.lost

    def begin(self, url: str) -> Ticket:
        """Counts one request to `url` in its load until the ticket is closed."""
        return Ticket(self.health(url))

    def mark_down(self, url: str, reason: str) -> None:
        e = self._engines.get(url)
        if e is not None:
            self._set(e, False, reason)

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
        """Healthy engines (serving `model`, when given) in the order to try them: `preferred`
        first when it is one of them, then by ascending load, ties by rendezvous hash of
        `affinity`; empty when none."""
        healthy = [e for e in self._engines.values() if e.healthy and (model is None or model in e.models)]
        healthy.sort(key=lambda e: (e.load(), _rank(e.url, affinity)))
        order = [e.url for e in healthy]
        if preferred in order:
            order.remove(preferred)
            order.insert(0, preferred)
        return order
