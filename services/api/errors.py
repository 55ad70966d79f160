"""The gateway's one error shape and the exception handler that renders it.

Every error the gateway answers with, its own or an engine's passed through, is the one
envelope of wire.error_body (`{"error": {"message", "type", "param", "code"}}`, `code` the
HTTP status, `type` from wire.ERROR_TYPES). Messages say what the caller should change.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException

from keepwarm.engine.serving import wire
from keepwarm.engine.serving.wire import WireError

log = logging.getLogger("keepwarm.api")


class ApiError(Exception):
    """An error the gateway answers with; raise it from any handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or wire.ERROR_TYPES.get(status, "api_error")
        self.headers: dict[str, str] = dict(headers or {})

    def envelope(self) -> wire.ErrorBody:
        return wire.error_body(self.message, self.status, self.param, self.type)

    def body(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.envelope())  # type: ignore[no-any-return]

    def response(self) -> Response[bytes]:
        return Response(
            content=wire.encode(self.envelope()),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


def client_closed() -> Response[bytes]:
    """The answer to a client that left before it came (nginx's 499): nothing reaches anyone."""
    return Response(content=b"", status_code=499)


def upstream_error(status: int, body: bytes, headers: Mapping[str, str]) -> ApiError:
    """An engine's non-200 answer as an ApiError: its message/type/param are kept
    when it used the error shape, its Retry-After is passed on."""
    message = f"engine answered HTTP {status}"
    param: str | None = None
    type_: str | None = None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        err = parsed["error"]
        message = str(err.get("message") or message)
        param = err.get("param") if isinstance(err.get("param"), str) else None
        type_ = err.get("type") if isinstance(err.get("type"), str) else None
    elif body:
        message = f"{message}: {body[:500].decode(errors='replace')}"
    passed = {k: v for k, v in headers.items() if k.lower() == "retry-after"}
    return ApiError(status, message, param=param, type_=type_, headers=passed)


def handle_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Litestar's handler for every exception: ApiError as is, litestar's own
    HTTP errors (404, 405, ...) in the same shape, anything else a logged 500."""
    if isinstance(exc, ApiError):
        return exc.response()
    if isinstance(exc, WireError):  # a body that does not fit its typed model
        return ApiError(exc.status, str(exc), param=exc.param).response()
    if isinstance(exc, HTTPException):
        detail = exc.detail or "error"
        if exc.status_code == 413:
            limit = request.route_handler.resolve_request_max_body_size()
            detail = f"request body exceeds the gateway limit of {limit} bytes (KEEPWARM_MAX_BODY_BYTES); send less"
        elif exc.status_code == 404:
            detail = f"no route for {request.method} {request.url.path}; /schema lists the routes"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}"
        return ApiError(exc.status_code, detail, headers=exc.headers or {}).response()
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, f"internal gateway error: {type(exc).__name__}").response()
