"""Block weights (kernels/quant_weight.py): the formulas against the `gguf` package's reference,
bitwise; rows, fused projections and the dense fallback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from keepwarm.kernels.quant_weight import (
    BLOCK_BYTES,
    KINDS,
    QuantKind,
    QuantWeight,
    cat_rows,
    embedding,
    regroup,
    ungroup,
)


def _blocks(kind: QuantKind, n: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    b = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES[kind]), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, 2 if kind == "Q4_1" else 1, generator=g) - 0.5).half()
    b[:, :, 0 : 2 * scales.shape[-1]] = scales.view(torch.uint8).reshape(n, k // 32, -1)
    return b.reshape(n, -1).contiguous()


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_the_gguf_reference(kind: QuantKind) -> None:
    b = _blocks(kind, 9, 96)
    w = QuantWeight.from_gguf(kind, b, 96)
    ref = dequantize(b.numpy(), GGMLQuantizationType[kind])
    assert w.dequantize().numpy().tobytes() == np.ascontiguousarray(ref, dtype=np.float32).tobytes()
    assert w.shape == (9, 96) and w.nbytes == 9 * 3 * BLOCK_BYTES[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_layout_regroups_each_row_and_back(kind: QuantKind) -> None:
    b = _blocks(kind, 5, 96)  # 3 blocks a row
    rows = regroup(kind, b)
    assert rows.shape == b.shape and torch.equal(ungroup(kind, rows), b)
    size = BLOCK_BYTES[kind]
    first = b[0].reshape(3, size)
    assert torch.equal(rows[0, :6], first[:, :2].reshape(-1))  # the row's three d, then ...
    h = 4 if kind == "Q4_1" else 2
    assert torch.equal(rows[0, 3 * h :], first[:, h:].reshape(-1))  # ... its quants, block by block
    assert torch.equal(regroup(kind, b[2:4]), rows[2:4])  # rows stay whole


def test_rows_are_an_embedding_lookup() -> None:
    w = QuantWeight.from_gguf("Q8_0", _blocks("Q8_0", 12, 64), 64)
    ids = torch.tensor([[3, 0], [11, 3]])
    dense = w.dequantize(torch.bfloat16)
    assert torch.equal(embedding(ids, w, torch.bfloat16), dense[ids])
    assert torch.equal(embedding(ids, dense, torch.bfloat16), dense[ids])


def test_mixed_kinds_fuse_dense() -> None:
    a = QuantWeight.from_gguf("Q8_0", _blocks("Q8_0", 4, 64), 64)
    b = QuantWeight.from_gguf("Q4_0", _blocks("Q4_0", 6, 64), 64)
    fused = cat_rows([a, b])
    assert isinstance(fused, torch.Tensor) and fused.dtype == torch.float32
    assert torch.equal(fused, torch.cat([a.dequantize(), b.dequantize()]))
    mixed = cat_rows([a, torch.zeros(2, 64, dtype=torch.bfloat16)])
    assert isinstance(mixed, torch.Tensor) and mixed.dtype == torch.bfloat16 and mixed.shape == (6, 64)


def test_a_malformed_block_matrix_is_a_broken_invariant() -> None:
    with pytest.raises(AssertionError):
        QuantWeight("Q4_1", torch.zeros(3, 19, dtype=torch.uint8), 32)


def test_q8_0_quantization_is_ggmls_bytes() -> None:
    from gguf.quants import quantize

    from keepwarm.kernels.quant_weight import quantize_q8_0

    g = torch.Generator().manual_seed(9)
    w = torch.randn(6, 128, generator=g) * 3
    w[0, :32] = 0  # an all-zero block
    w[1, 5] = 2.5 * w[1, :32].abs().max()  # a block whose largest value is exactly representable
    ours = quantize_q8_0(w)
    ref = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    assert ungroup("Q8_0", ours.blocks).numpy().tobytes() == np.ascontiguousarray(ref).tobytes()
    d = ours.dequantize()
    assert float((d - w).abs().max()) <= float(w.abs().max()) / 127 / 2 * 1.01
