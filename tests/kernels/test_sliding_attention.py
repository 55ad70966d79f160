"""Sliding-window attention with sinks: the torch references against a naive eager oracle
(transformers' gpt-oss formulation: mask, concatenated sink column, softmax, drop the sink),
and the Triton kernels, run on CPU under the Triton interpreter (conftest.py), against the
references. Decode reads a ring whose rows are rotated, so position order is tested."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest sets it too)

import pytest
import torch

from keepwarm.kernels.sliding_attention import (
    TORCH_SLIDING,
    TRITON_SLIDING,
    ring_rows,
    sliding_attention_for,
    torch_decode,
    torch_prefill,
    triton_decode,
    triton_prefill,
)


def _eager(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] (bottom-right aligned) in float64, the plain way."""
    t, hq, _ = q.shape
    s, hkv, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    vv = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    i = torch.arange(s - t, s)[:, None]
    j = torch.arange(s)[None, :]
    visible = (j <= i) & ((j > i - window) if window is not None else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(hq, 1, 1).expand(hq, t, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :s]
    return torch.einsum("hts,shd->thd", probs, vv)


def _inputs(t: int, s: int, hq: int, hkv: int, d: int, seed: int, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(s, hkv, d, generator=g).to(dtype)
    v = torch.randn(s, hkv, d, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g) * 2
    return q, k, v, sinks


CASES = [  # (T, S, Hq, Hkv, D, window)
    (9, 9, 4, 2, 16, None),
    (9, 9, 4, 2, 16, 4),
    (20, 20, 4, 4, 8, 1),
    (7, 30, 6, 2, 16, 12),  # a chunk after 23 earlier rows
    (40, 40, 2, 1, 24, 100),  # window larger than the sequence: full causal
    (33, 70, 4, 2, 16, 37),
]


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d", "window"), CASES)
def test_torch_prefill_matches_eager(
    t: int, s: int, hq: int, hkv: int, d: int, window: int | None, with_sinks: bool
) -> None:
    q, k, v, sinks = _inputs(t, s, hq, hkv, d, seed=t * s + hq)
    sk = sinks if with_sinks else None
    got = torch_prefill(q, k, v, d**-0.5, window, sk)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = _eager(q, k, v, d**-0.5, window, sk)
    assert (got.double() - want).abs().max().item() < 1e-5


def test_sinks_change_the_output_and_minus_infinity_sinks_are_no_sinks() -> None:
    q, k, v, sinks = _inputs(6, 6, 4, 2, 8, seed=3)
    plain = torch_prefill(q, k, v, 0.3, 3, None)
    assert (torch_prefill(q, k, v, 0.3, 3, sinks) - plain).abs().max().item() > 1e-2
    off = torch.full((4,), float("-inf"))
    assert (torch_prefill(q, k, v, 0.3, 3, off) - plain).abs().max().item() < 1e-6


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(
    ("ring", "window", "position"), [(8, 8, 3), (8, 8, 8), (8, 8, 21), (8, 5, 21), (40, None, 33)]
)
def test_torch_decode_reads_the_ring_in_position_order(
    ring: int, window: int | None, position: int, with_sinks: bool
) -> None:
    hq, hkv, d = 6, 2, 16
    q, seq_k, seq_v, sinks = _inputs(1, position + 1, hq, hkv, d, seed=position + ring)
    k = torch.zeros(ring, hkv, d)
    v = torch.zeros(ring, hkv, d)
    for a in range(position + 1):  # write the sequence into the ring as a model would
        k[a % ring], v[a % ring] = seq_k[a], seq_v[a]
    sk = sinks if with_sinks else None
    got = torch_decode(q[0], k, v, d**-0.5, position, window, sk)
    want = _eager(q, seq_k, seq_v, d**-0.5, window, sk)[0]
    assert (got.double() - want).abs().max().item() < 1e-5
    n = position + 1 if window is None else min(position + 1, window)
    assert torch.equal(ring_rows(k, position, n), seq_k[position + 1 - n :])


def test_decode_refuses_a_ring_too_small_for_the_window() -> None:
    q, k, v, _ = _inputs(1, 4, 2, 1, 8, seed=0)
    with pytest.raises(ValueError, match="needs 5 rows"):
        torch_decode(q[0], k, v, 1.0, 9, 5, None)
    with pytest.raises(ValueError, match="window must be >= 1"):
        torch_prefill(q, k, v, 1.0, 0, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(("t", "s", "hq", "hkv", "d", "window"), [CASES[1], CASES[3], CASES[5]])
def test_triton_prefill_matches_torch(
    t: int, s: int, hq: int, hkv: int, d: int, window: int | None, with_sinks: bool, dtype: torch.dtype
) -> None:
    q, k, v, sinks = _inputs(t, s, hq, hkv, d, seed=s, dtype=dtype)
    sk = sinks if with_sinks else None
    got = triton_prefill(q, k, v, d**-0.5, window, sk)
    want = torch_prefill(q, k, v, d**-0.5, window, sk)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.float() - want.float()).abs().max().item() < tol


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(
    ("ring", "window", "position"), [(8, 8, 5), (16, 16, 45), (16, 11, 45), (80, None, 70)]
)
def test_triton_decode_matches_torch(ring: int, window: int | None, position: int, with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(position)
    hq, hkv, d = 8, 2, 16
    q = torch.randn(hq, d, generator=g)
    k = torch.randn(ring, hkv, d, generator=g)
    v = torch.randn(ring, hkv, d, generator=g)
    sinks = torch.randn(hq, generator=g) if with_sinks else None
    got = triton_decode(q, k, v, d**-0.5, position, window, sinks)
    want = torch_decode(q, k, v, d**-0.5, position, window, sinks)
    assert (got - want).abs().max().item() < 1e-5


def test_triton_decode_splits_long_ranges() -> None:
    # 1,100 keys: several splits merged by the reduce kernel, sinks added exactly once
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(4, 16, generator=g),
        torch.randn(1200, 2, 16, generator=g),
        torch.randn(1200, 2, 16, generator=g),
    )
    sinks = torch.randn(4, generator=g)
    got = triton_decode(q, k, v, 0.25, 1099, None, sinks)
    assert (got - torch_decode(q, k, v, 0.25, 1099, None, sinks)).abs().max().item() < 1e-5


def test_selection() -> None:
    assert sliding_attention_for(torch.device("cpu")) is TORCH_SLIDING
    assert sliding_attention_for(torch.device("cpu"), use_triton=True) is TRITON_SLIDING


def test_minus_infinity_sinks_in_the_triton_prefill() -> None:
    # no sink at all, spelled as -inf logits: the running max must stay finite (window 3
    # leaves whole key blocks invisible to some rows)
    q, k, v, _ = _inputs(40, 40, 4, 2, 16, seed=11)
    off = torch.full((4,), float("-inf"))
    got = triton_prefill(q, k, v, 0.25, 3, off)
    assert torch.isfinite(got).all()
    assert (got - torch_prefill(q, k, v, 0.25, 3, None)).abs().max().item() < 1e-5
