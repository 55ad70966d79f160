"""Where each sequence's tokens sit in one batched forward (`Step`): the validation and row
bookkeeping every family's `Backend.step` (models/backend.py) starts from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from keepwarm.engine.models.backend import State


@dataclass(frozen=True)
class Step:
    """Where each sequence's tokens sit in one batched forward: sequence b's chunk is rows
    offsets[b] .. offsets[b] + lengths[b] - 1 of the concatenation, at positions starts[b] ..
    Row lists are plain ints (they index a tensor on any device)."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: tuple[int, ...]
    decodes: tuple[int, ...]  # sequences advancing by one token
    prefills: tuple[int, ...]  # sequences advancing by a chunk of several
    decode_rows: list[int]  # their token rows, in `decodes` order
    last_rows: list[int]  # each sequence's last token row

    @staticmethod
    def of(states: Sequence[State], chunks: Sequence[torch.Tensor]) -> Step:
        """Validates the step before any state is touched."""
        if not states or len(states) != len(chunks):
            raise ValueError(
                f"step needs one chunk per state, got {len(states)} states and {len(chunks)} chunks"
            )
        if len({id(s) for s in states}) != len(states):
            raise ValueError("step: a state appears twice; each sequence advances once per step")
        offsets, lengths = [], []
        off = 0
        for st, ch in zip(states, chunks, strict=True):
            if ch.dim() != 1 or ch.shape[0] == 0:
                raise ValueError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(ch.shape)}")
            n = int(ch.shape[0])
            if st.position + n > st.capacity:
                raise ValueError(
                    f"state capacity {st.capacity} is too small for {st.position + n} tokens: "
                    "allocate a larger state"
                )
            offsets.append(off)
            lengths.append(n)
            off += n
        decodes = tuple(b for b, n in enumerate(lengths) if n == 1)
        return Step(
            starts=tuple(s.position for s in states),
            lengths=tuple(lengths),
            offsets=tuple(offsets),
            decodes=decodes,
            prefills=tuple(b for b, n in enumerate(lengths) if n > 1),
            decode_rows=[offsets[b] for b in decodes],
            last_rows=[o + n - 1 for o, n in zip(offsets, lengths, strict=True)],
        )

    def positions(self, device: torch.device) -> torch.Tensor:
        """Absolute position of every token [T] int64."""
        return torch.cat(
            [torch.arange(s, s + n, device=device) for s, n in zip(self.starts, self.lengths, strict=True)]
        )
