"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seed."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from keepwarm.engine.generation.field_ranges import MAX_STOP, RANGES

_TINY = torch.finfo(torch.float32).tiny


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message says which and what is allowed, `param`
    names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("max_tokens", "temperature", "top_k", "top_p"):
            wrong = RANGES[name].refusal(name, getattr(self, name))
            if wrong is not None:
                raise SamplingError(wrong, param=name)
        if len(self.stop) > MAX_STOP:
            raise SamplingError(
                f"at most {MAX_STOP} stop strings are allowed, got {len(self.stop)}", param="stop"
            )


@dataclass(frozen=True)
class LogitsRules:
    """Per-request changes to the logits before sampling (OpenAI / vLLM semantics):
    presence and frequency penalties over the reply's tokens, a multiplicative
    repetition penalty over prompt and reply (HF semantics: divide positive logits,
    multiply negative ones), an additive bias per token id; and how many log
    probabilities to report (taken from the unmodified logits)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def changes_logits(self) -> bool:
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )


@dataclass(frozen=True)
class Pick:
    token: int
    logprob: float | None = None  # log p(token) under the model's logits (float32 log-softmax)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # the most likely tokens, best first


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 % (1 << 64)
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB % (1 << 64)
    return x ^ (x >> 31)


class Sampler:
    """Picks the next token from logits [vocab] float32; one per sequence. The draw for reply
    token `i` depends only on (seed, choice, i): its generator is seeded from those three for
    that token, so a seeded reply is the same whatever else the engine runs, however its steps
    are cut and in whatever order its positions are sampled (a verified draft samples several
    at once). Choice `i` of an n > 1 request draws from its own stream."""

    def __init__(self, params: SamplingParams, rules: LogitsRules | None = None, choice: int = 0) -> None:
        self.params = params
        self.rules = rules or LogitsRules()
        self.generator = torch.Generator()
        # unseeded: 64 random bits (torch.seed() would also reseed torch's global generators, and
        # it formats a stack trace on every call)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self.stream = _mix64((seed + 0x9E3779B97F4A7C15 * choice) % (1 << 64))

    def __call__(
        self,
        logits: torch.Tensor,
        prompt: Sequence[int] = (),
        reply: Sequence[int] = (),
        allowed: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Pick:
        """`prompt`, `reply`: the sequence's tokens so far (for penalties; the reply's length is
        the position drawn for); `allowed` masks disallowed tokens to -inf in place
        (constrained decoding)."""
        r = self.rules
        raw = logits.float()
        x = raw.cpu().clone() if (r.changes_logits or allowed is not None) else raw
        if r.changes_logits:
            x = self._apply_rules(x, prompt, reply)
        if allowed is not None:
            allowed(x)
        tok = self._pick(x, len(reply))
        if not r.logprobs:
            return Pick(tok)
        lp = torch.log_softmax(raw, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if r.top_logprobs:
            vals, idx = torch.topk(lp, min(r.top_logprobs, lp.shape[-1]))
            top = tuple((int(i), float(v)) for i, v in zip(idx, vals, strict=True))
        return Pick(tok, float(lp[tok]), top)

    def _apply_rules(self, x: torch.Tensor, prompt: Sequence[int], reply: Sequence[int]) -> torch.Tensor:
        r, vocab = self.rules, x.shape[-1]
        if reply and (r.presence_penalty or r.frequency_penalty):
            counts = torch.bincount(torch.tensor(list(reply), dtype=torch.long), minlength=vocab)[:vocab]
            x -= r.frequency_penalty * counts.to(x.dtype) + r.presence_penalty * (counts > 0).to(x.dtype)
        if r.repetition_penalty != 1.0 and (prompt or reply):
            seen = torch.unique(torch.tensor([*prompt, *reply], dtype=torch.long))
            seen = seen[seen < vocab]
            v = x[seen]
            x[seen] = torch.where(v > 0, v / r.repetition_penalty, v * r.repetition_penalty)
        for token, bias in r.logit_bias:
            if token < vocab:
                x[token] += bias
        return x

    def _pick(self, x: torch.Tensor, position: int) -> int:
        p = self.params
        if p.temperature < _TINY:  # 0, or so small that x / T would overflow: the limit is greedy
            return int(torch.argmax(x))
        x = x.float().cpu()
        x = (x - x.max()) / p.temperature  # <= 0 everywhere: no overflow to inf - inf
        if p.top_k > 0 and p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, idx = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_probs, dim=-1)
            drop = cum - sorted_probs > p.top_p  # keep the smallest set whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_probs)
        self.generator.manual_seed(_mix64((self.stream + 0x9E3779B97F4A7C15 * (position + 1)) % (1 << 64)))
        return int(torch.multinomial(probs, 1, generator=self.generator))
