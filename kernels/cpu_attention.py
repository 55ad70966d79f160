"""Causal attention on CPU with one reduction order per query row
(kernels/csrc/cpu_attention.cpp): keys in fixed tiles of 16 from absolute position 0, one
online-softmax order, fp32 arithmetic. A row's result depends only on its query and the keys
and values it sees, so a prefill chunk of any length, a restore tail and a decode step give
the same bits for the same row (torch's SDPA and einsum paths change their blocking with
the shapes).

Shapes as kernels/ops.py: prefill_attention(q [T, Hq, D], k, v [S, Hkv, D], scale) with
query t at position S - T + t; decode_attention(q [Hq, D], k, v, scale). `window` > 0
limits a query at position p to keys p - window + 1 .. p. Falls back to the torch
references (not invariant) when the kernel is absent or the inputs do not fit it."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from keepwarm.kernels import cpu_extension, reference

SOURCE = cpu_extension.CSRC / "cpu_attention.cpp"
EXTENSION_NAME = "keepwarm_cpu_attention"


@functools.cache
def extension() -> ModuleType | None:
    return cpu_extension.load(SOURCE, EXTENSION_NAME)


def available() -> bool:
    return extension() is not None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int = 0
) -> torch.Tensor | None:
    """q [T, Hq, D] against k, v [S, Hkv, D] -> [T, Hq, D], or None when the kernel cannot run."""
    ext = extension()
    if ext is None or torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    return ext.try_attention(q, k, v, scale, window)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = attention(q, k, v, scale)
    return out if out is not None else reference.prefill_attention(q, k, v, scale)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    out = attention(q.unsqueeze(0), k, v, scale)
    return out[0] if out is not None else reference.decode_attention(q, k, v, scale)
