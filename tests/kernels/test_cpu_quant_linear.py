"""The block product (kernels/cpu_quant_linear.py): within fp32 rounding of the dense product with
the blocks' exact values, for every kind (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), bf16 and fp32 activations, with and without
a bias; and a row's bits do not depend on how many rows the call has or where the row sits (the
4-row tiles and the single rows compute each row with one instruction sequence)."""

from __future__ import annotations

import pytest
import torch

from keepwarm.kernels import cpu_quant_linear, reference
from keepwarm.kernels.invariance import probe_quant_linear
from keepwarm.kernels.quant_weight import K_KINDS, KINDS, QuantKind, QuantWeight
from tests.kernels.quant_blocks import random_weight as random_blocks

pytestmark = pytest.mark.skipif(
    not cpu_quant_linear.available(),
    reason="the block kernel needs an x86 CPU with AVX2, FMA and F16C (or its build failed)",
)


def activation_error_bound(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """|y - x W^T| allowed by the int16 activations: per element at most half a step (amax of
    its block / 32767), times |w|, summed; plus fp32 rounding of the sums."""
    xf = x.float().reshape(-1, w.in_features)
    amax = xf.reshape(xf.shape[0], -1, 32).abs().amax(-1, keepdim=True)
    half_step = (amax / 32767 / 2).expand(-1, -1, 32).reshape(xf.shape)
    dense = w.dequantize()
    rounding = 1e-6 * (xf.abs() @ dense.abs().T)
    return (half_step @ dense.abs().T + rounding).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_close_to_the_dense_product(kind: QuantKind, dtype: torch.dtype, with_bias: bool) -> None:
    k = 768 if kind in K_KINDS else 576  # whole super-blocks
    w = random_blocks(kind, 70, k)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 11, k, generator=g).to(dtype)
    x[0, 0, 32:64] = 0  # an all-zero block
    bias = torch.randn(70, generator=g).to(dtype) if with_bias else None
    assert cpu_quant_linear.uses_kernel(x, w, bias)
    y = cpu_quant_linear.linear(x, w, bias)
    exact = torch.nn.functional.linear(
        x.double(), w.dequantize().double(), None if bias is None else bias.double()
    )
    assert y.dtype == dtype and y.shape == (3, 11, 70)
    bound = activation_error_bound(x, w).double()
    if dtype == torch.bfloat16:  # plus the output's rounding to bf16: half a step of 2^-8
        bound = bound + exact.abs() * 2.0**-8
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(bound.max()) < 0.02 * float(exact.abs().max())  # and the bound is tight
    ref = reference.quant_linear(x, w, bias)  # the torch reference: the exact weights in fp32
    assert bool(((ref.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_call(kind: QuantKind, dtype: torch.dtype) -> None:
    w = random_blocks(kind, 50, 1536, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 1536, generator=g).to(dtype)
    bias = torch.randn(50, generator=g).to(dtype)
    y = cpu_quant_linear.linear(x, w, bias)
    for a, b in ((0, 1), (0, 4), (1, 5), (3, 12), (5, 37), (36, 37)):
        assert torch.equal(cpu_quant_linear.linear(x[a:b], w, bias), y[a:b]), (a, b)
    # the start-up self-check's probe agrees
    assert probe_quant_linear(cpu_quant_linear.linear, w, bias, dtype) is None


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_rows_and_columns_of_a_fused_projection_are_the_parts(kind: QuantKind) -> None:
    from keepwarm.kernels.quant_weight import cat_rows

    k = 256
    a, b = random_blocks(kind, 24, k, seed=4), random_blocks(kind, 40, k, seed=5)
    fused = cat_rows([a, b], torch.bfloat16)
    assert isinstance(fused, QuantWeight) and fused.shape == (64, k)
    x = torch.randn(5, k).bfloat16()
    y = cpu_quant_linear.linear(x, fused)
    assert torch.equal(y[:, :24], cpu_quant_linear.linear(x, a))
    assert torch.equal(y[:, 24:], cpu_quant_linear.linear(x, b))


def test_the_kernels_refusals() -> None:
    w = random_blocks("Q8_0", 8, 64)
    with pytest.raises(RuntimeError, match="last dim must be K"):
        cpu_quant_linear.extension().quant_linear(torch.randn(2, 32), w.blocks, 0, 64)  # type: ignore[union-attr]
    # float16 x is not the kernel's: the reference answers
    x = torch.randn(2, 64).half()
    assert not cpu_quant_linear.uses_kernel(x, w)
    assert cpu_quant_linear.linear(x, w).dtype == torch.float16


@pytest.mark.parametrize("kind", KINDS)
def test_the_builds_give_the_same_bits(kind: QuantKind) -> None:
    """The AVX-512 build (compiled with the AVX-512 flags besides AVX2's) gives every output the
    AVX2 build's bits: the snapshots of a model on blocks do not depend on the CPU's build."""
    from keepwarm.kernels import cpu_extension, cpu_linear

    flags = cpu_linear.cpu_flags()
    if not all(f in flags for f in cpu_linear.ISA_FLAGS["avx512_bf16"]):
        pytest.skip("this CPU runs only the AVX2 build: nothing to compare it with")
    builds = [
        cpu_extension.build(
            cpu_quant_linear.SOURCE,
            cpu_linear.extension_name(cpu_quant_linear.EXTENSION_NAME, isa),
            isa,
            extra_flags=cpu_quant_linear.EXTRA_FLAGS,
        )
        for isa in cpu_linear.ISAS
    ]
    k = 768 if kind in K_KINDS else 576
    w = random_blocks(kind, 37, k, seed=6)
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(11, k, generator=g).to(dtype)  # two 4-row tiles and 3 single rows
        bias = torch.randn(37, generator=g).to(dtype)
        kind_id = KINDS.index(kind)
        outs = [ext.quant_linear(x, w.blocks, kind_id, k, bias) for ext in builds]
        assert torch.equal(outs[0], outs[1]), dtype
        assert torch.equal(outs[0], cpu_quant_linear.linear(x, w, bias))


def test_a_projection_of_mixed_kinds_is_its_parts_side_by_side() -> None:
    from keepwarm.kernels.ops import cpu_ops
    from keepwarm.kernels.quant_weight import QuantRows, cat_rows

    parts = [random_blocks(k, n, 256, seed=n) for k, n in (("Q4_K", 24), ("Q6_K", 40), ("Q5_1", 8))]
    fused = cat_rows(parts, torch.bfloat16)
    assert isinstance(fused, QuantRows)
    g = torch.Generator().manual_seed(8)
    x, bias = torch.randn(6, 256, generator=g).bfloat16(), torch.randn(72, generator=g).bfloat16()
    y = cpu_ops().project(x, fused, bias)
    want = torch.cat(
        [cpu_quant_linear.linear(x, p, b) for p, b in zip(parts, bias.split([24, 40, 8]), strict=True)], -1
    )
    assert y.shape == (6, 72) and torch.equal(y, want)
