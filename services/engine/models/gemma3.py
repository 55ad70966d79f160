"""Gemma 3 family (`model_type` gemma3_text, and `gemma3` GGUF files), matching transformers'
Gemma3ForCausalLM: local sliding-window layers and global layers (`layer_types`; by default
five local to one global, `sliding_window_pattern` 6) with their own RoPE (local base
`rope_local_base_freq` 10,000, global `rope_theta` 1,000,000 with optional scaling), q/k
RMSNorm, sandwich norms (input, post-attention, pre-feedforward, post-feedforward), every
RMSNorm Gemma's `x * (1 + w)` in float32, a GeGLU MLP with tanh-approximate GELU, embeddings
scaled by sqrt(hidden) rounded to the embedding dtype, the attention scale
`query_pre_attn_scalar ** -0.5`, and optional final-logit softcapping.

State and snapshots: models/sliding.py (global layers every row, local layers min(p, W) rows).
Every config.json field is implemented, known to be inert at inference, or refused by name
(`attn_logit_softcapping`, `use_bidirectional_attention`, a multimodal `gemma3` folder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.config_fields import refuse_quantized, refuse_unknown_fields
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rope import Rope, build_rope, rope_parameters
from keepwarm.engine.models.sliding import (
    FULL,
    SLIDING,
    Batch,
    Ends,
    SlidingKvBackend,
    check_layer_types,
)
from keepwarm.engine.models.weights import Loader
from keepwarm.kernels.ops import Ops

# Every field of transformers' Gemma3TextConfig (and the older names Hub configs still carry),
# by what this family does with it (tests/engine/models/test_gemma3.py keeps the lists complete).
HONOURED_FIELDS = frozenset(
    {
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation", "rms_norm_eps",
        "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq",
        "max_position_embeddings", "attention_bias", "query_pre_attn_scalar", "sliding_window",
        "layer_types", "sliding_window_pattern", "final_logit_softcapping", "attn_logit_softcapping",
        "use_bidirectional_attention",
    }
)  # fmt: skip
# Fields that do not change inference math (training, generation defaults, bookkeeping).
# `_sliding_window_pattern` is transformers' own copy of the pattern, never read back from a
# config.json (it reads `sliding_window_pattern`); `hidden_act` is a Gemma 1 name Gemma 3 does
# not read (`hidden_activation` is); `cache_implementation` is a generation setting.
NO_MATH_FIELDS = frozenset(
    {
        "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "initializer_range",
        "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout", "_name_or_path",
        "_sliding_window_pattern", "hidden_act", "cache_implementation", "output_hidden_states",
        "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label",
        "label2id", "problem_type", "tokenizer_class",
    }
)  # fmt: skip
GELU_TANH = "gelu_pytorch_tanh"
_DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    rope_parameters: dict[str, dict[str, Any]]  # per layer type

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> Gemma3Config:
        if cfg.get("model_type") == "gemma3":
            raise CheckpointError(
                "config.json: model_type 'gemma3' is the multimodal Gemma3ForConditionalGeneration "
                "(text_config + vision tower), which this engine does not load; use a text-only "
                "gemma3_text checkpoint (Gemma3ForCausalLM) or a gemma3 GGUF file"
            )
        refuse_unknown_fields(
            {k: v for k, v in cfg.items() if k != "quantization_config"},
            set(HONOURED_FIELDS | NO_MATH_FIELDS),
            "gemma3",
        )
        refuse_quantized(cfg)
        try:
            n = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise CheckpointError(f"config.json: required field {e.args[0]!r} is missing") from e
        if cfg.get("attn_logit_softcapping") is not None:
            raise CheckpointError(
                f"config.json: attn_logit_softcapping {cfg['attn_logit_softcapping']!r} is not supported "
                "(the attention kernels do not softcap scores); Gemma 3 checkpoints set it to null"
            )
        if cfg.get("use_bidirectional_attention"):
            raise CheckpointError(
                "config.json: use_bidirectional_attention true is not supported (an encoder's "
                "attention; a causal LM's state cannot be extended token by token)"
            )
        act = cfg.get("hidden_activation", GELU_TANH)
        if act != GELU_TANH:
            raise CheckpointError(
                f"config.json: hidden_activation {act!r} is not supported ({GELU_TANH!r} only)"
            )
        window = cfg.get("sliding_window", 4096)
        pattern = int(cfg.get("sliding_window_pattern", 6))
        if pattern < 1:
            raise CheckpointError(f"config.json: sliding_window_pattern {pattern} must be positive")
        default_types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        layer_types = check_layer_types(cfg.get("layer_types") or default_types, n, window)
        kv = cfg.get("num_key_value_heads", 4)
        kv = heads if kv is None else int(kv)
        if heads % kv:
            raise CheckpointError(
                "config.json: num_attention_heads must be a multiple of num_key_value_heads"
            )
        cap = cfg.get("final_logit_softcapping")
        if cap is not None and not float(cap) > 0:
            raise CheckpointError(f"config.json: final_logit_softcapping {cap!r} must be positive or null")
        head_dim = cfg.get("head_dim", 256)
        return Gemma3Config(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 9216)),
            layer_types=layer_types,
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=hidden // heads if head_dim is None else int(head_dim),
            sliding_window=int(window) if SLIDING in layer_types else int(window or 1),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=None if cap is None else float(cap),
            rope_parameters=_rope_per_type(cfg),
        )


def _rope_per_type(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's rope settings as transformers' Gemma3TextConfig derives them: the
    per-type `rope_parameters` when given, else the older fields (`rope_scaling` applies to the
    global layers, `rope_theta` is their base, `rope_local_base_freq` the local layers')."""
    given = cfg.get("rope_parameters")
    if given is not None and (not isinstance(given, dict) or not set(given) <= {FULL, SLIDING} or not given):
        raise CheckpointError(
            f"config.json: rope_parameters must map layer types ({FULL!r}, {SLIDING!r}) to their rope "
            f"settings, got {given!r}"
        )
    params: dict[str, dict[str, Any]] = {t: dict(p or {}) for t, p in (given or {}).items()}
    scaling = cfg.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise CheckpointError(f"config.json: rope_scaling must be a dict or null, got {scaling!r}")
        params.setdefault(FULL, {}).update(scaling)
    legacy = {FULL: cfg.get("rope_theta"), SLIDING: cfg.get("rope_local_base_freq")}
    for t in (FULL, SLIDING):
        p = params.setdefault(t, {})
        if "type" in p and "rope_type" not in p:
            p["rope_type"] = p.pop("type")
        p.setdefault("rope_type", "default")
        p.setdefault("rope_theta", legacy[t] if legacy[t] is not None else _DEFAULT_THETA[t])
    return params


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden] float32: 1 + weight (Gemma's norm scale)
    w_qkv: torch.Tensor  # [(Hq + 2 Hkv) D, hidden]
    b_qkv: torch.Tensor | None
    q_norm: torch.Tensor  # [D] float32: 1 + weight
    k_norm: torch.Tensor
    w_o: torch.Tensor  # [hidden, Hq D]
    b_o: torch.Tensor | None
    post_attn_norm: torch.Tensor
    pre_ffn_norm: torch.Tensor
    post_ffn_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 I, hidden]
    w_down: torch.Tensor  # [hidden, I]


_GELU_K = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh (F.gelu(approximate="tanh")) in float32, rounded once to
    x's dtype. Written as elementwise products and torch.tanh rather than F.gelu: torch's gelu
    kernel rounds the scalar tail of each thread's slice differently from its vector body, so an
    element's bits depend on where the slice boundaries fall (on the row count); products are
    correctly rounded everywhere and tanh runs one vectorised function over every element
    (tests/engine/models/test_gemma3.py checks both). Within 1 ulp of F.gelu."""
    xf = x.float()
    inner = (xf + xf * xf * xf * 0.044715) * _GELU_K
    return (xf * 0.5 * (torch.tanh(inner) + 1.0)).to(x.dtype)


class Gemma3Backend(SlidingKvBackend[_Layer]):
    family = "gemma3"

    def __init__(
        self,
        cfg: Gemma3Config,
        ropes: dict[str, Rope],
        ends: Ends,
        layers: list[_Layer],
        placement: Placement,
        dtype: torch.dtype,
        ops: Ops,
    ) -> None:
        super().__init__(cfg, ropes, ends, layers, placement, dtype, ops)
        self.cfg = cfg
        self.scale = cfg.query_pre_attn_scalar**-0.5
        # Gemma3TextScaledWordEmbedding: sqrt(hidden) as a float32 tensor, cast to the weight dtype
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(self.embed.dtype)

    def _hidden(self, batch: Batch, tokens: torch.Tensor) -> torch.Tensor:
        c, ops = self.cfg, self.ops
        eps = c.rms_norm_eps
        x = F.embedding(tokens, self.embed) * self.embed_scale.to(self.embed.device)  # [N, hidden]
        n, d, hq, hkv = x.shape[0], c.head_dim, c.num_heads, c.num_kv_heads
        cos_sin = self._cos_sin(batch)
        for i, layer in enumerate(self.layers):
            x, cos_sin = self._to_stage(i, x, cos_sin)
            h = ops.rms_norm_1p(x, layer.input_norm, eps)
            q, k, v = ops.linear(h, layer.w_qkv, layer.b_qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
            q = ops.rms_norm_1p(q.reshape(n, hq, d), layer.q_norm, eps)
            k = ops.rms_norm_1p(k.reshape(n, hkv, d), layer.k_norm, eps)
            cos, sin = cos_sin[c.layer_types[i]]
            q, k = ops.rotary(q, cos, sin), ops.rotary(k, cos, sin)
            out = batch.attend(i, q, k, v.reshape(n, hkv, d).contiguous(), self.scale)  # [N, Hq, D]
            attn = ops.linear(out.reshape(n, hq * d), layer.w_o, layer.b_o)
            x = x + ops.rms_norm_1p(attn, layer.post_attn_norm, eps)
            h = ops.rms_norm_1p(x, layer.pre_ffn_norm, eps)
            gate, up = ops.linear(h, layer.w_gate_up).chunk(2, dim=-1)
            mlp = ops.linear(gelu_tanh(gate) * up, layer.w_down)
            x = x + ops.rms_norm_1p(mlp, layer.post_ffn_norm, eps)
        return x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.ops.rms_norm_1p(h, self.final_norm, self.cfg.rms_norm_eps)
        logits = self.ops.linear(h, self.lm_head)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # in the model dtype, as transformers (elementwise: row-invariant)
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def build(ckpt: Checkpoint, where: torch.device | Placement, dtype: torch.dtype, ops: Ops) -> Gemma3Backend:
    """Each layer's weights straight onto its stage's device; the embedding on the first
    stage, the final norm and the head on the last."""
    cfg = Gemma3Config.from_dict(ckpt.config)
    placement = Placement.of(where, cfg.num_layers)
    hid, d = cfg.hidden_size, cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    inter = cfg.intermediate_size
    w = Loader(ckpt, placement, dtype)
    norm = w.norm_1p  # Gemma3RMSNorm's scale
    layers: list[_Layer] = []
    for i in range(cfg.num_layers):
        w.at_layer(i)
        p = f"model.layers.{i}."
        sa, mp = p + "self_attn.", p + "mlp."
        b_qkv = b_o = None
        if cfg.attention_bias:
            b_qkv = w.qkv(sa, q_size, kv_size)
            b_o = w(sa + "o_proj.bias", (hid,))
        gate_up, down = w.gate_up_down(mp, hid, inter)
        layers.append(
            _Layer(
                input_norm=norm(p + "input_layernorm.weight", hid),
                w_qkv=w.qkv(sa, q_size, kv_size, hid),
                b_qkv=b_qkv,
                q_norm=norm(sa + "q_norm.weight", d),
                k_norm=norm(sa + "k_norm.weight", d),
                w_o=w(sa + "o_proj.weight", (hid, q_size)),
                b_o=b_o,
                post_attn_norm=norm(p + "post_attention_layernorm.weight", hid),
                pre_ffn_norm=norm(p + "pre_feedforward_layernorm.weight", hid),
                post_ffn_norm=norm(p + "post_feedforward_layernorm.weight", hid),
                w_gate_up=gate_up,
                w_down=down,
            )
        )
    # transformers ties lm_head to the embedding (a stored copy is ignored)
    embed, lm_head = w.ends(
        w, "model.embed_tokens.weight", cfg.vocab_size, hid, cfg.tie_word_embeddings, True
    )
    ropes = {}
    for kind in sorted(set(cfg.layer_types)):
        params = cfg.rope_parameters[kind]
        if float(rope_parameters({"rope_parameters": params}).get("partial_rotary_factor", 1.0)) != 1.0:
            raise CheckpointError(
                f"config.json: rope_parameters[{kind!r}] partial_rotary_factor must be 1.0 for gemma3"
            )
        ropes[kind] = build_rope({**ckpt.config, "rope_parameters": params}, d, placement.first)
    ends = Ends(embed, norm("model.norm.weight", hid), lm_head)  # the final norm on the last stage
    return Gemma3Backend(cfg, ropes, ends, layers, placement, dtype, ops)
