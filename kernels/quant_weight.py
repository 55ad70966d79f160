"""A weight matrix kept in its quantized blocks (Q8_0, Q4_0, Q4_1): what `ops.project` multiplies
by without dequantizing it (kernels/cpu_quant_linear.py), and the blocks' formulas in torch.

GGUF blocks (bytes per block of 32 weights along a row; a row of K weights is its K / 32 blocks
back to back):
  Q8_0 (34): f16 d, 32 x int8 q           w = d * q
  Q4_0 (18): f16 d, 16 bytes of nibbles   w = d * (q - 8)
  Q4_1 (20): f16 d, f16 m, 16 bytes       w = d * q + m
(byte i's low nibble is weight i, its high nibble weight i + 16). `dequantize_blocks` computes
each value in float32 with the multiply and the add as two operations, as the `gguf` package's
reference does, so the results are bitwise the reference's.

In memory (`QuantWeight.blocks`, [N, K / 32 * block bytes] uint8, the same bytes) each row's
blocks are regrouped for the kernel: the row's K / 32 scales d, then (Q4_1) its minima m, then
its quants, so the kernel converts 8 scales at once. Rows stay whole, so they can be sliced,
permuted and concatenated like a dense matrix's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

import torch

QuantKind = Literal["Q8_0", "Q4_0", "Q4_1"]
KINDS: tuple[QuantKind, ...] = get_args(QuantKind)
BLOCK_BYTES: dict[QuantKind, int] = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
BLOCK = 32  # weights per block


def _f16(col: torch.Tensor) -> torch.Tensor:
    """Two bytes per row, little-endian float16, as float32 (one per block, shape (n, 1))."""
    return col.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes per block -> its 32 4-bit values, low nibbles first."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def dequantize_blocks(kind: QuantKind, raw: torch.Tensor) -> torch.Tensor:
    """Blocks of `kind` (uint8, any shape holding whole blocks) as a flat float32 tensor."""
    b = raw.reshape(-1, BLOCK_BYTES[kind])
    d = _f16(b[:, 0:2])
    if kind == "Q8_0":
        out = d * b[:, 2:].contiguous().view(torch.int8).float()
    elif kind == "Q4_0":
        out = d * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()
    else:
        out = d * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])
    return out.reshape(-1)


def _header(kind: QuantKind) -> int:
    """Bytes of f16 values at the head of a GGUF block (d; d and m for Q4_1)."""
    return 4 if kind == "Q4_1" else 2


def regroup(kind: QuantKind, raw: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [N, nb * block bytes] -> the kernel's rows (per row: every d, every m, every quant)."""
    n, h = raw.shape[0], _header(kind)
    b = raw.reshape(n, -1, BLOCK_BYTES[kind])
    parts = [b[:, :, i : i + 2].reshape(n, -1) for i in range(0, h, 2)] + [b[:, :, h:].reshape(n, -1)]
    return torch.cat(parts, dim=1).contiguous()


def ungroup(kind: QuantKind, rows: torch.Tensor) -> torch.Tensor:
    """The kernel's rows -> GGUF blocks (regroup's inverse)."""
    n, h, size = rows.shape[0], _header(kind), BLOCK_BYTES[kind]
    nb = rows.shape[1] // size
    heads = [rows[:, i * nb : (i + 2) * nb].reshape(n, nb, 2) for i in range(0, h, 2)]
    quants = rows[:, h * nb :].reshape(n, nb, size - h)
    return torch.cat([*heads, quants], dim=2).reshape(n, -1)


@dataclass(frozen=True)
class QuantWeight:
    """A [N, K] weight as `blocks` ([N, K / 32 * BLOCK_BYTES[kind]] uint8, contiguous, in the
    kernel's row layout: `from_gguf` makes one from a file's blocks)."""

    kind: QuantKind
    blocks: torch.Tensor
    in_features: int  # K

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert self.in_features % BLOCK == 0, self.in_features
        assert self.blocks.dtype == torch.uint8 and self.blocks.dim() == 2, (
            self.blocks.dtype,
            self.blocks.shape,
        )
        assert self.blocks.shape[1] == self.in_features // BLOCK * BLOCK_BYTES[self.kind], self.blocks.shape

    @classmethod
    def from_gguf(cls, kind: QuantKind, raw: torch.Tensor, in_features: int) -> QuantWeight:
        """From a GGUF tensor's bytes ([N, K / 32 * block bytes] uint8, blocks back to back)."""
        return cls(kind, regroup(kind, raw), in_features)

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.in_features)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, K] matrix (each value exact in float32, then cast to `dtype`)."""
        return dequantize_blocks(self.kind, ungroup(self.kind, self.blocks)).reshape(self.shape).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized, [*ids.shape, K] (an embedding lookup)."""
        picked = ungroup(self.kind, self.blocks.index_select(0, ids.reshape(-1).to(self.device)))
        return dequantize_blocks(self.kind, picked).reshape(*ids.shape, self.in_features).to(dtype)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.kind, self.blocks.to(device), self.in_features)


def quantize_q8_0(w: torch.Tensor) -> QuantWeight:
    """A dense [N, K] matrix (K a multiple of 32) as Q8_0 blocks, by ggml's reference: per block
    d = amax / 127 (stored as f16), q = roundf(x / d) with 1 / d computed once (0 for an all-zero
    block), ties away from zero. The bytes equal the `gguf` package's quantize."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = blocks * inv
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).to(torch.int8)
    raw = torch.cat([d.half().view(torch.uint8).reshape(n, -1, 2), q.view(torch.uint8)], dim=-1)
    return QuantWeight.from_gguf("Q8_0", raw.reshape(n, -1), k)


Weight: TypeAlias = torch.Tensor | QuantWeight  # a projection's weight: dense or in its blocks


def cat_rows(parts: Sequence[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight:
    """The parts stacked along N (a fused projection): blocks when every part has the same kind,
    else the dense matrices (dtype of the first dense part, float32 if none)."""
    if all(isinstance(p, QuantWeight) for p in parts):
        kinds = {p.kind for p in parts if isinstance(p, QuantWeight)}
        if len(kinds) == 1:
            qs = [p for p in parts if isinstance(p, QuantWeight)]
            return QuantWeight(qs[0].kind, torch.cat([q.blocks for q in qs]), qs[0].in_features)
    dense = [p for p in parts if isinstance(p, torch.Tensor)]
    dtype = dense[0].dtype if dense else torch.float32
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantWeight) else p for p in parts])


def embedding(ids: torch.Tensor, weight: torch.Tensor | QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """F.embedding for a dense or block weight."""
    if isinstance(weight, QuantWeight):
        return weight.rows(ids, dtype)
    return torch.nn.functional.embedding(ids, weight)
