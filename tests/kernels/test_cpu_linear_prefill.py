"""The CPU matrix product's prefill path (M > STREAM_ROWS) gives each row the decode path's
bits: the same reduction order, in both bf16 prefill forms (every kernel test here runs under
KEEPWARM_CPU_PREFILL_FORM=fma and =dpbf16): "dpbf16", one vdpbf16ps per block, and "fma",
the block as two fp32 FMAs on packed panels under DAZ/FTZ. Pinned over row counts around the
4-row tiles, odd K and N (the K tail block, the last partial 6-row strip), both loop orders of
the FMA form (tile by tile for short K, chain by chain over tile groups for long K), several x
panels, special values (zeros, denormals, inf, NaN payloads), and the thread count. The
caller's MXCSR (no flush-to-zero) survives the call. Then the start-up probe that chooses the
form: the FMA form is exact on this CPU, and the choice rule and its environment variable."""

from __future__ import annotations

import os

import pytest
import torch

from keepwarm.kernels import cpu_linear
from keepwarm.kernels.cpu_linear import PREFILL_FORM_ENV, STREAM_ROWS, CpuLinear, PrefillProbe

needs_kernel = pytest.mark.skipif(
    not cpu_linear.available(),
    reason="CPU lacks avx512_bf16 and avx2/fma/f16c (or KEEPWARM_CPU_LINEAR=0): the kernel cannot run",
)
pytestmark = needs_kernel

BF16 = torch.bfloat16


@pytest.fixture(scope="module", params=cpu_linear.PREFILL_FORMS)
def kernel(request: pytest.FixtureRequest) -> CpuLinear:
    """The process's extension bound again under KEEPWARM_CPU_PREFILL_FORM=<form>."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PREFILL_FORM_ENV, request.param)
        k = cpu_linear.bind(cpu_linear.default().ext)
    assert k.prefill_form == request.param
    return k


def _decode_rows(
    kernel: CpuLinear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.dtype | None
) -> torch.Tensor:
    """The decode path's result for every row (chunks of STREAM_ROWS rows)."""
    return torch.cat(
        [kernel(x[i : i + STREAM_ROWS], w, b, out_dtype=out) for i in range(0, x.shape[0], STREAM_ROWS)]
    )


def _bits(y: torch.Tensor) -> torch.Tensor:
    """Bit patterns, every NaN as one pattern: which NaN payload survives where several NaNs
    meet depends on the compiler's operand order in the commutative adds of the combine (it
    already differed between the two paths before the FMA form); bf16 outputs carry no
    payload (0x7fc0)."""
    if y.dtype == torch.float32:
        return torch.where(y.isnan(), torch.full_like(y, float("nan")), y).view(torch.int32)
    return y.view(torch.int16)


def _assert_prefill_is_decode(
    kernel: CpuLinear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, label: object
) -> None:
    assert x.shape[0] > STREAM_ROWS
    for out in (None, torch.float32):
        got, want = kernel(x, w, b, out_dtype=out), _decode_rows(kernel, x, w, b, out)
        assert torch.equal(_bits(got), _bits(want)), (label, out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [31, 33, 1000, 1027, 3077])
@pytest.mark.parametrize("m", [17, 63, 64, 65, 200])
def test_prefill_rows_are_the_decode_rows(kernel: CpuLinear, dtype: torch.dtype, k: int, m: int) -> None:
    """Odd K (a tail block; 1027 and 3077 run chain by chain, the rest tile by tile) and
    N = 6 * 6 + 5 (a partial strip), with and without bias; m = 200 at K = 3077 spans three
    x panels."""
    g = torch.Generator().manual_seed(1000 * m + k)
    n = 6 * 6 + 5
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    _assert_prefill_is_decode(kernel, x, w, b, (dtype, k, m, "bias"))
    _assert_prefill_is_decode(kernel, x, w, None, (dtype, k, m))


def test_prefill_over_many_panels_and_both_threads(kernel: CpuLinear) -> None:
    """300 rows at K = 1024 are two x panels; N = 1001 strips split over two threads; one
    thread gives the same bits."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 1024, generator=g).to(BF16)
    w = (torch.randn(1001, 1024, generator=g) * 0.05).to(BF16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel(x, w, out_dtype=torch.float32)
        torch.set_num_threads(1)
        one = kernel(x, w, out_dtype=torch.float32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(one), _bits(two))
    assert torch.equal(_bits(two), _bits(_decode_rows(kernel, x, w, None, torch.float32)))


def _special_bf16(shape: tuple[int, ...], g: torch.Generator, exponents: tuple[int, int]) -> torch.Tensor:
    """bf16 values with biased exponents drawn from [lo, hi), a random sign and mantissa;
    a tenth of them zero (signed), a twentieth denormal."""
    lo, hi = exponents
    exp = torch.randint(lo, hi, shape, generator=g)
    mant = torch.randint(0, 128, shape, generator=g)
    sign = torch.randint(0, 2, shape, generator=g)
    pick = torch.rand(shape, generator=g)
    exp = torch.where(pick < 0.15, torch.zeros_like(exp), exp)  # denormals (mantissa != 0) and zeros
    mant = torch.where(pick < 0.10, torch.zeros_like(mant), mant)
    bits = (sign << 15) | (exp << 7) | mant
    return bits.to(torch.int16).view(BF16)


@pytest.mark.parametrize(
    "exponents",
    [
        (0, 256),  # every exponent: inf, NaN payloads, denormals, overflow
        (60, 68),  # products near 2^-126: sums land in (and flush from) the denormal range
        (120, 132),  # ordinary magnitudes with exact zeros and denormal inputs mixed in
    ],
)
def test_special_values_give_the_decode_bits(kernel: CpuLinear, exponents: tuple[int, int]) -> None:
    """The FMA form of the bf16 block must flush denormals in and out as vdpbf16ps does: the
    fp32 outputs are compared as bit patterns (NaN as NaN), the bf16 ones exactly."""
    g = torch.Generator().manual_seed(exponents[0])
    m, k, n = 40, 1027, 13
    x = _special_bf16((m, k), g, exponents)
    w = _special_bf16((n, k), g, exponents)
    _assert_prefill_is_decode(kernel, x, w, None, exponents)
    _assert_prefill_is_decode(kernel, x, w, _special_bf16((n,), g, exponents), exponents)


def test_caller_keeps_denormals(kernel: CpuLinear) -> None:
    """The prefill path sets DAZ/FTZ only around its FMAs: afterwards the caller's threads
    still produce denormals."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(64, 256, generator=g).to(BF16), torch.randn(64, 256, generator=g).to(BF16)
    kernel(x, w)
    tiny = torch.full((1 << 16,), 1e-38)
    assert bool(((tiny * 0.25) > 0).all())  # 2.5e-39 is a denormal, not flushed to zero


# --- the start-up probe and the choice of form ------------------------------------------------


def _probe(mismatches: int = 0, speedup: float = 2.0) -> PrefillProbe:
    return PrefillProbe(lanes=1000, mismatches=mismatches, dpbf16_s=speedup * 1e-4, fma_s=1e-4)


def test_probe_finds_the_fma_form_exact_here() -> None:
    """On this CPU (the suite's: Emerald Rapids without AMX) the FMA form is vdpbf16ps bit for
    bit on all 262,144 probed lanes, and the process kernel uses the probe's choice."""
    probe = cpu_linear.probe_prefill(cpu_linear.default().ext)
    assert (probe.lanes, probe.mismatches, probe.exact) == (cpu_linear.PROBE_VECTORS * 16, 0, True)
    assert probe.dpbf16_s > 0 and probe.fma_s > 0
    forced = os.environ.get(PREFILL_FORM_ENV, "")
    assert cpu_linear.prefill_form() == (forced or probe.form())


def test_exactness_probe_is_deterministic_and_counts_lanes() -> None:
    """The same seed gives the same count; other seeds (other random lanes) also find none."""
    ext = cpu_linear.default().ext
    assert [ext.fma_form_mismatches(64, seed) for seed in (1, 1, 2, 3)] == [0, 0, 0, 0]
    assert ext.fma_form_mismatches(0, 1) == 0


@pytest.mark.parametrize(
    ("mismatches", "speedup", "form"),
    [(0, 2.0, "fma"), (0, 1.19, "dpbf16"), (0, 0.5, "dpbf16"), (1, 2.0, "dpbf16")],
)
def test_probe_chooses_fma_only_when_exact_and_clearly_faster(
    mismatches: int, speedup: float, form: str
) -> None:
    assert _probe(mismatches, speedup).form() == form
    assert cpu_linear.decide_prefill_form("", _probe(mismatches, speedup)) == form


def test_forced_forms_override_the_speed_race() -> None:
    assert cpu_linear.decide_prefill_form("fma", _probe(0, 0.5)) == "fma"
    assert cpu_linear.decide_prefill_form("dpbf16", _probe(0, 2.0)) == "dpbf16"
    assert cpu_linear.decide_prefill_form("dpbf16", _probe(7, 2.0)) == "dpbf16"


def test_forcing_fma_where_it_is_inexact_raises() -> None:
    with pytest.raises(ValueError, match=f"{PREFILL_FORM_ENV}=fma: .* 7 of 1000 probed lanes"):
        cpu_linear.decide_prefill_form("fma", _probe(7, 2.0))


@pytest.mark.parametrize("value", ["avx512", "FMA", "dpbf16 "])
def test_forcing_an_unknown_form_raises(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Through the real extension: bind (what load does) refuses the value, naming the variable."""
    monkeypatch.setenv(PREFILL_FORM_ENV, value)
    with pytest.raises(ValueError, match=f"{PREFILL_FORM_ENV}='{value}': must be one of fma, dpbf16"):
        cpu_linear.bind(cpu_linear.default().ext)
