"""api/chat_body.py: a gateway body is parsed once (msgspec); json reads it again only to say
what is wrong with a body msgspec refuses."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from keepwarm.api import chat_body
from keepwarm.api.errors import ApiError
from keepwarm.engine.serving import wire

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "seed": 3}'


def test_a_good_body_is_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    parses: list[bytes] = []
    real = msgspec.json.decode

    def counted(raw: Any, *a: Any, **kw: Any) -> Any:
        parses.append(raw)
        return real(raw, *a, **kw)

    def no_json(*a: Any, **kw: Any) -> Any:
        raise AssertionError("json.loads on a good body")

    monkeypatch.setattr(chat_body.msgspec.json, "decode", counted)
    monkeypatch.setattr(chat_body.json, "loads", no_json)
    monkeypatch.setattr(wire, "decode", lambda *a, **kw: pytest.fail("wire.decode on a good body"))
    body, parsed = chat_body._bounded_chat(CHAT, 10)
    req = chat_body.typed_body(CHAT, (body, parsed), wire.ChatCompletionRequest)
    assert parsed and len(parses) == 1
    assert (req.model, req.temperature, req.seed, req.messages[0].content) == ("m", 0.5, 3, "hi")


def test_json_only_diagnoses_a_refused_body() -> None:
    with pytest.raises(ApiError) as e:
        chat_body.parse_chat_body(b'{"messages": [{"role": "user"}], "temperature": NaN}', 10)
    assert "NaN, which is not JSON" in e.value.message
    with pytest.raises(ApiError) as e:
        chat_body.parse_chat_body(b'{"messages": [', 10)
    assert "not valid JSON" in e.value.message
    deep = b'{"messages": [{"role": "user"}], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ApiError) as e:
        chat_body.parse_chat_body(deep, 10)
    assert "nests deeper than" in e.value.message


def test_typed_errors_are_the_wire_models() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "x", "colour": "red"}]}).encode()
    with pytest.raises(wire.WireError) as e:
        chat_body.typed_body(raw, chat_body._bounded_chat(raw, 10), wire.ChatCompletionRequest)
    assert e.value.param == "messages[0].colour" and "unknown field" in str(e.value)
