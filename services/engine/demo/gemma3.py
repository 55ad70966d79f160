"""The gemma3 family's random-weight demo (demo_model.py --family gemma3): a config.json for a size,
and deterministic weights under save_pretrained's names."""

from __future__ import annotations

from typing import Any

import torch

from keepwarm.engine.demo.draws import Draws
from keepwarm.engine.demo.sizes import by_size
from keepwarm.engine.models.gemma3 import FULL, GELU_TANH, SLIDING, Gemma3Config


def demo_config(size: str) -> dict[str, Any]:
    """A full config.json for a random-weight demo (transformers can load the folder): five
    local (window 512 / 16) to one global layer, Gemma 3 270M's shape for "small", a tiny one
    for tests."""
    dims = by_size(
        size,
        small=dict(
            vocab_size=16384, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
            num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=512,
        ),
        tiny=dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            sliding_window=16,
        ),
    )  # fmt: skip
    n = int(dims["num_hidden_layers"])
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **dims,
        "layer_types": [SLIDING if (i + 1) % 6 else FULL for i in range(n)],
        "hidden_activation": GELU_TANH,
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": True,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
            FULL: {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "bfloat16",
    }


def init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights under save_pretrained's names for `config`: matrices
    N(0, initializer_range), residual-output projections scaled by 1/sqrt(2 * layers), the
    embedding N(0, 1 / sqrt(hidden)) (it is scaled by sqrt(hidden) at the input), norm weights
    small around 0 (Gemma's norm multiplies by 1 + weight)."""
    cfg = Gemma3Config.from_dict(config)
    draws = Draws(config, seed, cfg.num_layers)
    normal, std, out_std = draws.normal, draws.std, draws.out_std
    hid, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size

    wts: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((cfg.vocab_size, hid), hid**-0.5)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sa, mp = p + "self_attn.", p + "mlp."
        wts[sa + "q_proj.weight"] = normal((cfg.num_heads * d, hid), std)
        wts[sa + "k_proj.weight"] = normal((cfg.num_kv_heads * d, hid), std)
        wts[sa + "v_proj.weight"] = normal((cfg.num_kv_heads * d, hid), std)
        wts[sa + "o_proj.weight"] = normal((hid, cfg.num_heads * d), out_std)
        wts[sa + "q_norm.weight"] = normal((d,), 0.1)
        wts[sa + "k_norm.weight"] = normal((d,), 0.1)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            wts[f"{p}{name}_layernorm.weight"] = normal((hid,), 0.1)
        wts[mp + "gate_proj.weight"] = normal((inter, hid), std)
        wts[mp + "up_proj.weight"] = normal((inter, hid), std)
        wts[mp + "down_proj.weight"] = normal((hid, inter), out_std)
    wts["model.norm.weight"] = normal((hid,), 0.1)
    if not cfg.tie_word_embeddings:
        wts["lm_head.weight"] = normal((cfg.vocab_size, hid), std)
    return wts
