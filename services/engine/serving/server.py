"""The engine HTTP service (litestar): OpenAI chat completions with keepwarm's
extensions, models, health, Prometheus metrics and the cache admin API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import asdict, fields, replace
from typing import Any

from litestar import Litestar, Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from keepwarm.engine.config import EngineConfig
from keepwarm.engine.engine import Engine, Event
from keepwarm.engine.generation.engine_stats import EngineStats
from keepwarm.engine.generation.request import FinishEvent, RequestError, TokenEvent
from keepwarm.engine.serving import wire
from keepwarm.engine.serving.drain_rate import DrainRate
from keepwarm.engine.serving.model_set import LOADED, ModelSet, ModelSlot, served_configs
from keepwarm.engine.serving.openai_format import (
    ChunkWriter,
    LogprobWriter,
    ReplyShape,
    completion_body,
    parse_chat_request,
    parse_completion_request,
    text_completion_body,
    text_completion_chunk,
)
from keepwarm.engine.serving.reasoning import prompt_opens_reasoning, uses_think_tags
from keepwarm.engine.serving.tool_calls import encode_chat_with_tools, tool_format_for
from keepwarm.engine.serving.worker import Job, QueueFull, Worker


class EngineCollector:
    """Reads the engines' counters at scrape time (no duplicated bookkeeping): request and
    step counters summed over every served model (a model's counters survive its parks),
    state memory and the RAM tier over the loaded ones, the disk tier (one folder for all
    models) as the first loaded model's cache sees it; and each model's residency, loads
    and parks with their durations."""

    def __init__(self, models: ModelSet, worker: Worker) -> None:
        self.models = models
        self.worker = worker

    def collect(self) -> Iterable[Metric]:
        yield from self._model_set()
        s = _summed([slot.stats for slot in self.models.slots.values()])
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
        yield GaugeMetricFamily(
            "keepwarm_running_sequences", "Sequences running", value=self.worker.num_running
        )
        yield GaugeMetricFamily(
            "keepwarm_waiting_sequences", "Sequences waiting to be admitted", value=self.worker.num_waiting
        )
        yield CounterMetricFamily("keepwarm_steps", "Engine steps (batched forwards)", value=s.steps)
        yield CounterMetricFamily("keepwarm_step_tokens", "Tokens fed by all steps", value=s.step_tokens)
        yield CounterMetricFamily("keepwarm_step_seconds", "Time spent in steps", value=s.step_seconds)
        yield CounterMetricFamily(
            "keepwarm_preemptions", "Sequences preempted (snapshot to RAM) for memory", value=s.preemptions
        )
        yield from self._speculation()
        engines = self.models.engines()
        yield GaugeMetricFamily(
            "keepwarm_state_memory_bytes",
            "Sequence state memory in use",
            value=sum(e.memory.used_bytes for e in engines),
        )
        yield GaugeMetricFamily(
            "keepwarm_state_memory_budget_bytes",
            "Sequence state memory budget (each loaded model has one; summed)",
            value=sum(e.memory.budget_bytes for e in engines),
        )
        mems = [e.cache.memory.stats() for e in engines if e.cache.memory is not None]
        if mems:
            yield GaugeMetricFamily(
                "keepwarm_memory_cache_entries", "RAM tier entries", value=sum(m.entries for m in mems)
            )
            yield GaugeMetricFamily(
                "keepwarm_memory_cache_bytes", "RAM tier bytes", value=sum(m.bytes for m in mems)
            )
            yield CounterMetricFamily(
                "keepwarm_memory_cache_evictions", "RAM tier evictions", value=sum(m.evictions for m in mems)
            )
        if engines:
            yield from self._disk(engines[0])

    def _speculation(self) -> Iterable[Metric]:
        """Speculative decoding per model family: drafted and accepted tokens, and their ratio."""
        by_family: dict[str, tuple[int, int]] = {}
        for slot in self.models.slots.values():
            d, a = by_family.get(slot.family, (0, 0))
            by_family[slot.family] = (d + slot.stats.drafted_tokens, a + slot.stats.accepted_tokens)
        drafted = CounterMetricFamily(
            "keepwarm_spec_drafted_tokens",
            "Speculative decoding: tokens drafted and verified",
            labels=["family"],
        )
        accepted = CounterMetricFamily(
            "keepwarm_spec_accepted_tokens",
            "Speculative decoding: drafted tokens kept (the reply is the same either way)",
            labels=["family"],
        )
        rate = GaugeMetricFamily(
            "keepwarm_spec_acceptance_rate",
            "Accepted over drafted tokens (0 before any draft)",
            labels=["family"],
        )
        for family, (d, a) in sorted(by_family.items()):
            drafted.add_metric([family], d)
            accepted.add_metric([family], a)
            rate.add_metric([family], a / d if d else 0.0)
        yield from (drafted, accepted, rate)

    def _model_set(self) -> Iterable[Metric]:
        loaded = GaugeMetricFamily(
            "keepwarm_model_loaded", "1 while the model's weights are loaded", labels=["model"]
        )
        size = GaugeMetricFamily(
            "keepwarm_model_weight_bytes", "The model's weights when loaded", labels=["model"]
        )
        by_type = GaugeMetricFamily(
            "keepwarm_model_weight_bytes_by_type",
            "A loaded model's weights by type: a quantized block kind (Q4_1, Q8_0, ...) or a dtype",
            labels=["model", "type"],
        )
        loads = CounterMetricFamily("keepwarm_model_loads", "Model loads (first request, or back from parked)",
                                    labels=["model"])  # fmt: skip
        load_s = CounterMetricFamily(
            "keepwarm_model_load_seconds", "Time spent loading models", labels=["model"]
        )
        parks = CounterMetricFamily(
            "keepwarm_model_parks", "Models parked for --models-budget", labels=["model"]
        )
        park_s = CounterMetricFamily(
            "keepwarm_model_park_seconds", "Time spent parking models", labels=["model"]
        )
        for slot in self.models.slots.values():
            name = [slot.name]
            loaded.add_metric(name, 1 if slot.residency == LOADED else 0)
            size.add_metric(name, slot.weight_bytes)
            engine = slot.engine
            if engine is not None:
                for kind, nbytes in sorted(engine.weight_bytes_by_type.items()):
                    by_type.add_metric([slot.name, kind], nbytes)
            loads.add_metric(name, slot.loads)
            load_s.add_metric(name, slot.load_seconds)
            parks.add_metric(name, slot.parks)
            park_s.add_metric(name, slot.park_seconds)
        yield from (loaded, size, by_type, loads, load_s, parks, park_s)
        yield GaugeMetricFamily(
            "keepwarm_models_budget_bytes", "Weights the loaded models may hold together (0: no limit)",
            value=self.models.budget_bytes,
        )  # fmt: skip

    def _disk(self, engine: Engine) -> Iterable[Metric]:
        disk = engine.cache.disk
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
                "Saves dropped (writer queue full: --writer-queue or --writer-queue-bytes)",
                value=ds.dropped_saves,
            )
            rejected = CounterMetricFamily(
                "keepwarm_disk_cache_rejected_files", "Files rejected and deleted", labels=["reason"]
            )
            for reason, n in ds.rejected_by_reason.items():
                rejected.add_metric([reason], n)
            yield rejected
            yield CounterMetricFamily(
                "keepwarm_disk_cache_refused_for_space",
                "Saves not stored for lack of budget or free disk",
                value=ds.refused_for_space,
            )
            yield CounterMetricFamily(
                "keepwarm_disk_cache_enospc", "Writes that hit a full disk", value=ds.enospc
            )
            yield CounterMetricFamily(
                "keepwarm_disk_cache_garbage_rows", "Index rows dropped as damaged", value=ds.garbage_rows
            )
            foreign = CounterMetricFamily(
                "keepwarm_disk_cache_foreign_files",
                "Folder entries skipped as not the cache's",
                labels=["kind"],
            )
            for kind, n in ds.foreign_by_kind.items():
                foreign.add_metric([kind], n)
            yield foreign
            errors = CounterMetricFamily(
                "keepwarm_disk_cache_errors", "Errors the writer thread or index survived", labels=["kind"]
            )
            for kind, n in ds.errors_by_kind.items():
                errors.add_metric([kind], n)
            yield errors
            yield GaugeMetricFamily(
                "keepwarm_disk_cache_min_free_bytes", "Free-space floor in force", value=ds.min_free_bytes
            )


def _summed(stats: list[EngineStats]) -> EngineStats:
    """Every counter of `stats` added up."""
    out = EngineStats()
    for st in stats:
        for f in fields(EngineStats):
            mine, theirs = getattr(out, f.name), getattr(st, f.name)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(out, f.name, mine + theirs)
    return out


def _sse(obj: dict[str, Any] | str | bytes) -> bytes:
    if isinstance(obj, bytes):
        return b"data: " + obj + b"\n\n"
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _error(message: str, status: int, param: str | None = None) -> bytes:
    """The one error envelope (wire.error_body) as the body's bytes."""
    return wire.encode(wire.error_body(message, status, param))


def _present(data: wire.T | None) -> wire.T:
    """A typed body, or a 400 for an empty one (litestar hands an empty body over as None)."""
    if data is None:
        raise RequestError("the request body is empty; send a JSON object")
    return data


# The error statuses each generating endpoint answers with (documented in /schema).
_GENERATE_ERRORS = wire.error_responses(400, 401, 404, 413, 429)
# Seconds an idle client connection is kept open.
KEEP_ALIVE_S = 75


def create_app(models: ModelSet, cfg: EngineConfig) -> Litestar:
    """The HTTP service over `models` (one or several); `cfg` holds the serving settings
    (limits, keep-alives, the token), the same for every model."""
    registry = CollectorRegistry()
    ttft = Histogram(
        "keepwarm_ttft_seconds",
        "Time to first token",
        registry=registry,
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    )

    drain = DrainRate()  # measured queue drain, for the 429's Retry-After

    def observe(ev: Event) -> None:
        if isinstance(ev, FinishEvent):
            ttft.observe(ev.timings.ttft_ms / 1000)
            drain.finished(max(0, worker.depth - 1))

    worker = Worker(models, on_event=observe)
    registry.register(EngineCollector(models, worker))  # type: ignore[arg-type]

    async def acquire(slot: ModelSlot) -> Engine:
        """The model's engine (loaded now when parked), pinned until `models.release(slot)`."""
        _, engine = await asyncio.to_thread(models.acquire, slot.name)
        return engine

    def error(e: Exception) -> Response[Any]:
        if isinstance(e, ClientGone):
            return Response(content=b"", status_code=499)
        if isinstance(e, wire.WireError):
            return Response(_error(str(e), e.status, e.param), status_code=e.status)
        if isinstance(e, RequestError):
            return Response(_error(str(e), e.status, e.param), status_code=e.status)
        if isinstance(e, QueueFull):
            # Room for one more once this many requests have drained (a finish admits a waiting
            # one): the wait for that, not for the whole queue, is the honest Retry-After.
            ahead, rate = max(1, worker.num_waiting - cfg.queue_size + 1), drain.rate()
            wait = drain.retry_after_s(ahead)
            pace = f"draining at {rate:.3f} requests/s" if rate is not None else "no drain rate measured yet"
            return Response(
                _error(
                    f"the engine queue is full ({cfg.queue_size} requests waiting); room after {ahead} "
                    f"requests ahead finish, {pace}; retry after {wait} s",
                    429,
                ),
                status_code=429,
                headers={"Retry-After": str(wait)},
            )
        return Response(_error(f"internal error: {type(e).__name__}: {e}", 500), status_code=500)

    def on_error(req: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        status = getattr(exc, "status_code", None)
        if isinstance(status, int) and not isinstance(
            exc, RequestError
        ):  # litestar's own (404, 405, 413 ...)
            detail = getattr(exc, "detail", "") or str(exc)
            if status == 413:
                detail = (
                    f"request body exceeds the engine's limit of {wire.MAX_BODY_BYTES >> 20} MiB; send less"
                )
            elif status == 404:
                detail = f"no route for {req.method} {req.url.path}; see /schema for the routes"
            elif status == 405:
                detail = f"{req.method} is not allowed on {req.url.path}"
            return Response(_error(str(detail), status), status_code=status)
        return error(exc)

    async def next_event(job: Job) -> Event | None:
        item = await job.events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def reply_shape(
        engine: Engine, tools_enabled: bool, parallel: bool, prompt_tokens: list[int]
    ) -> ReplyShape:
        thinks = uses_think_tags(engine.template.source)
        tail = engine.tokenizer.decode(prompt_tokens[-16:], skip_special_tokens=False) if thinks else ""
        return ReplyShape(
            tool_format=tool_format_for(engine.template.source, tools_enabled),
            first_call_only=not parallel,
            reasoning=thinks,
            starts_in_reasoning=thinks and prompt_opens_reasoning(tail),
        )

    @post("/v1/chat/completions", status_code=200, dto=wire.WireBody[wire.ChatCompletionRequest],
          return_dto=None, responses=_GENERATE_ERRORS)  # fmt: skip
    async def chat_completions(
        request: Request[Any, Any, Any], data: wire.ChatCompletionRequest | None = None
    ) -> Response[Any]:
        """OpenAI Chat Completions (streamed as SSE with `stream: true`)."""
        body = _present(data)
        slot = models.slot(body.model)
        model_id = slot.name
        call = parse_chat_request(body, cfg.max_tokens_limit, slot.cfg.policy)
        req = call.request
        engine = await acquire(slot)
        try:
            prompt = await _prepared(request, engine, req)
            shape = reply_shape(engine, call.tools_enabled, call.parallel_tool_calls, prompt.tokens)
            rid = "chatcmpl-" + uuid.uuid4().hex[:24]
            if worker.depth == 0:
                drain.busy()
            job = worker.submit(engine, req, prompt)
        finally:
            models.release(slot)
        logprobs = LogprobWriter(engine.tokenizer) if req.logprobs else None
        if not call.stream:
            got = await _complete(job, request, _collect(job, req.n))
            if got is None:
                return Response(content=b"", status_code=499)
            finishes, tokens = got
            return Response(
                completion_body(rid, model_id, finishes, engine.namespace, shape, tokens, logprobs),
                media_type="application/json",
            )
        return Stream(
            _stream(job, engine, ChunkWriter(rid, model_id, shape, call.include_usage, req.n, logprobs)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @post("/v1/completions", status_code=200, dto=wire.WireBody[wire.CompletionRequest], return_dto=None,
          responses=_GENERATE_ERRORS)  # fmt: skip
    async def completions(
        request: Request[Any, Any, Any], data: wire.CompletionRequest | None = None
    ) -> Response[Any]:
        """OpenAI (legacy) Completions: a raw prompt, text or token ids."""
        body = _present(data)
        slot = models.slot(body.model)
        model_id = slot.name
        call = parse_completion_request(body, cfg.max_tokens_limit, slot.cfg.policy)
        req = call.request
        engine = await acquire(slot)
        try:
            if call.prompt_text is not None:
                ids = await asyncio.to_thread(engine.tokenizer.encode, call.prompt_text, True)
                req = replace(req, prompt_tokens=tuple(ids))
            if any(t >= engine.tokenizer.vocab_size for t in req.prompt_tokens or ()):
                raise RequestError(
                    f"prompt token ids must be below {engine.tokenizer.vocab_size}", param="prompt"
                )
            prompt = await _prepared(request, engine, req)
            rid = "cmpl-" + uuid.uuid4().hex[:24]
            if worker.depth == 0:
                drain.busy()
            job = worker.submit(engine, req, prompt)
        finally:
            models.release(slot)
        if not call.stream:
            ev = await _complete(job, request)
            if ev is None:
                return Response(content=b"", status_code=499)
            return Response(
                text_completion_body(rid, model_id, ev, engine.namespace), media_type="application/json"
            )
        return Stream(
            _stream_text(job, engine, rid, model_id, call.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @post("/tokenize", status_code=200, dto=wire.WireBody[wire.TokenizeRequest], return_dto=None,
          responses=wire.error_responses(400, 401, 404, 413))  # fmt: skip
    async def tokenize(data: wire.TokenizeRequest | None = None) -> wire.TokenizeResponse:
        """Token ids of a text prompt, or of messages rendered by the chat template."""
        body = _present(data)
        slot = models.slot(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send exactly one of prompt (text) or messages (a chat)", param="prompt")
        if body.prompt is not None:
            if body.tools is not None or body.chat_template_kwargs is not None:
                raise RequestError("tools and chat_template_kwargs apply to messages only", param="tools")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            engine = await acquire(slot)
            models.release(slot)  # the tokenizer outlives a park
            ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt, add)
        else:
            if body.add_special_tokens is not None:
                raise RequestError(
                    "add_special_tokens applies to prompt only (the chat template places special tokens)",
                    param="add_special_tokens",
                )
            chat = parse_chat_request(
                wire.ChatCompletionRequest(messages=body.messages, tools=body.tools,
                                           chat_template_kwargs=body.chat_template_kwargs),
                cfg.max_tokens_limit, slot.cfg.policy, trusted=False,
            )  # fmt: skip
            req = chat.request
            engine = await acquire(slot)
            models.release(slot)  # the template outlives a park
            try:
                rendered = await asyncio.to_thread(
                    encode_chat_with_tools,
                    engine.template,
                    list(req.messages or ()),
                    body.add_generation_prompt,
                    list(req.tools) if req.tools else None,
                    req.chat_template_kwargs,
                )
            except ValueError as e:
                raise RequestError(
                    f"messages could not be rendered by the chat template: {e}", param="messages"
                ) from e
            ids = rendered.tokens
        return wire.TokenizeResponse(tokens=list(ids), count=len(ids), max_model_len=cfg.max_context)

    @post("/detokenize", status_code=200, dto=wire.WireBody[wire.DetokenizeRequest], return_dto=None,
          responses=wire.error_responses(400, 401, 404, 413))  # fmt: skip
    async def detokenize(data: wire.DetokenizeRequest | None = None) -> wire.DetokenizeResponse:
        """The text of token ids (special tokens kept)."""
        body = _present(data)
        slot = models.slot(body.model)
        engine = await acquire(slot)
        models.release(slot)  # the tokenizer outlives a park
        if any(t >= engine.tokenizer.vocab_size for t in body.tokens):
            raise RequestError(f"token ids must be below {engine.tokenizer.vocab_size}", param="tokens")
        return wire.DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))

    async def _collect(job: Job, num_choices: int) -> tuple[list[FinishEvent], dict[int, list[TokenEvent]]]:
        """Every choice's finish event and token events."""
        finishes: list[FinishEvent] = []
        tokens: dict[int, list[TokenEvent]] = {}
        while len(finishes) < num_choices:
            ev = await next_event(job)
            if isinstance(ev, FinishEvent):
                finishes.append(ev)
            elif isinstance(ev, TokenEvent):
                tokens.setdefault(ev.index, []).append(ev)
            elif ev is None:
                raise RuntimeError("generation ended without a finish event")
        return finishes, tokens

    async def _complete(job: Job, request: Request[Any, Any, Any], waiting: Any = None) -> Any:
        """Wait for the answer (`waiting`, by default the finish event); a client that
        disconnects first cancels the job (None)."""
        answer = asyncio.ensure_future(waiting if waiting is not None else _finish_of(job))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():
                job.cancelled.set()
                answer.cancel()
        if answer.cancelled():
            return None
        return answer.result()

    async def _finish_of(job: Job) -> FinishEvent:
        while True:
            ev = await next_event(job)
            if isinstance(ev, FinishEvent):
                return ev
            if ev is None:
                raise RuntimeError("generation ended without a finish event")

    async def _paced(job: Job) -> AsyncIterator[Event | bytes]:
        """The job's events until it ends, with an SSE keep-alive comment (bytes) whenever none
        came for `keepalive_s`, and an SSE error event (bytes, last) when the request fails."""
        while True:
            try:
                ev = await asyncio.wait_for(next_event(job), timeout=cfg.keepalive_s)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            except RequestError as e:
                yield _sse(_error(str(e), e.status, e.param))
                return
            if ev is None:
                return
            yield ev

    async def _stream(job: Job, engine: Engine, out: ChunkWriter) -> AsyncIterator[bytes]:
        try:
            for chunk in out.starts():
                yield _sse(chunk)
            async for ev in _paced(job):
                if isinstance(ev, bytes):
                    yield ev
                    continue
                if isinstance(ev, TokenEvent):
                    chunk = out.token(ev)
                    if chunk is not None:
                        yield _sse(chunk)
                elif isinstance(ev, FinishEvent):
                    for chunk in out.finish(ev, engine.namespace):
                        yield _sse(chunk)
                    if out.done:
                        yield _sse("[DONE]")
                        break
        finally:
            job.cancelled.set()

    async def _stream_text(
        job: Job, engine: Engine, rid: str, model_id: str, include_usage: bool
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        try:
            async for ev in _paced(job):
                if isinstance(ev, bytes):
                    yield ev
                    continue
                if isinstance(ev, TokenEvent):
                    if ev.text:
                        yield _sse(
                            text_completion_chunk(
                                rid, model_id, created, ev.text, None, None, "", include_usage
                            )
                        )
                elif isinstance(ev, FinishEvent):
                    yield _sse(
                        text_completion_chunk(
                            rid, model_id, created, "", ev.finish_reason, None, "", include_usage
                        )
                    )
                    if include_usage:
                        yield _sse(
                            text_completion_chunk(rid, model_id, created, "", None, ev, engine.namespace)
                        )
                    yield _sse("[DONE]")
                    break
        finally:
            job.cancelled.set()

    @get("/v1/models", responses=wire.error_responses(401))
    async def list_models() -> wire.ModelList:
        """The models this engine serves (the first is the default), each with its residency."""
        return wire.ModelList(data=[slot.card() for slot in models.slots.values()])

    @get("/health")
    async def health() -> dict[str, Any]:
        default = models.slots[models.default]
        return {
            "status": "ok",
            "model": default.name,
            "namespace": default.namespace,
            "models": {s.name: s.residency for s in models.slots.values()},
            "queue_depth": worker.depth,
            "running": worker.num_running,
            "waiting": worker.num_waiting,
            "prefill_cost": _prefill_cost_info(default.engine),
        }

    @get("/metrics", media_type="text/plain; version=0.0.4")
    async def metrics() -> bytes:
        return generate_latest(registry)

    @get("/v1/cache")
    async def cache_info(limit: int = 100, model: str | None = None) -> dict[str, Any]:
        """The named model's cache (the default model's without `model`)."""
        slot = models.slot(model)
        engine = await acquire(slot)
        try:
            return await asyncio.to_thread(_cache_info, engine, limit)
        finally:
            models.release(slot)

    @delete("/v1/cache", status_code=200)
    async def cache_clear(model: str | None = None) -> dict[str, Any]:
        """Delete the named model's entries (the default model's without `model`)."""
        slot = models.slot(model)
        engine = await acquire(slot)
        try:
            return {"deleted": await asyncio.to_thread(_clear, engine)}
        finally:
            models.release(slot)

    async def shutdown() -> None:
        await asyncio.to_thread(worker.stop)
        await asyncio.to_thread(models.close)

    async def only_the_gateway(request: Request[Any, Any, Any]) -> Response[Any] | None:
        """With an engine token set, every endpoint but /health (metrics included:
        they count every tenant's traffic) answers only `Authorization: Bearer <token>`."""
        if not cfg.engine_token or request.url.path == "/health":
            return None
        scheme, _, given = (request.headers.get("authorization") or "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), cfg.engine_token.encode()
        ):
            return None
        message = "this engine serves only its gateway: send 'Authorization: Bearer <KEEPWARM_ENGINE_TOKEN>'"
        return Response(_error(message, 401), status_code=401, media_type="application/json")

    return Litestar(
        state=State({"worker": worker}),  # serve() starts its background work once serving
        route_handlers=[
            chat_completions,
            completions,
            tokenize,
            detokenize,
            list_models,
            health,
            metrics,
            cache_info,
            cache_clear,
        ],
        before_request=only_the_gateway,
        exception_handlers={Exception: on_error},
        on_shutdown=[shutdown],
        request_max_body_size=wire.MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(title="keepwarm engine", version="0.1.0", path="/schema"),
        plugins=[wire.ClosedStructSchema()],
    )


# Rendering and tokenizing prompts runs on its own small pool: the work is linear in the
# request (and the gateway caps messages and bytes), and a flood of large bodies can
# only queue here, never starve the threads that serve the cache admin API.
_PREPARE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="keepwarm-prepare")


class ClientGone(Exception):
    """The client disconnected before its prompt was ready (HTTP 499, nothing queued)."""


async def _prepared(request: Request[Any, Any, Any], engine: Engine, req: Any) -> Any:
    """`engine.prepare(req)` raced against the client's disconnect: a client that goes away
    while its prompt renders is dropped at once (its render, bounded, finishes unused and
    it never reaches the queue)."""
    loop = asyncio.get_running_loop()
    work = loop.run_in_executor(_PREPARE_POOL, engine.prepare, req)
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()  # not started yet: never runs
        raise ClientGone
    return work.result()


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


def _prefill_cost_info(engine: Engine | None) -> dict[str, Any] | None:
    """The default model's prefill cost model (None while it is parked): `calibration` is
    "persisted" (read from the cache folder), or its warm-up's "waiting" (the server is not
    answering yet), "running" (between requests) or "done"; `fitted` once it reports what
    restores save (from the warm-up or from real prefills, whichever comes first)."""
    if engine is None:
        return None
    return {
        "calibration": engine.calibration.state,
        "warmup_prefills": engine.calibration.done,
        "warmup_planned": engine.calibration.planned,
        "samples": engine.prefill_cost.samples,
        "fitted": engine.prefill_cost.calibrated,
    }


def _clear(engine: Engine) -> int:
    # saves accepted before the request land and reach the disk first (the writer runs at a low
    # priority and may still hold some), so none of them reappears after the clear
    engine.flush()
    n = 0
    if engine.cache.memory is not None:
        n += len(engine.cache.memory)
        engine.cache.memory.clear()
    if engine.cache.disk is not None:
        n += engine.cache.disk.clear()
    return n


def serve(cfg: EngineConfig) -> None:
    """Load the default model, then answer HTTP; background work (the prefill cost model's
    warm-up on a new cache folder) starts only once the server answers, and runs between
    requests."""
    import uvicorn

    models = ModelSet(served_configs(cfg), cfg.models_budget)
    app = create_app(models, cfg)
    worker: Worker = app.state.worker
    # The default model loads now (errors surface at start), on the generation thread, where
    # its steps run (worker.py says why); the others on their first request.
    slot, engine = worker.call(lambda: models.acquire(None))
    models.release(slot)
    others = (
        f"; also serving {', '.join(list(models.slots)[1:])} (loaded on demand)"
        if len(models.slots) > 1
        else ""
    )
    print(
        f"keepwarm engine: {slot.name} on http://{cfg.host}:{cfg.port} "
        f"(namespace {engine.namespace[:12]}, cache {cfg.cache_dir}){others}",
        flush=True,
    )
    if not cfg.engine_token:
        print("warning: no KEEPWARM_ENGINE_TOKEN: this engine serves anyone who reaches its port", flush=True)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=cfg.host,
            port=cfg.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            # Longer than any client's idle keep-alive (the gateway's is 5 s): the client, not the
            # engine, closes an idle connection, so no request goes out on one being closed.
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )

    def when_serving() -> None:
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.01)
        if engine.calibration.planned:
            fit = (
                f"prefill cost model: {engine.calibration.done} of {engine.calibration.planned} warm-up "
                "prefills run; the rest run between requests, and real prefills count too"
            )
        else:
            fit = "prefill cost model read from the cache folder"
        print(f"keepwarm engine: ready on http://{cfg.host}:{cfg.port} ({fit})", flush=True)
        worker.start_background()

    threading.Thread(target=when_serving, name="keepwarm-ready", daemon=True).start()
    server.run()
