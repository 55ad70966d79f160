"""The OpenAI-compatible gateway: `create_app(config) -> Litestar`.

POST /v1/chat/completions, per request:
  auth (Bearer key -> tenant) -> per-tenant rate limit (429) -> body size (413)
  -> JSON/`messages` checks (400 naming the field) -> client `cache_salt` and
  `session_hint` dropped; `cache_salt` = HMAC(secret, tenant); the session's last
  prefix key from Redis sent as `session_hint` -> the first healthy engine in
  affinity order; a connection failure before anything reached the client
  (connect error, engine gone before its headers, engine 503) moves on to the
  next engine -> the answer passed through.

Streaming is passed through line by line as bytes arrive (no buffering beyond
one SSE line). The one chunk carrying `usage` is parsed on the way: its
`keepwarm` object (the engine-internal prefix key) is removed, and the session
and stats are written to Redis *before* that chunk is forwarded, so a client
that sends its next turn right after `[DONE]` already gets the new hint.
Non-streaming answers lose their `keepwarm` object the same way. Clients see
plain OpenAI objects plus `usage.prompt_tokens_details` and `usage.timings`.

A client that disconnects closes the upstream request, so the engine cancels
the generation: streaming via litestar's disconnect listener cancelling the
relay (plus a background close as a backstop), non-streaming by racing the
engine call against the client's `http.disconnect`.

Redis trouble never fails a chat request: sessions, stats and the rate limit
degrade (logged); the Redis-only endpoints answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from litestar import Litestar, Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from redis.asyncio import Redis
from redis.exceptions import RedisError

from keepwarm.api.auth import Authenticator, Caller
from keepwarm.api.config import GatewayConfig
from keepwarm.api.engines import EnginePool
from keepwarm.api.errors import ApiError, handle_exception, upstream_error
from keepwarm.api.rate_limit import RateLimiter
from keepwarm.api.record import RequestRecord
from keepwarm.api.sessions import SessionStore, check_session_id
from keepwarm.api.stats import StatsStore

log = logging.getLogger("keepwarm.api")

# Failures that prove the engine never produced an answer the client could have
# seen part of; the request moves on to the next engine.
_FAILOVER_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Turn:
    """What the gateway knows about one chat request while it runs."""

    caller: Caller
    session: str | None
    engine: str


def parse_chat_body(raw: bytes) -> dict[str, Any]:
    """The request object, or a 400 naming what is wrong. Only what the gateway
    itself relies on is checked; the engine validates the rest (and names it)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON ({e}); send a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object with a 'messages' list")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            400, "'messages' is required: a non-empty list of {role, content} objects", param="messages"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                400, f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}].role"
            )
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string", param="user")
    return body


async def read_body(request: Request[Any, Any, Any], limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed `limit` bytes."""
    too_big = ApiError(
        413, f"request body exceeds the gateway limit of {limit} bytes (KEEPWARM_MAX_BODY_BYTES); send less"
    )
    announced = request.headers.get("content-length")
    if announced and announced.isdigit() and int(announced) > limit:
        raise too_big
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_big
        parts.append(part)
    return b"".join(parts)


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
        self.redis: Redis = Redis.from_url(
            config.redis_url, decode_responses=True, socket_timeout=5, socket_connect_timeout=2
        )
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s, read=config.read_timeout_s, write=30.0, pool=10.0
            ),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=64),
        )
        self.pool = EnginePool(config.engines, self.client, interval_s=config.health_interval_s)
        self.sessions = SessionStore(
            self.redis,
            prefix=config.redis_prefix,
            ttl_s=config.session_ttl_s,
            timeline_len=config.timeline_len,
        )
        self.stats = StatsStore(
            self.redis, prefix=config.redis_prefix, recent_len=config.recent_len, ttft_len=config.ttft_len
        )
        self.limiter = (
            RateLimiter(
                self.redis, prefix=config.redis_prefix, limit=config.rate_limit, window_s=config.rate_window_s
            )
            if config.rate_limit > 0
            else None
        )
        self._poller: asyncio.Task[None] | None = None

    async def open(self) -> None:
        await self.pool.probe_all()
        try:
            await self.stats.start(time.time())
        except RedisError as e:
            log.warning("redis unavailable at start (%s); sessions and stats wait for it", e)
        self._poller = asyncio.create_task(self.pool.run(), name="engine-health")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await self.client.aclose()
        await self.redis.aclose()

    # -- chat ------------------------------------------------------------

    async def check_rate(self, caller: Caller) -> None:
        if self.limiter is None:
            return
        try:
            wait = await self.limiter.retry_after(caller.tenant, time.time())
        except RedisError as e:
            log.warning("rate limit not enforced, redis unavailable: %s", e)
            return
        if wait is not None:
            raise ApiError(
                429,
                f"rate limit of {self.limiter.limit} requests per {self.limiter.window_s}s for this API key's "
                f"tenant reached; retry after {wait}s",
                headers={"Retry-After": str(wait)},
            )

    async def healthy_engines(self, affinity: str, preferred: str | None) -> list[str]:
        engines = self.pool.candidates(affinity, preferred)
        if not engines:
            # The poller may lag a restart; look once more before refusing.
            await self.pool.probe_all()
            engines = self.pool.candidates(affinity, preferred)
        if not engines:
            raise self.no_engine()
        return engines

    def no_engine(self) -> ApiError:
        down = "; ".join(f"{u}: {self.pool.health(u).error or 'down'}" for u in self.pool.urls)
        retry = max(1, math.ceil(self.config.health_interval_s))
        return ApiError(503, f"no healthy engine, retry later ({down})", headers={"Retry-After": str(retry)})

    async def remember(self, turn: Turn, usage: Any, keepwarm: Any) -> None:
        """Session + stats for one finished request; Redis trouble is logged only."""
        if not isinstance(usage, dict):
            return
        rec = RequestRecord.from_usage(
            usage, ts=time.time(), session=turn.session, tenant=turn.caller.tenant, engine=turn.engine
        )
        kw = keepwarm if isinstance(keepwarm, dict) else {}
        key = kw.get("prefix_key") if isinstance(kw.get("prefix_key"), str) else None
        tokens = kw.get("prefix_tokens") if isinstance(kw.get("prefix_tokens"), int) else 0
        try:
            if turn.session is not None:
                await self.sessions.record_turn(turn.caller.tenant, turn.session, rec, key, tokens)
            await self.stats.record(rec)
        except RedisError as e:
            log.warning("session/stats not recorded, redis unavailable: %s", e)

    async def chat(self, request: Request[Any, Any, Any]) -> Response[Any]:
        caller = self.auth.authenticate(request.headers.get("authorization"))
        await self.check_rate(caller)
        body = parse_chat_body(await read_body(request, self.config.max_body_bytes))
        sid: str | None = None
        if request.headers.get("x-session-id"):
            sid = check_session_id(request.headers["x-session-id"], "X-Session-Id")
        elif isinstance(body.get("user"), str) and body["user"]:
            sid = check_session_id(body["user"], "user")
        # Engine-only fields are the gateway's to set, never a client's.
        body.pop("session_hint", None)
        body["cache_salt"] = caller.salt
        session = None
        if sid is not None:
            try:
                session = await self.sessions.get(caller.tenant, sid)
            except RedisError as e:
                log.warning("session %s not read, redis unavailable: %s", sid, e)
        if session is not None and session.key:
            body["session_hint"] = {"key": session.key, "tokens": session.tokens}
        payload = json.dumps(body).encode()
        streaming = body.get("stream") is True
        affinity, preferred = sid or caller.tenant, session.engine if session else None
        tried: set[str] = set()
        engines = await self.healthy_engines(affinity, preferred)
        while engines:
            for url in engines:
                tried.add(url)
                turn = Turn(caller=caller, session=sid, engine=url)
                try:
                    if streaming:
                        return await self._stream(turn, payload)
                    return await self._complete(turn, payload, request)
                except _FAILOVER_ERRORS as e:
                    self.pool.mark_down(url, f"{type(e).__name__}: {e}")
                    log.warning("engine %s failed before answering (%s); trying the next", url, e)
                except _EngineBusy:
                    log.warning("engine %s answered 503; trying the next", url)
            # Every engine believed healthy failed: one fresh look for engines that came back.
            await self.pool.probe_all()
            engines = [u for u in self.pool.candidates(affinity, preferred) if u not in tried]
        raise self.no_engine()

    async def _open(self, turn: Turn, payload: bytes) -> httpx.Response:
        """The engine's response with headers read; non-200 answers raise."""
        req = self.client.build_request(
            "POST",
            f"{turn.engine}/v1/chat/completions",
            content=payload,
            headers={"content-type": "application/json"},
        )
        resp = await self.client.send(req, stream=True)
        if resp.status_code != 200:
            try:
                err = await resp.aread()
            finally:
                await resp.aclose()
            if resp.status_code == 503:
                raise _EngineBusy()
            raise upstream_error(resp.status_code, err, resp.headers)
        return resp

    async def _complete(self, turn: Turn, payload: bytes, request: Request[Any, Any, Any]) -> Response[Any]:
        async def call() -> bytes:
            resp = await self._open(turn, payload)
            try:
                return await resp.aread()
            finally:
                await resp.aclose()

        answer = asyncio.create_task(call())
        gone = asyncio.create_task(_until_disconnect(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
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
            return Response(content=b"", status_code=499)
        raw = answer.result()
        try:
            data = json.loads(raw)
        except ValueError:
            raise ApiError(502, f"engine {turn.engine} returned a body that is not JSON") from None
        if not isinstance(data, dict):
            raise ApiError(502, f"engine {turn.engine} returned JSON that is not an object")
        await self.remember(turn, data.get("usage"), data.pop("keepwarm", None))
        return Response(content=json.dumps(data).encode(), media_type="application/json")

    async def _stream(self, turn: Turn, payload: bytes) -> Response[Any]:
        resp = await self._open(turn, payload)
        return Stream(
            self._relay(turn, resp),
            media_type="text/event-stream",
            headers=dict(_SSE_HEADERS),
            background=BackgroundTask(resp.aclose),  # also runs after a client disconnect
        )

    async def _relay(self, turn: Turn, resp: httpx.Response) -> AsyncIterator[bytes]:
        pending = b""
        try:
            async for chunk in resp.aiter_bytes():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                if not lines:
                    continue
                out: list[bytes] = []
                for line in lines:
                    if line.startswith(b"data:") and b'"usage"' in line:
                        line = await self._usage_line(turn, line)
                    out.append(line + b"\n")
                yield b"".join(out)
            if pending:
                yield pending
        except httpx.HTTPError as e:
            # Mid-stream failure: bytes already reached the client, so no failover;
            # the client gets an error event in the stream instead of [DONE].
            log.warning("engine %s failed mid-stream: %s", turn.engine, e)
            err = ApiError(502, f"engine failed mid-stream ({type(e).__name__}); retry the request").body()
            yield b"data: " + json.dumps(err).encode() + b"\n\n"
        finally:
            # Shielded: after a client disconnect this frame runs inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    async def _usage_line(self, turn: Turn, line: bytes) -> bytes:
        """The usage chunk with its `keepwarm` object removed, after recording it."""
        try:
            obj = json.loads(line[5:])
        except ValueError:
            return line
        if not isinstance(obj, dict) or not isinstance(obj.get("usage"), dict):
            return line
        keepwarm = obj.pop("keepwarm", None)
        await self.remember(turn, obj["usage"], keepwarm)
        return b"data: " + json.dumps(obj).encode() if keepwarm is not None else line

    # -- everything else -------------------------------------------------

    async def models(self) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for url in await self.healthy_engines("models", None):
            try:
                r = await self.client.get(f"{url}/v1/models", timeout=5.0)
                for m in r.json().get("data", []) if r.status_code == 200 else []:
                    if isinstance(m, dict) and isinstance(m.get("id"), str):
                        seen.setdefault(m["id"], m)
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                log.warning("engine %s /v1/models failed: %s", url, e)
        if not seen:
            raise self.no_engine()
        return {"object": "list", "data": list(seen.values())}

    async def cache(self, top: int) -> dict[str, Any]:
        """Each engine's namespace and cache stats with its `top` most-hit disk
        entries, plus the `top` most-hit entries over all engines (each naming its engine)."""

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
            entries = [e | {"engine": url} for e in data.get("entries") or [] if isinstance(e, dict)]
            entries.sort(key=rank, reverse=True)
            return row | {
                "namespace": data.get("namespace"),
                "stats": data.get("stats", {}),
                "total_entries": len(entries),
                "entries": entries[:top],
            }

        engines = list(await asyncio.gather(*(one(u) for u in self.pool.urls)))
        merged = sorted((e for row in engines for e in row["entries"]), key=rank, reverse=True)
        return {"engines": engines, "entries": merged[:top]}

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
        try:
            return await coro
        except RedisError as e:
            raise ApiError(503, f"{what} unavailable: redis is not reachable ({e}); retry later") from None


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

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request[Any, Any, Any]) -> Response[Any]:
        return await gw.chat(request)

    @get("/v1/models")
    async def models(request: Request[Any, Any, Any]) -> dict[str, Any]:
        caller_of(request)
        return await gw.models()

    @get("/health")
    async def health() -> dict[str, Any]:
        try:
            redis_ok = bool(await gw.redis.ping())
        except RedisError:
            redis_ok = False
        engines = gw.pool.status()
        ok = all(e["healthy"] for e in engines) and redis_ok
        return {"status": "ok" if ok else "degraded", "engines": engines, "redis": redis_ok}

    @get("/v1/stats")
    async def stats(request: Request[Any, Any, Any]) -> dict[str, Any]:
        caller_of(request)
        return await gw.redis_call("stats", gw.stats.snapshot(gw.pool.status()))

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
        caller_of(request)
        return await gw.cache(max(0, min(top, 1000)))

    @delete("/v1/cache", status_code=200)
    async def clear_cache(request: Request[Any, Any, Any]) -> dict[str, Any]:
        caller = caller_of(request)
        admins = gw.config.admin_tenants
        if admins and caller.tenant not in admins:
            raise ApiError(
                403, f"tenant {caller.tenant!r} may not clear the cache; KEEPWARM_ADMIN_TENANTS lists who may"
            )
        return await gw.clear_cache()

    return Litestar(
        route_handlers=[chat_completions, models, health, stats, sessions, session, cache, clear_cache],
        lifespan=[lifespan],
        exception_handlers={Exception: handle_exception},
        request_max_body_size=None,  # read_body enforces config.max_body_bytes with a precise message
        openapi_config=None,
    )
