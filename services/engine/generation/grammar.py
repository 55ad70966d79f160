"""Constrained decoding: a request's Constraint (response_format json_object /
json_schema, tool_choice required / named) compiled into a token matcher that says
which tokens may come next.

Backend: llguidance (MIT, no runtime dependencies, one abi3 wheel; chosen over
xgrammar, which pulls torch + transformers + triton, and outlines-core, by the
per-token mask cost measured on this CPU — see BENCHMARKS / the report of issue 13).
It reads the `tokenizers` JSON the engine already loads.

Use, per sequence and step (the batched sampler owns the order):
    m = matcher_for(constraint, grammar_tokenizer, tool_format)   # at admission; GrammarError -> 400
    mask = m.allowed_tokens()          # int32 [ceil(V / 32)], bit t of word t // 32 = token t allowed
    apply_token_bitmask_(logits, mask) # logits [V] or [B, V] (with masks [B, W]); disallowed -> -inf
    tok = sample(logits); m.advance(tok)
    m.is_done()                        # the grammar is complete: only end-of-turn tokens remain
End-of-turn ids (the template's, e.g. <|im_end|>) are the grammar's stop tokens: once
the value is complete the mask allows exactly those.

JSON is compact (no free whitespace), so sampling cannot spin on whitespace.
`strict: true` refuses schemas with keywords llguidance does not implement (400 naming
the schema); `strict: false` compiles them leniently (unknown keywords ignored).
Tool calls are written in the template's own convention (`hermes`: `<tool_call>` blocks,
`llama3_json`: a bare JSON object with "parameters"; `generic`, for templates with none:
the whole reply is `{"tool_call":{"name":N,"arguments":{...}}}`, or with parallel calls
allowed that or `{"tool_calls":[{...},...]}`), arguments constrained by each tool's
`parameters` schema and names by the tools offered.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import llguidance
import torch

from keepwarm.engine.generation.request import Constraint

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_COMPACT: dict[str, Any] = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `param` is the request field to fix."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarTokenizer:
    """The vocabulary as llguidance sees it; build once per engine (about a second for large vocabularies)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        stops = sorted(set(stop_token_ids))
        assert stops, "a grammar needs at least one end-of-turn token"
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stops)
        self.ll = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=stops)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> GrammarTokenizer:
        """From keepwarm's Tokenizer; `vocab_size` is the model's logits width (>= the tokenizer's)."""
        return cls(tokenizer.json_text(), vocab_size or tokenizer.vocab_size, tokenizer.eos_token_ids)

    @property
    def mask_words(self) -> int:
        return (self.vocab_size + 31) // 32


def _json_grammar(schema: dict[str, Any], strict: bool, param: str) -> str:
    options: JsonCompileOptions = {"whitespace_flexible": False, "lenient": not strict}
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
    except ValueError as e:
        raise GrammarError(f"{param} is not a JSON Schema object: {e}", param) from e


def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _generic_schema(tools: list[dict[str, Any]], several: bool) -> dict[str, Any]:
    """The generic format's reply (serving/tool_calls.py): one call, or (`several`) one call or
    a non-empty list of calls; each call's name one of `tools` and its arguments that tool's schema."""
    calls = [_call_schema(t, "arguments") for t in tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    one = {
        "type": "object",
        "properties": {"tool_call": call},
        "required": ["tool_call"],
        "additionalProperties": False,
    }
    if not several:
        return one
    many = {
        "type": "object",
        "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    return {"anyOf": [one, many]}


def _tool_grammar(constraint: Constraint, tool_format: str | None, parallel: bool) -> str:
    tools = [
        t
        for t in constraint.tools
        if constraint.kind == "tool_required" or t["function"]["name"] == constraint.tool_name
    ]
    if tool_format == "hermes":
        # "<tool_call>\n" + {"name": N, "arguments": {...}} + "\n</tool_call>", one or (parallel) more blocks
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        rules = "\n".join(
            f"call{i}: %json {json.dumps({**_call_schema(t, 'arguments'), 'x-guidance': _COMPACT})}"
            for i, t in enumerate(tools)
        )
        repeat = ' ("\\n" block)*' if parallel and constraint.kind == "tool_required" else ""
        lark = f'start: block{repeat}\nblock: "<tool_call>\\n" ({calls}) "\\n</tool_call>"\n{rules}\n'
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    if tool_format == "llama3_json":
        schema = (
            {"anyOf": [_call_schema(t, "parameters") for t in tools]}
            if len(tools) > 1
            else _call_schema(tools[0], "parameters")
        )
        return _json_grammar(schema, True, "tool_choice")
    if tool_format == "generic":
        return _json_grammar(
            _generic_schema(tools, parallel and constraint.kind == "tool_required"), True, "tool_choice"
        )
    raise GrammarError(
        f"tool_choice {'required' if constraint.kind == 'tool_required' else 'with a named function'} "
        f"is not supported for this model's tool-call format ({tool_format or 'none'}); send tool_choice auto",
        "tool_choice",
    )


def grammar_for(
    constraint: Constraint, tool_format: str | None = None, parallel_tool_calls: bool = True
) -> str:
    """The llguidance grammar text for a constraint."""
    if constraint.kind == "json_object":
        return _json_grammar({"type": "object"}, False, "response_format")
    if constraint.kind == "json_schema":
        assert constraint.schema is not None
        return _json_grammar(constraint.schema, constraint.strict, "response_format.json_schema.schema")
    return _tool_grammar(constraint, tool_format, parallel_tool_calls)


class TokenMatcher:
    """One sequence's grammar state. Never raises on a bad token: it enters an error
    state (`error` says why), after which `allowed_tokens` allows only the stop tokens."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, param: str = "response_format") -> None:
        self.tokenizer = tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer.ll)
        if is_error:
            raise GrammarError(f"{param} cannot be enforced: {messages[0]}", param)
        self._m = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"{param} cannot be enforced: {self._m.get_error()}", param)
        self._mask = torch.empty(tokenizer.mask_words, dtype=torch.int32)

    def allowed_tokens(self) -> torch.Tensor:
        """int32 [ceil(V / 32)] bitmask of the tokens allowed next (a view reused by the next call)."""
        if self._m.is_error():
            self._mask.zero_()
            for t in self.tokenizer.stop_token_ids:
                self._mask[t // 32] |= _bit(t % 32)
            return self._mask
        self._m.unsafe_compute_mask_ptr(self._mask.data_ptr(), self._mask.numel() * 4)
        return self._mask

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False when the grammar did not allow it (error state)."""
        return bool(self._m.consume_token(token))

    def is_done(self) -> bool:
        """The constrained value is complete (or the matcher stopped on an error)."""
        return bool(self._m.is_stopped() or self._m.is_accepting() and self._only_stops_allowed())

    def _only_stops_allowed(self) -> bool:
        rest = self.allowed_tokens().clone()
        for t in self.tokenizer.stop_token_ids:
            rest[t // 32] &= ~_bit(t % 32)
        return not bool(rest.any())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch stores."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


def matcher_for(
    constraint: Constraint,
    tokenizer: GrammarTokenizer,
    tool_format: str | None = None,
    parallel_tool_calls: bool = True,
) -> TokenMatcher:
    param = "tool_choice" if constraint.kind.startswith("tool") else "response_format"
    return TokenMatcher(tokenizer, grammar_for(constraint, tool_format, parallel_tool_calls), param)


_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask_(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """logits [V] or [B, V] (any float dtype); mask int32 [W] or [B, W], W = ceil(V / 32).
    Disallowed tokens become -inf, in place; returns logits."""
    vocab = logits.shape[-1]
    bits = (mask.unsqueeze(-1) >> _SHIFTS.to(mask.device)) & 1  # [.., W, 32]
    allowed = bits.flatten(-2)[..., :vocab].bool()
    return logits.masked_fill_(~allowed, float("-inf"))
