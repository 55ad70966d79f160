"""The pure-torch reference ops against naive, loop-and-explicit-softmax versions in
float64, plus the ops_for() choice between the torch and Triton bundles."""

from __future__ import annotations

import math

import pytest
import torch

from keepwarm.kernels import reference
from keepwarm.kernels.ops import TORCH_OPS, ops_for


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [S, Hkv, D] -> [T, Hq, D] in float64. Query t sits at position
    S - T + t and sees keys 0..S - T + t; query head h reads kv head h // (Hq // Hkv)."""
    t_len, hq, d = q.shape
    s_len, hkv, _ = k.shape
    group = hq // hkv
    start = s_len - t_len
    out = torch.zeros(t_len, hq, d, dtype=torch.float64)
    for h in range(hq):
        kvh = h // group
        for t in range(t_len):
            visible = start + t + 1
            scores = [float(q[t, h].double() @ k[j, kvh].double()) * scale for j in range(visible)]
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
            total = sum(weights)
            for j in range(visible):
                out[t, h] += (weights[j] / total) * v[j, kvh].double()
    return out


def naive_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half written out per pair: (x_i, x_{i+h}) -> (x_i c_i - x_{i+h} s_i, x_{i+h} c_{i+h} + x_i s_{i+h})."""
    half = x.shape[-1] // 2
    xd, c, s = x.double(), cos.double(), sin.double()
    out = torch.empty_like(xd)
    for i in range(half):
        out[:, :, i] = xd[:, :, i] * c[:, None, i] - xd[:, :, i + half] * s[:, None, i]
        out[:, :, i + half] = xd[:, :, i + half] * c[:, None, i + half] + xd[:, :, i] * s[:, None, i + half]
    return out


ATTENTION_CASES = [
    # (T, start, Hq, Hkv, D)
    (1, 0, 2, 2, 16),  # a single token, no cache
    (7, 0, 4, 4, 16),  # MHA, fresh prompt
    (7, 5, 4, 1, 16),  # MQA over a cache
    (5, 9, 8, 2, 12),  # GQA 4:1 over a cache, odd head dim
    (1, 13, 4, 2, 16),  # one query at the end of a cache
]


@pytest.mark.parametrize(("t_len", "start", "hq", "hkv", "d"), ATTENTION_CASES)
def test_prefill_attention_matches_naive_softmax(t_len: int, start: int, hq: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(t_len * 100 + start)
    q = torch.randn(t_len, hq, d, generator=g)
    k = torch.randn(start + t_len, hkv, d, generator=g)
    v = torch.randn(start + t_len, hkv, d, generator=g)
    scale = d**-0.5
    out = reference.prefill_attention(q, k, v, scale)
    assert out.shape == (t_len, hq, d) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("s_len", "hq", "hkv", "d"), [(1, 2, 2, 16), (9, 4, 1, 16), (17, 8, 2, 12)])
def test_decode_attention_matches_naive_softmax(s_len: int, hq: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(s_len)
    q = torch.randn(hq, d, generator=g)
    k = torch.randn(s_len, hkv, d, generator=g)
    v = torch.randn(s_len, hkv, d, generator=g)
    out = reference.decode_attention(q, k, v, 0.3)
    assert out.shape == (hq, d) and out.dtype == torch.float32
    expected = naive_attention(q[None], k, v, 0.3)[0]
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_prefill_attention_ignores_keys_after_each_query() -> None:
    # Query t (position start + t) must not see rows past start + t: rewriting them leaves
    # row t unchanged and changes later rows.
    g = torch.Generator().manual_seed(3)
    t_len, start, hq, hkv, d = 4, 3, 4, 2, 8
    q = torch.randn(t_len, hq, d, generator=g)
    k = torch.randn(start + t_len, hkv, d, generator=g)
    v = torch.randn(start + t_len, hkv, d, generator=g)
    base = reference.prefill_attention(q, k, v, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[start + 1 :] = 7.0
    v2[start + 1 :] = -7.0
    changed = reference.prefill_attention(q, k2, v2, 0.5)
    assert torch.equal(changed[0], base[0])
    assert not torch.allclose(changed[1], base[1])


def test_gqa_query_heads_read_their_group_kv_head() -> None:
    # Hq = 4, Hkv = 2: heads 0, 1 read kv head 0 and heads 2, 3 read kv head 1. With a
    # single key the softmax is 1, so each output row is exactly its kv head's value row.
    q = torch.randn(1, 4, 8)
    k = torch.randn(1, 2, 8)
    v = torch.stack([torch.full((8,), 1.0), torch.full((8,), 2.0)])[None]  # [1, 2, 8]
    out = reference.prefill_attention(q, k, v, 1.0)
    assert out[0, :, 0].tolist() == [1.0, 1.0, 2.0, 2.0]
    dec = reference.decode_attention(q[0], k, v, 1.0)
    assert dec[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_decode_equals_last_prefill_row() -> None:
    g = torch.Generator().manual_seed(11)
    q = torch.randn(5, 4, 16, generator=g)
    k = torch.randn(12, 2, 16, generator=g)
    v = torch.randn(12, 2, 16, generator=g)
    pre = reference.prefill_attention(q, k, v, 0.25)
    dec = reference.decode_attention(q[-1].contiguous(), k, v, 0.25)
    torch.testing.assert_close(dec, pre[-1], rtol=1e-5, atol=1e-6)


def test_rms_norm_matches_formula_and_casts_like_transformers() -> None:
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    w = torch.tensor([2.0, 0.5])
    out = reference.rms_norm(x, w, 0.0)
    # rms of [3, 4] is sqrt(12.5); of [1, -1] is 1.
    expected = torch.tensor([[2 * 3 / math.sqrt(12.5), 0.5 * 4 / math.sqrt(12.5)], [2.0, -0.5]])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    xb = x.to(torch.bfloat16)
    assert reference.rms_norm(xb, w, 1e-6).dtype == torch.float32  # fp32 weight promotes
    assert reference.rms_norm(xb, w.to(torch.bfloat16), 1e-6).dtype == torch.bfloat16


def test_rotary_matches_pairwise_rotation() -> None:
    g = torch.Generator().manual_seed(5)
    t_len, h, dr = 3, 2, 8
    x = torch.randn(t_len, h, dr, generator=g)
    angles = torch.randn(t_len, dr // 2, generator=g)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    out = reference.rotary(x, cos, sin)
    torch.testing.assert_close(out.double(), naive_rotary(x, cos, sin), rtol=1e-6, atol=1e-6)
    # A rotation keeps each (i, i + half) pair's length.
    half = dr // 2
    torch.testing.assert_close(
        out[..., :half] ** 2 + out[..., half:] ** 2, x[..., :half] ** 2 + x[..., half:] ** 2
    )


def test_ops_for_cpu_is_torch_unless_triton_is_forced() -> None:
    from keepwarm.kernels import cpu_attention, cpu_linear, cpu_rowwise
    from keepwarm.kernels.triton_ops import TRITON_OPS

    cpu = torch.device("cpu")
    plain = ops_for(cpu)
    if cpu_linear.available() and cpu_attention.available() and cpu_rowwise.available():
        assert plain.name == "cpu_invariant"  # the invariant kernels behind the self-check
        off = ops_for(cpu, invariant=False)
        assert off.name == "torch+cpu_linear"
        assert (off.rms_norm, off.rotary, off.prefill_attention, off.decode_attention) == (
            TORCH_OPS.rms_norm,
            TORCH_OPS.rotary,
            TORCH_OPS.prefill_attention,
            TORCH_OPS.decode_attention,
        )
    else:
        assert plain is TORCH_OPS
    assert ops_for(cpu, use_triton=False) == plain
    assert ops_for(cpu, use_triton=True).name == "triton_invariant"  # the default: invariant
    forced = ops_for(cpu, use_triton=True, invariant=False)
    assert forced is TRITON_OPS
    assert forced.name == "triton" and TORCH_OPS.name == "torch"
