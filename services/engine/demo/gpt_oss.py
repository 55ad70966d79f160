"""The gpt_oss family's random-weight demo (demo_model.py --family gpt_oss): a config.json for a size,
and deterministic weights under save_pretrained's names."""

from __future__ import annotations

from typing import Any

import torch

from keepwarm.engine.demo.draws import Draws, ones
from keepwarm.engine.demo.sizes import by_size
from keepwarm.engine.models.gpt_oss import DEFAULT_ROPE, FULL, SLIDING, GptOssConfig


def demo_config(size: str) -> dict[str, Any]:
    """A full config.json for a random-weight demo (transformers can load the folder):
    alternating sliding (window 128) and full attention with sinks, top-2 of 8 experts.
    "small" for the stack and benches, "tiny" for tests."""
    dims = by_size(
        size,
        small=dict(
            vocab_size=16384, hidden_size=768, intermediate_size=768, num_hidden_layers=8,
            num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_local_experts=8,
            num_experts_per_tok=2,
        ),
        tiny=dict(
            vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2,
        ),
    )  # fmt: skip
    n = int(dims["num_hidden_layers"])
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        **dims,
        "layer_types": [SLIDING if (i + 1) % 2 else FULL for i in range(n)],
        "sliding_window": 128 if size == "small" else 16,
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_parameters": dict(DEFAULT_ROPE),
        "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "bfloat16",
    }


def init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights under save_pretrained's names for `config`: matrices
    N(0, initializer_range), residual-output projections scaled by 1/sqrt(2 * layers), small
    random biases and sinks, norms 1."""
    cfg = GptOssConfig.from_dict(config)
    draws = Draws(config, seed, cfg.num_layers)
    normal, std, out_std = draws.normal, draws.std, draws.out_std
    hid, d, e_n, inter = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.intermediate_size

    wts: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((cfg.vocab_size, hid), std)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sa, mp = p + "self_attn.", p + "mlp."
        for name, rows in (
            ("q", cfg.num_heads * d),
            ("k", cfg.num_kv_heads * d),
            ("v", cfg.num_kv_heads * d),
        ):
            wts[sa + f"{name}_proj.weight"] = normal((rows, hid), std)
            wts[sa + f"{name}_proj.bias"] = normal((rows,), std)
        wts[sa + "o_proj.weight"] = normal((hid, cfg.num_heads * d), out_std)
        wts[sa + "o_proj.bias"] = normal((hid,), std)
        wts[sa + "sinks"] = normal((cfg.num_heads,), 1.0)
        wts[mp + "router.weight"] = normal((e_n, hid), std)
        wts[mp + "router.bias"] = normal((e_n,), std)
        wts[mp + "experts.gate_up_proj"] = normal((e_n, hid, 2 * inter), std)
        wts[mp + "experts.gate_up_proj_bias"] = normal((e_n, 2 * inter), std)
        wts[mp + "experts.down_proj"] = normal((e_n, inter, hid), out_std)
        wts[mp + "experts.down_proj_bias"] = normal((e_n, hid), std)
        wts[p + "input_layernorm.weight"] = ones(hid)
        wts[p + "post_attention_layernorm.weight"] = ones(hid)
    wts["model.norm.weight"] = ones(hid)
    if not cfg.tie_word_embeddings:
        wts["lm_head.weight"] = normal((cfg.vocab_size, hid), std)
    return wts
