"""generation/field_ranges.py: each request field's range, declared once and read by the wire
models, the gateway's bounded checks and the engine's dataclasses."""

from __future__ import annotations

import msgspec
import pytest

from keepwarm.api.chat_body import FIELD_RANGES
from keepwarm.engine.generation.field_ranges import I32_MAX, RANGES, Range
from keepwarm.engine.generation.request import GenerateRequest, RequestError
from keepwarm.engine.generation.sampling import SamplingError, SamplingParams
from keepwarm.engine.serving import wire


def test_range_describes_and_checks_itself() -> None:
    r = Range(0, 1, integer=False, low_open=True)
    assert (r.interval(), r.describe()) == ("(0, 1]", "a number in (0, 1]")
    assert r.holds(1) and r.holds(0.5) and not r.holds(0) and not r.holds(True) and not r.holds(float("nan"))
    assert r.refusal("top_p", 0) == "top_p must be in (0, 1], got 0" and r.refusal("top_p", 1) is None
    assert r.bounds() == {"gt": 0, "le": 1}
    assert Range(1, I32_MAX, integer=True).describe() == f"an integer in [1, {I32_MAX}]"


def test_the_gateway_checks_the_engines_ranges() -> None:
    assert FIELD_RANGES is RANGES


@pytest.mark.parametrize("name", sorted(RANGES))
def test_the_wire_model_refuses_just_outside_each_range(name: str) -> None:
    r = RANGES[name]
    step = 1 if r.integer else 0.5
    below = r.low if r.low_open else r.low - step
    for value, ok in ((r.high, True), (r.high + step, False), (below, False)):
        body = msgspec.json.encode({"messages": [{"role": "user", "content": "x"}], name: value})
        if ok:
            wire.decode(body, wire.ChatCompletionRequest)
        else:
            with pytest.raises(wire.WireError) as e:
                wire.decode(body, wire.ChatCompletionRequest)
            assert e.value.param == name


def test_the_engines_dataclasses_carry_the_param() -> None:
    with pytest.raises(SamplingError) as s:
        SamplingParams(top_p=0.0)
    assert s.value.param == "top_p" and str(s.value) == "top_p must be in (0, 1], got 0.0"
    with pytest.raises(RequestError) as r:
        GenerateRequest(sampling=SamplingParams(), messages=({"role": "user", "content": "x"},), n=129)
    assert r.value.param == "n" and "[1, 128]" in str(r.value)


def test_one_error_envelope_for_both_services() -> None:
    from keepwarm.api.errors import ApiError

    assert ApiError(404, "no such model", param="model").body() == {
        "error": {"message": "no such model", "type": "not_found_error", "param": "model", "code": 404}
    }
    assert wire.error_body("x", 500).error.type == wire.ERROR_TYPES[500]
    assert wire.error_body("x", 418).error.type == "api_error"
