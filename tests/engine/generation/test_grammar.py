"""Constrained decoding on the demo tokenizer: random logits, masked by the matcher,
always sample text that parses and validates — for generated JSON Schemas (nested
objects, arrays, enums, required fields) and for forced tool calls in the template's
own format."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from keepwarm.engine.generation.grammar import (
    GrammarError,
    GrammarTokenizer,
    apply_token_bitmask_,
    matcher_for,
)
from keepwarm.engine.generation.request import Constraint
from keepwarm.engine.loading.tokenizer import Tokenizer
from keepwarm.engine.serving.tool_calls import parse_tool_calls

NUM_SCHEMAS = 24
MAX_STEPS = 600


@pytest.fixture(scope="module")
def tok(tiny_dense_model: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dense_model)


@pytest.fixture(scope="module")
def gtok(tok: Tokenizer) -> GrammarTokenizer:
    return GrammarTokenizer.from_tokenizer(tok)


def gen_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random schema whose every instance is short (bounded strings, numbers, arrays); an object at the top."""
    kinds = ["string", "integer", "boolean", "enum", "number"] + (["object", "array"] if depth < 3 else [])
    kind = "object" if depth == 0 else rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "東京"], rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {
            "type": "array",
            "items": gen_schema(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 3),
        }
    names = rng.sample(
        ["id", "name", "tags", "kind", "size", "owner", "meta", "river", "ok"], rng.randint(1, 4)
    )
    props = {n: gen_schema(rng, depth + 1) for n in names}
    return {
        "type": "object",
        "properties": props,
        "required": rng.sample(names, rng.randint(0, len(names))),
        "additionalProperties": False,
    }


def sample_constrained(matcher: Any, gtok: GrammarTokenizer, tok: Tokenizer, seed: int) -> tuple[str, int]:
    """Random logits [V] each step, masked, sampled; stops at an end-of-turn token."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        logits = torch.randn(gtok.vocab_size, generator=g) * 3
        apply_token_bitmask_(logits, matcher.allowed_tokens())
        t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        assert matcher.advance(t), matcher.error
        if t in gtok.stop_token_ids:
            assert matcher.is_done()
            return tok.decode(ids, skip_special_tokens=False), len(ids)
        ids.append(t)
    raise AssertionError(f"no end of turn in {MAX_STEPS} steps: {tok.decode(ids)!r}")


def test_random_sampling_under_generated_schemas_always_validates(
    gtok: GrammarTokenizer, tok: Tokenizer
) -> None:
    rng = random.Random(13)
    schemas = [gen_schema(rng) for _ in range(NUM_SCHEMAS)]
    # the set really exercises nesting, arrays, enums and required fields
    text = json.dumps(schemas)
    assert (
        text.count('"type": "object"') >= NUM_SCHEMAS + 10
        and '"items"' in text
        and '"enum"' in text
        and '"required": ["' in text
    )
    for i, schema in enumerate(schemas):
        m = matcher_for(Constraint("json_schema", schema=schema, strict=True), gtok)
        out, n = sample_constrained(m, gtok, tok, seed=i)
        value = json.loads(out)
        jsonschema.validate(value, schema)
        assert n >= 1


def test_json_object_mode_and_a_bad_token(gtok: GrammarTokenizer, tok: Tokenizer) -> None:
    m = matcher_for(Constraint("json_object"), gtok)
    mask = m.allowed_tokens()
    logits = torch.zeros(gtok.vocab_size)
    apply_token_bitmask_(logits, mask)
    allowed = [t for t in range(gtok.vocab_size) if logits[t] == 0]
    assert allowed and all(tok.decode([t]).lstrip().startswith("{") for t in allowed)
    for t in tok.encode('{"a": [1, {"b": null}]}'.replace(" ", "")):
        assert m.advance(t)
    assert m.is_done()
    bad = matcher_for(Constraint("json_object"), gtok)
    assert not bad.advance(tok.encode("x")[0]) and bad.error
    # an errored matcher only lets the reply end
    after = torch.zeros(gtok.vocab_size)
    apply_token_bitmask_(after, bad.allowed_tokens())
    assert {t for t in range(gtok.vocab_size) if after[t] == 0} == set(gtok.stop_token_ids)


TOOLS: tuple[dict[str, Any], ...] = (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"], "additionalProperties": False}}},
)  # fmt: skip


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "generic"])
@pytest.mark.parametrize(
    "kind,name", [("tool_named", "count"), ("tool_named", "get_weather"), ("tool_required", None)]
)
def test_forced_tool_calls_parse_as_calls(
    gtok: GrammarTokenizer, tok: Tokenizer, fmt: str, kind: str, name: str | None
) -> None:
    for seed in range(3):
        m = matcher_for(Constraint(kind, tools=TOOLS, tool_name=name), gtok, fmt, parallel_tool_calls=False)
        out, _ = sample_constrained(m, gtok, tok, seed)
        content, calls = parse_tool_calls(out, fmt)
        assert content == "" and len(calls) == 1, out
        if name:
            assert calls[0].name == name
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == calls[0].name)
        jsonschema.validate(json.loads(calls[0].arguments), schema)


def accepts(m: Any, tok: Tokenizer, text: str) -> bool:
    """Whether the matcher takes `text` (as the tokenizer splits it) and then lets the reply end."""
    return all(m.advance(t) for t in tok.encode(text)) and m.is_done()


W = '{"name":"get_weather","arguments":{"city":"Oslo","unit":"C"}}'
N = '{"name":"count","arguments":{"n":7}}'


@pytest.mark.parametrize(
    "kind,name,parallel,text,ok",
    [
        ("tool_required", None, False, '{"tool_call":' + W + "}", True),
        ("tool_required", None, False, '{"tool_call":' + N + "}", True),
        ("tool_required", None, True, '{"tool_call":' + N + "}", True),
        ("tool_required", None, True, '{"tool_calls":[' + N + "]}", True),
        ("tool_required", None, True, '{"tool_calls":[' + N + "," + W + "," + N + "]}", True),
        ("tool_named", "count", False, '{"tool_call":' + N + "}", True),
        ("tool_named", "count", True, '{"tool_call":' + N + "}", True),
        # not the shape: several calls without parallel calls, an empty list, another tool than the
        # named one, a name that is no tool's, arguments off the schema, extra or missing keys,
        # spaces (the JSON is compact), text around the object, an unfinished object
        ("tool_required", None, False, '{"tool_calls":[' + N + "]}", False),
        ("tool_required", None, True, '{"tool_calls":[]}', False),
        ("tool_named", "count", True, '{"tool_call":' + W + "}", False),
        ("tool_named", "count", True, '{"tool_calls":[' + N + "]}", False),
        ("tool_required", None, True, '{"tool_call":{"name":"lookup","arguments":{}}}', False),
        ("tool_required", None, True, '{"tool_call":{"name":"count","arguments":{"n":10}}}', False),
        ("tool_required", None, True, '{"tool_call":{"name":"count","arguments":{"n":1,"m":2}}}', False),
        ("tool_required", None, True, '{"tool_call":{"name":"count","arguments":{}}}', False),
        ("tool_required", None, True, '{"tool_call":{"name":"count"}}', False),
        ("tool_required", None, True, '{"tool_call":' + N + ',"content":""}', False),
        ("tool_required", None, True, '{"tool_call": ' + N + "}", False),
        ("tool_required", None, True, 'Sure.\n{"tool_call":' + N + "}", False),
        ("tool_required", None, True, '{"tool_call":' + N, False),
    ],
)
def test_generic_tool_grammar_accepts_exactly_the_call_shape(
    gtok: GrammarTokenizer, tok: Tokenizer, kind: str, name: str | None, parallel: bool, text: str, ok: bool
) -> None:
    m = matcher_for(
        Constraint(kind, tools=TOOLS, tool_name=name), gtok, "generic", parallel_tool_calls=parallel
    )
    assert accepts(m, tok, text) is ok
    if ok:  # complete: only an end-of-turn token may follow
        logits = torch.zeros(gtok.vocab_size)
        apply_token_bitmask_(logits, m.allowed_tokens())
        assert {t for t in range(gtok.vocab_size) if logits[t] == 0} == set(gtok.stop_token_ids)


def test_generic_parallel_calls_sample_into_valid_calls(gtok: GrammarTokenizer, tok: Tokenizer) -> None:
    counts = set()
    for seed in range(8):
        m = matcher_for(Constraint("tool_required", tools=TOOLS), gtok, "generic", parallel_tool_calls=True)
        out, _ = sample_constrained(m, gtok, tok, seed)
        content, calls = parse_tool_calls(out, "generic")
        assert content == "" and calls, out
        for call in calls:
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)
        counts.add((out.startswith('{"tool_calls":'), len(calls)))
    assert (False, 1) in counts and any(many for many, _ in counts)  # both shapes came up


def test_strict_schema_with_unsupported_keyword_is_refused(gtok: GrammarTokenizer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}},
              "unevaluatedProperties": {"type": "string"}}  # fmt: skip
    with pytest.raises(GrammarError) as e:
        matcher_for(Constraint("json_schema", schema=schema, strict=True), gtok)
    assert e.value.param == "response_format"
    matcher_for(Constraint("json_schema", schema=schema, strict=False), gtok)  # lenient compiles it
    with pytest.raises(GrammarError, match="not supported for this model's tool-call format"):
        matcher_for(Constraint("tool_required", tools=TOOLS), gtok, "dsml")


def test_bitmask_unpacking_matches_bits() -> None:
    mask = torch.tensor([[-(2**31) | 5, 1], [0, 2]], dtype=torch.int32)
    logits = torch.zeros(2, 40)
    apply_token_bitmask_(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2, 31, 32]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [33]
