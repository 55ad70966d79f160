"""Sampler features through the batched engine: n > 1 forks from one prefill, seeded
choices repeat, logprobs match the logits, grammar-constrained replies parse."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import torch

from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.cache_policy import parse_policy
from keepwarm.engine.generation.request import Constraint, FinishEvent, GenerateRequest, TokenEvent
from keepwarm.engine.generation.sampling import SamplingParams
from tests.engine.test_engine import SYSTEM, _cfg


def _chat(**kw: Any) -> GenerateRequest:
    sampling = kw.pop("sampling", SamplingParams(max_tokens=10, temperature=0.8, seed=42))
    return GenerateRequest(
        sampling=sampling,
        messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}),
        policy=parse_policy("off"),
        **kw,
    )


def _by_choice(events: list[Any]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for ev in events:
        if isinstance(ev, TokenEvent) and ev.token_id >= 0:
            out.setdefault(ev.index, []).append(ev.token_id)
    return out


def test_n_choices_share_one_prefill_and_repeat_with_a_seed(tiny_dense_model: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, None, memory_budget=0))
    try:
        first = list(engine.generate(_chat(n=3)))
        finishes = [ev for ev in first if isinstance(ev, FinishEvent)]
        assert sorted(f.index for f in finishes) == [0, 1, 2]
        prompt_len = finishes[0].prompt_tokens
        assert engine.stats.prefill_tokens == prompt_len  # one prefill for three choices
        again = list(engine.generate(_chat(n=3)))
        a, b = _by_choice(first), _by_choice(again)
        assert a == b and len({tuple(v) for v in a.values()}) > 1  # seeded: repeats; choices differ
        assert engine.memory.used_bytes == 0
        # choice 0 of n=3 is the n=1 reply with the same seed
        single = _by_choice(list(engine.generate(_chat())))
        assert single[0] == a[0]
    finally:
        engine.close()


def test_logprobs_agree_with_a_float32_log_softmax(tiny_dense_model: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, None, memory_budget=0))
    try:
        seen: list[torch.Tensor] = []
        inner = engine._sample

        def sample(seq: Any, logits: torch.Tensor) -> None:
            seen.append(logits.detach().float().clone())
            inner(seq, logits)

        engine._sample = sample  # type: ignore[method-assign]
        events = list(engine.generate(_chat(logprobs=True, top_logprobs=4)))
        toks = [ev for ev in events if isinstance(ev, TokenEvent) and ev.logprob is not None]
        assert len(toks) == len(seen) > 0
        for ev, logits in zip(toks, seen, strict=True):
            lp = torch.log_softmax(logits, dim=-1)
            assert ev.logprob == float(lp[ev.token_id])
            assert [t for t, _ in ev.top_logprobs] == torch.topk(lp, 4).indices.tolist()
    finally:
        engine.close()


SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
     "required": ["ok"], "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False},
]  # fmt: skip


def test_json_schema_replies_parse_and_validate(tiny_dense_model: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, None, memory_budget=0))
    try:
        for i, schema in enumerate(SCHEMAS):
            req = _chat(
                sampling=SamplingParams(max_tokens=200, temperature=1.0, seed=i),
                constraint=Constraint("json_schema", schema=schema, strict=True),
            )
            fin = engine.complete(req)
            assert fin.finish_reason == "stop", fin
            jsonschema.validate(json.loads(fin.text), schema)
    finally:
        engine.close()
