"""OpenAI Chat Completions wire format: request parsing with errors that name
the field, and response / stream-chunk bodies with keepwarm's extensions."""

from __future__ import annotations

import time
from typing import Any

from keepwarm.engine.cache.policy import PolicyError, policy_for_request
from keepwarm.engine.cache.prefix_cache import SessionHint
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, RequestError
from keepwarm.engine.generation.sampling import SamplingError, SamplingParams

ROLES = ("system", "developer", "user", "assistant", "tool")


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise RequestError(
            f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}", param=name
        )
    return kind(v)


def _flag(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be true or false, got {v!r}", param=name)
    return v


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}.content[{i}] must be {{'type': 'text', 'text': str}} "
                    "(only text parts are supported)",
                    param=f"{where}.content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def parse_messages(raw: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object with role and content", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role"
            )
        msg = {k: v for k, v in m.items() if k in ("name", "tool_calls", "tool_call_id")}
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _content_text(m.get("content"), where)
        out.append(msg)
    return tuple(out)


def parse_chat_request(
    body: Any, max_tokens_limit: int, default_policy: Any, trusted: bool = True
) -> GenerateRequest:
    """`trusted` is False for bodies that came from clients directly: cache_salt and
    session_hint are only honoured from the gateway."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = parse_messages(body.get("messages"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", int, 256)
    if max_tokens < 1 or max_tokens > max_tokens_limit:
        raise RequestError(
            f"max_tokens must be in 1..{max_tokens_limit}, got {max_tokens}", param="max_tokens"
        )
    n = _number(body, "n", int, 1)
    if n != 1:
        raise RequestError("n must be 1 (one choice per request)", param="n")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise RequestError("stop must be a string or a list of strings", param="stop")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", float, 1.0),  # OpenAI's default
            top_k=_number(body, "top_k", int, 0),
            top_p=_number(body, "top_p", float, 1.0),
            seed=_number(body, "seed", int, None),
            stop=stops,
            ignore_eos=_flag(body, "ignore_eos"),
        )
    except SamplingError as e:
        raise RequestError(str(e), param=str(e).split(" ", 1)[0]) from e
    pc = body.get("prefix_cache")
    if pc is not None and not isinstance(pc, dict):
        raise RequestError("prefix_cache must be an object {scope, window}", param="prefix_cache")
    try:
        policy = policy_for_request(default_policy, (pc or {}).get("scope"), (pc or {}).get("window"))
    except PolicyError as e:
        raise RequestError(str(e), param="prefix_cache") from e
    salt = ""
    hint = None
    if trusted:
        salt_raw = body.get("cache_salt", "")
        if not isinstance(salt_raw, str):
            raise RequestError("cache_salt must be a string", param="cache_salt")
        salt = salt_raw
        h = body.get("session_hint")
        if h is not None:
            if not (
                isinstance(h, dict) and isinstance(h.get("key"), str) and isinstance(h.get("tokens"), int)
            ):
                raise RequestError("session_hint must be {key: str, tokens: int}", param="session_hint")
            hint = SessionHint(h["key"], h["tokens"])
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("tools must be a list", param="tools")
    return GenerateRequest(
        sampling=sampling,
        messages=messages,
        tools=tuple(tools) if tools else None,
        policy=policy,
        cache_salt=salt,
        session_hint=hint,
    )


def usage_body(ev: FinishEvent) -> dict[str, Any]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
        "timings": ev.timings.as_dict(),
    }


def keepwarm_body(ev: FinishEvent, namespace: str) -> dict[str, Any]:
    return {"prefix_key": ev.prefix_key, "prefix_tokens": ev.prefix_tokens, "namespace": namespace}


def completion_body(rid: str, model: str, ev: FinishEvent, namespace: str) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": ev.text},
                "finish_reason": ev.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage_body(ev),
        "keepwarm": keepwarm_body(ev, namespace),
    }


def chunk_body(
    rid: str, model: str, created: int, delta: dict[str, Any], finish: str | None
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "service_unavailable",
    }.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
