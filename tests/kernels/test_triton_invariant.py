"""The invariant Triton bundle (kernels/triton_invariant.py), run on CPU under the Triton
interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1): each row's bits alone equal
its bits in batches of any composition, in prefill chunks of any length and as a decode row;
each kernel close to its pure-torch reference; and controls showing the non-invariant paths
(torch's GEMM, the old split-KV decode, the chunked delta rule) do change bits, so the
equalities here can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels import cpu_attention, reference, triton_invariant
from keepwarm.kernels.delta_rule import recurrent_gated_delta_rule
from keepwarm.kernels.ops import ops_for
from keepwarm.kernels.triton_invariant import TRITON_INVARIANT_OPS as OPS
from keepwarm.kernels.triton_ops import TRITON_OPS

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # rtol = atol per dtype


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def test_ops_for_a_gpu_picks_the_invariant_bundle() -> None:
    # Only builds the dataclass: no CUDA call, so this runs without a GPU.
    assert os.environ["TRITON_INTERPRET"] == "1"
    cuda = torch.device("cuda")
    assert ops_for(cuda, use_triton=True, invariant=True) is OPS
    assert OPS.name == "triton_invariant"
    assert ops_for(cuda, use_triton=True, invariant=False).name == "triton"
    assert OPS.delta_rule_prefill is OPS.delta_rule_decode is triton_invariant.gated_delta_rule
    assert OPS.topk is reference.stable_topk


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_equal_alone_and_in_batches_of_any_composition(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    pool = _randn(g, 40, 70, dtype=dtype)  # K = 70: a ragged last K tile
    w = _randn(g, 50, 70, dtype=dtype)
    b = _randn(g, 50, dtype=dtype)
    solo = torch.cat([OPS.linear(pool[i : i + 1], w, b) for i in range(40)])  # [40, 50]
    ref = F.linear(pool.float(), w.float(), b.float())
    if dtype == torch.float32:
        torch.testing.assert_close(solo, ref, rtol=TOL[dtype], atol=TOL[dtype])
    else:  # one rounding of the fp32 sum: within half a bf16 ulp (2^-9 relative) of it
        assert ((solo.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-4).all()
    for m in (1, 3, 17, 40):
        for trial in range(2):
            idx = torch.randint(0, 40, (m,), generator=g) if trial else torch.randperm(40, generator=g)[:m]
            out = OPS.linear(pool[idx], w, b)
            assert out.dtype == dtype and torch.equal(out, solo[idx]), (m, trial)
    # Leading dims flatten; no bias.
    x3 = pool[:12].view(3, 4, 70)
    assert torch.equal(
        OPS.linear(x3, w).view(12, 50), torch.cat([OPS.linear(pool[i], w)[None] for i in range(12)])
    )


def test_linear_control_torch_gemm_changes_row_bits_with_the_row_count() -> None:
    # The non-invariant bundle's linear is torch's; on this CPU its fp32 rows already
    # differ between one row and forty (on a GPU cuBLAS picks tiles by M likewise).
    g = torch.Generator().manual_seed(1)
    pool = _randn(g, 40, 70, dtype=torch.float32)
    w = _randn(g, 50, 70, dtype=torch.float32)
    assert TRITON_OPS.linear is F.linear
    full = F.linear(pool, w)
    assert any(not torch.equal(F.linear(pool[i : i + 1], w)[0], full[i]) for i in range(40))


def test_linear_bad_shapes_say_what_to_change() -> None:
    with pytest.raises(ValueError, match=r"must be \[N, 8\]"):
        OPS.linear(torch.zeros(2, 8), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="must match"):
        OPS.linear(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.bfloat16))


# --------------------------------------------------------------------------- row-local ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_softmax_rows_equal_alone_and_in_a_batch(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = _randn(g, 17, 80, dtype=dtype) * 3
    w = _randn(g, 80, dtype=dtype)
    scale = 1 + _randn(g, 80, dtype=torch.float32)
    cases = [
        (lambda t: OPS.rms_norm(t, w, 1e-6), lambda t: reference.rms_norm(t, w, 1e-6)),
        (lambda t: OPS.rms_norm_1p(t, scale, 1e-6), lambda t: reference.rms_norm_1p(t, scale, 1e-6)),
        (lambda t: OPS.softmax(t, -1), lambda t: reference.softmax(t, -1)),
    ]
    for op, ref in cases:
        batch = op(x)
        torch.testing.assert_close(batch.float(), ref(x).float(), rtol=TOL[dtype], atol=TOL[dtype])
        for i in (0, 5, 16):
            assert torch.equal(op(x[i : i + 1]), batch[i : i + 1])
            assert torch.equal(op(x[[i, i, 3]])[0], batch[i])
    # softmax over a middle dim (DeepSeek V4's compressor): each slice alone == in the batch.
    y = _randn(g, 5, 6, 3, dtype=dtype)
    full = OPS.softmax(y, 1)
    torch.testing.assert_close(full, reference.softmax(y, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(OPS.softmax(y[2:3], 1), full[2:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_silu_chunked_equals_one_shot(dtype: torch.dtype) -> None:
    # A chunk sees its K - 1 predecessors (the conv state) then its own positions.
    g = torch.Generator().manual_seed(3)
    c, length, kw = 8, 20, 4
    x = _randn(g, c, length + kw - 1, dtype=dtype)
    w = _randn(g, c, 1, kw, dtype=dtype)
    full = OPS.conv_silu(x, w)
    torch.testing.assert_close(
        full.float(), reference.conv_silu(x, w).float(), rtol=TOL[dtype], atol=TOL[dtype]
    )
    for chunk in (1, 7):
        parts = [OPS.conv_silu(x[:, a : min(length, a + chunk) + kw - 1], w) for a in range(0, length, chunk)]
        assert torch.equal(torch.cat(parts, dim=-1), full)


# --------------------------------------------------------------------------- attention


def _qkv(
    dtype: torch.dtype, t: int = 40, hq: int = 4, hkv: int = 2, d: int = 48, seed: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        _randn(g, t, hq, d, dtype=dtype),
        _randn(g, t, hkv, d, dtype=dtype),
        _randn(g, t, hkv, d, dtype=dtype),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_row_equal_one_shot_chunked_and_decoded(dtype: torch.dtype) -> None:
    q, k, v = _qkv(dtype)
    t, scale = q.shape[0], 48**-0.5
    one_shot = OPS.prefill_attention(q, k, v, scale)
    torch.testing.assert_close(
        one_shot.float(),
        reference.prefill_attention(q, k, v, scale).float(),
        rtol=TOL[dtype],
        atol=TOL[dtype],
    )
    for chunk in (1, 7, t):
        parts = [
            OPS.prefill_attention(q[a : a + chunk], k[: a + chunk], v[: a + chunk], scale)
            for a in range(0, t, chunk)
        ]
        assert torch.equal(torch.cat(parts), one_shot), chunk
    # Every third row, both sides of the first key-tile boundary (32), the last row.
    for i in sorted({*range(0, t, 3), 31, 32, t - 1}):
        assert torch.equal(OPS.decode_attention(q[i], k[: i + 1], v[: i + 1], scale), one_shot[i]), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_by_address_table_equals_each_row_alone(dtype: torch.dtype) -> None:
    # Caches of different lengths (both sides of the 32-key tile) at unrelated addresses, with
    # rows past each length that must not be read; GQA with 3 query heads per kv head.
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, scale = 6, 2, 48, 48**-0.5
    lens = [1, 31, 32, 33, 70]
    ks = [_randn(g, n + 4, hkv, d, dtype=dtype) for n in lens]
    vs = [_randn(g, n + 4, hkv, d, dtype=dtype) for n in lens]
    q = _randn(g, len(lens), hq, d, dtype=dtype)
    alone = [OPS.decode_attention(q[b], ks[b][:n], vs[b][:n], scale) for b, n in enumerate(lens)]
    k_table = torch.tensor([k.data_ptr() for k in ks])
    v_table = torch.tensor([v.data_ptr() for v in vs])
    positions = torch.tensor([n - 1 for n in lens])
    table = triton_invariant.decode_attention_table(q, k_table, v_table, positions, scale, hkv)
    batch = OPS.decode_attention_batch(
        q,
        [k[:n] for k, n in zip(ks, lens, strict=True)],
        [v[:n] for v, n in zip(vs, lens, strict=True)],
        scale,
    )
    for b in range(len(lens)):
        assert torch.equal(table[b], alone[b]), b
        assert torch.equal(batch[b], alone[b]), b
    # the new rows land at each sequence's position, nothing else moves
    before = [k.clone() for k in ks]
    rows = _randn(g, len(lens), hkv, d, dtype=dtype)
    triton_invariant.write_rows(rows, k_table, positions + 1)
    for b, n in enumerate(lens):
        assert torch.equal(ks[b][n], rows[b])
        assert torch.equal(
            torch.cat([ks[b][:n], ks[b][n + 1 :]]), torch.cat([before[b][:n], before[b][n + 1 :]])
        )


def test_address_tables_must_be_int64_rows_per_sequence() -> None:
    q = torch.zeros(2, 4, 16)
    good = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"contiguous \[2\] int64"):
        triton_invariant.decode_attention_table(q, good, good.to(torch.int32), good, 1.0, 2)
    with pytest.raises(ValueError, match=r"contiguous \[2\] int64"):
        triton_invariant.write_rows(torch.zeros(2, 2, 16), good[:1], good)


def test_attention_control_old_split_kv_decode_differs_from_its_prefill() -> None:
    # The non-invariant bundle reduces a decode row in split-KV partials merged by a second
    # kernel (and keeps P in fp32): rows differ from the same rows of its prefill. Its chunked
    # prefill, under the interpreter, does not differ from one shot (not used as a control).
    q, k, v = _qkv(torch.float32)
    one_shot = TRITON_OPS.prefill_attention(q, k, v, 0.2)
    differ = [
        i
        for i in range(40)
        if not torch.equal(TRITON_OPS.decode_attention(q[i], k[: i + 1], v[: i + 1], 0.2), one_shot[i])
    ]
    assert differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_windowed_attention_with_extra_keys_and_sinks_chunked_equals_one_shot(dtype: torch.dtype) -> None:
    # sliding.py / DeepSeek V4's call: a chunk passes the rows its first query can see
    # (offset = their absolute position), its own rows, extra rows with a per-query mask,
    # and one sink logit per head.
    q, k, v = _qkv(dtype, t=34, seed=5)
    g = torch.Generator().manual_seed(6)
    t, window, scale = q.shape[0], 9, 0.15
    extra = _randn(g, 5, 2, 48, dtype=dtype)
    extra_mask = torch.rand(t, 5, generator=g) > 0.4
    sinks = torch.randn(4, generator=g)
    kw = dict(window=window, extra_k=extra, extra_v=extra, sinks=sinks)
    one_shot = OPS.attention(q, k, v, scale, extra_mask=extra_mask, **kw)
    ref = cpu_attention.attention_reference(q, k, v, scale, extra_mask=extra_mask, **kw)
    torch.testing.assert_close(one_shot.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    for chunk in (1, 7):
        parts = []
        for a in range(0, t, chunk):
            b, lo = min(t, a + chunk), max(0, a - window + 1)
            parts.append(
                OPS.attention(q[a:b], k[lo:b], v[lo:b], scale, offset=lo, extra_mask=extra_mask[a:b], **kw)
            )
        assert torch.equal(torch.cat(parts), one_shot), chunk


def test_attention_bad_inputs_say_what_to_change() -> None:
    z = torch.zeros
    with pytest.raises(ValueError, match="fewer than the 4 queries"):
        OPS.prefill_attention(z(4, 2, 16), z(3, 2, 16), z(3, 2, 16), 1.0)
    with pytest.raises(ValueError, match="at least one cached row"):
        OPS.decode_attention(z(2, 16), z(0, 2, 16), z(0, 2, 16), 1.0)
    with pytest.raises(ValueError, match=r"extra_mask \(3, 2\) must be \(4, 5\)"):
        OPS.attention(
            z(4, 2, 16),
            z(4, 2, 16),
            z(4, 2, 16),
            1.0,
            extra_k=z(5, 2, 16),
            extra_v=z(5, 2, 16),
            extra_mask=z(3, 2),
        )


# --------------------------------------------------------------------------- gated delta rule


def _delta_inputs(
    dtype: torch.dtype, t: int = 14, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 24
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    return (
        _randn(g, t, hk, dk, dtype=dtype),
        _randn(g, t, hk, dk, dtype=dtype),
        _randn(g, t, hv, dv, dtype=dtype),
        -torch.rand(t, hv, generator=g),
        torch.rand(t, hv, generator=g).to(dtype),
        torch.randn(hv, dk, dv, generator=g) * 0.1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_rule_equal_in_one_call_chunks_and_token_by_token(dtype: torch.dtype) -> None:
    q, k, v, gate, beta, state = _delta_inputs(dtype)
    out, final = OPS.delta_rule_prefill(q, k, v, gate, beta, state)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, gate, beta, state)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=TOL[dtype], atol=TOL[dtype])
    torch.testing.assert_close(final, ref_state, rtol=1e-5, atol=1e-5)
    for chunk in (1, 7):
        s, parts = state, []
        for a in range(0, q.shape[0], chunk):
            sl = slice(a, a + chunk)
            fn = OPS.delta_rule_decode if chunk == 1 else OPS.delta_rule_prefill
            o, s = fn(q[sl], k[sl], v[sl], gate[sl], beta[sl], s)
            parts.append(o)
        assert torch.equal(torch.cat(parts), out) and torch.equal(s, final), chunk
    # Two sequences folded into the head dim of one call (qwen3_5's decode): each head's
    # bits equal its sequence's call alone.
    q2, k2, v2, g2, b2, s2 = (x.flip(0) for x in (q, k, v, gate, beta, state))
    o2, f2 = OPS.delta_rule_prefill(q2, k2, v2, g2, b2, s2)
    both, both_state = OPS.delta_rule_prefill(
        *(torch.cat(p, dim=1) for p in ((q, q2), (k, k2), (v, v2), (gate, g2), (beta, b2))),
        torch.cat([state, s2]),
    )
    assert torch.equal(both, torch.cat([out, o2], dim=1)) and torch.equal(both_state, torch.cat([final, f2]))


def test_delta_rule_control_old_chunked_prefill_differs_from_its_recurrence() -> None:
    q, k, v, gate, beta, state = _delta_inputs(torch.float32)
    chunked, _ = TRITON_OPS.delta_rule_prefill(q, k, v, gate, beta, state)
    serial, _ = TRITON_OPS.delta_rule_decode(q, k, v, gate, beta, state)
    torch.testing.assert_close(chunked, serial, rtol=1e-4, atol=1e-4)
    assert not torch.equal(chunked, serial)


# --------------------------------------------------------------------------- compiled, on a GPU

_GPU_SCRIPT = """
import torch
from keepwarm.kernels import reference
from keepwarm.kernels.ops import ops_for
ops = ops_for(torch.device("cuda"), invariant=True)
assert ops.name == "triton_invariant"
g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
    def r(*s):
        return torch.randn(*s, generator=g).to(dtype).cuda()
    x, w, b = r(300, 256), r(384, 256), r(384)
    solo = torch.cat([ops.linear(x[i : i + 1], w, b) for i in range(300)])
    for m in (1, 3, 17, 40, 64, 65, 300):
        assert torch.equal(ops.linear(x[:m], w, b), solo[:m]), ("linear", dtype, m)
    torch.testing.assert_close(solo.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()), rtol=tol, atol=tol * 16)
    q, k, v = r(70, 8, 128), r(70, 2, 128), r(70, 2, 128)
    one = ops.prefill_attention(q, k, v, 128**-0.5)
    torch.testing.assert_close(one, reference.prefill_attention(q, k, v, 128**-0.5), rtol=tol, atol=tol)
    for c in (1, 7, 70):
        parts = [ops.prefill_attention(q[a : a + c], k[: a + c], v[: a + c], 128**-0.5) for a in range(0, 70, c)]
        assert torch.equal(torch.cat(parts), one), ("prefill chunk", dtype, c)
    for i in range(70):
        assert torch.equal(ops.decode_attention(q[i], k[: i + 1], v[: i + 1], 128**-0.5), one[i]), ("decode", dtype, i)
    rows = [3, 31, 32, 69]  # one launch by address table, caches of different lengths
    batch = ops.decode_attention_batch(q[rows], [k[: i + 1] for i in rows], [v[: i + 1] for i in rows], 128**-0.5)
    assert all(torch.equal(batch[j], one[i]) for j, i in enumerate(rows)), ("decode batch", dtype)
    xs = r(33, 512)
    for f in (lambda t: ops.rms_norm(t, xs[0], 1e-6), lambda t: ops.softmax(t, -1)):
        full = f(xs)
        assert all(torch.equal(f(xs[i : i + 1])[0], full[i]) for i in range(33)), ("rowwise", dtype)
print("gpu ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU to compile the kernels")
def test_compiled_invariant_kernels_on_gpu(tmp_path: Path) -> None:
    # A fresh process without TRITON_INTERPRET, so the kernels are compiled, not interpreted.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "gpu_invariant.py"
    script.write_text(_GPU_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "gpu ok" in proc.stdout
