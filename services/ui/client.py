"""A small typed client for the gateway's public API: the dashboard's only data source.

Two error types reach the pages, each rendered as a clear message:
- `GatewayDown`: nothing answered (refused, DNS, timeout) -- start the gateway or fix --gateway;
- `GatewayError`: the gateway answered with an error status (401 bad key, 503 no engine, ...),
  carrying the gateway's own JSON error message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx

from keepwarm.ui.settings import UiSettings

CHAT_TIMEOUT_S = 300.0  # a cold prefill on CPU can take a while; reads use settings.timeout_s


class GatewayDown(ConnectionError):
    """The gateway did not answer at all."""

    def __init__(self, gateway: str, reason: str) -> None:
        super().__init__(f"the gateway at {gateway} is not reachable ({reason})")
        self.gateway = gateway
        self.reason = reason


class GatewayError(RuntimeError):
    """The gateway answered with an HTTP error; `message` is its `error.message` (or the raw body)."""

    def __init__(self, status: int, message: str, path: str) -> None:
        super().__init__(f"{path} answered HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path


@dataclass(frozen=True)
class ChatReply:
    """One non-streamed chat turn as the gateway returned it."""

    text: str
    finish_reason: str
    usage: dict[str, Any]  # OpenAI usage + prompt_tokens_details + timings
    wall_ms: float  # measured here: request sent -> whole reply received
    timings: dict[str, Any] = field(default_factory=dict)  # usage["timings"], {} when absent


class GatewayClient:
    def __init__(self, settings: UiSettings) -> None:
        self.settings = settings

    @property
    def gateway(self) -> str:
        return self.settings.gateway

    def _headers(self, session_id: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.settings.api_key:
            h["Authorization"] = f"Bearer {self.settings.api_key}"
        if session_id:
            h["X-Session-Id"] = session_id
        return h

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        timeout_s: float | None = None,
        session_id: str | None = None,
    ) -> Any:
        url = self.settings.gateway + path
        try:
            with httpx.Client(timeout=timeout_s or self.settings.timeout_s) as http:
                resp = http.request(method, url, json=json, headers=self._headers(session_id))
        except httpx.TimeoutException as e:
            raise GatewayDown(self.settings.gateway, f"timed out: {type(e).__name__}") from None
        except httpx.TransportError as e:
            raise GatewayDown(self.settings.gateway, f"{type(e).__name__}: {e}") from None
        if resp.status_code >= 400:
            raise GatewayError(resp.status_code, _error_message(resp), path)
        try:
            return resp.json()
        except ValueError:
            raise GatewayError(resp.status_code, f"not JSON: {resp.text[:200]!r}", path) from None

    def health(self) -> dict[str, Any]:
        return _as_dict(self._request("GET", "/health"), "/health")

    def stats(self) -> dict[str, Any]:
        return _as_dict(self._request("GET", "/v1/stats"), "/v1/stats")

    def sessions(self) -> Any:
        """The gateway's session list (a list, or an object holding one; views.session_rows reads both)."""
        return self._request("GET", "/v1/sessions")

    def session(self, session_id: str) -> Any:
        return self._request("GET", "/v1/sessions/" + quote(session_id, safe=""))

    def cache(self, top: int = 200) -> dict[str, Any]:
        """Each engine's cache stats plus up to `top` entries (the gateway ranks them by hits)."""
        return _as_dict(self._request("GET", f"/v1/cache?top={top}"), "/v1/cache")

    def clear_cache(self) -> int:
        body = _as_dict(self._request("DELETE", "/v1/cache", timeout_s=CHAT_TIMEOUT_S), "/v1/cache")
        return int(body.get("deleted", 0))

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        session_id: str | None,
        max_tokens: int = 64,
        temperature: float = 0.0,
        model: str = "default",
    ) -> ChatReply:
        payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        t0 = time.perf_counter()
        body = _as_dict(
            self._request(
                "POST", "/v1/chat/completions", json=payload, timeout_s=CHAT_TIMEOUT_S, session_id=session_id
            ),
            "/v1/chat/completions",
        )
        wall_ms = (time.perf_counter() - t0) * 1000.0
        choices = body.get("choices") or []
        if not choices:
            raise GatewayError(200, "the reply has no choices", "/v1/chat/completions")
        choice = choices[0]
        usage = body.get("usage") or {}
        return ChatReply(
            text=str((choice.get("message") or {}).get("content") or ""),
            finish_reason=str(choice.get("finish_reason") or ""),
            usage=usage,
            wall_ms=wall_ms,
            timings=usage.get("timings") or {},
        )


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500] or resp.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("detail"):
            return str(body["detail"])
    return str(body)[:500]


def _as_dict(body: Any, path: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise GatewayError(200, f"expected a JSON object, got {type(body).__name__}", path)
    return body
