"""Each Triton op against the pure-torch reference, run on CPU under the Triton
interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1). Sizes stay small
because interpreting is slow."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keepwarm.kernels import reference, triton_ops
from keepwarm.kernels.triton_ops import TRITON_OPS

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}
DTYPES = [torch.float32, torch.bfloat16]


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def test_interpreter_is_active() -> None:
    # Guards the premise of every test here: the kernels run interpreted on CPU tensors.
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert TRITON_OPS.name == "triton"
    assert TRITON_OPS.prefill_attention is triton_ops.prefill_attention


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 48), (1, 80)])
def test_rms_norm_matches_reference(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = _randn(g, *shape, dtype=dtype) * 3
    w = _randn(g, shape[-1], dtype=dtype)
    out = TRITON_OPS.rms_norm(x, w, 1e-6)
    ref = reference.rms_norm(x, w, 1e-6)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_rms_norm_bf16_input_fp32_weight_promotes_like_reference() -> None:
    g = torch.Generator().manual_seed(1)
    x = _randn(g, 9, 48, dtype=torch.bfloat16)
    w = _randn(g, 48, dtype=torch.float32)
    out = TRITON_OPS.rms_norm(x, w, 1e-5)
    ref = reference.rms_norm(x, w, 1e-5)
    assert out.dtype == ref.dtype == torch.float32
    # The normalized row is rounded to bf16 before the fp32 weight multiply in both.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rms_norm_non_contiguous_input() -> None:
    g = torch.Generator().manual_seed(2)
    x = _randn(g, 64, 6, dtype=torch.float32).t()  # [6, 64], stride (1, 6)
    w = _randn(g, 64, dtype=torch.float32)
    torch.testing.assert_close(
        TRITON_OPS.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), **TOL[torch.float32]
    )


def test_rms_norm_bad_weight_shape_says_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"weight shape \(32,\) must be \(64,\)"):
        TRITON_OPS.rms_norm(torch.zeros(2, 64), torch.ones(32), 1e-6)


# --------------------------------------------------------------------------- rotary


def _cos_sin(t_len: int, dr: int, dtype: torch.dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dr, 2, dtype=torch.float32) / dr))
    pos = torch.arange(start, start + t_len, dtype=torch.float32)
    emb = torch.cat([pos[:, None] * inv_freq[None]] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t_len", "h", "dr"), [(1, 4, 64), (7, 3, 48), (33, 2, 80)])
def test_rotary_matches_reference(dtype: torch.dtype, t_len: int, h: int, dr: int) -> None:
    g = torch.Generator().manual_seed(t_len + h + dr)
    x = _randn(g, t_len, h, dr, dtype=dtype)
    cos, sin = _cos_sin(t_len, dr, dtype, start=11)
    out = TRITON_OPS.rotary(x, cos, sin)
    ref = reference.rotary(x, cos, sin)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    if dtype == torch.bfloat16:
        # Every product and the sum are rounded to bf16 as the reference's torch ops round
        # them, and bf16 x bf16 products are exact in fp32: the results match bit for bit.
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, **TOL[dtype])


def test_rotary_partial_dims_of_a_wider_head() -> None:
    # Partial rotary: the first Dr = 32 dims of a 64-dim head, a non-contiguous view.
    g = torch.Generator().manual_seed(4)
    full = _randn(g, 5, 2, 64, dtype=torch.float32)
    x = full[..., :32]
    cos, sin = _cos_sin(5, 32, torch.float32)
    torch.testing.assert_close(
        TRITON_OPS.rotary(x, cos, sin), reference.rotary(x, cos, sin), **TOL[torch.float32]
    )


def test_rotary_fp32_tables_promote_bf16_input() -> None:
    g = torch.Generator().manual_seed(6)
    x = _randn(g, 3, 2, 16, dtype=torch.bfloat16)
    cos, sin = _cos_sin(3, 16, torch.float32, start=100)
    out = TRITON_OPS.rotary(x, cos, sin)
    ref = reference.rotary(x, cos, sin)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_rotary_bad_table_shape_says_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"must both be \(3, 16\)"):
        TRITON_OPS.rotary(torch.zeros(3, 2, 16), torch.zeros(3, 8), torch.zeros(3, 8))


# --------------------------------------------------------------------------- prefill attention

PREFILL_CASES = [
    # (T, start, Hq, Hkv, D)
    (1, 0, 4, 4, 64),  # one token, MHA
    (7, 5, 4, 1, 64),  # MQA over a cache
    (33, 0, 8, 2, 64),  # GQA 4:1, two query blocks, no cache
    (33, 17, 4, 4, 48),  # MHA over a cache, non-power-of-two head dim
    (7, 40, 4, 2, 80),  # GQA 2:1, cache longer than one key block, D = 80
    (1, 9, 4, 1, 48),  # a single query at the end of a cache, MQA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t_len", "start", "hq", "hkv", "d"), PREFILL_CASES)
def test_prefill_attention_matches_reference(
    dtype: torch.dtype, t_len: int, start: int, hq: int, hkv: int, d: int
) -> None:
    g = torch.Generator().manual_seed(t_len * 1000 + start * 10 + hkv)
    q = _randn(g, t_len, hq, d, dtype=dtype)
    k = _randn(g, start + t_len, hkv, d, dtype=dtype)
    v = _randn(g, start + t_len, hkv, d, dtype=dtype)
    scale = d**-0.5
    out = TRITON_OPS.prefill_attention(q, k, v, scale)
    ref = reference.prefill_attention(q, k, v, scale)
    assert out.shape == (t_len, hq, d) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_prefill_attention_fp16() -> None:
    g = torch.Generator().manual_seed(8)
    q = _randn(g, 7, 4, 64, dtype=torch.float16)
    k = _randn(g, 12, 2, 64, dtype=torch.float16)
    v = _randn(g, 12, 2, 64, dtype=torch.float16)
    torch.testing.assert_close(
        TRITON_OPS.prefill_attention(q, k, v, 0.125),
        reference.prefill_attention(q, k, v, 0.125),
        **TOL[torch.float16],
    )


def test_prefill_attention_views_of_fused_qkv_and_a_cache_buffer() -> None:
    # q is a strided view out of a fused QKV projection; k/v are the first S rows of a
    # preallocated cache whose tail holds garbage that must never be read.
    g = torch.Generator().manual_seed(9)
    t_len, start, hq, hkv, d = 7, 6, 4, 2, 48
    qkv = _randn(g, t_len, (hq + 2 * hkv) * d, dtype=torch.float32)
    q = qkv[:, : hq * d].view(t_len, hq, d)
    assert not q.is_contiguous()
    cache_k = torch.full((64, hkv, d), float("nan"))
    cache_v = torch.full((64, hkv, d), float("nan"))
    s_len = start + t_len
    cache_k[:s_len] = _randn(g, s_len, hkv, d, dtype=torch.float32)
    cache_v[:s_len] = _randn(g, s_len, hkv, d, dtype=torch.float32)
    k, v = cache_k[:s_len], cache_v[:s_len]
    out = TRITON_OPS.prefill_attention(q, k, v, 0.2)
    torch.testing.assert_close(out, reference.prefill_attention(q, k, v, 0.2), **TOL[torch.float32])


def test_prefill_attention_bad_head_counts_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="must be a multiple of kv heads 2"):
        TRITON_OPS.prefill_attention(torch.zeros(1, 3, 16), torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), 1.0)
    with pytest.raises(ValueError, match="fewer than the 4 queries"):
        TRITON_OPS.prefill_attention(torch.zeros(4, 2, 16), torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), 1.0)


def test_prefill_attention_empty_query_returns_empty() -> None:
    out = TRITON_OPS.prefill_attention(
        torch.zeros(0, 2, 16), torch.zeros(5, 2, 16), torch.zeros(5, 2, 16), 1.0
    )
    assert out.shape == (0, 2, 16)


# --------------------------------------------------------------------------- decode attention

DECODE_CASES = [
    # (S, Hq, Hkv, D): S = 1 and 7 take one split, 33 two, 1000 all 32 splits.
    (1, 4, 4, 64),
    (7, 4, 1, 64),
    (33, 8, 2, 48),
    (1000, 8, 2, 80),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("s_len", "hq", "hkv", "d"), DECODE_CASES)
def test_decode_attention_matches_reference(
    dtype: torch.dtype, s_len: int, hq: int, hkv: int, d: int
) -> None:
    g = torch.Generator().manual_seed(s_len * 10 + hkv)
    q = _randn(g, hq, d, dtype=dtype)
    k = _randn(g, s_len, hkv, d, dtype=dtype)
    v = _randn(g, s_len, hkv, d, dtype=dtype)
    scale = d**-0.5
    out = TRITON_OPS.decode_attention(q, k, v, scale)
    ref = reference.decode_attention(q, k, v, scale)
    assert out.shape == (hq, d) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_decode_attention_peaked_scores_across_splits() -> None:
    # One key (in the last of several splits) dominates: the split merge must rescale the
    # other splits' partial sums by 2^(m_s - M) or the output drifts from that key's value.
    s_len, hq, hkv, d = 200, 2, 1, 16
    q = torch.ones(hq, d)
    k = torch.zeros(s_len, hkv, d)
    k[190] = 4.0
    v = torch.arange(s_len, dtype=torch.float32)[:, None, None].expand(s_len, hkv, d).contiguous()
    out = TRITON_OPS.decode_attention(q, k, v, 1.0)
    torch.testing.assert_close(out, reference.decode_attention(q, k, v, 1.0), rtol=1e-5, atol=1e-4)
    assert abs(out[0, 0].item() - 190.0) < 1e-3


def test_decode_equals_prefill_of_one_token() -> None:
    g = torch.Generator().manual_seed(12)
    q = _randn(g, 1, 8, 64, dtype=torch.float32)
    k = _randn(g, 45, 2, 64, dtype=torch.float32)
    v = _randn(g, 45, 2, 64, dtype=torch.float32)
    dec = TRITON_OPS.decode_attention(q[0], k, v, 0.125)
    pre = TRITON_OPS.prefill_attention(q, k, v, 0.125)
    torch.testing.assert_close(dec, pre[0], rtol=1e-5, atol=1e-5)


def test_decode_attention_empty_cache_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="at least one cached row"):
        TRITON_OPS.decode_attention(torch.zeros(2, 16), torch.zeros(0, 2, 16), torch.zeros(0, 2, 16), 1.0)


# --------------------------------------------------------------------------- compiled, on a GPU

_GPU_SCRIPT = """
import torch
from keepwarm.kernels import reference
from keepwarm.kernels.triton_ops import TRITON_OPS
g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
    def r(*s):
        return torch.randn(*s, generator=g).to(dtype).cuda()
    x, w = r(33, 80), r(80)
    torch.testing.assert_close(TRITON_OPS.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), rtol=tol, atol=tol)
    x, c, s = r(33, 4, 48), r(33, 48), r(33, 48)
    torch.testing.assert_close(TRITON_OPS.rotary(x, c, s), reference.rotary(x, c, s), rtol=tol, atol=tol)
    for t, start, hq, hkv, d in ((33, 17, 8, 2, 128), (7, 300, 4, 1, 80), (1, 0, 4, 4, 64)):
        q, k, v = r(t, hq, d), r(start + t, hkv, d), r(start + t, hkv, d)
        torch.testing.assert_close(
            TRITON_OPS.prefill_attention(q, k, v, d**-0.5), reference.prefill_attention(q, k, v, d**-0.5),
            rtol=tol, atol=tol,
        )
        torch.testing.assert_close(
            TRITON_OPS.decode_attention(q[0].contiguous(), k, v, d**-0.5),
            reference.decode_attention(q[0].contiguous(), k, v, d**-0.5), rtol=tol, atol=tol,
        )
print("gpu ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU to compile the kernels")
def test_compiled_kernels_match_reference_on_gpu(tmp_path: Path) -> None:
    # A fresh process without TRITON_INTERPRET, so the kernels are compiled, not interpreted.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "gpu_check.py"
    script.write_text(_GPU_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "gpu ok" in proc.stdout
