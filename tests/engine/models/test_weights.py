"""models/weights.py: the output projection, stored or tied to the embedding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.weights import lm_head

CPU = torch.device("cpu")


def _ckpt(stored: bool) -> Checkpoint:
    names = {"lm_head.weight"} if stored else set()
    return cast(Checkpoint, SimpleNamespace(has=lambda n: n in names, path=Path("/m")))


def test_stored_head_is_loaded_unless_a_tied_config_wins() -> None:
    embed, stored = torch.zeros(3, 2), torch.ones(3, 2)
    assert lm_head(_ckpt(True), lambda: stored, embed, CPU, tied=False) is stored
    assert lm_head(_ckpt(True), lambda: stored, embed, CPU, tied=True) is stored
    assert lm_head(_ckpt(True), lambda: stored, embed, CPU, tied=True, tied_wins=True) is embed


def test_missing_head_ties_or_is_refused() -> None:
    embed = torch.zeros(3, 2)
    load: Any = lambda: pytest.fail("nothing stored to load")  # noqa: E731
    assert lm_head(_ckpt(False), load, embed, CPU, tied=True) is embed
    with pytest.raises(CheckpointError, match="lm_head.weight is missing and tie_word_embeddings is false"):
        lm_head(_ckpt(False), load, embed, CPU, tied=False)
