"""DeepSeek V4 weight names and shapes, one table for loading and for demo weights (demo/deepseek_v4.py).

A checkpoint names each weight one of three ways, all accepted on load:
  - transformers' module names (`model.layers.0.self_attn.q_a_proj.weight`, experts packed
    as `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I]);
  - what transformers' `save_pretrained` writes (its conversion mapping reversed):
    DeepSeek's own names under `model.` (`model.layers.0.attn.wq_a.weight`, experts one by
    one as `ffn.experts.{e}.w1|w2|w3.weight`), plus `model.embed_tokens.weight`,
    `model.norm.weight`, `model.hc_head.hc_*` and `head.weight`;
  - DeepSeek's release names without the `model.` prefix (`layers.0.attn.wq_a.weight`,
    `embed.weight`, `hc_head_fn`).
Demo weights (demo/deepseek_v4.py `init_weights`) use the `save_pretrained` form, which transformers loads back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.deepseek_v4_config import CSA, HASH_MOE, SLIDING, DeepseekV4Config


@dataclass(frozen=True)
class WeightSpec:
    key: str  # logical key used by the backend, e.g. "layers.3.q_a"
    names: tuple[str, ...]  # accepted checkpoint names, the save_pretrained form first
    shape: tuple[int, ...]
    init: str  # demo init: normal | out | embed | ones | zeros | small | tid2eid
    fp32: bool = False  # kept in float32 at runtime (transformers' _keep_in_fp32_modules_strict)


def _alias(hf: str, native: str) -> tuple[str, ...]:
    """Accepted names for a weight under the model prefix: save_pretrained form, module form,
    release form."""
    out = [f"model.{native}", f"model.{hf}", native]
    return tuple(dict.fromkeys(out))


def _layer_spec(
    specs: list[WeightSpec],
    layer: str,
    key: str,
    hf: str,
    native: str,
    shape: tuple[int, ...],
    init: str,
    fp32: bool = False,
) -> None:
    specs.append(WeightSpec(layer + key, _alias(layer + hf, layer + native), shape, init, fp32))


def weight_specs(cfg: DeepseekV4Config) -> list[WeightSpec]:
    """Every weight except the routed experts (see `expert_names`), in load order."""
    hid, d, n = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    qr, nh, inter = cfg.q_lora_rank, cfg.num_heads, cfg.moe_intermediate_size
    ih, idim, e = cfg.index_n_heads, cfg.index_head_dim, cfg.n_routed_experts
    mix = (2 + n) * n
    specs = [
        WeightSpec("embed", ("model.embed_tokens.weight", "embed.weight"), (cfg.vocab_size, hid), "embed"),
    ]
    for i, kind in enumerate(cfg.layer_types):
        s = functools.partial(_layer_spec, specs, f"layers.{i}.")
        s("attn_norm", "input_layernorm.weight", "attn_norm.weight", (hid,), "ones", True)
        s("ffn_norm", "post_attention_layernorm.weight", "ffn_norm.weight", (hid,), "ones", True)
        for hc in ("attn", "ffn"):
            s(f"{hc}_hc.fn", f"{hc}_hc.fn", f"hc_{hc}_fn", (mix, n * hid), "normal", True)
            s(f"{hc}_hc.base", f"{hc}_hc.base", f"hc_{hc}_base", (mix,), "zeros", True)
            s(f"{hc}_hc.scale", f"{hc}_hc.scale", f"hc_{hc}_scale", (3,), "ones", True)
        s("sinks", "self_attn.sinks", "attn.attn_sink", (nh,), "zeros", True)
        s("q_a", "self_attn.q_a_proj.weight", "attn.wq_a.weight", (qr, hid), "normal")
        s("q_a_norm", "self_attn.q_a_norm.weight", "attn.q_norm.weight", (qr,), "ones", True)
        s("q_b", "self_attn.q_b_proj.weight", "attn.wq_b.weight", (nh * d, qr), "normal")
        s("kv", "self_attn.kv_proj.weight", "attn.wkv.weight", (d, hid), "normal")
        s("kv_norm", "self_attn.kv_norm.weight", "attn.norm.weight", (d,), "ones", True)
        s("o_a", "self_attn.o_a_proj.weight", "attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, nh * d // cfg.o_groups), "normal")  # fmt: skip
        s(
            "o_b",
            "self_attn.o_b_proj.weight",
            "attn.wo_b.weight",
            (hid, cfg.o_groups * cfg.o_lora_rank),
            "out",
        )
        if kind != SLIDING:
            width = 2 * d if kind == CSA else d  # CSA: two series (Ca | Cb) per token
            r = cfg.rate(i)
            c, nc = "self_attn.compressor.", "attn.compressor."
            s("comp.kv", c + "kv_proj.weight", nc + "wkv.weight", (width, hid), "normal")
            s("comp.gate", c + "gate_proj.weight", nc + "wgate.weight", (width, hid), "normal")
            s("comp.position_bias", c + "position_bias", nc + "ape", (r, width), "small", True)
            s("comp.norm", c + "kv_norm.weight", nc + "norm.weight", (d,), "ones", True)
            if kind == CSA:
                x, nx = c + "indexer.", "attn.indexer."
                s("index.kv", x + "kv_proj.weight", nx + "compressor.wkv.weight", (2 * idim, hid), "normal")
                s(
                    "index.gate",
                    x + "gate_proj.weight",
                    nx + "compressor.wgate.weight",
                    (2 * idim, hid),
                    "normal",
                )
                s(
                    "index.position_bias",
                    x + "position_bias",
                    nx + "compressor.ape",
                    (r, 2 * idim),
                    "small",
                    True,
                )
                s("index.norm", x + "kv_norm.weight", nx + "compressor.norm.weight", (idim,), "ones", True)
                s("index.q_b", x + "q_b_proj.weight", nx + "wq_b.weight", (ih * idim, qr), "normal")
                s("index.weights_proj", x + "scorer.weights_proj.weight", nx + "weights_proj.weight", (ih, hid), "normal")  # fmt: skip
        s("router", "mlp.gate.weight", "ffn.gate.weight", (e, hid), "normal")
        if cfg.mlp_layer_types[i] == HASH_MOE:
            s(
                "tid2eid",
                "mlp.gate.tid2eid",
                "ffn.gate.tid2eid",
                (cfg.vocab_size, cfg.num_experts_per_tok),
                "tid2eid",
            )
        else:
            s("score_bias", "mlp.gate.e_score_correction_bias", "ffn.gate.bias", (e,), "zeros", True)
        m, nm = "mlp.shared_experts.", "ffn.shared_experts."
        s("shared.gate", m + "gate_proj.weight", nm + "w1.weight", (inter, hid), "normal")
        s("shared.up", m + "up_proj.weight", nm + "w3.weight", (inter, hid), "normal")
        s("shared.down", m + "down_proj.weight", nm + "w2.weight", (hid, inter), "out")
    specs += [
        WeightSpec("norm", ("model.norm.weight", "norm.weight"), (hid,), "ones", True),
        WeightSpec("hc_head.fn", ("model.hc_head.hc_fn", "hc_head_fn"), (n, n * hid), "normal", True),
        WeightSpec("hc_head.base", ("model.hc_head.hc_base", "hc_head_base"), (n,), "zeros", True),
        WeightSpec("hc_head.scale", ("model.hc_head.hc_scale", "hc_head_scale"), (1,), "ones", True),
    ]
    if not cfg.tie_word_embeddings:
        specs.append(
            WeightSpec("lm_head", ("head.weight", "lm_head.weight"), (cfg.vocab_size, hid), "normal")
        )
    return specs


def expert_names(layer: int, expert: int) -> dict[str, tuple[str, ...]]:
    """Per-expert names (save_pretrained / release form): w1 = gate, w3 = up, w2 = down."""
    out: dict[str, tuple[str, ...]] = {}
    for w in ("w1", "w2", "w3"):
        native = f"layers.{layer}.ffn.experts.{expert}.{w}.weight"
        out[w] = (f"model.{native}", native)
    return out


def load_weight(ckpt: Checkpoint, spec: WeightSpec, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Load `spec` under the first of its names the checkpoint has; integer tables keep their
    dtype, fp32-kept weights load as float32."""
    for name in spec.names:
        if ckpt.has(name):
            want: torch.dtype | None = (
                None if spec.init == "tid2eid" else (torch.float32 if spec.fp32 else dtype)
            )
            t = ckpt.load(name, want, device, shape=spec.shape)
            return t.long() if spec.init == "tid2eid" else t
    raise CheckpointError(
        f"{ckpt.path}: weight {spec.names[0]!r} is missing (also looked for {list(spec.names[1:])})"
    )


def _load_any(
    ckpt: Checkpoint, names: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    for name in names:
        if ckpt.has(name):
            return ckpt.load(name, dtype, device, shape=shape)
    raise CheckpointError(f"{ckpt.path}: weight {names[0]!r} is missing (also looked for {list(names[1:])})")


def load_experts(
    ckpt: Checkpoint, cfg: DeepseekV4Config, layer: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts of `layer` as gate_up [E, 2I, H] (gate rows first) and down [E, H, I]."""
    e, inter, hid = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    packed = f"model.layers.{layer}.mlp.experts."
    if ckpt.has(packed + "gate_up_proj"):
        gate_up = ckpt.load(packed + "gate_up_proj", dtype, device, shape=(e, 2 * inter, hid))
        down = ckpt.load(packed + "down_proj", dtype, device, shape=(e, hid, inter))
        return gate_up, down
    gate_up = torch.empty((e, 2 * inter, hid), dtype=dtype, device=device)
    down = torch.empty((e, hid, inter), dtype=dtype, device=device)
    for x in range(e):
        names = expert_names(layer, x)
        gate_up[x, :inter] = _load_any(ckpt, names["w1"], (inter, hid), dtype, device)
        gate_up[x, inter:] = _load_any(ckpt, names["w3"], (inter, hid), dtype, device)
        down[x] = _load_any(ckpt, names["w2"], (hid, inter), dtype, device)
    return gate_up, down
