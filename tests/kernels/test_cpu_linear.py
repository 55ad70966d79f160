"""The invariant CPU matrix product (bf16 and fp32, any row count) against torch F.linear
and an fp64 reference; one reduction order per row for every row count and both paths; the
routing: which calls take the kernel, which fall back to torch, and that a CPU without the
feature or a failed build leaves `linear` working on torch alone.

The kernel tests need a CPU with avx512_bf16, or with avx2 + fma + f16c for the AVX2 build
(they are skipped, with that reason, elsewhere); the fallback tests run everywhere, and on a
CPU without either assert available() is False. Which build a CPU gets, and the AVX2 build's
invariance on any CPU that can run it (an AVX-512 one included), are pinned here too."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu_linear
from keepwarm.kernels.cpu_linear import AVX2_FLAGS, EXTENSION_NAME, ISA_ENV, REQUIRED_FLAGS, CpuLinear

# The kernel is expected exactly where the CPU has the feature (and nobody switched it off).
HAS_FEATURE = cpu_linear.cpu_supports_kernel(cpu_linear.cpu_flags())
SWITCHED_OFF = os.environ.get("KEEPWARM_CPU_LINEAR", "1") == "0"
needs_kernel = pytest.mark.skipif(
    not HAS_FEATURE or SWITCHED_OFF,
    reason="CPU lacks avx512_bf16 and avx2/fma/f16c (or KEEPWARM_CPU_LINEAR=0): the kernel cannot run",
)

BF16 = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(shape: tuple[int, ...], g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(BF16)


def _ref64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


@pytest.fixture(scope="module")
def kernel() -> CpuLinear:
    k = cpu_linear.default()
    assert k.available(), "the extension failed to build on a CPU with one build's flags (see the log)"
    return k


# --- availability ------------------------------------------------------------------------


def test_available_follows_the_cpu() -> None:
    assert cpu_linear.available() is (HAS_FEATURE and not SWITCHED_OFF)


def test_cpu_flags_parse_a_cpuinfo_file(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nflags\t\t: fpu avx512f avx512bw avx512vl avx512_bf16 avx512_vnni\n"
        "processor\t: 1\nflags\t\t: fpu avx512f avx512bw avx512vl avx512_bf16 avx512_vnni\n"
    )
    flags = cpu_linear.cpu_flags(info)
    assert flags == frozenset({"fpu", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"})
    assert cpu_linear.cpu_supports_kernel(flags)
    assert not cpu_linear.cpu_supports_kernel(flags - {"avx512_bf16"})
    assert cpu_linear.cpu_flags(tmp_path / "missing") == frozenset()


def test_the_build_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX-512 BF16 where the CPU has it, else AVX2 (avx2 + fma + f16c), else none; the
    environment variable picks a supported build only; the builds never share a name."""
    monkeypatch.delenv(ISA_ENV, raising=False)
    zen4 = frozenset({"fpu", *AVX2_FLAGS, *REQUIRED_FLAGS})
    zen3 = frozenset({"fpu", "avx", *AVX2_FLAGS})
    assert cpu_linear.kernel_isa(zen4) == "avx512_bf16"
    assert cpu_linear.kernel_isa(zen3) == "avx2"
    assert cpu_linear.kernel_isa(zen3 - {"fma"}) is None
    assert cpu_linear.kernel_isa(frozenset(REQUIRED_FLAGS)) == "avx512_bf16"
    assert cpu_linear.cpu_supports_kernel(zen3) and not cpu_linear.cpu_supports_kernel(zen3 - {"f16c"})
    assert cpu_linear.kernel_isa(zen4, forced="avx2") == "avx2"
    assert cpu_linear.kernel_isa(zen3, forced="avx512_bf16") == "avx2"  # unsupported: ignored
    assert cpu_linear.kernel_isa(zen3, forced="sse") == "avx2"
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert cpu_linear.kernel_isa(zen4) == "avx2"
    names = {cpu_linear.extension_name(EXTENSION_NAME, isa) for isa in cpu_linear.ISAS}
    assert names == {EXTENSION_NAME, EXTENSION_NAME + "_avx2"}
    assert "-DKEEPWARM_AVX2" in cpu_linear.compile_flags("avx2")
    assert not any(f.startswith("-mavx512") for f in cpu_linear.compile_flags("avx2"))
    # every build hashes the raw entry points' header in (kernels/csrc/raw_kernels.h)
    assert cpu_linear.compile_flags("avx512_bf16")[:-1] == list(cpu_linear.CFLAGS)
    assert cpu_linear.compile_flags("avx512_bf16")[-1].startswith("-DKEEPWARM_HEADERS=")


def test_cpu_without_the_feature_falls_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KEEPWARM_CPU_LINEAR", raising=False)
    with caplog.at_level(logging.INFO, logger="keepwarm.kernels.cpu_linear"):
        k = cpu_linear.load(flags=frozenset({"avx512f", "avx512bw", "avx512vl"}))
    assert not k.available()
    assert "avx512_bf16" in caplog.text and "avx2, fma, f16c" in caplog.text
    g = _gen(1)
    x, w, b = _rand((1, 100), g), _rand((17, 100), g), _rand((17,), g)
    assert not k.uses_kernel(x, w, b)
    assert torch.equal(k(x, w, b), F.linear(x, w, b))


def test_failed_build_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KEEPWARM_CPU_LINEAR", raising=False)
    bad = tmp_path / "broken.cpp"
    bad.write_text('#error "this source does not compile"\n')
    with caplog.at_level(logging.WARNING, logger="keepwarm.kernels.cpu_linear"):
        k = cpu_linear.load(
            source=bad,
            name="keepwarm_cpu_linear_broken",
            flags=frozenset(REQUIRED_FLAGS),
            build_dir=tmp_path / "build",
        )
    assert not k.available()
    assert "building" in caplog.text and "failed" in caplog.text
    g = _gen(2)
    x, w = _rand((2, 64), g), _rand((8, 64), g)
    assert torch.equal(k(x, w), F.linear(x, w))


def test_env_switch_turns_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPWARM_CPU_LINEAR", "0")
    k = cpu_linear.load(flags=frozenset(REQUIRED_FLAGS))
    assert not k.available()


def test_unavailable_kernel_keeps_torch_results_for_every_shape() -> None:
    k = CpuLinear(None)
    g = _gen(3)
    for m in (1, 2, 7):
        x, w, b = _rand((m, 96), g), _rand((33, 96), g), _rand((33,), g)
        assert torch.equal(k(x, w, b), F.linear(x, w, b))
    x32, w32 = torch.randn(1, 16, generator=g), torch.randn(4, 16, generator=g)
    assert torch.equal(k(x32, w32), F.linear(x32, w32))
    assert k(x32, w32, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="out_dtype must be"):
        k(x32, w32, out_dtype=torch.float64)


# --- routing -----------------------------------------------------------------------------


@needs_kernel
def test_routing_takes_the_kernel_for_bf16_and_fp32_of_any_row_count(kernel: CpuLinear) -> None:
    g = _gen(4)
    w, b = _rand((32, 64), g), _rand((32,), g)
    for m in (1, 2, 3, 4, 5, 8, 16, 17, 64, 300):
        assert kernel.uses_kernel(_rand((m, 64), g), w, b)
    assert kernel.uses_kernel(_rand((64,), g), w)  # 1-D x: one token
    assert kernel.uses_kernel(_rand((1, 2, 64), g), w)  # leading dims flattened: 2 tokens
    assert kernel.uses_kernel(_rand((40, 64), g).float(), w.float(), b.float())  # fp32
    assert not kernel.uses_kernel(_rand((1, 64), g), w.float())  # mixed dtypes: F.linear rejects them too
    assert not kernel.uses_kernel(_rand((1, 64), g).half(), w.half())  # fp16
    assert not kernel.uses_kernel(_rand((1, 64), g), _rand((64, 32), g).T)  # weight not contiguous
    assert not kernel.uses_kernel(_rand((1, 64), g), w, b.float())
    assert not kernel.uses_kernel(_rand((1, 64), g), w, _rand((31,), g))
    assert not kernel.uses_kernel(_rand((0, 64), g), w)  # no rows
    wg = w.clone().requires_grad_(True)
    assert not kernel.uses_kernel(_rand((1, 64), g), wg)  # autograd needs torch's op
    with torch.no_grad():
        assert kernel.uses_kernel(_rand((1, 64), g), wg)


@needs_kernel
def test_fallback_shapes_return_torch_results_exactly(kernel: CpuLinear) -> None:
    g = _gen(5)
    w, b = _rand((48, 80), g), _rand((48,), g)
    x16 = _rand((17, 80), g).half()
    assert torch.equal(kernel(x16, w.half(), b.half()), F.linear(x16, w.half(), b.half()))
    wt = _rand((80, 48), g).T
    x1 = _rand((1, 80), g)
    assert torch.equal(kernel(x1, wt), F.linear(x1, wt))


# --- the kernel --------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 6])
@pytest.mark.parametrize("k", [64, 100, 1024, 3072 + 5])
@pytest.mark.parametrize("n", [1, 17, 2048])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch_and_fp64(kernel: CpuLinear, m: int, k: int, n: int, with_bias: bool) -> None:
    g = _gen(1000 * m + k + n + with_bias)
    x, w = _rand((m, k), g), _rand((n, k), g, scale=0.05)
    b = _rand((n,), g) if with_bias else None
    assert kernel.uses_kernel(x, w, b)
    y = kernel(x, w, b)
    torch_y = F.linear(x, w, b)
    assert y.dtype == BF16 and y.shape == (m, n)
    torch.testing.assert_close(y.float(), torch_y.float(), rtol=1e-2, atol=1e-2)
    ref = _ref64(x, w, b)
    err, torch_err = (y.double() - ref).abs(), (torch_y.double() - ref).abs()
    # One bf16 rounding of an fp32 sum: within half a bf16 ulp (<= 2^-8 |ref|) plus the fp32
    # accumulation error, which is far below that at these K.
    fp32_slack = k * 2.0**-24 * float((x.double().abs() @ w.double().abs().T).max()) + 1e-30
    assert bool((err <= ref.abs() * 2.0**-8 + fp32_slack).all())
    # Our error is not larger than torch's (same rounding, so equal up to ties).
    assert float(err.max()) <= float(torch_err.max()) * 1.01 + fp32_slack
    assert float(err.mean()) <= float(torch_err.mean()) * 1.01 + fp32_slack


@needs_kernel
@pytest.mark.parametrize("k", [64, 1000, 3072 + 5])
def test_each_row_is_bitwise_independent_of_the_batch(kernel: CpuLinear, k: int) -> None:
    """A token row's result is the same bits whatever the other rows and however many:
    decode steps of any batch size give each sequence what it gets alone."""
    g = _gen(k)
    w, b = _rand((96, k), g, scale=0.05), _rand((96,), g)
    x = _rand((16, k), g)
    alone = torch.stack([kernel(x[i : i + 1], w, b, out_dtype=torch.float32)[0] for i in range(16)])
    for m in (2, 3, 4, 5, 7, 8, 13, 16):
        got = kernel(x[:m], w, b, out_dtype=torch.float32)
        assert torch.equal(got, alone[:m]), m
        assert torch.equal(kernel(x[16 - m :], w, b, out_dtype=torch.float32), alone[16 - m :]), m


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("k", [1, 31, 33, 3077])
def test_exact_on_integer_data(kernel: CpuLinear, m: int, k: int) -> None:
    """Small integers make every product and partial sum exact in fp32, so the fp32 output
    equals the integer product exactly and the bf16 output is its round-to-nearest-even;
    this pins the masked K tail, the row blocking (N = 4 blocks + 3 leftover rows) and M."""
    g = _gen(7 * m + k)
    n = 4 * 9 + 3
    x = torch.randint(-3, 4, (m, k), generator=g).to(BF16)
    w = torch.randint(-3, 4, (n, k), generator=g).to(BF16)
    b = torch.randint(-50, 51, (n,), generator=g).to(BF16)
    exact = (x.long() @ w.long().T + b.long()).double()
    y32 = kernel(x, w, b, out_dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert torch.equal(y32.double(), exact)
    assert torch.equal(kernel(x, w, b), exact.to(BF16))


@needs_kernel
def test_bf16_rounding_is_nearest_even(kernel: CpuLinear) -> None:
    """Sums that land exactly halfway between two bf16 values: 257 (between 256 and 258)
    rounds to 256, 259 to 260, -257 to -256; 255 is exact."""
    k = 64
    x = torch.ones(1, k, dtype=BF16)
    targets = [257, 259, -257, 255, 513]
    w = torch.zeros(len(targets), k, dtype=BF16)
    for row, t in enumerate(targets):  # spread t over the row in parts of at most 64
        rest = t
        for col in range(k):
            part = max(-64, min(64, rest))
            w[row, col] = part
            rest -= part
        assert rest == 0
    y = kernel(x, w)
    assert y[0].tolist() == [256.0, 260.0, -256.0, 255.0, 512.0]
    assert torch.equal(y, torch.tensor([targets], dtype=torch.float64).to(BF16))


@needs_kernel
def test_bias_in_fp32_before_one_rounding(kernel: CpuLinear) -> None:
    """The bias is added to the fp32 sum and rounded once: 256 + 1 (bias) = 257 -> 256,
    while 256.5 + 1 = 257.5 -> 258 (rounding the product first would give 256 + 1 -> 256)."""
    x = torch.tensor([[1.0, 0.5]], dtype=BF16)
    w = torch.tensor([[256.0, 0.0], [256.0, 1.0]], dtype=BF16)
    b = torch.tensor([1.0, 1.0], dtype=BF16)
    assert kernel(x, w, b)[0].tolist() == [256.0, 258.0]
    assert kernel(x, w, b, out_dtype=torch.float32)[0].tolist() == [257.0, 257.5]


@needs_kernel
def test_shapes_and_non_contiguous_x(kernel: CpuLinear) -> None:
    g = _gen(11)
    w, b = _rand((40, 96), g), _rand((40,), g)
    base = _rand((2, 192), g)
    x_strided = base[:, ::2]  # [2, 96], not contiguous
    assert not x_strided.is_contiguous()
    assert torch.equal(kernel(x_strided, w, b), kernel(x_strided.contiguous(), w, b))
    x1 = _rand((96,), g)
    y1 = kernel(x1, w, b)
    assert y1.shape == (40,)
    assert torch.equal(y1, kernel(x1.view(1, 96), w, b)[0])
    x3 = _rand((1, 3, 96), g)
    y3 = kernel(x3, w)
    assert y3.shape == (1, 3, 40)
    assert torch.equal(y3.view(3, 40), kernel(x3.view(3, 96), w))
    assert F.linear(x3, w).shape == y3.shape


@needs_kernel
def test_weight_views_with_an_offset_and_strided_bias(kernel: CpuLinear) -> None:
    """A row slice of a fused weight is contiguous with a storage offset: the kernel reads
    from the slice's start. A strided bias is made contiguous."""
    g = _gen(14)
    fused, x = _rand((300, 160), g, scale=0.1), _rand((2, 160), g)
    part = fused[100:217]
    assert part.is_contiguous() and part.storage_offset() == 100 * 160
    b_base = _rand((234,), g)
    b = b_base[::2]
    assert kernel.uses_kernel(x, part, b)
    y = kernel(x, part, b)
    assert torch.equal(y, kernel(x, part.clone(), b.contiguous()))
    torch.testing.assert_close(y.float(), F.linear(x, part, b).float(), rtol=1e-2, atol=1e-2)


@needs_kernel
def test_autograd_inputs_keep_torch_and_its_graph(kernel: CpuLinear) -> None:
    g = _gen(15)
    x, w = _rand((1, 64), g), _rand((8, 64), g).requires_grad_(True)
    y = kernel(x, w)
    assert y.requires_grad and y.grad_fn is not None
    y.float().sum().backward()
    assert w.grad is not None and torch.equal(w.grad, x.expand(8, 64))


@needs_kernel
def test_thread_count_does_not_change_results(kernel: CpuLinear) -> None:
    """Each output row is computed by one thread in one fixed order, so the split over
    threads cannot change a bit."""
    g = _gen(12)
    x, w = _rand((2, 1024), g), _rand((2048, 1024), g, scale=0.05)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, w)
        torch.set_num_threads(2)
        two = kernel(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
def test_module_level_linear_is_the_kernel(kernel: CpuLinear) -> None:
    g = _gen(13)
    x, w = _rand((1, 1024), g), _rand((64, 1024), g)
    assert torch.equal(cpu_linear.linear(x, w), kernel(x, w))
    assert cpu_linear.default() is kernel
    assert kernel.ext is not None and kernel.ext.STREAM_ROWS == cpu_linear.STREAM_ROWS


# --- one reduction order for every row count -------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [1, 31, 64, 100, 1024, 3072 + 5])
def test_each_row_is_the_same_bits_for_every_row_count(kernel: CpuLinear, dtype: torch.dtype, k: int) -> None:
    """Streaming (<= 16 rows) and tiled (more) paths, every row count up to 130 and windows
    at every offset: a row's fp32 sum and its rounded output are the solo result."""
    g = _gen(100 + k)
    n = 4 * 6 + 5  # whole register strips plus a partial one
    w, b = _rand((n, k), g, scale=0.05).to(dtype), _rand((n,), g).to(dtype)
    x = _rand((130, k), g).to(dtype)
    alone32 = torch.stack([kernel(x[i : i + 1], w, b, out_dtype=torch.float32)[0] for i in range(130)])
    alone = torch.stack([kernel(x[i : i + 1], w, b)[0] for i in range(130)])
    for m in (2, 4, 5, 16, 17, 23, 64, 129, 130):
        for start in (0, 130 - m):
            got = kernel(x[start : start + m], w, b, out_dtype=torch.float32)
            assert torch.equal(got, alone32[start : start + m]), (dtype, k, m, start)
            assert torch.equal(kernel(x[start : start + m], w, b), alone[start : start + m]), (dtype, k, m)
    # the tiled path forced at one row equals the streaming path
    for i in (0, 77):
        assert torch.equal(
            kernel(x[i : i + 1], w, b, out_dtype=torch.float32, force_tiled=True)[0], alone32[i]
        )


@needs_kernel
@pytest.mark.parametrize("m", [1, 16, 17, 200])
@pytest.mark.parametrize("k", [64, 1000, 3077])
def test_fp32_matches_fp64(kernel: CpuLinear, m: int, k: int) -> None:
    g = _gen(m * 7 + k)
    x, w, b = (
        torch.randn(m, k, generator=g),
        torch.randn(61, k, generator=g) * 0.05,
        torch.randn(61, generator=g),
    )
    y = kernel(x, w, b)
    assert y.dtype == torch.float32 and kernel.uses_kernel(x, w, b)
    ref = _ref64(x, w, b)
    bound = k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 2.0**-23 * ref.abs()
    assert bool(((y.double() - ref).abs() <= bound).all())


@needs_kernel
@pytest.mark.parametrize("m", [17, 40, 300])
def test_tiled_path_exact_on_integer_data(kernel: CpuLinear, m: int) -> None:
    """Exact integer sums pin the tiled path's K tail, M tail (m % 4) and N tail (n % 6)."""
    g = _gen(m)
    k, n = 3077, 6 * 5 + 4
    x = torch.randint(-3, 4, (m, k), generator=g).to(BF16)
    w = torch.randint(-3, 4, (n, k), generator=g).to(BF16)
    b = torch.randint(-50, 51, (n,), generator=g).to(BF16)
    exact = (x.long() @ w.long().T + b.long()).double()
    assert torch.equal(kernel(x, w, b, out_dtype=torch.float32).double(), exact)
    assert torch.equal(kernel(x.float(), w.float(), b.float()).double(), exact)


# --- the AVX2 build (the AVX-512 intrinsics emulated), on any CPU that runs it -----------


@pytest.fixture(scope="module")
def avx2_kernels() -> dict[str, CpuLinear]:
    """The AVX2 build (the process's own on a CPU without AVX-512 BF16), bound in each form."""
    if not all(f in cpu_linear.cpu_flags() for f in AVX2_FLAGS):
        pytest.skip("CPU lacks avx2, fma or f16c: the AVX2 build cannot run")
    ext = cpu_linear.build_extension(name=cpu_linear.extension_name(EXTENSION_NAME, "avx2"), isa="avx2")
    probe = cpu_linear.probe_prefill(ext)
    assert probe.exact, "the AVX2 build's two bf16 forms are the same FMAs: the probe must find them one"
    bound = {}
    for form in cpu_linear.PREFILL_FORMS:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(cpu_linear.PREFILL_FORM_ENV, form)
            bound[form] = cpu_linear.bind(ext)
    return bound


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("k", [31, 576, 1027])
def test_avx2_build_rows_are_one_result_for_every_row_count_and_form(
    avx2_kernels: dict[str, CpuLinear], dtype: torch.dtype, k: int
) -> None:
    g = _gen(40 + k)
    x = torch.randn(70, k, generator=g).to(dtype)
    w, b = torch.randn(45, k, generator=g).to(dtype), torch.randn(45, generator=g).to(dtype)
    want = avx2_kernels["dpbf16"](x, w, b, out_dtype=torch.float32)
    ref = _ref64(x, w, b)
    assert torch.allclose(want.double(), ref, rtol=1e-4, atol=1e-3 * k**0.5)
    for kernel in avx2_kernels.values():
        for m in (1, 3, 4, 16, 17, 70):
            for out in (None, torch.float32):
                full = kernel(x[:m], w, b, out_dtype=out)
                assert torch.equal(full, want[:m].to(full.dtype)), (m, out)
                assert torch.equal(kernel(x[:m], w, b, out_dtype=out, force_tiled=True), full), (m, out)
