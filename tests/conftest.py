"""Suite-wide settings and shared fixtures. Triton kernels run under the
interpreter on CPU-only machines; the flag must be set before any kernel module
is imported."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3 demo checkpoint with a real BPE tokenizer and ChatML template."""
    from keepwarm.engine.demo.demo_model import make_demo_model

    path = tmp_path_factory.mktemp("models") / "tiny-dense"
    make_demo_model(path, family="dense", seed=0, size="tiny")
    return path


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_5 (Gated DeltaNet + gated attention) demo checkpoint."""
    from keepwarm.engine.demo.demo_model import make_demo_model

    path = tmp_path_factory.mktemp("models") / "tiny-hybrid"
    make_demo_model(path, family="hybrid", seed=0, size="tiny")
    return path


@pytest.fixture(scope="session")
def tiny_deepseek_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny deepseek_v4 (sliding window + CSA/HCA compressed attention, mHC) demo checkpoint."""
    from keepwarm.engine.demo.demo_model import make_demo_model

    path = tmp_path_factory.mktemp("models") / "tiny-deepseek_v4"
    make_demo_model(path, family="deepseek_v4", seed=0, size="tiny")
    return path
