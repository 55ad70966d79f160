"""Every config.json field of every family is implemented or refused at load with an error
naming it (issue 16: qwen2 `use_sliding_window` and qwen3_5 `attention_bias` loaded and
computed wrong logits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from keepwarm.engine.demo.deepseek_v4 import demo_config
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.deepseek_v4_config import DeepseekV4Config
from keepwarm.engine.models.dense import HONOURED_FIELDS, NO_MATH_FIELDS, DenseConfig
from keepwarm.engine.models.qwen3_5 import Qwen35Config
from keepwarm.kernels.ops import TORCH_OPS

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
CPU = torch.device("cpu")


def _save(tmp: Path, model_type: str, **extra: Any) -> Any:
    cfg = transformers.AutoConfig.for_model(model_type, **BASE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.5)
    model.save_pretrained(tmp)
    return model


def _build(path: Path) -> Any:
    return build_backend(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)


def _logits_match(ref: Any, ours: Any, n: int = 24) -> None:
    tokens = torch.randint(0, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(tokens[None]).logits[0, -1].float()
    state = ours.new_state(64)
    got = ours.prefill(state, tokens)
    torch.testing.assert_close(got.reshape(-1), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_sliding_window_is_refused_naming_the_field(tmp_path: Path, model_type: str) -> None:
    _save(tmp_path, model_type, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        _build(tmp_path)


def test_sliding_window_on_no_layer_is_plain_attention(tmp_path: Path) -> None:
    # max_window_layers >= num_hidden_layers: transformers makes every layer full attention
    ref = _save(tmp_path, "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=2)
    _logits_match(ref, _build(tmp_path))


def test_layer_types_other_than_full_attention_are_refused() -> None:
    cfg = {"model_type": "qwen3", **BASE, "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(CheckpointError, match="layer_types"):
        DenseConfig.from_dict(cfg)
    with pytest.raises(CheckpointError, match="hidden_act"):
        DenseConfig.from_dict({"model_type": "llama", **BASE, "hidden_act": "gelu"})
    with pytest.raises(CheckpointError, match="mlp_bias"):
        DenseConfig.from_dict({"model_type": "qwen3", **BASE, "mlp_bias": True})
    with pytest.raises(CheckpointError, match="quantization_config"):
        DenseConfig.from_dict({"model_type": "llama", **BASE, "quantization_config": {"quant_method": "fp8"}})


def test_llama_attention_and_mlp_bias_are_implemented(tmp_path: Path) -> None:
    ref = _save(tmp_path, "llama", attention_bias=True, mlp_bias=True)
    _logits_match(ref, _build(tmp_path))


def test_bias_tensors_the_config_does_not_ask_for_are_ignored_like_transformers(tmp_path: Path) -> None:
    # a llama checkpoint carrying bias tensors while attention_bias is false: transformers
    # ignores them (unexpected keys), so must the engine
    with_bias = tmp_path / "b"
    _save(with_bias, "llama", attention_bias=True)
    cfg = open_checkpoint(with_bias).config
    (with_bias / "config.json").write_text(__import__("json").dumps({**cfg, "attention_bias": False}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(with_bias, torch_dtype=torch.float32).eval()
    _logits_match(ref, _build(with_bias))


def test_qwen3_5_attention_bias_is_refused_naming_the_field(tmp_path: Path) -> None:
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, attention_bias=True,
    )  # fmt: skip
    transformers.Qwen3_5ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="attention_bias"):
        _build(tmp_path)
    raw = open_checkpoint(tmp_path).config
    with pytest.raises(CheckpointError, match="quantization_config"):
        Qwen35Config.from_dict({**raw, "attention_bias": False, "quantization_config": {"x": 1}})


def test_deepseek_v4_mlp_bias_is_refused_naming_the_field() -> None:
    cfg = demo_config("tiny")
    DeepseekV4Config.from_dict(dict(cfg))  # the demo config itself loads
    with pytest.raises(CheckpointError, match="mlp_bias"):
        DeepseekV4Config.from_dict({**cfg, "mlp_bias": True})


@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen2Config", "Qwen3Config"])
def test_every_transformers_field_of_the_dense_family_is_classified(name: str) -> None:
    # a new field in transformers must be implemented, refused or declared math-free here
    fields = set(getattr(transformers, name).__annotations__)
    assert fields - HONOURED_FIELDS - NO_MATH_FIELDS == set()
