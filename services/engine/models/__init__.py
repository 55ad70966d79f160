"""Model families, keyed by config.json `model_type`. Each family module exposes
`build(checkpoint, device, dtype, ops) -> Backend`."""

from __future__ import annotations

import importlib

import torch

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.backend import Backend
from keepwarm.kernels.ops import Ops

MODEL_TYPE_TO_FAMILY = {
    "llama": "dense",
    "qwen2": "dense",
    "qwen3": "dense",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "deepseek_v4": "deepseek_v4",
    "laguna": "laguna",
    "gpt_oss": "gpt_oss",
}


def build_backend(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, ops: Ops) -> Backend:
    family = MODEL_TYPE_TO_FAMILY.get(ckpt.model_type)
    if family is None:
        known = ", ".join(sorted(MODEL_TYPE_TO_FAMILY))
        raise CheckpointError(
            f"{ckpt.path / 'config.json'}: model_type {ckpt.model_type!r} is not supported (supported: {known})"
        )
    module = importlib.import_module(f"keepwarm.engine.models.{family}")
    backend: Backend = module.build(ckpt, device, dtype, ops)
    return backend
