"""The row-local CPU ops beyond RMSNorm / silu_mul (qwen3_5's): rms_norm_1p, sigmoid, silu,
softplus and the depthwise causal conv + silu are within float rounding of torch, and an
element's bits do not depend on the row count, the row's place or the rows around it (torch's
elementwise ops finish each thread's range with scalar code whose last bit can differ)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu_rowwise, reference

pytestmark = pytest.mark.skipif(
    not cpu_rowwise.available(),
    reason="the CPU kernels need AVX-512 BF16 or AVX2 + FMA (this CPU has neither, or the build failed)",
)
DTYPES = [torch.float32, torch.bfloat16]
TORCH = {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(TORCH))
def test_pointwise_close_to_torch_and_row_invariant(dtype: torch.dtype, name: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(67, 45, generator=g) * 8).to(dtype)
    fn = getattr(cpu_rowwise, name)
    y = fn(x)
    assert y.dtype == dtype and y.shape == x.shape
    ref = TORCH[name](x.float()).to(dtype)
    tol = 4e-7 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)
    for a, b in ((0, 1), (5, 6), (3, 40), (66, 67)):
        assert torch.equal(fn(x[a:b]), y[a:b]), (a, b)
    assert torch.equal(fn(x[:, 7:30]), y[:, 7:30])  # strided rows: the same per-element bits


def test_softplus_at_the_extremes() -> None:
    x = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 19.99, 20.0, 20.01, 60.0])
    torch.testing.assert_close(cpu_rowwise.softplus(x), F.softplus(x), atol=0, rtol=2e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_1p_close_to_torch_and_row_invariant(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 72, generator=g).to(dtype)
    scale = 1 + torch.randn(72, generator=g) * 0.1
    y = cpu_rowwise.rms_norm_1p(x, scale, 1e-6)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), reference.rms_norm_1p(x, scale, 1e-6).float(), atol=tol, rtol=tol)
    assert torch.equal(cpu_rowwise.rms_norm_1p(x[7:8], scale, 1e-6), y[7:8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_silu_close_to_torch_and_the_same_in_one_window_or_many(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    c, k, n = 40, 4, 37
    x = torch.randn(c, k - 1 + n, generator=g).to(dtype)
    w = (torch.randn(c, 1, k, generator=g) * 0.5).to(dtype)
    y = cpu_rowwise.conv_silu(x, w)  # [C, n]
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), reference.conv_silu(x, w).float(), atol=tol, rtol=tol)
    windows = torch.stack([x[:, t : t + k] for t in range(n)])  # [n, C, K]: decode-shaped calls
    assert torch.equal(cpu_rowwise.conv_silu(windows, w)[..., 0].t(), y)
    assert torch.equal(cpu_rowwise.conv_silu(x[:, 10 : 10 + k + 5], w), y[:, 10:16])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_the_references_bits_on_heads_of_a_fused_projection(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    t, hq, hkv, d = 13, 6, 2, 64
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 4).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)  # strided rows: a view into the fused output
    angles = torch.rand(t, d // 2, generator=g) * 100
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    y = cpu_rowwise.rotary(q, cos, sin)
    assert y.is_contiguous() and y.dtype == dtype
    assert torch.equal(y, reference.rotary(q, cos, sin))
    assert torch.equal(cpu_rowwise.rotary(q[5:6], cos[5:6], sin[5:6]), y[5:6])
    partial = q[..., :32]  # a partial rotary dim: rows strided by the head
    assert torch.equal(
        cpu_rowwise.rotary(partial, cos[:, :32], sin[:, :32]),
        reference.rotary(partial, cos[:, :32], sin[:, :32]),
    )
