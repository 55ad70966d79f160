"""The CPU matrix product's decode path (M <= STREAM_ROWS) in both bf16 forms: "dpbf16" (one
weight row at a time, one vdpbf16ps per block) and "fma" (from DECODE_FMA_ROWS rows: register
tiles of 4 weight rows x up to 4 token rows, chain by chain, each block as two fp32 FMAs under
DAZ/FTZ on an unpacked x panel). For every M in 1..STREAM_ROWS the two forms give each other's
bits and the prefill path's (force_tiled, in both forms): odd K (the tail block, chain 0's
leftover blocks), N not a multiple of the 4-row tile, with and without bias, bf16 and fp32
outputs, special values (zeros, denormals, inf, NaN payloads), one and two threads (each
thread's run of weight rows ending in a partial tile). The caller's MXCSR survives the call."""

from __future__ import annotations

import pytest
import torch

from keepwarm.kernels import cpu_linear
from keepwarm.kernels.cpu_linear import (
    DECODE_FMA_ROWS,
    PREFILL_FORM_ENV,
    PREFILL_FORMS,
    STREAM_ROWS,
    CpuLinear,
)
from tests.kernels.test_cpu_linear_prefill import _bits, _special_bf16

needs_kernel = pytest.mark.skipif(
    not cpu_linear.available(),
    reason="CPU lacks avx512_bf16 and avx2/fma/f16c (or KEEPWARM_CPU_LINEAR=0): the kernel cannot run",
)
pytestmark = needs_kernel

BF16 = torch.bfloat16
ROWS = range(1, STREAM_ROWS + 1)


@pytest.fixture(scope="module")
def kernels() -> dict[str, CpuLinear]:
    """The process's extension bound under each KEEPWARM_CPU_PREFILL_FORM."""
    bound = {}
    for form in PREFILL_FORMS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(PREFILL_FORM_ENV, form)
            bound[form] = cpu_linear.bind(cpu_linear.default().ext)
        assert bound[form].prefill_form == form
    return bound


def _assert_one_result(
    kernels: dict[str, CpuLinear], x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, label: object
) -> None:
    """Decode in both forms and prefill in both forms: one set of bits, for bf16 and fp32 out."""
    assert x.shape[0] <= STREAM_ROWS
    for out in (None, torch.float32):
        want = _bits(kernels["dpbf16"](x, w, b, out_dtype=out))
        for form, k in kernels.items():
            for tiled in (False, True):
                got = _bits(k(x, w, b, out_dtype=out, force_tiled=tiled))
                assert torch.equal(got, want), (label, out, form, tiled)


def test_the_decode_form_threshold_is_the_extensions() -> None:
    assert cpu_linear.default().ext.STREAM_FMA_ROWS == DECODE_FMA_ROWS
    assert 1 < DECODE_FMA_ROWS <= STREAM_ROWS


@pytest.mark.parametrize("k", [31, 1000, 1027])
@pytest.mark.parametrize("m", ROWS)
def test_decode_rows_are_one_result_in_both_forms(kernels: dict[str, CpuLinear], m: int, k: int) -> None:
    """K = 31 (a tail block only), 1000 (31 blocks: chain 0 takes 3 leftovers and a tail), 1027
    (32 blocks and a tail); N = 4 * 9 + 3 ends in a partial weight tile."""
    g = torch.Generator().manual_seed(100 * m + k)
    n = 4 * 9 + 3
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(BF16)
    b = torch.randn(n, generator=g).to(BF16)
    _assert_one_result(kernels, x, w, b, (m, k, "bias"))
    _assert_one_result(kernels, x, w, None, (m, k))


@pytest.mark.parametrize("exponents", [(0, 256), (60, 68), (120, 132)])
def test_special_values_are_one_result_in_both_forms(
    kernels: dict[str, CpuLinear], exponents: tuple[int, int]
) -> None:
    """Every exponent (inf, NaN payloads, denormals, overflow), products near 2^-126 (flushed
    in and out by DAZ/FTZ), ordinary values mixed with zeros and denormals: the first m rows
    for every m, N = 4 * 3 + 1."""
    g = torch.Generator().manual_seed(exponents[0] + 1)
    k, n = 1027, 13
    x = _special_bf16((STREAM_ROWS, k), g, exponents)
    w = _special_bf16((n, k), g, exponents)
    b = _special_bf16((n,), g, exponents)
    for m in ROWS:
        _assert_one_result(kernels, x[:m], w, b, (exponents, m))


@pytest.mark.parametrize("m", [DECODE_FMA_ROWS, 8, 11, STREAM_ROWS])
def test_two_threads_split_the_weight_rows_mid_tile(kernels: dict[str, CpuLinear], m: int) -> None:
    """N = 301 at K = 1027 splits into two runs of 151 and 150 rows (neither a multiple of the
    4-row tile); one thread gives the same bits, and so does the dpbf16 form."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 1027, generator=g).to(BF16)
    w = (torch.randn(301, 1027, generator=g) * 0.05).to(BF16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernels["fma"](x, w, out_dtype=torch.float32)
        torch.set_num_threads(1)
        one = kernels["fma"](x, w, out_dtype=torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(one), _bits(two))
    assert torch.equal(_bits(two), _bits(kernels["dpbf16"](x, w, out_dtype=torch.float32)))


def test_caller_keeps_denormals_after_fma_decode(kernels: dict[str, CpuLinear]) -> None:
    """The FMA decode sets DAZ/FTZ only around its tiles: afterwards the caller still produces
    denormals."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, 256, generator=g).to(BF16), torch.randn(64, 256, generator=g).to(BF16)
    kernels["fma"](x, w)
    tiny = torch.full((1 << 16,), 1e-38)
    assert bool(((tiny * 0.25) > 0).all())  # 2.5e-39 is a denormal, not flushed to zero
