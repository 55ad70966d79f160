"""The gated delta rule: chunked == token-by-token, both == transformers' Qwen3.5 functions,
and the Triton kernels, recurrent and chunked (under the interpreter, see conftest.py),
== the torch references."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (conftest sets it too)

import pytest
import torch
import torch.nn.functional as F

from keepwarm.kernels.delta_rule import (
    TORCH_DELTA_RULE,
    TRITON_DELTA_RULE,
    chunk_gated_delta_rule,
    delta_rule_for,
    recurrent_gated_delta_rule,
    triton_chunk_gated_delta_rule,
    triton_gated_delta_rule,
)


def _inputs(
    t: int, hk: int, hv: int, dk: int, dv: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=gen).to(dtype)
    k = torch.randn(t, hk, dk, generator=gen).to(dtype)
    v = torch.randn(t, hv, dv, generator=gen).to(dtype)
    a = torch.randn(t, hv, generator=gen)
    g = -torch.rand(hv, generator=gen).mul(4).add(0.1)[None, :] * F.softplus(a + 1.0)  # log decay < 0
    beta = torch.rand(t, hv, generator=gen).to(dtype)
    state = torch.randn(hv, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("t", "chunk"), [(1, 64), (5, 64), (64, 64), (70, 64), (37, 8), (16, 4)])
def test_chunked_equals_recurrent(t: int, chunk: int) -> None:
    q, k, v, g, beta, state = _inputs(t, hk=2, hv=4, dk=16, dv=8, seed=t)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert out_c.shape == (t, 4, 8) and s_c.shape == (4, 16, 8)
    assert out_c.dtype == torch.float32 and s_c.dtype == torch.float32
    assert (out_c - out_r).abs().max().item() < 1e-5
    assert (s_c - s_r).abs().max().item() < 1e-5


def test_state_input_is_not_written() -> None:
    q, k, v, g, beta, state = _inputs(9, hk=2, hv=2, dk=8, dv=8, seed=3)
    before = state.clone()
    fns = (
        chunk_gated_delta_rule,
        recurrent_gated_delta_rule,
        triton_gated_delta_rule,
        triton_chunk_gated_delta_rule,
    )
    for fn in fns:
        fn(q, k, v, g, beta, state)
        assert torch.equal(state, before), fn.__name__


def test_split_sequence_carries_state() -> None:
    """Running 0..t1 then t1..t (state handed over) equals one run: what chunked prefill relies on."""
    q, k, v, g, beta, state = _inputs(50, hk=1, hv=2, dk=16, dv=16, seed=11)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, state)
    o1, s1 = chunk_gated_delta_rule(q[:13], k[:13], v[:13], g[:13], beta[:13], state)
    o2, s2 = chunk_gated_delta_rule(q[13:], k[13:], v[13:], g[13:], beta[13:], s1)
    assert (torch.cat([o1, o2]) - out).abs().max().item() < 1e-5
    assert (s2 - s).abs().max().item() < 1e-5


def test_matches_transformers_functions() -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    q, k, v, g, beta, state = _inputs(40, hk=2, hv=4, dk=16, dv=8, seed=5)
    ref_c, ref_sc = hf.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        initial_state=state[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    ref_r, ref_sr = hf.torch_recurrent_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=g[None],
        beta=beta[None],
        initial_state=state[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert (out_c - ref_c[0]).abs().max().item() < 1e-6
    assert (s_c - ref_sc[0]).abs().max().item() < 1e-6
    assert (out_r - ref_r[0]).abs().max().item() < 1e-6
    assert (s_r - ref_sr[0]).abs().max().item() < 1e-6


@pytest.mark.parametrize(
    ("t", "hk", "hv", "dk", "dv"),
    [(1, 2, 4, 16, 8), (7, 2, 4, 16, 8), (12, 1, 3, 12, 10), (5, 2, 2, 8, 96)],
)
def test_triton_matches_reference(t: int, hk: int, hv: int, dk: int, dv: int) -> None:
    """Non-power-of-two head dims exercise the masks; dv 96 spans two V blocks."""
    q, k, v, g, beta, state = _inputs(t, hk, hv, dk, dv, seed=100 + t)
    out_t, s_t = triton_gated_delta_rule(q, k, v, g, beta, state)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert out_t.shape == out_r.shape and s_t.shape == s_r.shape
    assert (out_t - out_r).abs().max().item() < 1e-5
    assert (s_t - s_r).abs().max().item() < 1e-5


def test_bf16_inputs_keep_float32_state() -> None:
    q, k, v, g, beta, state = _inputs(20, hk=2, hv=4, dk=16, dv=8, seed=9, dtype=torch.bfloat16)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert out_c.dtype == torch.bfloat16 and s_c.dtype == torch.float32
    assert (out_c.float() - out_r.float()).abs().max().item() < 2e-2
    assert (s_c - s_r).abs().max().item() < 1e-4


def test_selection() -> None:
    assert delta_rule_for(torch.device("cpu")) is TORCH_DELTA_RULE
    assert delta_rule_for(torch.device("cpu"), use_triton=True) is TRITON_DELTA_RULE
    assert delta_rule_for(torch.device("cuda"), use_triton=False) is TORCH_DELTA_RULE
    assert TRITON_DELTA_RULE.prefill is triton_chunk_gated_delta_rule
    assert TRITON_DELTA_RULE.decode is triton_gated_delta_rule


@pytest.mark.parametrize(
    ("t", "hk", "hv", "dk", "dv", "chunk"),
    [
        (1, 2, 4, 16, 16, 16),  # one token
        (5, 1, 2, 24, 16, 64),  # shorter than one chunk, non-power-of-two Dk
        (37, 2, 4, 16, 24, 16),  # ragged last chunk, non-power-of-two Dv
        (64, 1, 3, 32, 32, 64),  # exactly one chunk
        (70, 2, 4, 24, 32, 32),  # ragged, three chunks
        (40, 1, 2, 16, 96, 16),  # Dv spans two V blocks
    ],
)
def test_triton_chunk_matches_references(t: int, hk: int, hv: int, dk: int, dv: int, chunk: int) -> None:
    q, k, v, g, beta, state = _inputs(t, hk, hv, dk, dv, seed=200 + t)
    before = state.clone()
    out_t, s_t = triton_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    out_c, s_c = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(state, before)
    assert out_t.shape == (t, hv, dv) and s_t.shape == (hv, dk, dv)
    assert out_t.dtype == torch.float32 and s_t.dtype == torch.float32
    assert (out_t - out_c).abs().max().item() < 1e-4
    assert (s_t - s_c).abs().max().item() < 1e-4
    assert (out_t - out_r).abs().max().item() < 1e-4
    assert (s_t - s_r).abs().max().item() < 1e-4


def test_triton_chunk_bf16_inputs() -> None:
    q, k, v, g, beta, state = _inputs(45, hk=2, hv=4, dk=24, dv=16, seed=21, dtype=torch.bfloat16)
    out_t, s_t = triton_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert out_t.dtype == torch.bfloat16 and s_t.dtype == torch.float32
    assert (out_t.float() - out_r.float()).abs().max().item() < 2e-2
    assert (s_t - s_r).abs().max().item() < 1e-4


def test_triton_chunk_strong_decay_stays_finite() -> None:
    """Per-token log decays near -30: exp(cum) underflows to 0 within a chunk, as in the
    reference; nothing may overflow into inf/nan."""
    q, k, v, g, beta, state = _inputs(40, hk=1, hv=2, dk=16, dv=16, seed=8)
    g = g * 30.0 / g.abs().max()
    out_t, s_t = triton_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=32)
    out_r, s_r = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert bool(torch.isfinite(out_t).all()) and bool(torch.isfinite(s_t).all())
    assert (out_t - out_r).abs().max().item() < 1e-4
    assert (s_t - s_r).abs().max().item() < 1e-4


def test_triton_chunk_split_sequence_carries_state() -> None:
    q, k, v, g, beta, state = _inputs(50, hk=1, hv=2, dk=16, dv=16, seed=12)
    out, s = triton_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    o1, s1 = triton_chunk_gated_delta_rule(q[:13], k[:13], v[:13], g[:13], beta[:13], state, chunk_size=16)
    o2, s2 = triton_chunk_gated_delta_rule(q[13:], k[13:], v[13:], g[13:], beta[13:], s1, chunk_size=16)
    assert (torch.cat([o1, o2]) - out).abs().max().item() < 1e-4
    assert (s2 - s).abs().max().item() < 1e-4


@pytest.mark.parametrize("chunk", [8, 48])
def test_triton_chunk_rejects_bad_chunk_size(chunk: int) -> None:
    q, k, v, g, beta, state = _inputs(4, hk=1, hv=1, dk=16, dv=16, seed=1)
    with pytest.raises(ValueError, match="power of two >= 16"):
        triton_chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=chunk)
