"""models/sliding.py's stage-boundary move: the hidden state and each rope's cos/sin move to
the next stage's device once, kinds that share a rope sharing the moved tensors."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from keepwarm.engine.models.sliding import FULL, SLIDING, SlidingKvBackend

META = torch.device("meta")


def _backend(stage: torch.device) -> Any:
    return SimpleNamespace(placement=SimpleNamespace(device_of=lambda i: stage))


def test_a_stage_boundary_moves_each_rope_once() -> None:
    x, shared, own = (
        torch.ones(2, 4),
        (torch.ones(2, 3), torch.zeros(2, 3)),
        (torch.ones(2, 5), torch.zeros(2, 5)),
    )
    moved_x, moved = SlidingKvBackend._to_stage(
        _backend(META), 3, x, {FULL: shared, SLIDING: shared, "x": own}
    )
    assert moved_x.device == META and all(t.device == META for pair in moved.values() for t in pair)
    assert moved[FULL] is moved[SLIDING] and moved["x"] is not moved[FULL]
    assert [tuple(t.shape) for t in moved["x"]] == [(2, 5), (2, 5)]


def test_no_boundary_moves_nothing() -> None:
    x, cs = torch.ones(2, 4), {FULL: (torch.ones(2, 3), torch.zeros(2, 3))}
    same_x, same = SlidingKvBackend._to_stage(_backend(torch.device("cpu")), 0, x, cs)
    assert same_x is x and same is cs
