"""The weight-loading pieces every family's `build` shares: the output projection, stored or
tied to the embedding (`lm_head`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError


class _Movable(Protocol):
    def to(self, device: torch.device) -> _Movable: ...


W = TypeVar("W")

LM_HEAD = "lm_head.weight"


def lm_head(
    ckpt: Checkpoint,
    load: Callable[[], W],
    embed: W,
    device: torch.device,
    tied: bool,
    tied_wins: bool = False,
) -> W:
    """The output projection on `device` (the last stage): `load()` (the stored lm_head.weight)
    where the checkpoint has one, else the embedding where the config ties them (the same tensor
    unless the first and last stage differ). `tied_wins`: a tied config ignores a stored copy
    (as transformers does for gemma3)."""
    if ckpt.has(LM_HEAD) and not (tied_wins and tied):
        return load()
    if tied:
        return embed.to(device)  # type: ignore[attr-defined,no-any-return]
    raise CheckpointError(f"{ckpt.path}: lm_head.weight is missing and tie_word_embeddings is false")
