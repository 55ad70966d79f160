"""The gateway's Prometheus metrics (GET /metrics, for an admin tenant's key: the figures
cover every tenant's traffic).

- `keepwarm_gateway_requests_total{route, status}`: every answered request to a route
  the gateway has, by route template (`/v1/sessions/{session_id:str}`, never the id)
  and HTTP status.
- `keepwarm_gateway_upstream_retries_total{reason}`: a request sent again, to the same or
  another engine, after a failure before any answer (`broken_connection`,
  `engine_down`, `engine_lost`, `engine_busy`, `queue_full`).
- `keepwarm_gateway_upstream_wait_seconds{outcome}`: from sending a request to an engine
  to its first answer (headers): the engine's queue wait plus prefill; `answer` or
  `queue_full` (a 429).
- `keepwarm_gateway_redis_circuit_open`, `..._trips_total`, `..._fast_failures_total`:
  the Redis circuit breaker.
- `keepwarm_gateway_engine_healthy{engine}`, `keepwarm_gateway_engine_load{engine}`: the
  pool as this gateway sees it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from keepwarm.api.breaker import Breaker
from keepwarm.api.engines import EnginePool

RETRY_REASONS = ("broken_connection", "engine_down", "engine_lost", "engine_busy", "queue_full")
_WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Live(Collector):
    """Figures read when scraped: the breaker and the engine pool."""

    def __init__(self, breaker: Breaker, pool: EnginePool) -> None:
        self.breaker, self.pool = breaker, pool

    def collect(self) -> Iterable[Any]:
        state = self.breaker.state()
        yield GaugeMetricFamily(
            "keepwarm_gateway_redis_circuit_open", "1 while the Redis circuit is open", value=int(state.open)
        )
        yield CounterMetricFamily(
            "keepwarm_gateway_redis_circuit_trips",
            "Closed-to-open transitions since start",
            value=state.trips,
        )
        yield CounterMetricFamily(
            "keepwarm_gateway_redis_circuit_fast_failures",
            "Redis calls refused without touching Redis (circuit open)",
            value=state.fast_failures,
        )
        healthy = GaugeMetricFamily(
            "keepwarm_gateway_engine_healthy", "1 when the engine is healthy", labels=["engine"]
        )
        load = GaugeMetricFamily(
            "keepwarm_gateway_engine_load",
            "Sequences on the engine as this gateway sees it",
            labels=["engine"],
        )
        for url in self.pool.urls:
            e = self.pool.health(url)
            healthy.add_metric([url], int(e.healthy))
            load.add_metric([url], e.load())
        yield healthy
        yield load


class GatewayMetrics:
    def __init__(self, breaker: Breaker, pool: EnginePool) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "keepwarm_gateway_requests", "Requests answered, by route and status", ["route", "status"],
            registry=self.registry,
        )  # fmt: skip
        self._retries = Counter(
            "keepwarm_gateway_upstream_retries", "Requests sent again after a failure before any answer",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        for reason in RETRY_REASONS:
            self._retries.labels(reason)  # every reason listed from the start, at 0
        self._wait = Histogram(
            "keepwarm_gateway_upstream_wait_seconds", "Seconds from sending to an engine to its first answer",
            ["outcome"], buckets=_WAIT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_Live(breaker, pool))

    def retried(self, reason: str) -> None:
        assert reason in RETRY_REASONS, reason
        self._retries.labels(reason).inc()

    def waited(self, outcome: str, seconds: float) -> None:
        self._wait.labels(outcome).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self, app: Asgi) -> Asgi:
        """Counts every HTTP answer by route template and status (litestar has routed the
        request by the time its middleware runs, so the template is known)."""

        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return

            async def watch(message: Message) -> None:
                if message["type"] == "http.response.start":
                    self._requests.labels(_route(scope), str(message["status"])).inc()
                await send(message)

            await app(scope, receive, watch)

        return counted


def _route(scope: Scope) -> str:
    handler = scope.get("route_handler")
    paths = getattr(handler, "paths", None)
    return min(paths) if paths else "unmatched"  # the handler's path template, never the request's path
