"""What a step that verifies drafted tokens may overwrite in one state, saved before the
step, so that after it the state returns exactly to the last accepted position
(generation/speculation.py). Never an approximation: rows are restored bit for bit.

From the state's geometry (models/geometry.py), per tensor:
  - one row per position (`all_rows`: dense and full-attention K/V): a step writes only at and
    after its start, and rows past the state's position are never read: nothing to save, the
    position alone moves back;
  - a sliding window's ring (`WindowRows`, fed fewer rows than the ring holds): the ring slots
    the step writes, saved and put back for the rejected positions;
  - anything else (the hybrid family's conv and delta-rule states, DeepSeek V4's compressors,
    pending rows and windows; a ring fed more rows than it holds): the whole tensor, copied.
    Such a state goes back to where the step started and feeds the accepted tokens again in
    its next step (`replay`): the same rows, and the kernels give a row the same bits in any
    chunking, so the state is the one plain decoding would have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keepwarm.engine.models.backend import State
from keepwarm.engine.models.geometry import Geometry, all_rows
from keepwarm.engine.models.sliding import WindowRows


@dataclass
class Rewind:
    start: int  # the state's position before the step
    rows: int  # tokens the step feeds
    logits: torch.Tensor | None  # the state's logits before the step
    rings: list[tuple[str, torch.Tensor, torch.Tensor]]  # (name, slots [rows], their rows before)
    whole: dict[str, torch.Tensor]  # name -> copy before the step

    @property
    def replay(self) -> bool:
        """Whether going back means going to the step's start (accepted tokens fed again)."""
        return bool(self.whole)

    @staticmethod
    @torch.inference_mode()
    def before(geometry: Geometry, state: State, rows: int) -> Rewind:
        """Save what feeding `rows` tokens to `state` will overwrite."""
        assert rows >= 1 and state.position + rows <= state.capacity
        p = state.position
        rings: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        whole: dict[str, torch.Tensor] = {}
        for spec in geometry.specs:
            t = state.tensors.get(spec.name)
            if t is None:  # the logits sidecar: state.logits, kept below
                continue
            if spec.length_dim == 0 and spec.rows is all_rows:
                continue
            if spec.length_dim == 0 and isinstance(spec.rows, WindowRows) and rows <= t.shape[0]:
                slots = torch.arange(p, p + rows, device=t.device) % t.shape[0]
                rings.append((spec.name, slots, t.index_select(0, slots)))
                continue
            whole[spec.name] = t.clone()
        return Rewind(p, rows, None if state.logits is None else state.logits.clone(), rings, whole)

    @torch.inference_mode()
    def to(self, state: State, keep: int, logits: torch.Tensor) -> None:
        """After the step: make `state` cover only its first `keep` tokens (start < keep <=
        start + rows), `logits` being the logits after token `keep` - 1. With `replay` the
        state goes back to the step's start instead: the caller feeds start .. keep again."""
        end = self.start + self.rows
        assert self.start < keep <= end and state.position == end, (self.start, keep, state.position)
        if keep == end:
            return
        if self.replay:
            for name, saved in self.whole.items():  # a family may have replaced the tensor
                state.tensors[name] = saved
            for name, slots, saved in self.rings:
                state.tensors[name].index_copy_(0, slots, saved)
            state.position, state.logits = self.start, self.logits
            return
        cut = keep - self.start  # the first rejected row of the step
        for name, slots, saved in self.rings:
            state.tensors[name].index_copy_(0, slots[cut:], saved[cut:])
        state.position, state.logits = keep, logits
