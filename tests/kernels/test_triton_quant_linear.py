"""The GPU block product (kernels/triton_quant_linear.py), under the Triton interpreter on CPU
tensors (tests/kernels/conftest.py) and, `gpu`-marked, on a lent device: for every kind, the
product with the exact weights to fp32 rounding, and a row's bits whatever the call's rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from keepwarm.kernels import triton_quant_linear
from keepwarm.kernels.quant_weight import K_KINDS, KINDS, QuantKind
from tests.kernels.quant_blocks import random_weight


def _k(kind: QuantKind) -> int:
    return 256 if kind in K_KINDS else 96


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_exact_weights_product_and_row_invariance(
    kind: QuantKind, dtype: torch.dtype, device: str
) -> None:
    k = _k(kind)
    w = random_weight(kind, 70, k, seed=3).to(device)  # 70: a ragged last column tile
    g = torch.Generator().manual_seed(4)
    x = torch.randn(19, k, generator=g).to(dtype).to(device)  # 19: a ragged last row tile
    bias = torch.randn(70, generator=g).to(dtype).to(device)
    y = triton_quant_linear.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (19, 70)
    exact = torch.nn.functional.linear(x.double(), w.dequantize().double().to(device), bias.double())
    scale = x.double().abs() @ w.dequantize().double().abs().T.to(device) + bias.double().abs()
    # fp32 sums of exact products, then (bf16) one rounding of the output
    bound = scale * 1e-6 + (exact.abs() * 2.0**-8 if dtype == torch.bfloat16 else 0)
    assert bool(((y.double() - exact).abs() <= bound).all())
    for a, b in ((0, 1), (3, 4), (0, 16), (5, 19), (16, 19)):
        assert torch.equal(triton_quant_linear.linear(x[a:b], w, bias), y[a:b]), (a, b)
    assert torch.equal(triton_quant_linear.linear(x[None, 2:7], w, bias)[0], y[2:7])  # leading dims


def test_refusals_name_what_to_change() -> None:
    w = random_weight("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="last dim 32 must be the weight's K 64"):
        triton_quant_linear.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="bias must be"):
        triton_quant_linear.linear(torch.randn(2, 64), w, torch.zeros(8, dtype=torch.bfloat16))


def test_the_gpu_bundles_multiply_blocks_with_it() -> None:
    from keepwarm.kernels.triton_invariant import TRITON_INVARIANT_OPS
    from keepwarm.kernels.triton_ops import TRITON_OPS

    assert TRITON_INVARIANT_OPS.quant_linear is TRITON_OPS.quant_linear is triton_quant_linear.linear


def test_a_block_model_on_the_triton_bundle_is_chunk_invariant(tmp_path: Path) -> None:
    """A dense model whose projections are Q4_K / Q6_K / Q8_0 / Q5_0 blocks, on the invariant
    Triton bundle (interpreted here): a one-shot prefill, a chunked one and token-by-token
    decoding give the same logits, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from keepwarm.engine.loading.checkpoint import open_checkpoint
    from keepwarm.engine.models import build_backend
    from keepwarm.kernels.triton_invariant import TRITON_INVARIANT_OPS

    cfg = transformers.AutoConfig.for_model(
        "llama", vocab_size=101, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    b = build_backend(open_checkpoint(tmp_path), torch.device("cpu"), torch.bfloat16, TRITON_INVARIANT_OPS)
    layer = b.layers[0]
    for name, kind in (("w_qkv", "Q4_K"), ("w_o", "Q6_K"), ("w_gate_up", "Q8_0"), ("w_down", "Q5_0")):
        setattr(layer, name, random_weight(kind, *getattr(layer, name).shape, seed=len(name)))
    tokens = torch.tensor([5, 17, 3, 99, 42, 8, 61, 2])
    one = b.forward(b.new_state(16), tokens, all_logits=True)
    st = b.new_state(16)
    chunked = torch.cat(
        [b.forward(st, tokens[:3], all_logits=True), b.forward(st, tokens[3:], all_logits=True)]
    )
    st = b.new_state(16)
    stepped = torch.cat([b.forward(st, tokens[i : i + 1]) for i in range(len(tokens))])
    assert torch.equal(one, chunked) and torch.equal(one, stepped)
    assert torch.isfinite(one).all()
