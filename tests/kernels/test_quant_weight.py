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
    K_KINDS,
    KINDS,
    QuantKind,
    QuantWeight,
    block_weights,
    cat_rows,
    embedding,
    regroup,
    row_bytes,
    ungroup,
)
from tests.kernels.quant_blocks import gguf_blocks


def _blocks(kind: QuantKind, n: int, k: int) -> torch.Tensor:
    return gguf_blocks(kind, n, k, seed=7)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_the_gguf_reference(kind: QuantKind) -> None:
    k = 3 * block_weights(kind)
    b = _blocks(kind, 9, k)
    w = QuantWeight.from_gguf(kind, b, k)
    ref = dequantize(b.numpy(), GGMLQuantizationType[kind])
    assert w.dequantize().numpy().tobytes() == np.ascontiguousarray(ref, dtype=np.float32).tobytes()
    ids = torch.tensor([8, 0, 3])
    assert torch.equal(w.rows(ids, torch.float32), torch.from_numpy(ref.reshape(9, k))[ids])
    assert w.shape == (9, k) and w.nbytes == 9 * row_bytes(kind, k)
    # in memory within 3 % of the file
    assert 1.0 <= w.nbytes / (9 * 3 * BLOCK_BYTES[kind]) <= 1.03


@pytest.mark.parametrize("kind", [*K_KINDS, "Q5_0", "Q5_1"])
def test_repacked_rows_stay_whole(kind: QuantKind) -> None:
    b = _blocks(kind, 5, 512)
    rows = regroup(kind, b)
    assert rows.shape == (5, row_bytes(kind, 512))
    assert torch.equal(regroup(kind, b[2:4]), rows[2:4])
    assert torch.equal(regroup(kind, b[[4, 0]]), rows[[4, 0]])


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
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


def test_a_dense_part_makes_the_fused_projection_dense() -> None:
    a = QuantWeight.from_gguf("Q8_0", _blocks("Q8_0", 4, 64), 64)
    mixed = cat_rows([a, torch.zeros(2, 64, dtype=torch.float32)], torch.bfloat16)  # the model's dtype
    assert isinstance(mixed, torch.Tensor) and mixed.dtype == torch.bfloat16 and mixed.shape == (6, 64)
    assert torch.equal(mixed[:4], a.dequantize(torch.bfloat16))


def test_q4_0_and_q5_0_fuse_with_q8_0_as_q8_0_of_the_same_values() -> None:
    """A Q4_K_M file's fallback Q5_0 q / k beside a Q8_0 v: one Q8_0 matrix, every value kept."""
    parts = [
        QuantWeight.from_gguf(k, _blocks(k, 3 + i, 64), 64) for i, k in enumerate(("Q5_0", "Q4_0", "Q8_0"))
    ]
    fused = cat_rows(parts, torch.bfloat16)
    assert isinstance(fused, QuantWeight) and fused.kind == "Q8_0" and fused.shape == (12, 64)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_kinds_that_cannot_share_blocks_fuse_as_rows_of_parts() -> None:
    """A Q4_K_M file's Q4_K q and k beside a Q6_K v: q and k one Q4_K matrix, v its own part."""
    from keepwarm.kernels.quant_weight import QuantRows

    parts = [
        QuantWeight.from_gguf(k, _blocks(k, 2 + i, 256), 256) for i, k in enumerate(("Q4_K", "Q4_K", "Q6_K"))
    ]
    fused = cat_rows(parts, torch.bfloat16)
    assert isinstance(fused, QuantRows) and fused.shape == (9, 256)
    assert [(p.kind, p.shape) for p in fused.parts] == [("Q4_K", (5, 256)), ("Q6_K", (4, 256))]
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


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


def test_q4_k_quantization_keeps_every_value_within_its_step() -> None:
    """quantize_q4_k: each value within half its sub-block's step plus half the super-block's
    dmin of the input (a sub-block of zeros exact, an all-positive one too), the file's layout
    (the gguf package's dequantize reads the same values)."""
    from gguf.quants import dequantize as gguf_dequantize

    from keepwarm.kernels.quant_weight import q4_k_bytes, quantize_q4_k

    g = torch.Generator().manual_seed(11)
    w = torch.randn(6, 512, generator=g) * 0.05
    w[0, :32] = 0
    w[1, 32:64] = torch.rand(32, generator=g)
    q = quantize_q4_k(w)
    assert q.kind == "Q4_K" and q.shape == (6, 512)
    got = q.dequantize()
    assert torch.equal(got[0, :32], torch.zeros(32))
    x = w.reshape(6, 2, 8, 32)
    step = (x.amax(-1) - x.amin(-1).clamp(max=0)) / 15
    dmin = x.amin(-1).clamp(max=0).neg().amax(-1, keepdim=True) / 63
    bound = (step / 2 + dmin / 2) * 1.02 + 1e-7
    assert bool(((got - w).reshape(6, 2, 8, 32).abs() <= bound[..., None]).all())
    assert float((got - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()) < 0.1
    # the bytes are the file format's: the gguf package reads the same values from them
    ref = gguf_dequantize(q4_k_bytes(w).numpy(), GGMLQuantizationType.Q4_K)
    assert got.numpy().tobytes() == np.ascontiguousarray(ref, dtype=np.float32).tobytes()
