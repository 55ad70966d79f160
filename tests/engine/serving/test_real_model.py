"""The real model through the engine's HTTP API: SmolLM2-135M-Instruct (its Q4_1 GGUF, the
default model) answers a factual question, writes JSON that its schema accepts and tool calls
that their tools' schemas accept within 128 tokens, ends them itself (`stop` / `tool_calls`),
and a next turn restores the previous prompt from the cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.api.procs import Proc, start_engine

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def engine(smollm2_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("real-model")
    proc = start_engine(smollm2_model, tmp / "cache", tmp / "logs", extra=["--max-context", "2048"])
    yield proc
    proc.stop()


def chat(engine: Proc, messages: list[dict], **kw: object) -> dict:
    body = {"messages": messages, "max_tokens": 128, "temperature": 0, **kw}
    r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_the_stable_id(engine: Proc) -> None:
    r = httpx.get(engine.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in r["data"]] == ["SmolLM2-135M-Instruct"]


def test_a_factual_question_is_answered_and_the_next_turn_restores_it(engine: Proc) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = chat(engine, messages)
    answer = first["choices"][0]["message"]["content"]
    assert first["choices"][0]["finish_reason"] == "stop"
    assert "stop_reason" not in first["choices"][0]  # ended by its end-of-turn token
    assert answer == "The capital of France is Paris."
    cut = chat(engine, messages, stop=["Rome", "Paris"])["choices"][0]
    assert (cut["message"]["content"], cut["finish_reason"]) == ("The capital of France is ", "stop")
    assert cut["stop_reason"] == "Paris"  # the stop string that ended it, as vLLM names it
    again = chat(engine, messages)
    assert again["choices"][0]["message"]["content"] == answer
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"]
    follow = [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = chat(engine, follow)
    assert "Rome" in second["choices"][0]["message"]["content"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


def test_json_schema_output_is_valid_and_ends_by_itself(engine: Proc) -> None:
    messages = [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    reply = chat(engine, messages, response_format=fmt)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, ANSWER_SCHEMA)
    assert value["city"] == "Paris"
    assert reply["usage"]["completion_tokens"] < 128


def test_tool_choice_required_calls_a_tool_with_valid_arguments(engine: Proc) -> None:
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    reply = chat(engine, messages, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert args["city"] == "Paris"
    assert reply["usage"]["completion_tokens"] < 128
    # the tool's result goes back (tool_choice auto: a 135M model may well call again); the
    # first prompt is restored from the cache
    history = [
        *messages,
        choice["message"],
        {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"},
    ]
    after = chat(engine, history, tools=[WEATHER, TIME])
    assert after["choices"][0]["finish_reason"] in ("stop", "tool_calls")
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= reply["usage"]["prompt_tokens"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_after_a_restart_the_disk_snapshot_gives_the_same_reply_bit_for_bit(
    smollm2_model: Path, tmp_path: Path, dtype: str
) -> None:
    """A snapshot written by one engine process and restored by the next continues exactly:
    the same tokens with the same logprobs (so the same logits), in bf16 and fp32."""
    messages = [
        {"role": "system", "content": "You are a geography tutor. Answer in one sentence."},
        {"role": "user", "content": "Which river flows through Paris?"},
    ]
    replies = []
    for run in range(2):
        proc = start_engine(
            smollm2_model, tmp_path / "cache", tmp_path / f"logs{run}", extra=["--dtype", dtype]
        )
        try:
            replies.append(chat(proc, messages, max_tokens=24, logprobs=True, top_logprobs=3))
        finally:
            proc.stop()
    first, second = replies
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["usage"]["prompt_tokens"]
    assert second["usage"]["timings"]["cache_source"] == "disk"
    assert second["choices"][0]["message"] == first["choices"][0]["message"]
    assert second["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]


def test_metrics_report_the_weights_by_type_within_a_tenth_of_the_file(
    engine: Proc, smollm2_model: Path
) -> None:
    """The default --weights keeps the file's Q4_1 projections and Q8_0 embedding in their blocks:
    /metrics reports each type's bytes, the blocks exactly the file's tensors of that type."""
    from keepwarm.engine.loading.gguf_file import GgufFile

    chat(engine, [{"role": "user", "content": "Hi"}], max_tokens=1)  # loaded
    text = httpx.get(engine.url + "/metrics", timeout=30).text
    rows = {
        line.split('type="')[1].split('"')[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("keepwarm_model_weight_bytes_by_type{")
    }
    file_bytes: dict[str, int] = {}
    for t in GgufFile(smollm2_model).tensors.values():
        file_bytes[t.type_name] = file_bytes.get(t.type_name, 0) + t.nbytes
    assert rows["Q4_1"] == file_bytes["Q4_1"] and rows["Q8_0"] == file_bytes["Q8_0"]
    assert len(set(rows) - {"Q4_1", "Q8_0"}) == 1  # the norms, at the runtime dtype
    assert sum(rows.values()) <= 1.1 * smollm2_model.stat().st_size
