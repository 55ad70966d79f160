"""The invariant CPU attention and row-wise ops: each query row / token row is the same bits
whatever else is in the call (decode step, prefill chunk of any length, batch of any size),
and the results agree with the torch references within rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu_attention, cpu_rowwise, reference

needs_kernels = pytest.mark.skipif(
    not (cpu_attention.available() and cpu_rowwise.available()),
    reason="the CPU kernels need AVX-512 BF16 or AVX2 + FMA (this CPU has neither, or the build failed)",
)
DTYPES = [torch.float32, torch.bfloat16]


def _qkv(s: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 16), (16, 8, 64), (2, 1, 100), (8, 8, 128)])
def test_decode_and_every_chunk_equal_the_one_shot_prefill(
    dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    s = 70
    q, k, v = _qkv(s, hq, hkv, d, dtype, seed=d)
    scale = d**-0.5
    full = cpu_attention.prefill_attention(q, k, v, scale)
    ref = reference.prefill_attention(q.float(), k.float(), v.float(), scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full.float(), ref, rtol=tol, atol=tol)
    for t in range(s):
        assert torch.equal(cpu_attention.decode_attention(q[t], k[: t + 1], v[: t + 1], scale), full[t]), t
    for a, b in ((0, 1), (0, 7), (7, 30), (3, 4), (30, 70), (15, 17), (16, 48)):
        assert torch.equal(cpu_attention.prefill_attention(q[a:b], k[:b], v[:b], scale), full[a:b]), (a, b)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_rows_see_the_last_w_keys(dtype: torch.dtype) -> None:
    s, w, d = 50, 7, 32
    q, k, v = _qkv(s, 4, 2, d, dtype, seed=5)
    out = cpu_attention.attention(q, k, v, d**-0.5, window=w)
    assert out is not None
    for t in (0, 6, 7, 33, 49):
        lo = max(0, t - w + 1)
        # the row equals full attention over exactly its window's keys (positions re-based)
        sub = cpu_attention.attention(q[t : t + 1], k[lo : t + 1], v[lo : t + 1], d**-0.5)
        assert sub is not None
        torch.testing.assert_close(out[t].float(), sub[0].float(), rtol=1e-5, atol=1e-5)
        dec = cpu_attention.attention(q[t : t + 1], k[: t + 1], v[: t + 1], d**-0.5, window=w)
        assert dec is not None and torch.equal(dec[0], out[t])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 1, 32), (8, 2, 64), (2, 1, 100)])
def test_offset_window_extra_keys_and_sinks_match_the_reference_and_any_chunking(
    dtype: torch.dtype, hq: int, hkv: int, d: int
) -> None:
    """Sliding window over kept rows (offset), compressed extra keys with a per-query mask and
    sinks, as DeepSeek V4 and gpt-oss call it: close to the torch reference, and each row the
    same bits whether the keys start at 0 or at any later kept row, and whatever else is in the call."""
    s, w, c = 90, 21, 37
    q, k, v = _qkv(s, hq, hkv, d, dtype, seed=d + 1)
    xk, xv, _ = _qkv(c, hkv, hkv, d, dtype, seed=d + 2)
    g = torch.Generator().manual_seed(d)
    mask = torch.rand(s, c, generator=g) < 0.4
    mask[:, 30:] = False  # rows no query sees: a fully masked tile
    sinks = torch.randn(hq, generator=g)
    scale = d**-0.5
    args = dict(window=w, extra_k=xk, extra_v=xv, extra_mask=mask, sinks=sinks)
    full = cpu_attention.attention(q, k, v, scale, **args)
    assert full is not None
    ref = cpu_attention.attention_reference(q, k, v, scale, **args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full.float(), ref.float(), rtol=tol, atol=tol)
    no_sink = cpu_attention.attention(q, k, v, scale, window=w, extra_k=xk, extra_v=xv, extra_mask=mask)
    assert no_sink is not None and not torch.equal(no_sink, full)  # the sinks take weight
    for a, b in ((0, 1), (0, 7), (7, 30), (29, 30), (30, 64), (64, 90), (89, 90)):
        lo = max(0, a - w + 1)  # keep only the rows the window needs, as a sliding cache does
        n = c - a % 5  # fewer extra rows exist earlier on; the dropped ones are masked for all
        for keys_from in (0, lo):
            out = cpu_attention.attention(
                q[a:b], k[keys_from:b], v[keys_from:b], scale, window=w, offset=keys_from,
                extra_k=xk[:n], extra_v=xv[:n], extra_mask=mask[a:b, :n], sinks=sinks,
            )  # fmt: skip
            assert out is not None and torch.equal(out, full[a:b]), (a, b, keys_from)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "d"), [(16, 8, 64), (4, 2, 16), (2, 1, 100), (32, 2, 64), (8, 8, 128)])
@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_decode_batch_rows_equal_each_sequence_decoded_alone(
    dtype: torch.dtype, hq: int, hkv: int, d: int, batch: int
) -> None:
    """Each sequence of a batched decode step, with its own cache length (views of a larger
    preallocated cache, as the engine holds them), is the same bits as its decode alone."""
    g = torch.Generator().manual_seed(batch * 1000 + d)
    lens = torch.randint(1, 200, (batch,), generator=g).tolist()
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    caches = [torch.randn(2, 256, hkv, d, generator=g).to(dtype) for _ in lens]
    ks = [c[0, :n] for c, n in zip(caches, lens, strict=True)]
    vs = [c[1, :n] for c, n in zip(caches, lens, strict=True)]
    out = cpu_attention.decode_attention_batch(q, ks, vs, d**-0.5)
    assert out.shape == (batch, hq, d) and out.dtype == dtype
    for b in range(batch):
        assert torch.equal(out[b], cpu_attention.decode_attention(q[b], ks[b], vs[b], d**-0.5)), (b, lens[b])
    ref = reference.decode_attention(q[0].float(), ks[0].float(), vs[0].float(), d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[0].float(), ref, rtol=tol, atol=tol)


def test_decode_batch_default_loops_over_the_bundles_decode_attention() -> None:
    """A bundle without a batched kernel (torch, Triton) gets a loop over its own
    decode_attention, also after dataclasses.replace swaps that op."""
    from dataclasses import replace

    from keepwarm.kernels.ops import TORCH_OPS

    q, k, v = _qkv(9, 4, 2, 16, torch.float32, seed=3)
    ks, vs = [k[:9], k[:4]], [v[:9], v[:4]]
    out = TORCH_OPS.decode_attention_batch(q[:2], ks, vs, 0.25)
    for b in range(2):
        assert torch.equal(out[b], reference.decode_attention(q[b], ks[b], vs[b], 0.25))
    doubled = replace(
        TORCH_OPS, decode_attention=lambda q, k, v, s: 2 * reference.decode_attention(q, k, v, s)
    )
    assert torch.equal(doubled.decode_attention_batch(q[:2], ks, vs, 0.25), 2 * out)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5, 40])
def test_window_and_sinks_agree_with_the_sliding_families_reference(
    dtype: torch.dtype, window: int | None
) -> None:
    """The kernel's sinks and window are gpt-oss's (kernels/sliding_attention.torch_prefill)."""
    from keepwarm.kernels import sliding_attention

    q, k, v = _qkv(45, 8, 2, 64, dtype, seed=9)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(9))
    got = cpu_attention.attention(q[20:], k, v, 0.125, window=window or 0, sinks=sinks)
    ref = sliding_attention.torch_prefill(q[20:], k, v, 0.125, window, sinks)
    assert got is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 37, 64, 1024, 3077])
def test_rms_norm_and_silu_mul_rows_are_independent_of_the_batch(dtype: torch.dtype, dim: int) -> None:
    g = torch.Generator().manual_seed(dim)
    x, w = torch.randn(70, dim, generator=g).to(dtype), torch.randn(dim, generator=g).to(dtype)
    gu = torch.randn(70, 2 * dim, generator=g).to(dtype)
    gate, up = gu.chunk(2, dim=-1)  # strided rows, as from a fused projection
    norm, act = cpu_rowwise.rms_norm(x, w, 1e-6), cpu_rowwise.silu_mul(gate, up)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        norm.float(), reference.rms_norm(x.float(), w.float(), 1e-6), rtol=tol, atol=tol
    )
    torch.testing.assert_close(act.float(), (F.silu(gate.float()) * up.float()), rtol=tol, atol=tol)
    for i in range(70):
        assert torch.equal(cpu_rowwise.rms_norm(x[i : i + 1], w, 1e-6)[0], norm[i])
        assert torch.equal(cpu_rowwise.silu_mul(gate[i], up[i]), act[i])
    heads = x.view(70, 1, dim)[:, :, :]  # 3-D rows
    assert torch.equal(cpu_rowwise.rms_norm(heads, w, 1e-6).view(70, dim), norm)


def test_fallbacks_are_the_references() -> None:
    x, w = torch.randn(3, 8).half(), torch.randn(8).half()
    assert torch.equal(cpu_rowwise.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    assert torch.equal(cpu_rowwise.silu_mul(x, x), F.silu(x) * x)
    q, k, v = _qkv(5, 2, 1, 8, torch.float16, seed=1)
    assert torch.equal(
        cpu_attention.prefill_attention(q, k, v, 0.3), reference.prefill_attention(q, k, v, 0.3)
    )
    batch = cpu_attention.decode_attention_batch(q[:2], [k, k[:3]], [v, v[:3]], 0.3)
    assert torch.equal(batch[1], reference.decode_attention(q[1], k[:3], v[:3], 0.3))
