"""The fused decode step (kernels/cpu_decode_step.py) against its reference, the per-operation
path of models/dense.py on the same kernels: the same logits and the same K/V rows, bit for
bit, for bf16 and every kind of block weights, GQA / MQA, qwen2's biases and qwen3's q/k norms, one sequence
and a batch of sequences at different positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.dense import DenseBackend
from keepwarm.kernels import cpu_decode_step, cpu_linear
from keepwarm.kernels.invariance import SelfCheck, _CheckedStep
from keepwarm.kernels.ops import cpu_ops
from keepwarm.kernels.quant_weight import K_KINDS, QuantRows, cat_rows
from tests.kernels.quant_blocks import random_weight

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16)),
    "llama-mqa-mlp-bias": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, mlp_bias=True)),
    "qwen2-bias": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3-qk-norm": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # every projection's input a whole number of k-quant super-blocks
    "llama-256": (
        "llama",
        dict(
            hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64
        ),
    ),
}
WEIGHTS = ("bf16", "Q8_0", "Q4_0", "Q4_1")

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="no CPU kernels on this CPU (x86 AVX2 needed)"
)


def _backend(tmp: Path, case: str, weights: str) -> DenseBackend:
    model_type, extra = CASES[case]
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial biases and norms
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp)
    b = build_backend(open_checkpoint(tmp), torch.device("cpu"), torch.bfloat16, cpu_ops())
    assert isinstance(b, DenseBackend)
    if weights != "bf16":
        for i, layer in enumerate(b.layers):
            for j, name in enumerate(("w_qkv", "w_o", "w_gate_up", "w_down")):
                w = getattr(layer, name)
                if weights == "mixed":  # a Q4_K_M file's layer: q, k Q4_K and v Q6_K; the rest Q4_K
                    kv = (w.shape[0] - 256) // 2 if name == "w_qkv" else 0
                    q_k = random_weight("Q4_K", w.shape[0] - kv, w.shape[1], seed=4 * i + j)
                    parts = [q_k, random_weight("Q6_K", kv, w.shape[1], seed=9)] if kv else [q_k]
                    setattr(layer, name, cat_rows(parts, torch.bfloat16))
                else:
                    setattr(layer, name, random_weight(weights, *w.shape, seed=4 * i + j))  # type: ignore[arg-type]
        b._step = b._decode_step()
    return b


def _run(b: DenseBackend) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three sequences prefilled to different lengths, then batched and single decode steps:
    every step's logits and every cache row."""
    states = [b.new_state(64) for _ in range(3)]
    gen = torch.Generator().manual_seed(2)
    for s, n in zip(states, (2, 9, 30), strict=True):
        b.prefill(s, torch.randint(0, BASE["vocab_size"], (n,), generator=gen))
    logits = []
    for i in range(4):
        logits.append(b.step(states, [torch.tensor([3 + i]) for _ in states]))
        logits.append(b.decode(states[1], 5 + i))
        logits.append(b.step(states[::2], [torch.tensor([7 + i]), torch.tensor([8 + i])]))
    rows = [t[: s.position].clone() for s in states for t in s.tensors.values()]
    return logits, rows


@pytest.mark.parametrize(
    ("case", "weights"),
    [(c, w) for c in sorted(CASES) for w in WEIGHTS] + [("llama-256", k) for k in (*K_KINDS, "mixed")],
)
def test_fused_step_has_the_per_operation_bits(case: str, weights: str, tmp_path: Path) -> None:
    assert cpu_decode_step.available()
    b = _backend(tmp_path, case, weights)
    step = b._step
    assert isinstance(step, _CheckedStep)
    calls = {"per_op": 0}
    per_op = b._qkv

    def counting(*args: Any) -> Any:
        calls["per_op"] += 1
        return per_op(*args)

    b._qkv = counting  # type: ignore[method-assign]
    if weights == "mixed":
        assert isinstance(b.layers[0].w_qkv, QuantRows)
    fused_logits, fused_rows = _run(b)
    # the prefills (3 sequences x 2 layers) and the self-check's first decode step per op
    assert calls["per_op"] == 3 * 2 + 2
    b._step = None
    want_logits, want_rows = _run(b)
    assert len(fused_logits) == len(want_logits) == 12
    for got, want in zip(fused_logits, want_logits, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(fused_rows, want_rows, strict=True):
        assert torch.equal(got, want)


def test_the_self_check_gates_the_fused_step(tmp_path: Path) -> None:
    """The first step runs per operation (it probes the kernels at these shapes); a refused
    self-check keeps every later step there."""
    b = _backend(tmp_path, "llama-gqa", "Q8_0")
    step = b._step
    assert isinstance(step, _CheckedStep)
    state = b.new_state(16)
    b.prefill(state, torch.tensor([1, 2, 3]))
    x = torch.zeros(1, BASE["hidden_size"], dtype=torch.bfloat16)
    cos, sin = b.rope.cos_sin(state.position, 1, torch.bfloat16)
    args = (x, cos, sin, b.state_addresses(state), [state.position])
    assert step.run(*args) is None
    out = step.run(*args)
    assert out is not None and out.shape == (1, BASE["hidden_size"]) and out.dtype == torch.bfloat16
    check = step.check
    assert isinstance(check, SelfCheck)
    check.refused = "a probe failed"
    try:
        assert step.run(*args) is None
    finally:
        check.refused = None


def test_no_fused_step_where_it_does_not_apply(tmp_path: Path) -> None:
    """float32 activations, or a projection in a form the step has no product for: None, and
    the per-operation path runs."""
    b = _backend(tmp_path, "qwen2-bias", "bf16")
    assert b._step is not None
    fp32 = build_backend(open_checkpoint(tmp_path), torch.device("cpu"), torch.float32, cpu_ops())
    assert isinstance(fp32, DenseBackend) and fp32._step is None
    b.layers[1].w_o = b.layers[1].w_o.float()  # type: ignore[union-attr]
    assert b._decode_step() is None
