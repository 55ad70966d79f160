"""The qwen3_5 family's random-weight demo (demo_model.py --family qwen3_5): a config.json for a size,
and deterministic weights under save_pretrained's names."""

from __future__ import annotations

import math
from typing import Any

import torch

from keepwarm.engine.demo.draws import Draws
from keepwarm.engine.demo.sizes import by_size
from keepwarm.engine.models.qwen3_5 import FULL, LINEAR, Qwen35Config


def demo_config(size: str) -> dict[str, Any]:
    """A full config.json for a random-weight demo model (transformers can load the folder).
    "small": ~110M params, 12 layers with 3 linear : 1 full attention; "tiny": for tests."""
    dims = by_size(
        size,
        small=dict(
            vocab_size=32768, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128,
            linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        ),
        tiny=dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        ),
    )  # fmt: skip
    n = int(dims["num_hidden_layers"])
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        **dims,
        "layer_types": [LINEAR if (i + 1) % 4 else FULL for i in range(n)],
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "bfloat16",
    }


def init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights under transformers' names for `config` (a demo_config dict):
    projections N(0, initializer_range), residual-output projections scaled down by
    sqrt(2 * layers), zero-centred norms at 0 (scale 1), gated-norm weights 1,
    A_log = log(U(1, 16)), dt_bias 1 (transformers' own initialization)."""
    cfg = Qwen35Config.from_dict(config)
    draws = Draws(config, seed, cfg.num_layers)
    normal, std, out_std = draws.normal, draws.std, draws.out_std
    hid, d, inter, hv = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.linear_num_value_heads

    def const(shape: tuple[int, ...], value: float) -> torch.Tensor:
        return torch.full(shape, value, dtype=torch.bfloat16)

    wts: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((cfg.vocab_size, hid), std)}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}."
        if kind == LINEAR:
            la = p + "linear_attn."
            wts[la + "in_proj_qkv.weight"] = normal((cfg.conv_dim, hid), std)
            wts[la + "in_proj_z.weight"] = normal((cfg.value_dim, hid), std)
            wts[la + "in_proj_b.weight"] = normal((hv, hid), std)
            wts[la + "in_proj_a.weight"] = normal((hv, hid), std)
            wts[la + "conv1d.weight"] = normal(
                (cfg.conv_dim, 1, cfg.conv_kernel), 1.0 / math.sqrt(cfg.conv_kernel)
            )
            a = torch.empty(hv).uniform_(1.0, 16.0, generator=draws.gen)
            wts[la + "A_log"] = a.log().to(torch.bfloat16)
            wts[la + "dt_bias"] = const((hv,), 1.0)
            wts[la + "norm.weight"] = const((cfg.linear_value_head_dim,), 1.0)
            wts[la + "out_proj.weight"] = normal((hid, cfg.value_dim), out_std)
        else:
            sa = p + "self_attn."
            kv = cfg.num_kv_heads * d
            wts[sa + "q_proj.weight"] = normal((cfg.num_heads * d * 2, hid), std)
            wts[sa + "k_proj.weight"] = normal((kv, hid), std)
            wts[sa + "v_proj.weight"] = normal((kv, hid), std)
            wts[sa + "o_proj.weight"] = normal((hid, cfg.num_heads * d), out_std)
            wts[sa + "q_norm.weight"] = const((d,), 0.0)
            wts[sa + "k_norm.weight"] = const((d,), 0.0)
        wts[p + "input_layernorm.weight"] = const((hid,), 0.0)
        wts[p + "post_attention_layernorm.weight"] = const((hid,), 0.0)
        wts[p + "mlp.gate_proj.weight"] = normal((inter, hid), std)
        wts[p + "mlp.up_proj.weight"] = normal((inter, hid), std)
        wts[p + "mlp.down_proj.weight"] = normal((hid, inter), out_std)
    wts["model.norm.weight"] = const((hid,), 0.0)
    if not cfg.tie_word_embeddings:
        wts["lm_head.weight"] = normal((cfg.vocab_size, hid), std)
    return wts
