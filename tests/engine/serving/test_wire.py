"""The engine's typed wire format: every request field honoured or refused with a 400
naming it, streams that carry usage only when asked, tool calls and reasoning in the
response shapes, /v1/completions, /tokenize and /detokenize — with the official openai
client over a real engine process where the engine is involved."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.request import FinishEvent, RequestError, Timings
from keepwarm.engine.serving import wire
from keepwarm.engine.serving.openai_format import (
    ChunkWriter,
    ReplyShape,
    completion_body,
    parse_chat_request,
    parse_completion_request,
)
from tests.api.procs import Proc, start_engine

USER = [{"role": "user", "content": "Tell me about the river."}]


def parse(body: dict[str, Any], trusted: bool = True) -> Any:
    return parse_chat_request(json.dumps(body).encode(), 4096, Policy("full"), trusted)


def refused(body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(body)
    return e.value


# --- parsing (no engine) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"frequency_penalty": 3}, "frequency_penalty", "<= 2"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "one of text, json_object, json_schema"),
        ({"logit_bias": {"x5": 10}}, "logit_bias", "token ids"),
        ({"n": 0}, "n", ">= 1"),
        ({"tool_choice": "auto"}, "tool_choice", "needs a non-empty tools list"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name", "not in tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "must be"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
        ({"store": True}, "store", "not supported"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "chat_template_kwargs"),
        ({"min_p": 0.1}, "min_p", "unknown field"),
        ({"seed": 2**64}, "seed", "<= 9223372036854775807"),
        ({"temperature": "hot"}, "temperature", "a number"),
        ({"stop": ["a"] * 17}, "stop", "length <= 16"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "not both"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content", "only text parts"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
         "messages[0].tool_call_id", "only allowed on tool messages"),
        ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages[0].colour", "unknown field"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of system, developer"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
    ],
)  # fmt: skip
def test_fields_refused_with_a_400_naming_them(extra: dict[str, Any], param: str, words: str) -> None:
    err = refused({"messages": USER, **extra})
    assert err.param == param and err.status == 400 and words in str(err), str(err)


def test_sampler_fields_reach_the_request() -> None:
    call = parse({
        "messages": USER, "n": 3, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5,
        "frequency_penalty": -1, "repetition_penalty": 1.2, "logit_bias": {"5": 10},
        "response_format": {"type": "json_object"},
    })  # fmt: skip
    req = call.request
    assert (req.n, req.logprobs, req.top_logprobs) == (3, True, 2)
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, -1, 1.2)
    assert req.logit_bias == ((5, 10.0),) and req.constraint is not None
    assert req.constraint.kind == "json_object"
    tools = [{"type": "function", "function": {"name": "f"}}]
    forced = parse({"messages": USER, "tools": tools, "tool_choice": "required"}).request
    assert forced.constraint is not None and forced.constraint.kind == "tool_required"


def test_fields_honoured() -> None:
    call = parse({
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
             "refusal": None, "annotations": [], "audio": None, "function_call": None, "reasoning": "think"},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ],
        "model": "any", "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": -5,
        "stop": "END", "stop_token_ids": [3], "n": 1, "logprobs": False, "presence_penalty": 0,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": "auto", "parallel_tool_calls": False, "response_format": {"type": "text"},
        "chat_template_kwargs": {"enable_thinking": False}, "user": "u1", "stream": True,
        "stream_options": {"include_usage": True}, "prefix_cache": {"scope": "auto", "window": 4},
        "cache_salt": "s", "session_hint": {"key": "k", "tokens": 9},
    })  # fmt: skip
    req = call.request
    assert req.messages[0] == {"role": "system", "content": "Be brief."}
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert req.messages[2]["reasoning_content"] == "think" and req.messages[3]["tool_call_id"] == "call_1"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.stop_token_ids) == (
        7,
        0.5,
        0.9,
        -5,
        ("END",),
        (3,),
    )
    assert req.tools == (
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
    )
    assert req.chat_template_kwargs == {"enable_thinking": False}
    assert (call.stream, call.include_usage, call.tools_enabled, call.parallel_tool_calls) == (
        True,
        True,
        True,
        False,
    )
    assert (req.policy, req.cache_salt, req.session_hint.key) == (Policy("auto", window=4), "s", "k")
    untrusted = parse({"messages": USER, "cache_salt": "s", "session_hint": {"key": "k", "tokens": 9}}, False)
    assert untrusted.request.cache_salt == "" and untrusted.request.session_hint is None
    assert not parse({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                      "tool_choice": "none"}).tools_enabled  # fmt: skip


def test_completion_requests_take_text_or_token_ids() -> None:
    text = parse_completion_request(b'{"prompt": "Once", "max_tokens": 3}', 64, Policy("off"))
    assert text.prompt_text == "Once" and text.request.prompt_tokens is None
    ids = parse_completion_request(b'{"prompt": [1, 2, 3]}', 64, Policy("off"))
    assert ids.request.prompt_tokens == (1, 2, 3) and ids.request.sampling.max_tokens == 16
    for body, param in [(b'{"prompt": ["a", "b"]}', "prompt[0]"), (b'{"prompt": "x", "echo": true}', "echo"),
                        (b'{"prompt": [-1]}', "prompt[0]"), (b'{"prompt": "x", "suffix": "y"}', "suffix")]:  # fmt: skip
        with pytest.raises(RequestError) as e:
            parse_completion_request(body, 64, Policy("off"))
        assert e.value.param == param, (body, str(e.value))


def finish(text: str, reason: str = "stop") -> FinishEvent:
    return FinishEvent(reason, text, 10, 5, 0, Timings())


CANNED = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_canned_tool_call_reply_in_the_response_bodies() -> None:
    shape = ReplyShape(tool_format="hermes")
    body = json.loads(completion_body("id1", "m", finish(CANNED), "ns", shape))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    plain = json.loads(completion_body("id1", "m", finish(CANNED), "ns", ReplyShape()))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": CANNED}  # tools off: text as is
    assert plain["choices"][0]["finish_reason"] == "stop"

    for include_usage in (False, True):
        w = ChunkWriter("id2", "m", shape, include_usage)
        chunks = [w.start()] + [c for c in (w.text(CANNED[i : i + 4]) for i in range(0, len(CANNED), 4)) if c]
        chunks += w.finish(finish(CANNED), "ns")
        data = [json.loads(c) for c in chunks]
        assert all(d["choices"] for d in data[:-1]) and bool(data[-1]["choices"]) != include_usage
        assert all("usage" not in d for d in data if d["choices"])
        deltas = [d["choices"][0]["delta"] for d in data if d["choices"]]
        assert "".join(d.get("content", "") for d in deltas) == "Checking."
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")] and calls[0]["id"]
        finals = [d for d in data if d["choices"] and d["choices"][0]["finish_reason"]]
        assert [f["choices"][0]["finish_reason"] for f in finals] == ["tool_calls"]
        if include_usage:
            assert data[-1]["usage"]["completion_tokens"] == 5 and data[-1]["keepwarm"]["namespace"] == "ns"


def test_wire_errors_name_nested_fields() -> None:
    with pytest.raises(wire.WireError) as e:
        wire.decode(b'{"messages": [{"role": "user", "content": 5}]}', wire.ChatCompletionRequest)
    assert e.value.param == "messages[0].content" and "a string or a list or null" in str(e.value)
    with pytest.raises(wire.WireError) as e:
        wire.decode(b"[1]", wire.ChatCompletionRequest)
    assert e.value.param is None and "JSON object" in str(e.value)
    with pytest.raises(wire.WireError, match="messages is required"):
        wire.decode(b"{}", wire.ChatCompletionRequest)


# --- over a real engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("engine-wire")
    proc = start_engine(tiny_dense_model, tmp / "cache", tmp / "logs", extra=["--max-context", "2048"])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(engine: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_stream_has_no_usage_chunk_unless_asked(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "tiny-dense", "messages": USER, "max_tokens": 4, "temperature": 0}
    plain = list(client.chat.completions.create(stream=True, **kw))
    assert plain and all(c.choices for c in plain) and all(c.usage is None for c in plain)
    assert plain[0].choices[0].delta.role == "assistant" and plain[-1].choices[0].finish_reason in (
        "stop",
        "length",
    )
    asked = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert all(c.choices for c in asked[:-1])
    full = client.chat.completions.create(**kw)
    assert asked[-1].usage.completion_tokens == full.usage.completion_tokens
    assert full.usage.model_extra["timings"]["prefill_tokens"] >= 0  # keepwarm's timings, always here
    assert "".join(c.choices[0].delta.content or "" for c in plain) == full.choices[0].message.content


def test_openai_client_errors_name_the_field(client: openai.OpenAI) -> None:
    for kw, param in [({"top_logprobs": 2}, "top_logprobs"), ({"n": 0}, "n"),
                      ({"response_format": {"type": "xml"}}, "response_format.type"),
                      ({"extra_body": {"colour": "red"}}, "colour")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-dense", messages=USER, max_tokens=2, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param


def test_openai_client_n_logprobs_and_json(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": "tiny-dense", "messages": USER, "max_tokens": 6}
    a = client.chat.completions.create(n=3, seed=9, temperature=0.9, logprobs=True, **kw)
    b = client.chat.completions.create(n=3, seed=9, temperature=0.9, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in a.choices
    )  # every choice counted
    greedy = client.chat.completions.create(logprobs=True, top_logprobs=3, temperature=0, **kw)
    content = greedy.choices[0].logprobs.content
    assert len(content) == greedy.usage.completion_tokens
    for entry in content:  # greedy picks the most likely token; log probabilities are <= 0, best first
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
    streamed = list(client.chat.completions.create(n=2, seed=3, temperature=1.0, stream=True, **kw))
    assert {c.choices[0].index for c in streamed if c.choices} == {0, 1}
    # a seed whose sampled object closes within 200 tokens on the random-weight model (about half
    # of the seeds do: 2, 5, 6, 7 and 11 of 1-12)
    j = client.chat.completions.create(response_format={"type": "json_object"}, temperature=1.0, seed=7,
                                       **{**kw, "max_tokens": 200})  # fmt: skip
    assert j.choices[0].finish_reason == "stop" and isinstance(json.loads(j.choices[0].message.content), dict)


def test_tool_round_trip_input_renders_and_answers(client: openai.OpenAI, engine: Proc) -> None:
    """The second half of a tool loop: the assistant's call and the tool's result go back in."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather for a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
    ]  # fmt: skip
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny-dense", messages=messages, tools=tools, max_tokens=4,
                                           temperature=0, stream=stream)  # fmt: skip
        if stream:
            chunks = list(r)
            assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
        else:
            assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    toks = httpx.post(engine.url + "/tokenize", json={"messages": messages, "tools": tools}).json()
    text = httpx.post(engine.url + "/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": -3}\n</tool_response>' in text and text.endswith(
        "<|im_start|>assistant\n"
    )
    assert '"name": "get_weather", "description": "Weather for a city"' in text
    full = client.chat.completions.create(
        model="tiny-dense", messages=messages, tools=tools, max_tokens=2, temperature=0
    )
    assert full.usage.prompt_tokens == toks["count"]


def test_tokenize_detokenize_and_completions(client: openai.OpenAI, engine: Proc) -> None:
    t = httpx.post(engine.url + "/tokenize", json={"prompt": "The river ran 東京"}).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 2048
    back = httpx.post(engine.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert back == {"prompt": "The river ran 東京"}
    bad = httpx.post(engine.url + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(engine.url + "/tokenize", json={"prompt": "x", "messages": USER})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"

    by_text = client.completions.create(
        model="tiny-dense", prompt="The river ran", max_tokens=4, temperature=0
    )
    by_ids = client.completions.create(
        model="tiny-dense", prompt=t["tokens"][:3], max_tokens=4, temperature=0
    )
    same = client.completions.create(
        model="tiny-dense",
        prompt=httpx.post(engine.url + "/tokenize", json={"prompt": "The river ran"}).json()["tokens"],
        max_tokens=4,
        temperature=0,
    )
    assert by_text.object == "text_completion" and by_text.choices[0].text == same.choices[0].text
    assert by_text.usage.prompt_tokens == same.usage.prompt_tokens and by_ids.usage.prompt_tokens == 3
    streamed = list(client.completions.create(model="tiny-dense", prompt="The river ran", max_tokens=4, temperature=0,
                                              stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text.choices[0].text
    assert all(c.choices for c in streamed)


def test_chat_template_kwargs_reach_the_template(engine: Proc) -> None:
    """The demo template reads no kwargs (same tokens); a reserved name is refused by the template."""
    base = httpx.post(engine.url + "/tokenize", json={"messages": USER}).json()["tokens"]
    same = httpx.post(engine.url + "/tokenize", json={"messages": USER,
                      "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]  # fmt: skip
    assert same == base
    r = httpx.post(engine.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2,
                   "chat_template_kwargs": {"add_generation_prompt": False}})  # fmt: skip
    assert r.status_code == 400 and "cannot set 'add_generation_prompt'" in r.json()["error"]["message"]


def test_wire_timings_carry_every_engine_timing() -> None:
    """usage.timings is typed (wire.Timings): the same fields as the engine's Timings, rounded,
    diverged_at only when set."""
    import msgspec

    from keepwarm.engine.generation.request import Timings

    assert Timings is wire.Timings  # one declaration: the engine's timings are the wire's
    t = msgspec.to_builtins(Timings(cache_source="disk", restore_ms=1.234567).rounded())
    assert t["restore_ms"] == 1.23 and t["cache_source"] == "disk" and "diverged_at" not in t
    assert msgspec.to_builtins(Timings(diverged_at=7).rounded())["diverged_at"] == 7
