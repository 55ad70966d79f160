"""Random GGUF block matrices for the block-weight tests: every quant byte random, the f16
scales (and minima) set to realistic finite values."""

from __future__ import annotations

import torch

from keepwarm.kernels.quant_weight import BLOCK_BYTES, QuantKind, QuantWeight, block_weights

# byte offsets of a GGUF block's f16 fields: (scales d, minima or dmin or None)
F16_FIELDS: dict[str, tuple[int, int | None]] = {
    "Q8_0": (0, None),
    "Q4_0": (0, None),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, None),
    "Q5_0": (0, None),
    "Q5_1": (0, 2),
}


def gguf_blocks(kind: QuantKind, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k / block weights * block bytes] uint8: random quants; d in [1e-3, 1.1e-2] (k-quants:
    d in [1e-4, 1.1e-3], times their 6- or 8-bit scales), m in [-0.05, 0] (Q4_1, Q5_1; Q4_K / Q5_K
    dmin in [0, 1e-3])."""
    g = torch.Generator().manual_seed(seed)
    nb = k // block_weights(kind)
    b = torch.randint(0, 256, (n, nb, BLOCK_BYTES[kind]), dtype=torch.uint8, generator=g)
    d_at, m_at = F16_FIELDS[kind]
    k_quant = block_weights(kind) > 32
    d = (torch.rand(n, nb, 1, generator=g) * 0.01 + 0.001) * (0.1 if k_quant else 1.0)
    b[:, :, d_at : d_at + 2] = d.half().view(torch.uint8).reshape(n, nb, 2)
    if m_at is not None:
        m = (
            -torch.rand(n, nb, 1, generator=g) * 0.05
            if kind in ("Q4_1", "Q5_1")
            else torch.rand(n, nb, 1, generator=g) * 1e-3
        )
        b[:, :, m_at : m_at + 2] = m.half().view(torch.uint8).reshape(n, nb, 2)
    return b.reshape(n, -1).contiguous()


def random_weight(kind: QuantKind, n: int, k: int, seed: int = 0) -> QuantWeight:
    return QuantWeight.from_gguf(kind, gguf_blocks(kind, n, k, seed), k)
