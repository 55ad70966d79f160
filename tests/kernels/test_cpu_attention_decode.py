"""The CPU decode path (kernels/csrc/cpu_attention.cpp, `decode_heads`) reads keys and values
straight from the cache rows instead of staging each head: its rows must be the same bits as
the query's row inside a prefill call over the same keys (the staged path), for every length
around the 16-key tiles, GQA group size, dtype and batch composition."""

from __future__ import annotations

import pytest
import torch

from keepwarm.kernels import cpu_attention

needs_kernels = pytest.mark.skipif(
    not cpu_attention.available(),
    reason="the CPU kernels need AVX-512 BF16 or AVX2 + FMA (this CPU has neither, or the build failed)",
)
DTYPES = [torch.float32, torch.bfloat16]
LENGTHS = [1, 15, 16, 17, 300, 1029]
# (Hq, Hkv, D): the dense demo model's heads (G = 2), G = 1, 3, 6 and 16, D not a multiple of 16, odd D
SHAPES = [(16, 8, 64), (8, 8, 128), (6, 2, 64), (12, 2, 48), (32, 2, 64), (4, 2, 100), (3, 1, 37)]


def _sequence(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Queries [n, Hq, D] and a cache's first n rows [n, Hkv, D] (views of a longer cache, as
    the engine holds them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g).to(dtype)
    cache = torch.randn(2, n + 5, hkv, d, generator=g).to(dtype)
    return q, cache[0, :n], cache[1, :n]


def _staged_last_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The last query's row through the staged path: a window of all n keys changes nothing for
    that row, and a windowed call always stages (a decode row with window 0 does not)."""
    out = cpu_attention.attention(q[-1:], k, v, scale, window=k.shape[0])
    assert out is not None
    return out[0]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), SHAPES)
def test_a_decode_row_is_the_prefill_row_at_every_length(
    dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    scale = d**-0.5
    for n in LENGTHS:
        q, k, v = _sequence(n, hq, hkv, d, dtype, seed=n * 7 + d)
        row = _staged_last_row(q, k, v, scale)
        assert torch.equal(cpu_attention.prefill_attention(q, k, v, scale)[n - 1], row), n
        assert torch.equal(cpu_attention.decode_attention(q[n - 1], k, v, scale), row), n
        batch = cpu_attention.decode_attention_batch(q[n - 1 :], [k], [v], scale)
        assert torch.equal(batch[0], row), n


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(16, 8, 64), (6, 2, 64), (3, 1, 37)])
@pytest.mark.parametrize("lengths", [[1029], [1, 300, 17], [300, 1029, 1, 15, 16, 17, 64, 1000]])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_decode_rows_are_the_prefill_rows(
    dtype: torch.dtype, hq: int, hkv: int, d: int, lengths: list[int], threads: int
) -> None:
    """B = 1, 3, 8 sequences of different lengths in one call, split over 1 or 2 threads: each
    row is its sequence's prefill row."""
    scale = d**-0.5
    seqs = [_sequence(n, hq, hkv, d, dtype, seed=b * 100 + n) for b, n in enumerate(lengths)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_attention.decode_attention_batch(
            torch.stack([q[-1] for q, _, _ in seqs]), [k for _, k, _ in seqs], [v for _, _, v in seqs], scale
        )
    finally:
        torch.set_num_threads(before)
    assert out.shape == (len(lengths), hq, d) and out.dtype == dtype
    for b, (q, k, v) in enumerate(seqs):
        assert torch.equal(out[b], _staged_last_row(q, k, v, scale)), (b, lengths[b])
