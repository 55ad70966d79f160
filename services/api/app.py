"""The OpenAI-compatible gateway: `create_app(config) -> Litestar`.

POST /v1/chat/completions and POST /v1/completions, per request:
  auth (Bearer key -> tenant) -> per-tenant rate limit (429) -> body size (413)
  -> bounded JSON (depth, message count, every numeric field's range: 400/413
  naming the field or limit, see chat_body) -> the typed wire model (400 naming
  the field, as an engine would) -> `model` resolved against the models healthy
  engines serve (404 listing them; `default` or no model: the only one served)
  -> client `cache_salt` and `session_hint` dropped; `cache_salt` = HMAC(secret,
  tenant); the session's last prefix key from Redis sent as `session_hint` ->
  the first healthy engine serving that model in routing order (engines.py: the
  session's engine while it is healthy, else the least loaded by the engines'
  running + waiting sequences, so a moved session restores from the shared disk
  cache through its hint); a failure before anything reached the client moves on
  to the next engine -> the answer passed through. Busy is not dead: an engine
  is marked down for everyone only when it answers nobody (connection refused,
  a timeout, three /health timeouts in a row); one connection that broke before
  an answer costs only that request a retry (after a health probe of the
  engine), and a request whose engine was marked down while it waited tries it
  again if it is healthy at the next look (each engine at most twice). When
  every engine answered 429 (queue full), the client gets the 429 with the
  shortest Retry-After among them; a 503 means no engine answers at all.
  A stream, once its first byte reached the client, is never retried.

Streaming is passed through line by line as bytes arrive (no buffering beyond
one SSE line). The one chunk carrying `usage` is parsed on the way: its
`keepwarm` object (the engine-internal prefix key) is removed, and the session
and stats are written to Redis *before* that chunk is forwarded, so a client
that sends its next turn right after `[DONE]` already gets the new hint.
Non-streaming answers lose their `keepwarm` object the same way. The engine's answers are
decoded into the wire models (wire.ChatCompletion, ChatCompletionChunk, Completion), never
handled as plain dicts. Clients see
plain OpenAI objects plus `usage.prompt_tokens_details` and `usage.timings`.

A client that disconnects closes the upstream request, so the engine cancels
the generation: streaming via litestar's disconnect listener cancelling the
relay (plus a background close as a backstop), non-streaming by racing the
engine call against the client's `http.disconnect`.

POST /tokenize and /detokenize are passed to an engine serving the model.
/schema serves the OpenAPI document (request bodies typed by the wire models;
every error in the one shape of errors.py).

Every engine request carries `Authorization: Bearer <engine token>` when one is
configured (engines refuse anyone else).

Tenant isolation: /v1/stats, /v1/sessions and /v1/cache answer only about the
caller's tenant (cache entries: the keys engines reported for the tenant's
requests; per-engine rows: shared capacity figures, never another request's
counters, keys or paths). DELETE /v1/cache, and listing every tenant's entries,
are for KEEPWARM_ADMIN_TENANTS only; by default no tenant is admin.

Several gateways share everything through Redis: sessions (hence affinity:
session -> engine, last prefix key), stats, rate-limit windows and the tenants'
cache keys; API keys and the secret are configuration, the same in every
replica. Per process by nature: the engines' health and load (each gateway
polls them itself; an engine down for one gateway is tried by the others
until they see it too) and the Redis circuit breaker (each gateway's own
connection).

Redis trouble never fails a chat request: every Redis call has a short socket
timeout and no retries, behind a circuit breaker (see breaker), so a dead or
hung Redis costs one timeout and then nothing; sessions, stats and the rate
limit degrade (logged once per outage); the Redis-only endpoints answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import httpx
import msgspec
from litestar import Litestar, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from keepwarm.api.auth import Authenticator, Caller
from keepwarm.api.breaker import Breaker, RedisUnavailable
from keepwarm.api.chat_body import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody
from keepwarm.api.config import GatewayConfig
from keepwarm.api.engines import EnginePool, Ticket
from keepwarm.api.errors import ApiError, client_closed, handle_exception, upstream_error
from keepwarm.api.messages_api import routes as messages_routes
from keepwarm.api.metrics import GatewayMetrics
from keepwarm.api.rate_limit import RateLimiter
from keepwarm.api.record import RequestRecord
from keepwarm.api.responses_api import routes as responses_routes
from keepwarm.api.sessions import SessionStore, check_session_id
from keepwarm.api.stats import StatsStore
from keepwarm.api.tenant_keys import TenantKeys
from keepwarm.engine.serving import wire

log = logging.getLogger("keepwarm.api")
R = TypeVar("R")  # what one attempt on an engine returns

# Failures that prove the engine never produced an answer the client could have
# seen part of; the request moves on. Two kinds, told apart because one broken
# connection must not take a busy engine away from every other request:
# - the engine answers nobody (connection refused, no connection or no byte in
#   time): it is marked down at once, for every request;
# - one connection broke before an answer (a keep-alive connection the engine
#   closed as the request went out, a reset): only this request is affected; it
#   tries again, on a new connection, after one health probe of that engine
#   (which marks it down only if the engine itself does not answer).
_DEAD_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, httpx.WriteTimeout)
_BROKEN_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.PoolTimeout)
_FAILOVER_ERRORS = _DEAD_ERRORS + _BROKEN_ERRORS
# Times one request is sent to one engine before it gives that engine up.
_TRIES_PER_ENGINE = 2
# What a tenant that is not admin sees of an engine's cache stats: the shared
# capacity, nothing about other tenants' requests (counters, keys, paths).
_SHARED_STATS = {
    "memory": ("entries", "bytes", "budget_bytes"),
    "disk": ("num_entries", "num_bytes", "budget_bytes", "min_free_bytes", "free_bytes", "evictions"),
}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Turn:
    """What the gateway knows about one chat request while it runs."""

    caller: Caller
    session: str | None
    engine: str
    usage_to_client: bool = True  # streams: the client asked for stream_options.include_usage
    path: str = "/v1/chat/completions"


async def _until_disconnect(request: Request[Any, Any, Any]) -> None:
    """Returns when the client has gone away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Gateway:
    """Everything one gateway process holds; created by create_app, opened in
    the app's lifespan."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.auth = Authenticator(config.api_keys, config.secret)
        # No retries: one attempt bounded by the socket timeouts; the breaker decides the rest.
        self.redis: Redis = Redis.from_url(
            config.redis_url,
            decode_responses=True,
            socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self.breaker = Breaker(cooldown_s=config.redis_cooldown_s)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s, read=config.read_timeout_s, write=30.0, pool=10.0
            ),
            # Idle connections closed by the gateway after 5 s, well before an engine would close
            # them (75 s), so a request never goes out on a connection the engine is closing.
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=64, keepalive_expiry=5.0),
            headers={"Authorization": f"Bearer {config.engine_token}"} if config.engine_token else None,
        )
        self.pool = EnginePool(
            config.engines,
            self.client,
            interval_s=config.health_interval_s,
            probe_timeout_s=config.health_timeout_s,
        )
        self.metrics = GatewayMetrics(self.breaker, self.pool)
        self.sessions = SessionStore(
            self.redis,
            prefix=config.redis_prefix,
            ttl_s=config.session_ttl_s,
            timeline_len=config.timeline_len,
        )
        self.stats = StatsStore(
            self.redis, prefix=config.redis_prefix, recent_len=config.recent_len, ttft_len=config.ttft_len
        )
        self.tenant_keys = TenantKeys(self.redis, prefix=config.redis_prefix, ttl_s=config.session_ttl_s)
        self.limiter = (
            RateLimiter(
                self.redis, prefix=config.redis_prefix, limit=config.rate_limit, window_s=config.rate_window_s
            )
            if config.rate_limit > 0
            else None
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def open(self) -> None:
        await self.pool.probe_all()
        self._tasks = [
            asyncio.create_task(self.pool.run(), name="engine-health"),
            asyncio.create_task(self.breaker.watch(self.redis_probe), name="redis-breaker"),
        ]

    async def redis_probe(self) -> None:
        """The breaker's half-open probe: a ping on a fresh connection. Every pooled connection
        is dropped first (none is in use while the circuit is open): after a Redis restart they
        are all dead, and the first requests after the circuit closes would trip it again."""
        await self.redis.connection_pool.disconnect()
        await self.redis.ping()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.client.aclose()
        await self.redis.aclose()

    def is_admin(self, caller: Caller) -> bool:
        return caller.tenant in self.config.admin_tenants

    def admin_only(self, caller: Caller, what: str) -> str:
        """The 403 message for a tenant that is not admin."""
        who = ", ".join(self.config.admin_tenants) or "no tenant (it is empty)"
        return f"tenant {caller.tenant!r} may not {what}; KEEPWARM_ADMIN_TENANTS lists who may: {who}"

    async def redis_do(self, coro: Any, what: str) -> Any:
        """A Redis call for something a chat can do without: None when Redis is
        not answering (logged once per outage by the breaker, or here for other errors)."""
        try:
            return await self.breaker.call(coro)
        except RedisUnavailable:
            return None
        except RedisError as e:
            log.warning("%s skipped, redis error: %s", what, e)
            return None

    # -- chat ------------------------------------------------------------

    async def check_rate(self, caller: Caller) -> None:
        if self.limiter is None:
            return
        wait = await self.redis_do(self.limiter.retry_after(caller.tenant, time.time()), "rate limit")
        if wait is not None:
            raise ApiError(
                429,
                f"rate limit of {self.limiter.limit} requests per {self.limiter.window_s}s for this API key's "
                f"tenant reached; retry after {wait}s",
                headers={"Retry-After": str(wait)},
            )

    async def healthy_engines(self, affinity: str, preferred: str | None, model: str) -> list[str]:
        engines = self.pool.candidates(affinity, preferred, model)
        if not engines:
            # The poller may lag a restart; look once more before refusing.
            await self.pool.probe_all()
            engines = self.pool.candidates(affinity, preferred, model)
        if not engines:
            raise self.unavailable(model)
        return engines

    def no_engine(self) -> ApiError:
        down = "; ".join(self.pool.problems()) or "every engine failed this request"
        retry = max(1, math.ceil(self.config.health_interval_s))
        return ApiError(503, f"no healthy engine, retry later ({down})", headers={"Retry-After": str(retry)})

    async def remember(self, turn: Turn, usage: wire.Usage, keepwarm: wire.KeepwarmInfo | None) -> None:
        """Session, stats and the tenant's cache key for one finished request;
        Redis trouble costs the record, never the answer."""
        now = time.time()
        rec = RequestRecord.from_usage(
            usage, ts=now, session=turn.session, tenant=turn.caller.tenant, engine=turn.engine
        )
        row = rec.encoded()  # one encoding for the session timeline and the stats list
        key = keepwarm.prefix_key if keepwarm is not None else None
        tokens = keepwarm.prefix_tokens if keepwarm is not None else 0
        if turn.session is not None:
            await self.redis_do(
                self.sessions.record_turn(turn.caller.tenant, turn.session, rec, key, tokens, row),
                "session record",
            )
        if key:
            await self.redis_do(self.tenant_keys.add(turn.caller.tenant, key, now), "cache key record")
        await self.redis_do(self.stats.record(rec, row), "stats record")

    def resolve_model(self, name: str | None) -> str:
        """The served model a request's `model` names: itself, or for `default` (or none) the one
        model served. 404 listing the served ones for an unknown name; 503 when the model's
        engines are all down (or no engine is up to say what is served)."""
        served = self.pool.served()
        if not served:
            raise self.no_engine()
        if name is None or name == wire.DEFAULT_MODEL:
            if len(served) == 1:
                return next(iter(served))
            raise ApiError(
                400,
                f"this gateway serves several models ({', '.join(sorted(served))}); name one in 'model' "
                f"({wire.DEFAULT_MODEL!r} stands for the only model when just one is served)",
                param="model",
            )
        if name in served:
            return name
        if self.pool.known(name):
            raise self.model_down(name)
        raise ApiError(
            404,
            f"model {name!r} is not served here; served models: {', '.join(sorted(served))} "
            f"(GET /v1/models; {wire.DEFAULT_MODEL!r} names the only one when just one is served)",
            param="model",
        )

    def model_down(self, name: str) -> ApiError:
        """The 503 for a model some engine served but no healthy one serves now."""
        retry = max(1, math.ceil(self.config.health_interval_s))
        return ApiError(
            503,
            f"no healthy engine serves model {name!r} now; retry later",
            param="model",
            headers={"Retry-After": str(retry)},
        )

    def unavailable(self, model: str) -> ApiError:
        """Why no engine took a request for `model` (resolved once, by `served_model`): the
        model's own 503 when its engines went away, else the 503 naming every engine's trouble."""
        served = self.pool.served()
        if served and model not in served and self.pool.known(model):
            return self.model_down(model)
        return self.no_engine()

    async def served_model(self, name: str | None) -> str:
        if not self.pool.served():
            await self.pool.probe_all()  # the poller may lag a restart; look once more
        return self.resolve_model(name)

    async def generate(
        self, request: Request[Any, Any, Any], data: wire.SamplingFields, path: str
    ) -> Response[Any]:
        """Chat completions and completions: the same sessions, salt, routing and usage records."""
        if data.stream:
            return await self._routed(request, data, path, self._stream, hands_over=True)
        reply = await self.complete(request, data, path)
        if reply is None:  # the client left first
            return client_closed()
        return Response(content=wire.encode(reply), media_type="application/json")

    async def complete(
        self, request: Request[Any, Any, Any], data: wire.SamplingFields, path: str
    ) -> wire.ChatCompletion | wire.Completion | None:
        """A non-streamed answer (`data.stream` false) as its wire model, its usage recorded and
        the engine-internal `keepwarm` object removed; None when the client left first."""

        async def attempt(
            turn: Turn, payload: bytes, ticket: Ticket
        ) -> wire.ChatCompletion | wire.Completion | None:
            return await self._complete(turn, payload, request)

        assert not data.stream, "complete() answers a non-streamed request"
        return await self._routed(request, data, path, attempt, hands_over=False)

    async def _routed(
        self,
        request: Request[Any, Any, Any],
        data: wire.SamplingFields,
        path: str,
        attempt: Callable[[Turn, bytes, Ticket], Awaitable[R]],
        hands_over: bool,
    ) -> R:
        """`attempt` on one engine after another (session affinity first) until one answers;
        `hands_over`: a successful attempt owns the engine's ticket (a stream closes it)."""
        caller: Caller = request.state.caller
        sid: str | None = None
        if request.headers.get("x-session-id"):
            sid = check_session_id(request.headers["x-session-id"], "X-Session-Id")
        elif data.user:
            sid = check_session_id(data.user, "user")
        model = await self.served_model(data.model)
        session = None
        if sid is not None:
            session = await self.redis_do(self.sessions.get(caller.tenant, sid), "session read")
        # Engine-only fields are the gateway's to set, never a client's.
        changes: dict[str, Any] = {"model": model, "cache_salt": caller.salt, "session_hint": None}
        if session is not None and session.key:
            changes["session_hint"] = wire.SessionHintBody(key=session.key, tokens=session.tokens)
        streaming = data.stream
        usage_to_client = True
        if streaming:
            # The gateway needs the usage chunk (sessions, stats); the client gets it only if it asked.
            usage_to_client = bool(data.stream_options and data.stream_options.include_usage)
            changes["stream_options"] = wire.StreamOptions(include_usage=True)
        payload = wire.encode(msgspec.structs.replace(data, **changes))
        affinity, preferred = sid or caller.tenant, session.engine if session else None
        tries: Counter[str] = Counter()  # sends per engine; _TRIES_PER_ENGINE = given up
        full: list[ApiError] = []  # engines that answered 429
        engines = await self.healthy_engines(affinity, preferred, model)
        while engines:
            for url in engines:
                tries[url] += 1
                turn = Turn(
                    caller=caller, session=sid, engine=url, usage_to_client=usage_to_client, path=path
                )
                ticket = self.pool.begin(url)  # counted in the engine's load while it runs
                handed_over = False  # a stream closes its ticket when it ends
                try:
                    result = await attempt(turn, payload, ticket)
                    handed_over = hands_over
                    return result
                except _DEAD_ERRORS as e:
                    self.pool.mark_down(url, f"{type(e).__name__}: {e}")
                    tries[url] = _TRIES_PER_ENGINE
                    self.metrics.retried("engine_down")
                    log.warning("engine %s failed before answering (%s); trying the next", url, e)
                except _BROKEN_ERRORS as e:
                    log.warning("connection to engine %s broke before an answer (%r); trying again", url, e)
                    self.metrics.retried("broken_connection")
                    await self.pool.probe(url)  # down only if the engine itself does not answer
                except _EngineLost:
                    self.metrics.retried("engine_lost")
                    log.warning("engine %s went down while the request waited; trying the next", url)
                except _EngineBusy:
                    tries[url] = _TRIES_PER_ENGINE
                    self.metrics.retried("engine_busy")
                    log.warning("engine %s answered 503; trying the next", url)
                except _EngineFull as e:
                    tries[url] = _TRIES_PER_ENGINE
                    self.metrics.retried("queue_full")
                    full.append(e.error)
                finally:
                    if not handed_over:
                        ticket.close()
            # One fresh look: engines that came back (a paused one resumed, a slow /health
            # answered again) are tried again, each at most _TRIES_PER_ENGINE times in all.
            await self.pool.probe_all()
            engines = [
                u for u in self.pool.candidates(affinity, preferred, model) if tries[u] < _TRIES_PER_ENGINE
            ]
        if full:
            raise min(full, key=_retry_after)
        raise self.unavailable(model)

    async def _until_lost(self, url: str) -> None:
        await self.pool.lost(url).wait()

    async def _race_loss(self, turn: Turn, work: asyncio.Task[Any], *others: asyncio.Task[Any]) -> None:
        """Waits for `work` or any of `others`; if the engine is marked down first,
        `work` is cancelled (closing the upstream request) and _EngineLost raised."""
        lost = asyncio.create_task(self._until_lost(turn.engine))
        try:
            await asyncio.wait({work, lost, *others}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if not work.done() and lost.done() and not lost.cancelled():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, *_FAILOVER_ERRORS):
                await work
            raise _EngineLost()

    async def _open(self, turn: Turn, payload: bytes) -> httpx.Response:
        """The engine's response with headers read; non-200 answers raise."""
        req = self.client.build_request(
            "POST",
            f"{turn.engine}{turn.path}",
            content=payload,
            headers={"content-type": "application/json"},
        )
        sent = time.monotonic()
        resp = await self.client.send(req, stream=True)
        waited = time.monotonic() - sent
        if resp.status_code == 200:
            self.metrics.waited("answer", waited)
        elif resp.status_code == 429:
            self.metrics.waited("queue_full", waited)
        if resp.status_code != 200:
            try:
                err = await resp.aread()
            finally:
                await resp.aclose()
            if resp.status_code == 503:
                raise _EngineBusy()
            error = upstream_error(resp.status_code, err, resp.headers)
            if resp.status_code == 429:
                raise _EngineFull(error)
            raise error
        return resp

    async def _complete(
        self, turn: Turn, payload: bytes, request: Request[Any, Any, Any]
    ) -> wire.ChatCompletion | wire.Completion | None:
        async def call() -> bytes:
            resp = await self._open(turn, payload)
            try:
                return await resp.aread()
            finally:
                await resp.aclose()

        answer = asyncio.create_task(call())
        gone = asyncio.create_task(_until_disconnect(request))
        try:
            await self._race_loss(turn, answer, gone)
        finally:
            gone.cancel()
            if not answer.done():
                # The client left: cancelling closes the upstream connection,
                # which is the engine's signal to stop generating.
                log.info("client left before %s answered; closing the upstream request", turn.engine)
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
        if answer.cancelled():
            return None
        reply = _engine_reply(turn, answer.result())
        if reply.usage is not None and not isinstance(reply.usage, msgspec.UnsetType):
            await self.remember(turn, reply.usage, _keepwarm(reply.keepwarm))
        return msgspec.structs.replace(reply, keepwarm=msgspec.UNSET)  # engine-internal

    async def _stream(self, turn: Turn, payload: bytes, ticket: Ticket) -> Response[Any]:
        opening = asyncio.create_task(self._open(turn, payload))
        try:
            await self._race_loss(turn, opening)
        finally:
            if not opening.done():  # this request itself was cancelled (client gone)
                opening.cancel()
        resp = opening.result()

        async def finish() -> None:
            ticket.close()
            await resp.aclose()

        return Stream(
            self._relay(turn, resp, ticket),
            media_type="text/event-stream",
            headers=dict(_SSE_HEADERS),
            background=BackgroundTask(finish),  # also runs after a client disconnect
        )

    async def _relay(self, turn: Turn, resp: httpx.Response, ticket: Ticket) -> AsyncIterator[bytes]:
        pending = b""
        skip_blank = False
        try:
            async for chunk in resp.aiter_bytes():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if not lines:
                    continue
                out: list[bytes] = []
                for line in lines:
                    if skip_blank and not line:
                        skip_blank = False
                        continue
                    if line.startswith(b"data:") and b'"usage"' in line:
                        kept = await self._usage_line(turn, line)
                        if kept is None:  # the client did not ask for usage: drop the whole event
                            skip_blank = True
                            continue
                        line = kept
                    out.append(line + b"\n")
                if out:
                    yield b"".join(out)
            if pending:
                yield pending
        except httpx.HTTPError as e:
            # Mid-stream failure: bytes already reached the client, so no failover;
            # the client gets an error event in the stream instead of [DONE].
            log.warning("engine %s failed mid-stream: %s", turn.engine, e)
            err = ApiError(
                502, f"engine failed mid-stream ({type(e).__name__}); retry the request"
            ).envelope()
            yield b"data: " + wire.encode(err) + b"\n\n"
        finally:
            ticket.close()
            # Shielded: after a client disconnect this frame runs inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    async def _usage_line(self, turn: Turn, line: bytes) -> bytes | None:
        """The usage chunk with its `keepwarm` object removed, after recording it;
        None (drop it) when the client did not ask for usage."""
        try:
            chunk = wire.decode(line[5:], _CHUNKS[turn.path])
        except wire.WireError:
            return line
        if not isinstance(chunk.usage, wire.Usage):
            return line
        keepwarm = _keepwarm(chunk.keepwarm)
        await self.remember(turn, chunk.usage, keepwarm)
        if not turn.usage_to_client:
            return None
        if keepwarm is None:
            return line
        return b"data: " + wire.encode(msgspec.structs.replace(chunk, keepwarm=msgspec.UNSET))

    # -- everything else -------------------------------------------------

    async def models(self) -> wire.ModelList:
        """Every model a healthy engine serves, as the engines' /v1/models listed them (learned
        by the health poll); for a model several engines serve, the smallest max_model_len
        (what any of them takes) and the earliest `created`."""
        if not self.pool.served():
            await self.pool.probe_all()
        served = self.pool.served()
        if not served:
            raise self.no_engine()
        cards = []
        for name in sorted(served):
            of = served[name]
            cards.append(
                wire.ModelCard(
                    id=name,
                    created=min(_int(c.get("created")) for c in of),
                    owned_by=str(of[0].get("owned_by") or "keepwarm"),
                    max_model_len=min(_int(c.get("max_model_len")) for c in of),
                )
            )
        return wire.ModelList(data=cards)

    async def pass_through(self, request: Request[Any, Any, Any], data: Any, path: str) -> Response[Any]:
        """/tokenize, /detokenize: the answer of an engine serving the model, as it is."""
        caller: Caller = request.state.caller
        model = await self.served_model(data.model)
        payload = wire.encode(msgspec.structs.replace(data, model=model))
        for url in await self.healthy_engines(caller.tenant, None, model):
            try:
                r = await self.client.post(
                    f"{url}{path}", content=payload, headers={"content-type": "application/json"}
                )
            except _DEAD_ERRORS as e:
                self.pool.mark_down(url, f"{type(e).__name__}: {e}")
                self.metrics.retried("engine_down")
                continue
            except _BROKEN_ERRORS as e:
                log.warning("connection to engine %s broke before an answer (%r); trying the next", url, e)
                self.metrics.retried("broken_connection")
                await self.pool.probe(url)
                continue
            if r.status_code != 200:
                raise upstream_error(r.status_code, r.content, r.headers)
            return Response(content=r.content, media_type="application/json")
        raise self.no_engine()

    async def cache(self, caller: Caller, top: int) -> dict[str, Any]:
        """Each engine's namespace and cache figures with the caller's `top` most-hit
        disk entries, plus the `top` most-hit entries over all engines (each naming
        its engine). A tenant sees only its own entries and the engines' shared
        capacity; an admin tenant sees every entry and every figure."""
        admin = self.is_admin(caller)
        own: set[str] | None = None
        if not admin:
            own = await self.redis_call("cache listing", self.tenant_keys.of(caller.tenant))

        def rank(e: dict[str, Any]) -> tuple[float, float]:
            return (float(e.get("hits") or 0), float(e.get("last_used") or 0))

        async def one(url: str) -> dict[str, Any]:
            row: dict[str, Any] = {"url": url, "healthy": self.pool.health(url).healthy}
            try:
                r = await self.client.get(f"{url}/v1/cache", params={"limit": 100_000}, timeout=10.0)
                data = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as e:
                return row | {"error": f"{type(e).__name__}: {e}", "entries": []}
            if not isinstance(data, dict):
                return row | {"error": f"engine answered HTTP {r.status_code}", "entries": []}
            entries = [
                e | {"engine": url}
                for e in data.get("entries") or []
                if isinstance(e, dict) and (own is None or e.get("key") in own)
            ]
            entries.sort(key=rank, reverse=True)
            raw = data.get("stats")
            stats: dict[str, Any] = raw if isinstance(raw, dict) else {}
            return row | {
                "namespace": data.get("namespace"),
                "stats": stats if admin else _shared_stats(stats),
                "total_entries": len(entries),
                "entries": entries[:top],
            }

        engines = list(await asyncio.gather(*(one(u) for u in self.pool.urls)))
        merged = sorted((e for row in engines for e in row["entries"]), key=rank, reverse=True)
        return {"tenant": caller.tenant, "engines": engines, "entries": merged[:top]}

    async def clear_cache(self) -> dict[str, Any]:
        async def one(url: str) -> dict[str, Any]:
            try:
                r = await self.client.delete(f"{url}/v1/cache", timeout=30.0)
                if r.status_code != 200:
                    return {"url": url, "deleted": 0, "error": f"engine answered HTTP {r.status_code}"}
                return {"url": url, "deleted": int(r.json().get("deleted", 0))}
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                return {"url": url, "deleted": 0, "error": f"{type(e).__name__}: {e}"}

        rows = list(await asyncio.gather(*(one(u) for u in self.pool.urls)))
        return {"deleted": sum(r["deleted"] for r in rows), "engines": rows}

    async def redis_call(self, what: str, coro: Any) -> Any:
        """For the Redis-only endpoints: the result, or a 503 saying Redis is down."""
        try:
            return await self.breaker.call(coro)
        except RedisError as e:
            raise ApiError(503, f"{what} unavailable: redis is not reachable ({e}); retry later") from None


# The engine's answers, typed: a whole reply and a streamed chunk, per generating path.
_REPLIES: dict[str, type[wire.ChatCompletion] | type[wire.Completion]] = {
    "/v1/chat/completions": wire.ChatCompletion,
    "/v1/completions": wire.Completion,
}
_CHUNKS: dict[str, type[wire.ChatCompletionChunk] | type[wire.Completion]] = {
    "/v1/chat/completions": wire.ChatCompletionChunk,
    "/v1/completions": wire.Completion,
}


def _engine_reply(turn: Turn, raw: bytes) -> wire.ChatCompletion | wire.Completion:
    """An engine's non-streamed answer as its wire model, or a 502 saying what was wrong."""
    try:
        return wire.decode(raw, _REPLIES[turn.path])
    except wire.WireError as e:
        if e.param is None and "not valid JSON" in str(e):
            raise ApiError(502, f"engine {turn.engine} returned a body that is not JSON") from None
        raise ApiError(
            502, f"engine {turn.engine} returned a body that does not fit its model: {e}"
        ) from None


def _keepwarm(info: wire.KeepwarmInfo | msgspec.UnsetType) -> wire.KeepwarmInfo | None:
    return info if isinstance(info, wire.KeepwarmInfo) else None


def _shared_stats(stats: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tier, names in _SHARED_STATS.items():
        section = stats.get(tier)
        out[tier] = {n: section[n] for n in names if n in section} if isinstance(section, dict) else None
    return out


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _retry_after(e: ApiError) -> float:
    try:
        return float(e.headers.get("Retry-After") or e.headers.get("retry-after") or math.inf)
    except ValueError:
        return math.inf


class _EngineLost(Exception):
    """The engine was marked down while the request waited for it; nothing reached the client."""


class _EngineFull(Exception):
    """An engine answered 429 (its queue is full); another may have room."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class _EngineBusy(Exception):
    """An engine answered 503 (starting or stopping); another may serve."""


def create_app(config: GatewayConfig) -> Litestar:
    gw = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        await gw.open()
        try:
            yield
        finally:
            await gw.close()

    def caller_of(request: Request[Any, Any, Any]) -> Caller:
        return gw.auth.authenticate(request.headers.get("authorization"))

    async def admit(request: Request[Any, Any, Any]) -> None:
        """Before a POST body is read: the caller (401) and its rate limit (429)."""
        caller = caller_of(request)
        await gw.check_rate(caller)
        request.state.caller = caller

    chat_body = type("ChatBody", (ChatBody,), {"max_messages": config.max_messages})
    generate_errors = wire.error_responses(400, 401, 404, 413, 429, 503)
    tool_errors = wire.error_responses(400, 401, 404, 413, 429, 503)

    @post("/v1/chat/completions", status_code=200, before_request=admit, dto=chat_body, return_dto=None,
          responses=generate_errors)  # fmt: skip
    async def chat_completions(
        request: Request[Any, Any, Any], data: wire.ChatCompletionRequest | None = None
    ) -> Response[Any]:
        """OpenAI Chat Completions (SSE with `stream: true`), routed by `model` and session."""
        return await gw.generate(request, _present(data), "/v1/chat/completions")

    @post("/v1/completions", status_code=200, before_request=admit, dto=CompletionBody, return_dto=None,
          responses=generate_errors)  # fmt: skip
    async def completions(
        request: Request[Any, Any, Any], data: wire.CompletionRequest | None = None
    ) -> Response[Any]:
        """OpenAI (legacy) Completions: a raw prompt, with chat's sessions, cache and usage."""
        return await gw.generate(request, _present(data), "/v1/completions")

    @post("/tokenize", status_code=200, before_request=admit, dto=TokenizeBody, return_dto=None,
          responses=tool_errors)  # fmt: skip
    async def tokenize(
        request: Request[Any, Any, Any], data: wire.TokenizeRequest | None = None
    ) -> wire.TokenizeResponse:
        """Token ids of a prompt, or of messages rendered by the model's chat template."""
        return await gw.pass_through(request, _present(data), "/tokenize")  # type: ignore[return-value]

    @post("/detokenize", status_code=200, before_request=admit, dto=DetokenizeBody, return_dto=None,
          responses=tool_errors)  # fmt: skip
    async def detokenize(
        request: Request[Any, Any, Any], data: wire.DetokenizeRequest | None = None
    ) -> wire.DetokenizeResponse:
        """The text of token ids."""
        return await gw.pass_through(request, _present(data), "/detokenize")  # type: ignore[return-value]

    @get("/v1/models", responses=wire.error_responses(401, 503))
    async def models(request: Request[Any, Any, Any]) -> wire.ModelList:
        """The models the healthy engines serve."""
        caller_of(request)
        return await gw.models()

    @get("/health")
    async def health() -> dict[str, Any]:
        redis_ok = bool(await gw.redis_do(gw.redis.ping(), "health ping"))
        engines = gw.pool.status()
        ok = bool(engines) and all(e["healthy"] for e in engines) and redis_ok  # none resolved: degraded
        return {
            "status": "ok" if ok else "degraded",
            "engines": engines,
            "redis": redis_ok,
            "redis_circuit": gw.breaker.state().as_dict(),
        }

    @get("/metrics", media_type="text/plain; version=0.0.4", responses=wire.error_responses(401, 403))
    async def metrics(request: Request[Any, Any, Any]) -> bytes:
        """Prometheus metrics of every tenant's traffic: an admin tenant's key only."""
        caller = caller_of(request)
        if not gw.is_admin(caller):
            raise ApiError(403, gw.admin_only(caller, "read the gateway's metrics, which cover every tenant"))
        return gw.metrics.render()

    @get("/v1/stats")
    async def stats(request: Request[Any, Any, Any]) -> dict[str, Any]:
        caller = caller_of(request)
        return await gw.redis_call("stats", gw.stats.snapshot(caller.tenant, gw.pool.status()))

    @get("/v1/sessions")
    async def sessions(request: Request[Any, Any, Any], limit: int = 100) -> dict[str, Any]:
        caller = caller_of(request)
        rows = await gw.redis_call("sessions", gw.sessions.latest(caller.tenant, max(1, min(limit, 1000))))
        return {"tenant": caller.tenant, "sessions": [s.as_dict() for s in rows]}

    @get("/v1/sessions/{session_id:str}")
    async def session(request: Request[Any, Any, Any], session_id: str) -> dict[str, Any]:
        caller = caller_of(request)
        found = await gw.redis_call("sessions", gw.sessions.get(caller.tenant, session_id))
        if found is None:
            raise ApiError(
                404, f"no session {session_id!r} for this tenant (it may have expired)", param="session_id"
            )
        timeline = await gw.redis_call("sessions", gw.sessions.timeline(caller.tenant, session_id))
        return {"session": found.as_dict(), "timeline": [r.as_dict() for r in timeline]}

    @get("/v1/cache")
    async def cache(request: Request[Any, Any, Any], top: int = 20) -> dict[str, Any]:
        caller = caller_of(request)
        return await gw.cache(caller, max(0, min(top, 1000)))

    @delete("/v1/cache", status_code=200)
    async def clear_cache(request: Request[Any, Any, Any]) -> dict[str, Any]:
        caller = caller_of(request)
        if not gw.is_admin(caller):
            raise ApiError(403, gw.admin_only(caller, "clear the cache, which every tenant shares"))
        return await gw.clear_cache()

    return Litestar(
        route_handlers=[
            chat_completions,
            completions,
            tokenize,
            detokenize,
            models,
            health,
            metrics,
            stats,
            sessions,
            session,
            cache,
            clear_cache,
            *messages_routes(gw),
            *responses_routes(gw),
        ],
        lifespan=[lifespan],
        middleware=[gw.metrics.middleware],
        exception_handlers={Exception: handle_exception},
        request_max_body_size=config.max_body_bytes,  # a 413 naming KEEPWARM_MAX_BODY_BYTES (errors.py)
        openapi_config=OpenAPIConfig(title="keepwarm gateway", version="0.1.0", path="/schema"),
        plugins=[wire.ClosedStructSchema()],
    )


def _present(data: Any) -> Any:
    """A typed body, or a 400 for an empty one (litestar hands an empty body over as None)."""
    if data is None:
        raise ApiError(400, "request body is empty; send a JSON object")
    return data
