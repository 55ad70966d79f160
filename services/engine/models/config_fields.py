"""Refusing config.json fields a family does not implement: each check raises a CheckpointError
naming the field (tests/engine/models/test_config_fields.py holds every family to it)."""

from __future__ import annotations

from collections.abc import Mapping, Set

from keepwarm.engine.loading.checkpoint import CheckpointError


def refuse_unknown_fields(cfg: Mapping[str, object], known: Set[str], family: str) -> None:
    """Every config.json field must be one the family implements or knows to be inert."""
    unknown = sorted(k for k in cfg if k not in known)
    if unknown:
        raise CheckpointError(
            f"config.json: field(s) {unknown} are not supported by the {family} family "
            "(remove them, or use a checkpoint without them)"
        )


def require_silu(cfg: Mapping[str, object]) -> None:
    """`hidden_act` (default silu) must be silu, the only activation the family computes."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"config.json: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)"
        )


def refuse_quantized(cfg: Mapping[str, object]) -> None:
    """A `quantization_config` (a quantized Hugging Face folder) is refused."""
    if cfg.get("quantization_config"):
        raise CheckpointError("config.json: quantization_config: quantized checkpoints are not supported")
