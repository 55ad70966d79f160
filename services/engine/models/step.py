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
    head_rows: list[int]  # the rows the step computes logits for (`heads`), in order
    head_last: list[int]  # where each sequence's last row sits among `head_rows`

    @staticmethod
    def of(
        states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> Step:
        """Validates the step before any state is touched. `heads[b]`: how many of chunk b's
        last rows need logits (a verified draft needs one per drafted token; None: 1 each)."""
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
        rows, lasts = head_rows(lengths, heads)
        return Step(
            starts=tuple(s.position for s in states),
            lengths=tuple(lengths),
            offsets=tuple(offsets),
            decodes=decodes,
            prefills=tuple(b for b, n in enumerate(lengths) if n > 1),
            decode_rows=[offsets[b] for b in decodes],
            last_rows=[o + n - 1 for o, n in zip(offsets, lengths, strict=True)],
            head_rows=rows,
            head_last=lasts,
        )

    def positions(self, device: torch.device) -> torch.Tensor:
        """Absolute position of every token [T] int64."""
        return torch.cat(
            [torch.arange(s, s + n, device=device) for s, n in zip(self.starts, self.lengths, strict=True)]
        )


def head_rows(lengths: Sequence[int], heads: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """The rows of a step (chunks of `lengths`, concatenated) that get logits: the last
    `heads[b]` rows of each chunk b (its last row when `heads` is None), in order; and where
    each chunk's last row sits among them (its `state.logits`)."""
    if heads is not None and len(heads) != len(lengths):
        raise ValueError(f"step: {len(heads)} head counts for {len(lengths)} chunks")
    rows: list[int] = []
    lasts: list[int] = []
    off = 0
    for b, n in enumerate(lengths):
        h = 1 if heads is None else heads[b]
        if not 1 <= h <= n:
            raise ValueError(f"step: chunk {b} has {n} tokens, cannot give logits for its last {h}")
        rows.extend(range(off + n - h, off + n))
        lasts.append(len(rows) - 1)
        off += n
    return rows, lasts


class BatchedForward:
    """A backend's compute entry points (models/backend.py: prefill, decode, step, and the tests'
    forward) on top of its one batched `_forward(states, chunks, heads)`: every family runs every
    request through the same pass, so a reply's bits do not depend on which entry it came by."""

    device: torch.device  # where tokens enter

    def _forward(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Advance each `states[b]` by `chunks[b]` in one pass; logits [sum(heads), vocab] float32
        after each chunk's last `heads[b]` tokens (its last token when `heads` is None)."""
        raise NotImplementedError

    def prefill(self, state: State, tokens: torch.Tensor) -> torch.Tensor:
        return self._forward([state], [tokens])[0]

    def decode(self, state: State, token: int) -> torch.Tensor:
        return self._forward([state], [torch.tensor([token], dtype=torch.int64, device=self.device)])[0]

    def step(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        return self._forward(states, chunks, heads)

    def forward(self, state: State, tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Advance `state` by `tokens` [T]; logits [1 or T, vocab] float32."""
        return self._forward([state], [tokens], [len(tokens)] if all_logits else None)
