"""Schemathesis against the engine's OpenAPI document (a real engine process on
loopback, behind its token): every operation, generated inputs fitting and
violating the schema, no 5xx and every error in the one JSON error shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.procs import ENGINE_AUTH, ENGINE_TOKEN, Proc, start_engine
from tests.api.schema_fuzz import fuzz

# Every documented operation: 4 POST bodies, models, health, metrics, cache (GET, DELETE).
OPERATIONS = 9


@pytest.fixture(scope="module")
def engine(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("engine-schema")
    proc = start_engine(tiny_dense_model, tmp / "cache", tmp / "logs", token=ENGINE_TOKEN)
    yield proc
    proc.stop()


def test_the_engine_documents_typed_bodies(engine: Proc) -> None:
    assert (
        httpx.get(engine.url + "/schema/openapi.json").status_code == 401
    )  # behind the token, as all but /health
    doc = httpx.get(engine.url + "/schema/openapi.json", headers=ENGINE_AUTH).json()
    post = {p: v["post"] for p, v in doc["paths"].items() if "post" in v}
    assert set(post) == {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}
    kinds = {p: op["requestBody"]["content"]["application/json"]["schema"]["$ref"] for p, op in post.items()}
    assert kinds == {
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/tokenize": "#/components/schemas/TokenizeRequest",
        "/detokenize": "#/components/schemas/DetokenizeRequest",
    }
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["TextPart"]["properties"]["type"] == {"type": "string", "const": "text"}  # tagged union
    assert schemas["ChatMessage"]["additionalProperties"] is False
    models = httpx.get(engine.url + "/v1/models", headers=ENGINE_AUTH).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny-dense"]
    card = models["data"][0]
    assert (card["owned_by"], card["max_model_len"], card["object"]) == ("keepwarm", 512, "model")
    config = Path(engine.argv[engine.argv.index("--model") + 1]) / "config.json"
    assert card["created"] == int(config.stat().st_mtime)


def test_an_unknown_model_is_a_404_naming_the_served_one(engine: Proc) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": [1]}),
    ):
        r = httpx.post(engine.url + path, json={**body, "model": "gpt-4o"}, headers=ENGINE_AUTH, timeout=60)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["param"] == "model" and "'gpt-4o' is not served here" in err["message"]
        assert "'tiny-dense'" in err["message"] and err["code"] == 404
        for name in ("tiny-dense", "default"):  # the served name and the alias both work
            ok = httpx.post(engine.url + path, json={**body, "model": name, **({"max_tokens": 2} if "prompt" in body
                            and path != "/tokenize" else {})}, headers=ENGINE_AUTH, timeout=60)  # fmt: skip
            assert ok.status_code == 200, (path, name, ok.text)


def test_schemathesis_finds_no_5xx_and_only_the_error_shape(engine: Proc) -> None:
    report = fuzz(engine.url, ENGINE_AUTH, examples=25)
    print("engine:", report.summary())
    assert not report.failures, "\n".join(report.failures)
    assert len(report.by_operation) + len(report.no_cases) == 2 * OPERATIONS
    assert all(label.endswith(" negative") for label in report.no_cases)
    assert report.statuses[200] > 0 and report.statuses[400] > 0
