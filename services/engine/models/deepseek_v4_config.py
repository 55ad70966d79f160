"""DeepSeek V4 config.json, parsed the way transformers' DeepseekV4Config fills its defaults.

Layer types (one per layer): `sliding_attention` (window only),
`compressed_sparse_attention` (CSA: window + overlapping compressor at rate m with a
lightning indexer picking top-k compressed rows per query), `heavily_compressed_attention`
(HCA: window + non-overlapping compressor at rate m', every compressed row visible).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keepwarm.engine.loading.checkpoint import CheckpointError
from keepwarm.engine.models.config_fields import require_silu

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
_DEFAULT_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_heads: int
    head_dim: int
    rope_dim: int  # trailing rotary slice of every head (qk_rope_head_dim)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    n_routed_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    scoring_func: str  # router score: sqrtsoftplus (V4) or sigmoid
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_main: dict[str, Any]  # transformers' rope_parameters["main"]
    rope_compress: dict[str, Any]  # transformers' rope_parameters["compress"]
    max_position_embeddings: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def rate(self, layer: int) -> int:
        """Compression rate of `layer`; 0 for a sliding-only layer."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> DeepseekV4Config:
        try:
            n = int(cfg["num_hidden_layers"])
            head_dim = int(cfg.get("head_dim", 512))
            prf = cfg.get("partial_rotary_factor")
            if prf is None:
                qk_rope = cfg.get("qk_rope_head_dim")
                prf = float(qk_rope) / head_dim if qk_rope is not None else 64 / 512
            prf = float(prf)

            rates = dict(_DEFAULT_RATES)
            rates.update({str(k): int(v) for k, v in (cfg.get("compress_rates") or {}).items()})
            if cfg.get("compress_rate_csa") is not None:
                rates[CSA] = int(cfg["compress_rate_csa"])
            if cfg.get("compress_rate_hca") is not None:
                rates[HCA] = int(cfg["compress_rate_hca"])

            layer_types = cfg.get("layer_types")
            if layer_types is None and cfg.get("compress_ratios") is not None:
                layer_types = [_LEGACY_RATIO_TO_TYPE[int(r)] for r in cfg["compress_ratios"]]
            if layer_types is None:
                inter = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
                layer_types = [HCA] * min(n, 2) + inter
            layer_types = list(layer_types)[:n]

            mlp_types = cfg.get("mlp_layer_types")
            if mlp_types is None:
                n_hash = int(cfg.get("num_hash_layers", 3))
                mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
            mlp_types = list(mlp_types)[:n]

            rope_theta = float(cfg.get("rope_theta", 10000.0))
            rp = dict(cfg.get("rope_parameters") or {})
            if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
                main, compress = dict(rp["main"]), dict(rp["compress"])
            else:
                yarn = {k: v for k, v in rp.items() if k not in ("main", "compress")}
                main = {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": prf}
                compress = {
                    **yarn,
                    "rope_theta": float(cfg.get("compress_rope_theta", 160000.0)),
                    "partial_rotary_factor": prf,
                }
                compress.setdefault("rope_type", "default")
                if compress["rope_type"] == "yarn":
                    compress.setdefault("attention_factor", 1.0)

            out = DeepseekV4Config(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                num_heads=int(cfg["num_attention_heads"]),
                head_dim=head_dim,
                rope_dim=int(head_dim * prf),
                q_lora_rank=int(cfg["q_lora_rank"]),
                o_groups=int(cfg["o_groups"]),
                o_lora_rank=int(cfg["o_lora_rank"]),
                layer_types=tuple(str(t) for t in layer_types),
                mlp_layer_types=tuple(str(t) for t in mlp_types),
                compress_rates=rates,
                sliding_window=int(cfg.get("sliding_window", 128)),
                hc_mult=int(cfg.get("hc_mult", 4)),
                hc_sinkhorn_iters=int(cfg.get("hc_sinkhorn_iters", 20)),
                hc_eps=float(cfg.get("hc_eps", 1e-6)),
                n_routed_experts=int(cfg["n_routed_experts"]),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.5)),
                scoring_func=str(cfg.get("scoring_func", "sqrtsoftplus")),
                swiglu_limit=float(cfg.get("swiglu_limit", 10.0)),
                index_n_heads=int(cfg.get("index_n_heads", 64)),
                index_head_dim=int(cfg.get("index_head_dim", 128)),
                index_topk=int(cfg.get("index_topk", 512)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_main=main,
                rope_compress=compress,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 1048576)),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json: required field {e.args[0]!r} is missing") from e
        out._check(cfg)
        return out

    def _check(self, cfg: dict[str, Any]) -> None:
        n = int(cfg["num_hidden_layers"])
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, (HASH_MOE, MOE)),
        ):
            if len(types) != n:
                raise CheckpointError(
                    f"config.json: {name} has {len(types)} entries, num_hidden_layers is {n}"
                )
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise CheckpointError(f"config.json: {name} entries {bad} are unknown (use one of {allowed})")
        for kind in (CSA, HCA):
            if kind in self.layer_types and self.compress_rates.get(kind, 0) < 1:
                raise CheckpointError(f"config.json: compress_rates[{kind!r}] must be >= 1")
        if self.sliding_window < 1:
            raise CheckpointError("config.json: sliding_window must be >= 1")
        if int(cfg.get("num_key_value_heads", 1)) != 1:
            raise CheckpointError(
                "config.json: DeepSeek V4 uses one shared K=V head (num_key_value_heads must be 1)"
            )
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise CheckpointError(
                "config.json: num_attention_heads * head_dim must be a multiple of o_groups"
            )
        if self.rope_dim % 2 or self.rope_dim > self.head_dim or self.rope_dim > self.index_head_dim:
            raise CheckpointError(
                "config.json: partial_rotary_factor * head_dim must be even and fit head_dim and index_head_dim"
            )
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            raise CheckpointError(
                f"config.json: scoring_func {self.scoring_func!r} is not supported (sqrtsoftplus or sigmoid)"
            )
        require_silu(cfg)
        if cfg.get("mlp_bias"):
            raise CheckpointError(
                "config.json: mlp_bias is true (biases in the shared expert's projections), which this "
                "engine does not implement for deepseek_v4"
            )
        if cfg.get("quantization_config"):
            raise CheckpointError(
                "config.json: quantized (FP8/FP4) DeepSeek V4 checkpoints are not supported; "
                "dequantize to bf16 and drop quantization_config"
            )
