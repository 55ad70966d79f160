"""The start-up self-check: it passes the invariant CPU kernels, and refuses invariant mode
(one ERROR line naming the op and shape, then the fallback for every call) when a kernel
changes a row's bits with the batch — here torch's own fp32 GEMM, whose rows differ
between 1 and 2 rows on oneDNN."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu_attention, cpu_delta_rule, cpu_linear, cpu_rowwise
from keepwarm.kernels.invariance import SelfCheck, probe_linear
from keepwarm.kernels.ops import TORCH_OPS, cpu_ops

needs_kernels = pytest.mark.skipif(
    not all(m.available() for m in (cpu_linear, cpu_attention, cpu_rowwise, cpu_delta_rule)),
    reason="the invariant CPU kernels need AVX-512 BF16 or AVX2 + FMA (or the build failed)",
)


@needs_kernels
def test_the_invariant_kernels_pass_every_probe(caplog: pytest.LogCaptureFixture) -> None:
    fast = replace(
        TORCH_OPS,
        name="cpu_invariant",
        linear=cpu_linear.linear,
        rms_norm=cpu_rowwise.rms_norm,
        silu_mul=cpu_rowwise.silu_mul,
        prefill_attention=cpu_attention.prefill_attention,
        decode_attention=cpu_attention.decode_attention,
        rms_norm_1p=cpu_rowwise.rms_norm_1p,
        sigmoid=cpu_rowwise.sigmoid,
        silu=cpu_rowwise.silu,
        softplus=cpu_rowwise.softplus,
        conv_silu=cpu_rowwise.conv_silu,
        delta_rule_prefill=cpu_delta_rule.gated_delta_rule,
        delta_rule_decode=cpu_delta_rule.gated_delta_rule,
        attention=cpu_attention.attention,
    )
    check = SelfCheck(fast, TORCH_OPS)
    ops = check.ops()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(96, 64, generator=g).to(dtype)
        x = torch.randn(3, 64, generator=g).to(dtype)
        with caplog.at_level(logging.ERROR):
            assert torch.equal(ops.linear(x, w), cpu_linear.linear(x, w))
            ops.rms_norm(x, w[0], 1e-6)
            ops.silu_mul(x, x)
            q, k = torch.randn(5, 4, 16).to(dtype), torch.randn(5, 2, 16).to(dtype)
            ops.prefill_attention(q, k, k, 0.25)
            ops.decode_attention(q[0], k, k, 0.25)
            extra = dict(extra_k=k[:3], extra_v=k[:3], extra_mask=torch.rand(5, 3) < 0.5)
            got = ops.attention(q, k, k, 0.25, window=3, offset=2, sinks=torch.zeros(4), **extra)
            want = cpu_attention.attention(q, k, k, 0.25, window=3, offset=2, sinks=torch.zeros(4), **extra)
            assert got is not None and want is not None and torch.equal(got, want)
            ops.rms_norm_1p(x, torch.ones(64), 1e-6)
            for f in (ops.sigmoid, ops.silu, ops.softplus):
                f(x)
            ops.conv_silu(torch.randn(64, 9).to(dtype), torch.randn(64, 1, 4).to(dtype))
            beta, state = torch.rand(5, 4).to(dtype), torch.zeros(4, 16, 16)
            ops.delta_rule_prefill(q[:, :2], k, q, -torch.rand(5, 4), beta, state)
            ops.delta_rule_decode(q[:1, :2], k[:1], q[:1], -torch.rand(1, 4), beta[:1], state)
    assert check.refused is None and not caplog.records
    assert len(check.checked) == 2 * 11  # 11 buckets per dtype, each probed once


def test_a_batch_dependent_kernel_is_refused_with_one_error_line(caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def drifting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.shape[0])
        y = F.linear(x, w, b)
        return y + 1e-3 * (x.shape[0] > 16)  # rows in big batches come out different

    fast = replace(TORCH_OPS, name="drifting", linear=drifting)
    check = SelfCheck(fast, TORCH_OPS)
    w, x = torch.randn(8, 32), torch.randn(2, 32)
    with caplog.at_level(logging.ERROR, logger="keepwarm.kernels.invariance"):
        y = check.ops().linear(x, w)
    assert torch.equal(y, TORCH_OPS.linear(x, w))  # the failing call already runs the fallback
    assert check.refused is not None and "linear (8, 32)" in check.refused
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert "invariant mode refused" in caplog.text and "drifting" in caplog.text
    n = len(calls)
    check.ops().linear(x, torch.randn(4, 32))  # a new bucket after a refusal: no probe, fallback
    assert len(calls) == n


def _drifting_attention(trigger: str) -> Callable[..., torch.Tensor | None]:
    """cpu_attention.attention, except that a call using `trigger` with more than 16 queries
    comes out shifted (a kernel whose path for that argument blocks by the row count), or, for
    "offset", with its key tiles counted from row 0 instead of absolute positions."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw: Any) -> Any:
        if trigger == "offset":
            return cpu_attention.attention(q, k, v, scale, **{**kw, "offset": 0})
        out = cpu_attention.attention(q, k, v, scale, **kw)
        used = {"window": kw.get("window", 0) > 0, "extra": "extra_k" in kw, "sinks": "sinks" in kw}
        return out + 1e-3 if out is not None and used[trigger] and q.shape[0] > 16 else out

    return attention


@needs_kernels
@pytest.mark.parametrize("trigger", ["window", "offset", "extra", "sinks"])
def test_attention_that_changes_with_the_row_count_under_its_newer_arguments_is_refused(
    caplog: pytest.LogCaptureFixture, trigger: str
) -> None:
    """The plain causal probe (prefill_attention, decode_attention) cannot see a drift that
    only the general attention's window, offset, extra keys or sinks bring; its own probe does."""
    fast = replace(
        TORCH_OPS,
        name="drifting",
        prefill_attention=cpu_attention.prefill_attention,
        decode_attention=cpu_attention.decode_attention,
        attention=_drifting_attention(trigger),
    )
    check = SelfCheck(fast, TORCH_OPS)
    ops = check.ops()
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    with caplog.at_level(logging.ERROR, logger="keepwarm.kernels.invariance"):
        assert torch.equal(
            ops.prefill_attention(q, k, k, 0.25), cpu_attention.prefill_attention(q, k, k, 0.25)
        )
        assert check.refused is None and not caplog.records  # the causal probe passed
        got = ops.attention(q, k, k, 0.25, window=3, offset=2, sinks=torch.zeros(4))
    assert got is None  # the failing call already runs the fallback (no kernel: the model's torch path)
    assert check.refused is not None and check.refused.startswith("attention(window=")
    assert "Hq=4 Hkv=2 D=16 torch.float32" in check.refused
    assert [r.levelname for r in caplog.records] == ["ERROR"] and "drifting" in caplog.text
    assert ops.prefill_attention(q, k, k, 0.25).equal(TORCH_OPS.prefill_attention(q, k, k, 0.25))


def test_the_probe_sees_what_torch_fp32_gemm_does_here() -> None:
    """The probe reports a real platform difference exactly when there is one (torch 2.13's
    fp32 GEMM on oneDNN: every row differs between 1 and 2 rows)."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 256, generator=g), torch.randn(40, 256, generator=g)
    differs = not torch.equal(F.linear(x[:1], w)[0], F.linear(x[:2], w)[0])
    assert (probe_linear(F.linear, w, None) is not None) == differs


@needs_kernels
def test_cpu_ops_are_one_checked_bundle_per_process() -> None:
    assert cpu_ops() is cpu_ops() and cpu_ops().name == "cpu_invariant"
    assert cpu_ops(False).name == "torch+cpu_linear"
