"""The numeric range of every request field, declared once: the wire models take their
msgspec constraints from here (serving/wire.py), the gateway checks the same ranges before
decoding (api/chat_body.py) and the engine's own dataclasses check them again for callers that
build requests in Python (generation/request.py, generation/sampling.py). Pure Python: every
layer may import it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

I32_MAX = 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class Range:
    """An inclusive (or open-below) range for one numeric field."""

    low: float
    high: float
    integer: bool
    low_open: bool = False

    def interval(self) -> str:
        """'[0, 100]', '(0, 1]'."""
        return f"{'(' if self.low_open else '['}{_fmt(self.low)}, {_fmt(self.high)}]"

    def describe(self) -> str:
        """'an integer in [1, 128]', 'a number in (0, 1]'."""
        return f"{'an integer' if self.integer else 'a number'} in {self.interval()}"

    def holds(self, v: Any) -> bool:
        """Whether `v` (any JSON value) is a number of the right kind within the range."""
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (self.integer and not isinstance(v, int))
        ):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return (self.low < v if self.low_open else self.low <= v) and v <= self.high

    def refusal(self, name: str, v: Any) -> str | None:
        """None when `v` is within the range, else the message naming `name` and the range."""
        return None if self.holds(v) else f"{name} must be in {self.interval()}, got {v}"

    def bounds(self) -> dict[str, float]:
        """msgspec.Meta's keywords for the range."""
        low = "gt" if self.low_open else "ge"
        return {low: _num(self.low, self.integer), "le": _num(self.high, self.integer)}


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _num(x: float, integer: bool) -> float:
    return int(x) if integer else x


# Each numeric field of the Chat Completions / Completions request (plus keepwarm's), with the
# widest range an engine honours; an engine may refuse more (max_tokens beyond its limit).
RANGES: dict[str, Range] = {
    "max_tokens": Range(1, I32_MAX, integer=True),
    "max_completion_tokens": Range(1, I32_MAX, integer=True),
    "temperature": Range(0, 100, integer=False),
    "top_p": Range(0, 1, integer=False, low_open=True),
    "top_k": Range(0, I32_MAX, integer=True),
    "seed": Range(I64_MIN, I64_MAX, integer=True),
    "n": Range(1, 128, integer=True),
    "presence_penalty": Range(-2, 2, integer=False),
    "frequency_penalty": Range(-2, 2, integer=False),
    "repetition_penalty": Range(0, 10, integer=False, low_open=True),
    "top_logprobs": Range(0, 20, integer=True),
}
LOGIT_BIAS = Range(-100, 100, integer=False)  # each value of `logit_bias`
TOKEN_ID = Range(0, I32_MAX, integer=True)  # stop_token_ids, token-id prompts, detokenize
COMPLETION_LOGPROBS = Range(0, 5, integer=True)  # /v1/completions' `logprobs` (a count there)
MAX_STOP = 16  # stop strings per request
PREFIX_CACHE_RANGES: dict[str, Range] = {"window": Range(0, I32_MAX, integer=True)}
