"""Deterministic random weights for the demo families (demo/<family>.py `init_weights`): one
generator per model, drawn in the order a family asks, bf16."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


class Draws:
    """`normal(shape, s)`: N(0, s) in bf16 from the model's one generator; `std` is the config's
    initializer_range, `out_std` the residual-output projections' (std / sqrt(2 * layers), so the
    residual stream's norm stays O(1) through depth)."""

    def __init__(self, config: Mapping[str, object], seed: int, num_layers: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.std = float(config.get("initializer_range", 0.02))  # type: ignore[arg-type]
        self.out_std = self.std / math.sqrt(2 * num_layers)

    def normal(self, shape: tuple[int, ...], s: float) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen) * s).to(torch.bfloat16)


def ones(n: int) -> torch.Tensor:
    """A norm weight of 1s, bf16."""
    return torch.ones(n, dtype=torch.bfloat16)
