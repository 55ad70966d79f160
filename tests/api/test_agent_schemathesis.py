"""Schemathesis against the agent APIs (POST /v1/responses, GET/DELETE /v1/responses/{id},
POST /v1/messages, POST /v1/messages/count_tokens), from their OpenAPI document
(keepwarm.api.agent_schema), with the session's gateway and demo engine behind them: generated
inputs fitting and violating the schema, no 5xx, and every error in the API's own envelope
(OpenAI's for Responses, Anthropic's for Messages)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode

from keepwarm.api.agent_schema import openapi_document
from tests.api.procs import Proc
from tests.api.schema_fuzz import error_body, error_shape_problem

HEADERS = {"Authorization": "Bearer key-alpha"}


def anthropic_shape_problem(status: int, content_type: str, content: bytes) -> str | None:
    body, problem = error_body(status, content_type, content)
    if body is None:
        return problem
    text = content[:300].decode(errors="replace")
    err = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(body, dict) and body.get("type") == "error" and isinstance(err, dict)):
        return f"HTTP {status} not in Anthropic's envelope: {text}"
    if set(err) != {"type", "message"} or not (isinstance(err["message"], str) and err["message"]):
        return f"HTTP {status} error fields {sorted(err)}: {text}"
    return None


def test_the_agent_apis_are_documented_with_closed_bodies() -> None:
    doc = openapi_document()
    assert set(doc["paths"]) == {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
                                 "/v1/messages/count_tokens"}  # fmt: skip
    schemas = doc["components"]["schemas"]
    assert schemas["ResponsesRequest"]["additionalProperties"] is False
    assert schemas["MessagesRequest"]["additionalProperties"] is False
    assert set(schemas["MessagesRequest"]["required"]) == {"model", "messages", "max_tokens"}
    errors = doc["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert errors == {"$ref": "#/components/schemas/AnthropicErrorBody"}


def test_schemathesis_finds_no_5xx_and_only_each_apis_error_shape(gateway: Proc) -> None:
    schema = schemathesis.openapi.from_dict(openapi_document())
    session = requests.Session()
    failures: list[str] = []
    statuses: Counter[int] = Counter()
    labels: set[str] = set()
    operations: list[Any] = list(schema.get_all_operations())
    for result in operations:
        op = result.ok()
        check = anthropic_shape_problem if op.path.startswith("/v1/messages") else error_shape_problem
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(op, mode, check, gateway.url, session, statuses, labels, failures)
    print("agent APIs:", dict(sorted(statuses.items())), sorted(labels))
    assert not failures, "\n".join(failures)
    assert sum(n for s, n in statuses.items() if 400 <= s < 500) > 0
    assert {lbl.rsplit(" ", 1)[0] for lbl in labels} >= {"POST /v1/responses", "POST /v1/messages",
                                                       "POST /v1/messages/count_tokens"}  # fmt: skip


def _fuzz(op: Any, mode: GenerationMode, check: Any, url: str, session: requests.Session,
          statuses: Counter[int], labels: set[str], failures: list[str]) -> None:  # fmt: skip
    label = f"{op.method.upper()} {op.path} {mode.value}"
    seen: set[str] = set()

    @hypothesis.settings(max_examples=15, deadline=None, database=None, derandomize=True,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        resp = case.call(base_url=url, headers=HEADERS, session=session, timeout=120)
        statuses[resp.status_code] += 1
        labels.add(label)
        ctype = resp.headers.get("content-type") or ""
        problem = check(resp.status_code, ctype if isinstance(ctype, str) else ctype[0], resp.content)
        kind = problem.split(":", 1)[0] if problem else ""
        if problem and kind not in seen:
            seen.add(kind)
            body = case.body if isinstance(case.body, (dict, list)) else repr(case.body)[:200]
            failures.append(f"{label}: {problem}\n    sent: {json.dumps(body)[:400]}")

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, label
