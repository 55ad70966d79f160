"""The laguna family's random-weight demo (demo_model.py --family laguna): a config.json for a size,
and deterministic weights under save_pretrained's names."""

from __future__ import annotations

from typing import Any

import torch

from keepwarm.engine.demo.draws import Draws, ones
from keepwarm.engine.demo.sizes import by_size
from keepwarm.engine.models.laguna import DEFAULT_ROPE, DENSE, FULL, SLIDING, SPARSE, LagunaConfig


def demo_config(size: str) -> dict[str, Any]:
    """A full config.json for a random-weight demo (transformers can load the folder):
    3 sliding (window 128) : 1 full attention, per-layer head counts, a dense first MLP then
    MoE with a shared expert. "small" for the stack and benches, "tiny" for tests."""
    dims = by_size(
        size,
        small=dict(
            vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
            num_attention_heads=12, num_key_value_heads=4, head_dim=64, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        ),
        tiny=dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        ),
    )  # fmt: skip
    n = int(dims["num_hidden_layers"])
    heads = int(dims["num_attention_heads"])
    kv = int(dims["num_key_value_heads"])
    return {
        "architectures": ["LagunaForCausalLM"],
        "model_type": "laguna",
        **dims,
        "layer_types": [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(n)],
        "sliding_window": 128 if size == "small" else 16,
        "num_attention_heads_per_layer": [heads if i % 2 == 0 else heads - kv for i in range(n)],
        "mlp_layer_types": [DENSE] + [SPARSE] * (n - 1),
        "gating": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "rope_parameters": {t: dict(p) for t, p in DEFAULT_ROPE.items()},
        "moe_routed_scaling_factor": 1.0,
        "moe_apply_router_weight_on_input": False,
        "moe_router_logit_softcapping": 0.0,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "bfloat16",
    }


def init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic bf16 weights under save_pretrained's names for `config`: projections
    N(0, initializer_range), residual-output projections scaled by 1/sqrt(2 * layers), norms 1,
    zero selection bias."""
    cfg = LagunaConfig.from_dict(config)
    draws = Draws(config, seed, cfg.num_layers)
    normal, std, out_std = draws.normal, draws.std, draws.out_std
    hid, d, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads

    def mlp(p: str, inter: int) -> None:
        wts[p + "gate_proj.weight"] = normal((inter, hid), std)
        wts[p + "up_proj.weight"] = normal((inter, hid), std)
        wts[p + "down_proj.weight"] = normal((hid, inter), out_std)

    wts: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((cfg.vocab_size, hid), std)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sa = p + "self_attn."
        hq = cfg.heads_per_layer[i]
        wts[sa + "q_proj.weight"] = normal((hq * d, hid), std)
        wts[sa + "k_proj.weight"] = normal((hkv * d, hid), std)
        wts[sa + "v_proj.weight"] = normal((hkv * d, hid), std)
        wts[sa + "g_proj.weight"] = normal((hq if cfg.gate_per_head else hq * d, hid), std)
        wts[sa + "o_proj.weight"] = normal((hid, hq * d), out_std)
        wts[sa + "q_norm.weight"] = ones(d)
        wts[sa + "k_norm.weight"] = ones(d)
        wts[p + "input_layernorm.weight"] = ones(hid)
        wts[p + "post_attention_layernorm.weight"] = ones(hid)
        mp = p + "mlp."
        if cfg.mlp_layer_types[i] == DENSE:
            mlp(mp, cfg.intermediate_size)
        else:
            wts[mp + "gate.weight"] = normal((cfg.num_experts, hid), std)
            wts[mp + "experts.e_score_correction_bias"] = torch.zeros(cfg.num_experts, dtype=torch.bfloat16)
            for e in range(cfg.num_experts):
                mlp(f"{mp}experts.{e}.", cfg.moe_intermediate_size)
            mlp(mp + "shared_expert.", cfg.shared_expert_intermediate_size)
    wts["model.norm.weight"] = ones(hid)
    if not cfg.tie_word_embeddings:
        wts["lm_head.weight"] = normal((cfg.vocab_size, hid), std)
    return wts
