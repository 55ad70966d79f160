"""models/step.py: a batched step's rows, and its refusals before any state is touched."""

from __future__ import annotations

import pytest
import torch

from keepwarm.engine.models.backend import State
from keepwarm.engine.models.step import Step


def _chunk(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64)


def test_rows_of_a_mixed_step() -> None:
    states = [State(capacity=16, position=3), State(capacity=16), State(capacity=16, position=7)]
    step = Step.of(states, [_chunk(1), _chunk(4), _chunk(1)])
    assert step.starts == (3, 0, 7)
    assert step.lengths == (1, 4, 1)
    assert step.offsets == (0, 1, 5)
    assert step.decodes == (0, 2) and step.prefills == (1,)
    assert step.decode_rows == [0, 5]
    assert step.last_rows == [0, 4, 5]
    assert step.positions(torch.device("cpu")).tolist() == [3, 0, 1, 2, 3, 7]


def test_refusals() -> None:
    s = State(capacity=4)
    with pytest.raises(ValueError, match="one chunk per state"):
        Step.of([s], [])
    with pytest.raises(ValueError, match="appears twice"):
        Step.of([s, s], [_chunk(1), _chunk(1)])
    with pytest.raises(ValueError, match="non-empty 1-D"):
        Step.of([s], [_chunk(0)])
    with pytest.raises(ValueError, match="capacity 4 is too small for 5 tokens"):
        Step.of([s], [_chunk(5)])
