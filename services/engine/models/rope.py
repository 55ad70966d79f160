"""Rotary position embedding tables from a config.json, for every rope type the
dense families' checkpoints use (default, linear, llama3, yarn), computed the
way transformers computes them (float32 inverse frequencies, rotate-half)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from keepwarm.engine.loading.checkpoint import CheckpointError

TABLE_BLOCK = 1024  # positions per precomputed block of the cos/sin table


@dataclass(frozen=True)
class Rope:
    """cos/sin of every position come from a table computed once, in fixed blocks of
    TABLE_BLOCK positions (each block always by the same vectorized computation), so a
    position's values are the same bits whether it is reached in a long prefill chunk,
    a short one or a decode step, and no step computes trigonometry."""

    inv_freq: torch.Tensor  # [Dr/2] float32
    attention_scaling: float
    tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]

    def _block(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(
            b * TABLE_BLOCK, (b + 1) * TABLE_BLOCK, device=self.inv_freq.device, dtype=torch.float32
        )
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling

    def table(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [>= end, Dr] in `dtype` for positions 0.. (grown a block at a time)."""
        have = self.tables.get(dtype)
        rows = 0 if have is None else have[0].shape[0]
        if rows < end:
            blocks = [self._block(b) for b in range(rows // TABLE_BLOCK, -(-end // TABLE_BLOCK))]
            cos = torch.cat([c.to(dtype) for c, _ in blocks])
            sin = torch.cat([s.to(dtype) for _, s in blocks])
            if have is not None:
                cos, sin = torch.cat([have[0], cos]), torch.cat([have[1], sin])
            self.tables[dtype] = have = (cos, sin)
        assert have is not None
        return have

    def cos_sin(self, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [length, Dr] for positions start..start+length-1."""
        cos, sin = self.table(start + length, dtype)
        return cos[start : start + length], sin[start : start + length]

    def cos_sin_at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, Dr] for arbitrary positions [T] int64 (a batch of sequences at
        different offsets)."""
        cos, sin = self.table(int(positions.max()) + 1, dtype)
        idx = positions.to(cos.device)
        return cos[idx], sin[idx]


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rope dict in transformers 5 form, whether config.json has `rope_parameters`
    or the older `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" not in params and cfg.get("partial_rotary_factor") is not None:
        params["partial_rotary_factor"] = cfg["partial_rotary_factor"]
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        params.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings")),
        )
    return params


def build_rope(cfg: dict[str, Any], head_dim: int, device: torch.device) -> Rope:
    p = rope_parameters(cfg)
    rope_type = p["rope_type"]
    base = float(p["rope_theta"])
    dim = int(head_dim * float(p.get("partial_rotary_factor", 1.0)))
    idx = torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32)
    inv_freq = 1.0 / (base ** (idx / dim))
    scaling = 1.0
    if rope_type == "default":
        pass
    elif rope_type == "linear":
        inv_freq = inv_freq / float(p["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3(inv_freq, p)
    elif rope_type == "yarn":
        inv_freq, scaling = _yarn(dim, base, p, cfg)
    else:
        raise CheckpointError(
            f"config.json: rope type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)"
        )
    return Rope(inv_freq.to(device), scaling)


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, out)


def _yarn(dim: int, base: float, p: dict[str, Any], cfg: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = p.get("factor")
    orig = float(p["original_max_position_embeddings"])
    if factor is None:
        factor = float(cfg["max_position_embeddings"]) / orig
    factor = float(factor)

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (
            mscale_of(factor, m) / mscale_of(factor, m_all) if m and m_all else mscale_of(factor)
        )
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attention_factor)
