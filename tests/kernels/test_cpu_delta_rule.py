"""The token-serial CPU delta rule: close to the torch recurrence (and so to transformers'),
and bitwise the same for a span in one call, in chunks of 1, 7 or 64 tokens, and for a
sequence alone or folded with others into the head dim (qwen3_5's batched decode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu_delta_rule
from keepwarm.kernels.delta_rule import recurrent_gated_delta_rule

pytestmark = pytest.mark.skipif(
    not cpu_delta_rule.available(),
    reason="the CPU kernels need AVX-512 BF16 or AVX2 + FMA (this CPU has neither, or the build failed)",
)
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(
    t: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=gen).to(dtype)
    k = torch.randn(t, hk, dk, generator=gen).to(dtype)
    v = torch.randn(t, hv, dv, generator=gen).to(dtype)
    g = -torch.rand(hv, generator=gen).mul(4).add(0.1)[None, :] * F.softplus(
        torch.randn(t, hv, generator=gen) + 1
    )
    beta = torch.rand(t, hv, generator=gen).to(dtype)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 4, 16, 16), (1, 3, 24, 40), (2, 2, 64, 17)])
def test_matches_the_torch_recurrence(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    q, k, v, g, beta, s0 = _inputs(33, *shape, dtype)
    state = s0.clone()
    out, s1 = cpu_delta_rule.gated_delta_rule(q, k, v, g, beta, s0)
    ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    assert torch.equal(s0, state)  # the caller's state is never written
    assert out.dtype == dtype and out.shape == ref.shape and s1.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(s1, s_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_any_chunking_and_any_folding_give_the_same_bits(dtype: torch.dtype) -> None:
    hk, hv, dk, dv, t = 2, 4, 32, 24, 130
    q, k, v, g, beta, s0 = _inputs(t, hk, hv, dk, dv, dtype, seed=1)
    full, s_full = cpu_delta_rule.gated_delta_rule(q, k, v, g, beta, s0)
    for chunk in (1, 7, 64):
        s, outs = s0, []
        for i in range(0, t, chunk):
            sl = slice(i, i + chunk)
            o, s = cpu_delta_rule.gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], s)
            outs.append(o)
        assert torch.equal(torch.cat(outs), full) and torch.equal(s, s_full), chunk
    # token 5 of this sequence, folded with 4 other sequences' tokens into one decode call
    others = _inputs(4, hk, hv, dk, dv, dtype, seed=2)
    _, s5 = cpu_delta_rule.gated_delta_rule(q[:5], k[:5], v[:5], g[:5], beta[:5], s0)
    fold = [
        torch.cat([x[5:6].flatten(0, 1), o.flatten(0, 1)])[None]
        for x, o in zip((q, k, v, g, beta), others[:5], strict=True)
    ]
    out, s_fold = cpu_delta_rule.gated_delta_rule(*fold, torch.cat([s5, others[5].repeat(4, 1, 1)]))
    assert torch.equal(out[0, :hv], full[5]) and torch.equal(
        s_fold[:hv], cpu_delta_rule.gated_delta_rule(q[5:6], k[5:6], v[5:6], g[5:6], beta[5:6], s5)[1]
    )


def test_grouped_value_heads_read_their_key_head() -> None:
    """Hv = 2 Hk: value head j reads key head j // 2 (repeat_interleave order), as transformers."""
    q, k, v, g, beta, s0 = _inputs(9, 2, 4, 16, 16, torch.float32, seed=3)
    out, _ = cpu_delta_rule.gated_delta_rule(q, k, v, g, beta, s0)
    rep = [x.repeat_interleave(2, dim=1) for x in (q, k)]
    same, _ = cpu_delta_rule.gated_delta_rule(*rep, v, g, beta, s0)
    assert torch.equal(out, same)
