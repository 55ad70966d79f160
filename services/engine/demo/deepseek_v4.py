"""The deepseek_v4 family's random-weight demo (demo_model.py --family deepseek_v4): a
config.json for a size, and deterministic weights under the checkpoint's names."""

from __future__ import annotations

import torch

from keepwarm.engine.demo.draws import Draws
from keepwarm.engine.models.deepseek_v4_config import DeepseekV4Config
from keepwarm.engine.models.deepseek_v4_weights import expert_names, weight_specs


def demo_config(size: str) -> dict[str, object]:
    """A full config.json for a random-weight DeepSeek V4 demo model (transformers loads it).
    "small": 6 layers (2 HCA, then CSA/HCA interleaved, as V4 does), rates scaled down to
    CSA 4 / HCA 16 and a 64-token window, so prompts of a few hundred tokens cross many
    blocks of every compressed layer; "tiny": for tests."""
    if size == "small":
        dims: dict[str, object] = dict(
            vocab_size=32768, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=6,
            num_attention_heads=8, head_dim=64, q_lora_rank=128, o_groups=4, o_lora_rank=64,
            n_routed_experts=8, num_experts_per_tok=2, index_n_heads=4, index_head_dim=32, index_topk=32,
            sliding_window=64, hc_mult=4,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        )  # fmt: skip
        layer_types = [
            "heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
            "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
        ]  # fmt: skip
        mlp_types = ["hash_moe"] * 2 + ["moe"] * 4
    elif size == "tiny":
        dims = dict(
            vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
            n_routed_experts=4, num_experts_per_tok=2, index_n_heads=4, index_head_dim=16, index_topk=4,
            sliding_window=8, hc_mult=2,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        )  # fmt: skip
        layer_types = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]
        mlp_types = ["hash_moe", "moe", "moe"]
    else:
        raise ValueError(f"demo size {size!r} is unknown (use 'small' or 'tiny')")
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **dims,
        "num_key_value_heads": 1,
        "partial_rotary_factor": 0.25,
        "layer_types": layer_types,
        "mlp_layer_types": mlp_types,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "max_position_embeddings": 65536,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": "bfloat16",
    }


def init_weights(config: dict[str, object], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights under save_pretrained names for `config` (a demo_config dict):
    bf16 throughout except `tid2eid` (int64). Projections N(0, initializer_range), residual
    outputs scaled by 1/sqrt(2 * layers), embeddings N(0, 1), norms and mHC scales 1, mHC
    bases and sinks 0, compressor position biases N(0, 0.1), hash routes a random distinct
    set of experts per token."""
    cfg = DeepseekV4Config.from_dict(dict(config))
    draws = Draws(config, seed, cfg.num_layers)
    normal, std, out_std = draws.normal, draws.std, draws.out_std
    bf = torch.bfloat16

    wts: dict[str, torch.Tensor] = {}
    for spec in weight_specs(cfg):
        name, shape = spec.names[0], spec.shape
        if spec.init == "normal":
            wts[name] = normal(shape, std)
        elif spec.init == "out":
            wts[name] = normal(shape, out_std)
        elif spec.init == "embed":
            wts[name] = normal(shape, 1.0)
        elif spec.init == "small":
            wts[name] = normal(shape, 0.1)
        elif spec.init == "ones":
            wts[name] = torch.ones(shape, dtype=bf)
        elif spec.init == "zeros":
            wts[name] = torch.zeros(shape, dtype=bf)
        else:
            assert spec.init == "tid2eid", spec.init
            rows = [
                torch.randperm(cfg.n_routed_experts, generator=draws.gen)[: shape[1]] for _ in range(shape[0])
            ]
            wts[name] = torch.stack(rows).to(torch.int64)
    inter, hid = cfg.moe_intermediate_size, cfg.hidden_size
    for i in range(cfg.num_layers):
        for x in range(cfg.n_routed_experts):
            names = expert_names(i, x)
            wts[names["w1"][0]] = normal((inter, hid), std)
            wts[names["w3"][0]] = normal((inter, hid), std)
            wts[names["w2"][0]] = normal((hid, inter), out_std)
    return wts
