"""A GGUF file as a checkpoint: a Hugging Face-shaped config built from its metadata and its
tensors under the Hugging Face names the model families load, dequantized on load.

The mapping follows llama.cpp's converter in reverse (the same one transformers applies
when it reads a GGUF): `blk.N.attn_q.weight` is `model.layers.N.self_attn.q_proj.weight`,
and for the `llama` architecture the Q and K rows are permuted back from llama.cpp's
interleaved-pair RoPE layout to the half-split layout the families rotate with. A `qwen3moe`
file's stacked experts `blk.N.ffn_gate_exps` / `ffn_up_exps` [E, I, hidden] read as one
`model.layers.N.mlp.experts.gate_up_proj` [E, 2 I, hidden] (gate rows first, as transformers'
Qwen2MoeTensorProcessor builds it), `ffn_down_exps` as `mlp.experts.down_proj`. A `gemma3`
file's four norms per layer map to Gemma's sandwich norms (`ffn_norm` is the pre-feedforward
norm there), and every norm weight is read minus 1: llama.cpp's converter stores Gemma's
`1 + w` scale, transformers' Gemma2TensorProcessor subtracts the 1 again (in float32, after
dequantizing), and so does this loader.

Every `{arch}.*` metadata key is either honoured (mapped into the config), known not to
change the computation, or refused with an error naming it; so is every tensor the family
would not load (a tensor this mapping does not know is refused, never skipped).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keepwarm.engine.loading.chat_template import ChatTemplate, ChatTemplateError
from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.loading.gguf_file import GgufError, GgufFile
from keepwarm.engine.loading.tokenizer import Tokenizer
from keepwarm.kernels.quant_weight import KINDS, QuantWeight

# GGUF architecture -> config.json model_type
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma3": "gemma3_text",
}
_MOE_ARCHITECTURES = {"qwen3moe"}

# {arch}.<key> -> config.json field
_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attention.key_length": "head_dim",
}
# qwen3moe.<key> -> config.json field (transformers maps only the first two and leaves
# moe_intermediate_size at Qwen3MoeConfig's default, 768; llama.cpp reads all three)
_MOE_CONFIG_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
}
# gemma3.<key> -> config.json field (transformers maps the window; llama.cpp reads the local
# layers' base from freq_base_swa when a file has it, else 10,000 as Gemma3TextConfig's default)
_GEMMA3_CONFIG_KEYS = {
    "attention.sliding_window": "sliding_window",
    "rope.freq_base_swa": "rope_local_base_freq",
}
# {arch}.<key> read below, or that change nothing the engine computes
_CHECKED_KEYS = {"rope.dimension_count", "attention.value_length", "rope.scaling.type", "rope.scaling.factor"}

# per-layer GGUF tensor suffix -> Hugging Face suffix under model.layers.N.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_DENSE_FFN_TENSORS = {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
# qwen3moe only: the router, and the experts stacked [E, ...] (gate and up read as one)
_MOE_LAYER_TENSORS = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
# gemma3 only: the sandwich norms (llama.cpp's ffn_norm is the pre-feedforward norm there)
_GEMMA3_LAYER_TENSORS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA3_DROPPED = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}  # no such tensors in a Gemma 3
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name `gguf_name` loads as, or None when the architecture has no such
    tensor (a qwen3moe layer's MLP is its experts; the other architectures have none)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    moe = arch in _MOE_ARCHITECTURES
    names = {k: v for k, v in _LAYER_TENSORS.items() if not (moe and k in _DENSE_FFN_TENSORS)}
    if moe:
        names.update(_MOE_LAYER_TENSORS)
    if arch == "gemma3":
        names = {k: v for k, v in names.items() if k not in _GEMMA3_DROPPED}
        names.update(_GEMMA3_LAYER_TENSORS)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def config_from_metadata(gguf: GgufFile) -> dict[str, Any]:
    """The config.json transformers would build for this file; refuses, naming the key, any
    architecture or metadata that asks for math the families do not implement."""
    arch = gguf.architecture
    model_type = ARCHITECTURES.get(arch)
    if model_type is None:
        raise CheckpointError(
            f"{gguf.path}: general.architecture {arch!r} is not supported "
            f"(supported GGUF architectures: {', '.join(sorted(ARCHITECTURES))})"
        )
    meta = gguf.metadata
    cfg: dict[str, Any] = {"model_type": model_type, "architectures": [f"{model_type}ForCausalLM"]}
    prefix = arch + "."
    moe = arch in _MOE_ARCHITECTURES
    config_keys = {**_CONFIG_KEYS, **_MOE_CONFIG_KEYS} if moe else dict(_CONFIG_KEYS)
    if arch == "gemma3":
        config_keys.update(_GEMMA3_CONFIG_KEYS)
    for key, value in meta.items():
        if not key.startswith(prefix):
            continue
        short = key[len(prefix) :]
        if short in config_keys:
            cfg[config_keys[short]] = value
        elif short not in _CHECKED_KEYS:
            raise CheckpointError(
                f"{gguf.path}: metadata {key} = {value!r} is not supported by this engine's {arch} "
                "loader (it may change the computation)"
            )
    needed = ["num_hidden_layers", "hidden_size", "num_attention_heads"]
    needed += list(_MOE_CONFIG_KEYS.values()) if moe else ["intermediate_size"]
    for need in needed:
        if need not in cfg:
            raise CheckpointError(f"{gguf.path}: metadata {prefix}{_key_of(need)} is missing")
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("rms_norm_eps", 1e-6 if arch != "llama" else 1e-5)
    if "vocab_size" not in cfg:
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise CheckpointError(
                f"{gguf.path}: neither {prefix}vocab_size nor tokenizer.ggml.tokens is present"
            )
        cfg["vocab_size"] = len(tokens)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    value_dim = meta.get(prefix + "attention.value_length", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(
            f"{gguf.path}: metadata {prefix}attention.value_length {value_dim} differs from the key length "
            f"{head_dim}, which this engine does not implement"
        )
    rotary = meta.get(prefix + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise CheckpointError(
            f"{gguf.path}: metadata {prefix}rope.dimension_count {rotary} rotates part of a {head_dim}-wide "
            "head, which this engine does not implement for this architecture"
        )
    scaling = meta.get(prefix + "rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta[prefix + "rope.scaling.factor"])}
    elif scaling != "none":
        raise CheckpointError(
            f"{gguf.path}: metadata {prefix}rope.scaling.type {scaling!r} is not supported (none and linear are)"
        )
    if "rope_freqs.weight" in gguf.tensors:
        raise CheckpointError(
            f"{gguf.path}: tensor rope_freqs.weight (per-frequency RoPE factors, Llama 3.1 style) is not "
            "supported from a GGUF; use the Hugging Face folder of this model"
        )
    cfg["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    for tid, name in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ):
        if isinstance(meta.get(name), int):
            cfg[tid] = meta[name]
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    if arch == "gemma3":
        _gemma3_config(gguf, cfg, head_dim)
    if moe:
        # llama.cpp's qwen3moe graph: every layer sparse, the top-k weights renormalized
        # (transformers' GGUF_CONFIG_DEFAULTS_MAPPING sets norm_topk_prob the same way)
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return cfg


def _gemma3_config(gguf: GgufFile, cfg: dict[str, Any], head_dim: int) -> None:
    """The fields a gemma3 GGUF does not store, as both transformers and llama.cpp assume them
    (the layer pattern, five local to one global, is Gemma3TextConfig's default as it is
    llama.cpp's), or refused where the two disagree."""
    if head_dim != 256:
        # transformers takes Gemma3TextConfig's query_pre_attn_scalar (256) whatever the file;
        # llama.cpp scales by head_dim ** -0.5 (hidden / heads for the 27B): they differ here
        raise CheckpointError(
            f"{gguf.path}: a gemma3 GGUF stores no query_pre_attn_scalar, and with "
            f"{gguf.architecture}.attention.key_length {head_dim} (not 256) transformers (256) and "
            "llama.cpp (the head size) scale attention differently; use the Hugging Face folder of this model"
        )
    cfg["architectures"] = ["Gemma3ForCausalLM"]
    cfg["query_pre_attn_scalar"] = 256
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["head_dim"] = head_dim
    # linear rope scaling (Gemma 3 4B and up) applies to the global layers only, as llama.cpp
    # runs it and as the Hugging Face config says (transformers' GGUF reader drops the key)


def _key_of(field_name: str) -> str:
    return next(k for k, v in {**_CONFIG_KEYS, **_MOE_CONFIG_KEYS}.items() if v == field_name)


@dataclass(frozen=True)
class GgufCheckpoint(Checkpoint):
    """`path` is the .gguf file; `name_to_file` maps each Hugging Face weight name to it."""

    gguf: GgufFile = field(default=None, repr=False)  # type: ignore[assignment]
    # each Hugging Face name's GGUF tensors: one, or the parts concatenated along dim 1
    hf_to_gguf: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False)

    @property
    def weights_format(self) -> str:
        """ "gguf", or "gguf-blocks" when projections run on their blocks (other bits: another
        snapshot namespace)."""
        return "gguf-blocks" if self.keep_blocks else "gguf"

    @property
    def weight_names_matter(self) -> bool:
        return False

    def runtime_bytes(self, dtype: torch.dtype) -> int:
        """Bytes loaded at `dtype`; with `keep_blocks`, a matrix of block type at its file size."""
        size = torch.empty((), dtype=dtype).element_size()
        return sum(
            t.nbytes
            if self.keep_blocks and t.type_name in KINDS and len(t.shape) == 2
            else math.prod(t.shape) * size
            for t in self.gguf.tensors.values()
        )

    def open_tokenizer(self) -> Tokenizer:
        from keepwarm.engine.loading.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self.gguf)

    def open_chat_template(self, tokenizer: Tokenizer) -> ChatTemplate:
        """`tokenizer.chat_template`, and named ones (`tokenizer.chat_template.NAME`)."""
        meta = self.gguf.metadata
        named = {
            k.removeprefix("tokenizer.chat_template."): v
            for k, v in meta.items()
            if k.startswith("tokenizer.chat_template.") and isinstance(v, str)
        }
        if isinstance(meta.get("tokenizer.chat_template"), str):
            named["default"] = meta["tokenizer.chat_template"]
        if not named:
            raise ChatTemplateError(
                f"{self.path}: the GGUF metadata has no tokenizer.chat_template, so chat cannot be rendered"
            )
        return ChatTemplate(named["default"] if list(named) == ["default"] else named, tokenizer)

    def load_linear(
        self, name: str, dtype: torch.dtype, device: torch.device | str, shape: tuple[int, int]
    ) -> torch.Tensor | QuantWeight:
        parts = self.hf_to_gguf.get(name, ())
        t = self.gguf.tensors[parts[0]] if len(parts) == 1 else None
        if not self.keep_blocks or t is None or t.type_name not in KINDS or len(t.shape) != 2:
            return super().load_linear(name, dtype, device, shape)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path.name} ({parts[0]}): weight {name!r} has shape {tuple(t.shape)}, "
                f"the config implies {tuple(shape)}"
            )
        blocks = torch.from_numpy(np.array(self.gguf.raw(parts[0]), copy=True)).view(t.shape[0], -1)
        if self.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = (
                self.config["num_attention_heads"] if "q_proj" in name else self.config["num_key_value_heads"]
            )
            blocks = _unpermute_rope_rows(blocks, int(heads))
        for report in self.on_load:
            report()
        return QuantWeight.from_gguf(t.type_name, blocks, int(t.shape[1])).to(device)  # type: ignore[arg-type]

    def _read(self, name: str) -> tuple[torch.Tensor, str]:
        parts = self.hf_to_gguf.get(name)
        if parts is None:
            raise CheckpointError(f"{self.path}: weight {name!r} has no tensor in this GGUF file")
        try:
            pieces = [self.gguf.dequantize(p) for p in parts]
        except GgufError as e:
            raise CheckpointError(str(e)) from e
        if len({tuple(p.shape) for p in pieces}) != 1:
            raise CheckpointError(
                f"{self.path}: tensors {', '.join(parts)} (read together as {name!r}) differ in shape"
            )
        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        src = " + ".join(parts)
        if self.model_type == "gemma3_text" and parts[0].endswith("norm.weight"):
            t = t.float() - 1  # the converter's 1 + w back to Gemma's w (as transformers reads it)
        if self.model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")) and t.dim() == 2:
            heads = (
                self.config["num_attention_heads"] if "q_proj" in name else self.config["num_key_value_heads"]
            )
            t = _unpermute_rope_rows(t, int(heads))
        return t, f"{self.path.name} ({src})"

    def file(self, name: str) -> Path:
        raise CheckpointError(f"{self.path}: a GGUF file has no {name} beside it")


def _unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores each head's rows as interleaved (even, odd) pairs;
    the families rotate the first half against the second (transformers' layout)."""
    rows = w.shape[0]
    half = rows // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


@functools.lru_cache(maxsize=4)
def _parsed(path: Path, size: int, mtime_ns: int) -> GgufFile:
    """One parse of a file's header per process (the model set, the engine and the tokenizer
    each open the checkpoint; the header of a 49k-token vocabulary takes ~0.2 s to read). Keyed
    by size and mtime too, so a file replaced in place is read again."""
    del size, mtime_ns
    return GgufFile(path)


def open_gguf(path: Path, keep_blocks: bool = False) -> GgufCheckpoint:
    try:
        st = path.stat()
        gguf = _parsed(path.resolve(), st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from e
    except GgufError as e:
        raise CheckpointError(str(e)) from e
    config = config_from_metadata(gguf)
    hf_to_gguf: dict[str, tuple[str, ...]] = {}
    for name in gguf.tensors:
        hf = _hf_name(name, gguf.architecture)
        if hf is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} is not one this engine's {gguf.architecture} loader knows "
                "(it would be ignored, changing the model)"
            )
        hf_to_gguf[hf] = (*hf_to_gguf.get(hf, ()), name)
    for hf, parts in hf_to_gguf.items():
        if hf.endswith("experts.gate_up_proj"):  # gate rows first, then up, both present
            layer = hf.split(".")[2]
            want = (f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight")
            if set(parts) != set(want):
                raise CheckpointError(f"{path}: layer {layer} needs both {want[0]} and {want[1]}")
            hf_to_gguf[hf] = want
    return GgufCheckpoint(
        path,
        config,
        dict.fromkeys(hf_to_gguf, path),
        keep_blocks=keep_blocks,
        gguf=gguf,
        hf_to_gguf=hf_to_gguf,
    )
