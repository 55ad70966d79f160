"""Schemathesis against the gateway's OpenAPI document, with a real engine behind it
(real processes on loopback): every operation (the agent APIs, Responses and Anthropic
Messages, among them), generated inputs fitting and violating the schema, no 5xx and every
error in the one JSON error shape (Anthropic's envelope on the Messages routes)."""

from __future__ import annotations

import httpx

from tests.api.procs import Proc
from tests.api.schema_fuzz import error_shape_problem, fuzz

ALPHA = {"Authorization": "Bearer key-alpha"}


def test_the_gateway_documents_typed_bodies_and_the_error_shape(gateway: Proc) -> None:
    doc = httpx.get(gateway.url + "/schema/openapi.json").json()
    paths = doc["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models"} <= set(paths)
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is False
    assert {"tools", "tool_choice", "response_format", "logprobs", "prefix_cache"} <= set(chat["properties"])
    for status in ("400", "401", "404", "413", "429", "503"):
        answer = paths["/v1/chat/completions"]["post"]["responses"][status]
        assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    card = doc["components"]["schemas"]["ModelCard"]
    assert {"id", "created", "owned_by", "max_model_len"} <= set(card["required"])
    # the agent APIs, with closed bodies and each API's error envelope
    assert {
        "/v1/responses",
        "/v1/responses/{response_id}",
        "/v1/messages",
        "/v1/messages/count_tokens",
    } <= set(paths)
    assert set(paths["/v1/responses/{response_id}"]) == {"get", "delete"}
    schemas = doc["components"]["schemas"]
    assert schemas["ResponsesRequest"]["additionalProperties"] is False
    assert schemas["MessagesRequest"]["additionalProperties"] is False
    assert set(schemas["MessagesRequest"]["required"]) == {"model", "messages", "max_tokens"}
    errors = paths["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert errors == {"$ref": "#/components/schemas/AnthropicErrorBody"}
    errors = paths["/v1/responses"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert errors == {"$ref": "#/components/schemas/ErrorBody"}


def test_schemathesis_finds_no_5xx_and_only_the_error_shape(gateway: Proc) -> None:
    # A request the schema allows but the gateway refuses (typed body, no field named): the shape holds.
    r = httpx.post(gateway.url + "/v1/completions", headers=ALPHA, content=b"")
    assert r.status_code == 400 and error_shape_problem(400, r.headers["content-type"], r.content) is None
    report = fuzz(gateway.url, ALPHA, examples=25)
    print("gateway:", report.summary())
    assert not report.failures, "\n".join(report.failures)
    # Every documented operation in both modes (but NEGATIVE for those with no inputs to break):
    # 12 of chat, completions, tokens, models, sessions, cache, health, metrics; 5 of the agent APIs
    assert len(report.by_operation) + len(report.no_cases) == 2 * 17
    assert {label.rsplit(" ", 1)[0] for label in report.by_operation} >= {
        "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
        "POST /v1/messages", "POST /v1/messages/count_tokens",
    }  # fmt: skip
    assert all(label.endswith(" negative") for label in report.no_cases)
    assert report.statuses[200] > 0 and sum(n for s, n in report.statuses.items() if 400 <= s < 500) > 0
