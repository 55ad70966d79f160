"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message says which and what is allowed."""


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
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if len(self.stop) > 16:
            raise SamplingError(f"at most 16 stop strings are allowed, got {len(self.stop)}")


class Sampler:
    """Picks the next token from logits [vocab] float32; one per request (owns its RNG)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0.0:
            return int(torch.argmax(logits))
        x = logits.float().cpu() / p.temperature
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
        return int(torch.multinomial(probs, 1, generator=self.generator))
