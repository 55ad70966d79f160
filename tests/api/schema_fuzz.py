"""Schemathesis against a running service's OpenAPI document (/schema/openapi.json):
every operation, with bodies, query and path values generated from the schema
(POSITIVE: fitting it; NEGATIVE: violating it), each answer checked for the two
promises every keepwarm service makes: no 5xx, and every error in the one shape
    {"error": {"message": str, "type": str, "param": str | null, "code": <the status>}},
except the gateway's Anthropic Messages routes (/v1/messages...), whose errors come in
Anthropic's envelope {"type": "error", "error": {"type": str, "message": str}}.

Failures are collected, not raised inside Hypothesis (no shrinking: the first
failing input of each kind is reported as sent), so one run states them all.
Generation is derandomized: the same schema gives the same cases every run.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import GenerationMode


@dataclass
class FuzzReport:
    calls: int = 0
    seconds: float = 0.0
    statuses: Counter[int] = field(default_factory=Counter)
    by_operation: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    # operation/mode pairs with no case to generate (NEGATIVE for an operation with no inputs)
    no_cases: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.calls} calls over {len(self.by_operation)} operation/mode pairs in {self.seconds:.1f}s; "
            f"statuses {dict(sorted(self.statuses.items()))}; nothing to generate for {self.no_cases}"
        )


def error_body(status: int, content_type: str, content: bytes) -> tuple[Any, str | None]:
    """An error answer's JSON body, or why the answer breaks the services' promises (a 5xx, a
    4xx that is not JSON); (None, None) for a success."""
    text = content[:300].decode(errors="replace")
    if status >= 500:
        return None, f"HTTP {status}: {text}"
    if status < 400:
        return None, None
    if not content_type.startswith("application/json"):
        return None, f"HTTP {status} with content-type {content_type!r}: {text}"
    try:
        return json.loads(content), None
    except ValueError:
        return None, f"HTTP {status} with a body that is not JSON: {text}"


def error_shape_problem(status: int, content_type: str, content: bytes) -> str | None:
    """Why an answer breaks the services' promises, or None."""
    body, problem = error_body(status, content_type, content)
    if body is None:
        return problem
    text = content[:300].decode(errors="replace")
    err = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(err, dict)):
        return f"HTTP {status} not in the error shape: {text}"
    if set(err) != {"message", "type", "param", "code"}:
        return f"HTTP {status} error fields {sorted(err)}: {text}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return f"HTTP {status} error without a message or type: {text}"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"HTTP {status} error param {err['param']!r} is not a string"
    if err["code"] != status:
        return f"HTTP {status} error code {err['code']!r}"
    return None


def anthropic_shape_problem(status: int, content_type: str, content: bytes) -> str | None:
    """Why an answer of the Messages API breaks its promises (Anthropic's envelope), or None."""
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


def problem_check(path: str) -> Any:
    """The error-shape check for an operation's answers."""
    return anthropic_shape_problem if path.startswith("/v1/messages") else error_shape_problem


def _describe(case: Any) -> str:
    body = case.body if not isinstance(case.body, (bytes, bytearray)) else case.body[:300]
    try:
        shown = json.dumps(body)[:400]
    except (TypeError, ValueError):
        shown = repr(body)[:400]
    return f"{case.method} {case.formatted_path} query={case.query} body={shown}"


def fuzz(
    base_url: str,
    headers: dict[str, str],
    *,
    examples: int,
    modes: tuple[GenerationMode, ...] = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE),
) -> FuzzReport:
    """Runs `examples` generated cases per operation and mode; returns what happened."""
    schema = schemathesis.openapi.from_url(f"{base_url}/schema/openapi.json", headers=headers, timeout=30)
    report = FuzzReport()
    session = requests.Session()
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in modes:
            _run(op, mode, base_url, headers, session, examples, report)
    report.seconds = time.monotonic() - t0
    return report


def _run(op: Any, mode: GenerationMode, base_url: str, headers: dict[str, str], session: requests.Session,
         examples: int, report: FuzzReport) -> None:  # fmt: skip
    label = f"{op.method.upper()} {op.path} {mode.value}"
    seen: set[str] = set()

    @hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis.given(case=op.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        resp = case.call(base_url=base_url, headers=headers, session=session, timeout=120)
        report.calls += 1
        report.statuses[resp.status_code] += 1
        report.by_operation[label] = report.by_operation.get(label, 0) + 1
        problem = problem_check(op.path)(
            resp.status_code, (resp.headers.get("content-type") or [""])[0], resp.content
        )
        kind = problem.split(":", 1)[0] if problem else ""
        if problem and kind not in seen:  # the first input of each kind of failure
            seen.add(kind)
            report.failures.append(f"{label}: {problem}\n    sent: {_describe(case)}")

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, f"{label}: schemathesis generated no case"
        report.no_cases.append(label)
