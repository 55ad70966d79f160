"""`model` routing at the gateway over real processes: two engines serving different
models (`--model-name`, --max-context differing), the gateway learning them from
each engine's /v1/models, routing by `model` with session affinity inside the
model's engines, a 404 listing the served models for an unknown one, the
`default` alias, and /v1/completions, /tokenize, /detokenize through the gateway."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.api.procs import (
    ENGINE_AUTH,
    ENGINE_TOKEN,
    GatewayStack,
    Proc,
    shared_demo_model,
    start_engine,
    start_gateway,
    start_valkey,
)

ALPHA = {"Authorization": "Bearer key-alpha"}
MODELS = {"river-small": "512", "river-large": "384"}  # served name -> --max-context
SYSTEM = "You answer questions about rivers, lakes and the towns along them, in one short sentence."


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    root = tmp_path_factory.mktemp("routing")
    model = shared_demo_model(tmp_path_factory.getbasetemp())
    started: list[Proc] = []
    try:
        started.append(start_valkey(root / "valkey"))
        for i, (name, ctx) in enumerate(MODELS.items()):
            # start_engine's own --max-context comes first; a repeated flag wins (argparse).
            eng = start_engine(model, root / f"cache-{i}", root / "logs", token=ENGINE_TOKEN,
                               extra=["--model-name", name, "--max-context", ctx])  # fmt: skip
            started.append(eng)
        gw = start_gateway(
            [p.url for p in started[1:]], started[0].url, root / "logs", engine_token=ENGINE_TOKEN
        )
    except BaseException:
        for p in reversed(started):
            p.stop()
        raise
    s = GatewayStack(valkey=started[0], engines=started[1:], gateway=gw)
    yield s
    s.stop()


def requests_of(engine: Proc) -> float:
    text = httpx.get(engine.url + "/metrics", headers=ENGINE_AUTH).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("keepwarm_requests_total"))


def chat(gw: Proc, model: str | None, session: str | None = None, **kw: Any) -> httpx.Response:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "Which river?"}],
                            "max_tokens": 3, "temperature": 0, **kw}  # fmt: skip
    if model is not None:
        body["model"] = model
    headers = {**ALPHA, **({"X-Session-Id": session} if session else {})}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return dict(body["error"])


def test_gateway_lists_each_served_model_with_its_card(stack: GatewayStack) -> None:
    models = openai.OpenAI(base_url=stack.gateway.url + "/v1", api_key="key-alpha").models.list().data
    assert [m.id for m in models] == sorted(MODELS)
    argv = stack.engines[0].argv
    written = int((Path(argv[argv.index("--model") + 1]) / "config.json").stat().st_mtime)
    for m in models:
        assert (m.owned_by, m.created, m.object) == ("keepwarm", written, "model")
        assert m.model_extra == {"max_model_len": int(MODELS[m.id])}


def test_each_model_is_served_by_its_engine(stack: GatewayStack) -> None:
    small, large = stack.engines
    for name, engine, other in (("river-small", small, large), ("river-large", large, small)):
        before, before_other = requests_of(engine), requests_of(other)
        for stream in (False, True):
            r = chat(stack.gateway, name, stream=stream)
            assert r.status_code == 200, r.text
            if not stream:
                assert r.json()["model"] == name  # the engine's own name for what it served
            else:
                assert f'"model":"{name}"' in r.text
        assert requests_of(engine) == before + 2 and requests_of(other) == before_other


def test_a_session_stays_within_the_engines_of_its_model(stack: GatewayStack) -> None:
    small, large = stack.engines
    redis_sync = redis.Redis.from_url(stack.valkey.url, decode_responses=True)
    first = chat(stack.gateway, "river-small", session="hop")
    assert first.status_code == 200
    assert redis_sync.hget("keepwarm:session:alpha:hop", "engine") == small.url
    # The same session asking the other model goes to that model's engine, not its old one.
    before = requests_of(large)
    assert chat(stack.gateway, "river-large", session="hop").json()["model"] == "river-large"
    assert requests_of(large) == before + 1
    assert redis_sync.hget("keepwarm:session:alpha:hop", "engine") == large.url


def test_an_unknown_model_is_a_404_listing_the_served_ones(stack: GatewayStack) -> None:
    for stream in (False, True):
        err = error_of(chat(stack.gateway, "gpt-4o", stream=stream), 404)
        assert err["param"] == "model" and err["type"] == "not_found_error"
        assert err["message"].startswith(
            "model 'gpt-4o' is not served here; served models: river-large, river-small"
        )
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/tokenize", {"prompt": "x"}),
                       ("/detokenize", {"tokens": [1]})):  # fmt: skip
        r = httpx.post(stack.gateway.url + path, json={**body, "model": "nope"}, headers=ALPHA, timeout=60)
        assert "served models: river-large, river-small" in error_of(r, 404)["message"]
    # With two models served, neither `default` nor leaving `model` out picks one.
    for model in ("default", None):
        err = error_of(chat(stack.gateway, model), 400)
        assert (
            err["param"] == "model" and "serves several models (river-large, river-small)" in err["message"]
        )


def test_completions_through_the_gateway_keep_sessions_and_the_cache(stack: GatewayStack) -> None:
    redis_sync = redis.Redis.from_url(stack.valkey.url, decode_responses=True)
    prompt = "The river ran past the mill, the bridge and the old church before it reached the sea, and then"
    c = openai.OpenAI(base_url=stack.gateway.url + "/v1", api_key="key-alpha", max_retries=0,
                      default_headers={"X-Session-Id": "cmpl"})  # fmt: skip
    first = c.completions.create(model="river-large", prompt=prompt, max_tokens=4, temperature=0)
    again = c.completions.create(model="river-large", prompt=prompt, max_tokens=4, temperature=0)
    assert first.model == "river-large" and first.choices[0].text == again.choices[0].text
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the first call's prefix, restored
    assert "keepwarm" not in (again.model_extra or {})  # engine-internal: stripped
    s = redis_sync.hgetall("keepwarm:session:alpha:cmpl")
    assert (s["turns"], s["hits"], s["engine"]) == ("2", "1", stack.engines[1].url)
    # Streamed: usage only when asked, as for chat.
    chunks = list(c.completions.create(model="river-large", prompt=prompt, max_tokens=4, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == first.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == first.usage.prompt_tokens
    plain = list(
        c.completions.create(model="river-large", prompt=prompt, max_tokens=4, temperature=0, stream=True)
    )
    assert all(ch.choices for ch in plain)


def test_tokenize_and_detokenize_through_the_gateway(stack: GatewayStack) -> None:
    gw = stack.gateway.url
    t = httpx.post(gw + "/tokenize", json={"model": "river-small", "prompt": "The river ran"}, headers=ALPHA)
    assert t.status_code == 200, t.text
    body = t.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 512
    d = httpx.post(gw + "/detokenize", json={"model": "river-small", "tokens": body["tokens"]}, headers=ALPHA)
    assert d.status_code == 200 and d.json()["prompt"].endswith("The river ran")
    # The other model's engine answers for its own model (its max_model_len).
    t2 = httpx.post(gw + "/tokenize", json={"model": "river-large", "prompt": "The river ran"}, headers=ALPHA)
    assert t2.json() == {**body, "max_model_len": 384}
    assert error_of(httpx.post(gw + "/tokenize", json={"prompt": "x"}), 401)["type"] == "authentication_error"


def test_a_model_whose_engines_are_down_is_a_503_not_a_404(stack: GatewayStack) -> None:
    """Last in this module: it stops the river-large engine."""
    stack.engines[1].stop()
    err = error_of(chat(stack.gateway, "river-large"), 503)
    assert err["param"] == "model" and "no healthy engine serves model 'river-large'" in err["message"]
    assert chat(stack.gateway, "river-small").status_code == 200
    # One model left: the alias names it.
    assert chat(stack.gateway, "default").json()["model"] == "river-small"


def test_one_model_served_accepts_the_alias_and_its_name(gateway: Proc) -> None:
    """The session gateway (one engine, model 'tiny'): `default` and no `model` mean 'tiny'."""
    for model in ("tiny", "default", None):
        r = chat(gateway, model)
        assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    assert "served models: tiny " in error_of(chat(gateway, "demo"), 404)["message"]
