"""Request bodies as the gateway accepts them: bounded before any work, then
decoded into the engine's typed wire models (keepwarm.engine.serving.wire, which
imports nothing but msgspec and litestar), so the gateway refuses exactly what
an engine would, before any engine is asked, with the same message.

`parse_chat_body(raw, max_messages)` returns the request object or raises an
ApiError naming the field or the limit:
  - JSON only (NaN / Infinity refused), nested at most MAX_JSON_DEPTH levels
    (400; a 100,000-deep body is refused without recursing that deep);
  - `messages` a non-empty list of objects with a string `role`, at most
    `max_messages` of them (413, KEEPWARM_MAX_MESSAGES);
  - every numeric field the API defines within its range (400 naming the field; the ranges
    are the engine's, declared once in keepwarm.engine.generation.field_ranges),
    and every other number anywhere in the body a 64-bit integer or a finite float,
    so no value reaches an engine that it cannot hold (a seed >= 2^64 used to fail
    only after the prefill had run).
`parse_bounded(raw)` does the same for any other body (no `messages` rules).
The body is parsed once (msgspec, to plain objects); the `*Body` DTO classes run these checks
on it and convert it to the typed model with `wire.convert` (a WireError naming the field; the
app renders it as a 400 in the one error shape); they also document the body in /schema.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import msgspec

from keepwarm.api.errors import ApiError
from keepwarm.engine.generation.field_ranges import I64_MIN, PREFIX_CACHE_RANGES, RANGES, Range
from keepwarm.engine.serving import wire

MAX_JSON_DEPTH = 64  # a chat body needs ~6 levels; tool schemas a few more
_U64_MAX = 2**64 - 1
_LONG_DIGITS = re.compile(rb"[0-9]{20}")


# The gateway checks every top-level range the engine's models declare (field_ranges.RANGES).
FIELD_RANGES: dict[str, Range] = RANGES


def _refuse_constant(name: str) -> Any:
    raise ApiError(400, f"request body contains {name}, which is not JSON; send finite numbers")


def _check_depth(body: Any) -> None:
    """Refuses nesting deeper than MAX_JSON_DEPTH, level by level (no recursion)."""
    level: list[Any] = [body]
    depth = 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        nxt: list[Any] = []
        for node in level:
            nxt.extend(
                v for v in (node.values() if isinstance(node, dict) else node) if isinstance(v, (dict, list))
            )
        level, depth = nxt, depth + 1


def _check_integers(body: Any) -> None:
    """Refuses any integer outside [-2^63, 2^64 - 1], naming where it is."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{path}.{k}".lstrip(".")) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
        elif isinstance(node, int) and not isinstance(node, bool) and not I64_MIN <= node <= _U64_MAX:
            raise ApiError(400, f"'{path}' is {node}: numbers must fit in 64 bits", param=path or None)


def _too_deep() -> ApiError:
    return ApiError(
        400,
        f"request JSON nests deeper than {MAX_JSON_DEPTH} levels (the gateway's limit); send a flatter body",
        param=None,
    )


def _check_ranges(obj: dict[str, Any], ranges: dict[str, Range], prefix: str = "") -> None:
    for name, rng in ranges.items():
        v = obj.get(name)
        if v is not None and not rng.holds(v):
            field = prefix + name
            raise ApiError(400, f"'{field}' must be {rng.describe()}, got {v!r}", param=field)


def _load(raw: bytes, shape: str) -> tuple[dict[str, Any], bool]:
    """The body as a dict, parsed once by msgspec (True); a body msgspec refuses is parsed again
    by json only to say what is wrong with it as the gateway always has (False: `wire.decode`
    of the bytes then gives the typed model's own error)."""
    try:
        body, parsed = msgspec.json.decode(raw), True
    except RecursionError:
        raise _too_deep() from None
    except msgspec.MsgspecError:
        body, parsed = _diagnosed(raw), False
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object{shape}")
    _check_depth(body)
    return body, parsed


def _diagnosed(raw: bytes) -> Any:
    """The body as json reads it (NaN and Infinity refused), or the ApiError saying why not."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON ({e}); send a JSON object") from None


def _check_common(raw: bytes, body: dict[str, Any]) -> None:
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise ApiError(400, "'user' must be a string", param="user")
    _check_ranges(body, FIELD_RANGES)
    pc = body.get("prefix_cache")
    if pc is not None:
        if not isinstance(pc, dict):
            raise ApiError(400, "'prefix_cache' must be an object {scope, window}", param="prefix_cache")
        _check_ranges(pc, PREFIX_CACHE_RANGES, "prefix_cache.")
    if _LONG_DIGITS.search(raw):  # only a run of 20+ digits can be an integer beyond 64 bits
        _check_integers(body)


Bounded = tuple[dict[str, Any], bool]  # the body parsed, and whether msgspec parsed it (`_load`)


def parse_bounded(raw: bytes) -> dict[str, Any]:
    """Any request object (completions, tokenize, ...), or an ApiError naming what is wrong."""
    return bounded_body(raw)[0]


def bounded_body(raw: bytes) -> Bounded:
    """`parse_bounded`'s body with its Bounded flag, for `typed_body`."""
    body, parsed = _load(raw, "")
    _check_common(raw, body)
    return body, parsed


def parse_chat_body(raw: bytes, max_messages: int) -> dict[str, Any]:
    """The request object, or an ApiError (400 / 413) naming what is wrong."""
    return _bounded_chat(raw, max_messages)[0]


def _bounded_chat(raw: bytes, max_messages: int) -> Bounded:
    body, parsed = _load(raw, " with a 'messages' list")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            400, "'messages' is required: a non-empty list of {role, content} objects", param="messages"
        )
    if len(messages) > max_messages:
        raise ApiError(
            413,
            f"'messages' has {len(messages)} entries; the gateway accepts at most {max_messages} "
            "(KEEPWARM_MAX_MESSAGES); send fewer",
            param="messages",
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                400, f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}].role"
            )
    _check_common(raw, body)
    return body, parsed


def typed_body(raw: bytes, bounded: Bounded, kind: type[wire.T]) -> wire.T:
    """The typed model of a bounded body: converted from the one parse, or (a body only json
    could read) decoded from the bytes for the model's own error."""
    body, parsed = bounded
    return wire.convert(body, kind) if parsed else wire.decode(raw, kind)


class ChatBody(wire.WireBody[wire.ChatCompletionRequest]):
    """POST /v1/chat/completions: bounded, then typed. `max_messages` is set per app
    (`type("ChatBody", (ChatBody,), {"max_messages": n})`)."""

    max_messages: ClassVar[int] = 1_000

    def decode_bytes(self, value: bytes) -> Any:
        return typed_body(value, _bounded_chat(value, self.max_messages), self.model_type)


class CompletionBody(wire.WireBody[wire.CompletionRequest]):
    """POST /v1/completions: bounded, then typed."""

    def decode_bytes(self, value: bytes) -> Any:
        return typed_body(value, bounded_body(value), self.model_type)


class TokenizeBody(wire.WireBody[wire.TokenizeRequest]):
    def decode_bytes(self, value: bytes) -> Any:
        return typed_body(value, bounded_body(value), self.model_type)


class DetokenizeBody(wire.WireBody[wire.DetokenizeRequest]):
    def decode_bytes(self, value: bytes) -> Any:
        return typed_body(value, bounded_body(value), self.model_type)
