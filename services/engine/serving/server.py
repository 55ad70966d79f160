"""The engine HTTP service (litestar): OpenAI chat completions with keepwarm's
extensions, models, health, Prometheus metrics and the cache admin API."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict
from typing import Any

from litestar import Litestar, Request, Response, delete, get, post
from litestar.response import Stream
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from keepwarm.engine.config import EngineConfig
from keepwarm.engine.engine import Engine, Event
from keepwarm.engine.generation.request import FinishEvent, RequestError, TokenEvent
from keepwarm.engine.serving.openai_format import (
    chunk_body,
    completion_body,
    error_body,
    keepwarm_body,
    parse_chat_request,
    usage_body,
)
from keepwarm.engine.serving.worker import Job, QueueFull, Worker


class EngineCollector:
    """Reads the engine's counters at scrape time (no duplicated bookkeeping)."""

    def __init__(self, engine: Engine, worker: Worker) -> None:
        self.engine = engine
        self.worker = worker

    def collect(self) -> Iterable[Metric]:
        s = self.engine.stats
        yield CounterMetricFamily("keepwarm_requests", "Generation requests", value=s.requests)
        yield CounterMetricFamily("keepwarm_prompt_tokens", "Prompt tokens", value=s.prompt_tokens)
        cached = CounterMetricFamily(
            "keepwarm_cached_prompt_tokens", "Prompt tokens restored", labels=["tier"]
        )
        for tier, n in s.hit_tokens_by_tier.items():
            cached.add_metric([tier], n)
        yield cached
        hits = CounterMetricFamily("keepwarm_cache_hits", "Prefix cache hits", labels=["tier"])
        for tier, n in s.hits_by_tier.items():
            hits.add_metric([tier], n)
        yield hits
        yield CounterMetricFamily("keepwarm_cache_lookups", "Prefix cache lookups", value=s.lookups)
        yield CounterMetricFamily("keepwarm_prefill_tokens", "Tokens prefilled", value=s.prefill_tokens)
        yield CounterMetricFamily(
            "keepwarm_prefill_seconds", "Time spent in prefill", value=s.prefill_seconds
        )
        yield CounterMetricFamily(
            "keepwarm_prefill_saved_seconds",
            "Cold prefill time minus restore time",
            value=s.prefill_saved_seconds,
        )
        yield CounterMetricFamily(
            "keepwarm_restore_seconds", "Time spent restoring snapshots", value=s.restore_seconds
        )
        yield CounterMetricFamily("keepwarm_restore_bytes", "Snapshot bytes restored", value=s.restore_bytes)
        yield CounterMetricFamily("keepwarm_completion_tokens", "Generated tokens", value=s.completion_tokens)
        yield CounterMetricFamily("keepwarm_snapshots_saved", "Snapshots taken", value=s.snapshots_saved)
        yield GaugeMetricFamily("keepwarm_queue_depth", "Requests queued or running", value=self.worker.depth)
        mem = self.engine.cache.memory
        if mem is not None:
            ms = mem.stats()
            yield GaugeMetricFamily("keepwarm_memory_cache_entries", "RAM tier entries", value=ms.entries)
            yield GaugeMetricFamily("keepwarm_memory_cache_bytes", "RAM tier bytes", value=ms.bytes)
            yield CounterMetricFamily(
                "keepwarm_memory_cache_evictions", "RAM tier evictions", value=ms.evictions
            )
        disk = self.engine.cache.disk
        if disk is not None:
            ds = disk.stats()
            yield GaugeMetricFamily("keepwarm_disk_cache_entries", "Disk tier entries", value=ds.num_entries)
            yield GaugeMetricFamily(
                "keepwarm_disk_cache_bytes", "Disk tier bytes (all namespaces)", value=ds.num_bytes
            )
            yield CounterMetricFamily(
                "keepwarm_disk_cache_evictions", "Disk tier evictions", value=ds.evictions
            )
            yield CounterMetricFamily("keepwarm_disk_cache_saves", "Disk tier files written", value=ds.saves)
            yield CounterMetricFamily(
                "keepwarm_disk_cache_dropped_saves",
                "Saves dropped (writer queue full)",
                value=ds.dropped_saves,
            )
            rejected = CounterMetricFamily(
                "keepwarm_disk_cache_rejected_files", "Files rejected and deleted", labels=["reason"]
            )
            for reason, n in ds.rejected_by_reason.items():
                rejected.add_metric([reason], n)
            yield rejected


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_app(engine: Engine, cfg: EngineConfig) -> Litestar:
    registry = CollectorRegistry()
    ttft = Histogram(
        "keepwarm_ttft_seconds",
        "Time to first token",
        registry=registry,
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    )

    def observe(ev: Event) -> None:
        if isinstance(ev, FinishEvent):
            ttft.observe(ev.timings.ttft_ms / 1000)

    worker = Worker(engine, cfg.queue_size, on_event=observe)
    registry.register(EngineCollector(engine, worker))  # type: ignore[arg-type]
    model_id = cfg.served_name

    def error(e: Exception) -> Response[Any]:
        if isinstance(e, RequestError):
            return Response(error_body(str(e), e.status, e.param), status_code=e.status)
        if isinstance(e, QueueFull):
            return Response(
                error_body(f"the engine queue is full ({cfg.queue_size} requests); retry shortly", 429),
                status_code=429,
                headers={"Retry-After": "1"},
            )
        return Response(error_body(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)

    def on_error(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        status = getattr(exc, "status_code", None)
        if isinstance(status, int) and not isinstance(
            exc, RequestError
        ):  # litestar's own (404, 405, 413 ...)
            detail = getattr(exc, "detail", "") or str(exc)
            return Response(error_body(str(detail), status), status_code=status)
        return error(exc)

    async def next_event(job: Job) -> Event | None:
        item = await job.events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
        try:
            body = await request.json()
        except Exception:
            raise RequestError("the request body is not valid JSON") from None
        req = parse_chat_request(body, cfg.max_tokens_limit, engine.default_policy)
        if body.get("stream") is not None and not isinstance(body.get("stream"), bool):
            raise RequestError("stream must be true or false", param="stream")
        prompt = await asyncio.to_thread(engine.prepare, req)
        rid = "chatcmpl-" + uuid.uuid4().hex[:24]
        job = worker.submit(req, prompt)
        if not body.get("stream"):
            return await _complete(job, rid, request)
        return Stream(
            _stream(job, rid),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _complete(job: Job, rid: str, request: Request[Any, Any, Any]) -> Response[Any]:
        """Wait for the finish event; a client that disconnects first cancels the job."""
        answer = asyncio.ensure_future(_finish_of(job))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():
                job.cancelled.set()
                answer.cancel()
        if answer.cancelled():
            return Response(content=b"", status_code=499)
        ev = answer.result()
        return Response(completion_body(rid, model_id, ev, engine.namespace))

    async def _finish_of(job: Job) -> FinishEvent:
        while True:
            ev = await next_event(job)
            if isinstance(ev, FinishEvent):
                return ev
            if ev is None:
                raise RuntimeError("generation ended without a finish event")

    async def _stream(job: Job, rid: str) -> AsyncIterator[bytes]:
        created = int(time.time())
        try:
            yield _sse(chunk_body(rid, model_id, created, {"role": "assistant", "content": ""}, None))
            while True:
                try:
                    ev = await asyncio.wait_for(next_event(job), timeout=cfg.keepalive_s)
                except asyncio.TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                except RequestError as e:
                    yield _sse(error_body(str(e), e.status, e.param))
                    break
                if ev is None:
                    break
                if isinstance(ev, TokenEvent):
                    if ev.text:
                        yield _sse(chunk_body(rid, model_id, created, {"content": ev.text}, None))
                elif isinstance(ev, FinishEvent):
                    yield _sse(chunk_body(rid, model_id, created, {}, ev.finish_reason))
                    final = chunk_body(rid, model_id, created, {}, None)
                    final["choices"] = []
                    final["usage"] = usage_body(ev)
                    final["keepwarm"] = keepwarm_body(ev, engine.namespace)
                    yield _sse(final)
                    yield _sse("[DONE]")
                    break
        finally:
            job.cancelled.set()

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_id,
                    "object": "model",
                    "created": 0,
                    "owned_by": "keepwarm",
                    "family": engine.backend.family,
                }
            ],
        }

    @get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id, "namespace": engine.namespace, "queue_depth": worker.depth}

    @get("/metrics", media_type="text/plain; version=0.0.4")
    async def metrics() -> bytes:
        return generate_latest(registry)

    @get("/v1/cache")
    async def cache_info(limit: int = 100) -> dict[str, Any]:
        return await asyncio.to_thread(_cache_info, engine, limit)

    @delete("/v1/cache", status_code=200)
    async def cache_clear() -> dict[str, Any]:
        return {"deleted": await asyncio.to_thread(_clear, engine)}

    async def shutdown() -> None:
        await asyncio.to_thread(worker.stop)
        await asyncio.to_thread(engine.close)

    return Litestar(
        route_handlers=[chat_completions, models, health, metrics, cache_info, cache_clear],
        exception_handlers={Exception: on_error},
        on_shutdown=[shutdown],
        request_max_body_size=32 * 1024 * 1024,
    )


async def _until_disconnect(request: Request[Any, Any, Any]) -> None:
    """Returns when the client has gone away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _cache_info(engine: Engine, limit: int) -> dict[str, Any]:
    memory = engine.cache.memory
    disk = engine.cache.disk
    stats: dict[str, Any] = {
        "engine": asdict(engine.stats),
        "memory": asdict(memory.stats()) if memory is not None else None,
        "disk": None,
    }
    entries: list[dict[str, Any]] = []
    if disk is not None:
        stats["disk"] = {
            **asdict(disk.stats()),
            "budget_bytes": engine.cfg.disk_budget,
            "min_free_bytes": engine.cfg.min_free_disk,
            "path": str(engine.cfg.cache_dir),
            "free_bytes": shutil.disk_usage(disk.root).free,
        }
        newest = sorted(disk.entries(), key=lambda e: e.last_used, reverse=True)[:limit]
        entries = [asdict(e) for e in newest]
    return {
        "namespace": engine.namespace,
        "model": engine.cfg.served_name,
        "family": engine.backend.family,
        "policy": str(engine.default_policy),
        "min_tokens": engine.cfg.min_tokens,
        "stats": stats,
        "entries": entries,
    }


def _clear(engine: Engine) -> int:
    n = 0
    if engine.cache.memory is not None:
        n += len(engine.cache.memory)
        engine.cache.memory.clear()
    if engine.cache.disk is not None:
        n += engine.cache.disk.clear()
    return n


def serve(cfg: EngineConfig) -> None:
    import uvicorn

    engine = Engine(cfg)
    app = create_app(engine, cfg)
    print(
        f"keepwarm engine: {cfg.served_name} on http://{cfg.host}:{cfg.port} "
        f"(namespace {engine.namespace[:12]}, cache {cfg.cache_dir})",
        flush=True,
    )
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
