"""The torch block dequantizers against their reference, the `gguf` package's numpy formulas:
bitwise equal on random blocks of every kind the kernels take (every nibble and int8 value, scales over float16's range,
subnormal, zero and negative scales) and on every tensor of the real SmolLM2 Q4_1 file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize

from keepwarm.engine.loading import packaged_model
from keepwarm.engine.loading.gguf_blocks import dequantize_blocks
from keepwarm.engine.loading.gguf_file import GgufFile
from tests.kernels.quant_blocks import F16_FIELDS

SIZES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _random_blocks(type_name: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, SIZES[type_name]), dtype=np.uint8)
    # finite float16 scales (and offsets), of both signs, from subnormal to the largest
    d_at, m_at = F16_FIELDS[type_name]
    for at in (d_at, m_at):
        if at is None:
            continue
        scales = rng.choice(
            np.array([0.0, -0.0, 6e-8, -6e-8, 1e-5, 0.03, -0.7, 1.0, 300.0, -65504.0]), size=n
        )
        scales[: n // 2] = rng.normal(0, 0.05, size=n // 2)
        blocks[:, at : at + 2] = scales.astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("type_name", sorted(SIZES))
def test_random_blocks_bitwise_as_the_reference(type_name: str) -> None:
    blocks = _random_blocks(type_name, 4096, seed=len(type_name) * 7 + ord(type_name[1]))
    ref = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[type_name]).reshape(-1))
    got = dequantize_blocks(type_name, blocks.reshape(-1))
    assert got is not None and got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(_bits(got), _bits(ref))


def test_f16_widened_exactly_and_other_types_left_to_the_reference() -> None:
    values = np.array([0.0, -0.0, 6e-8, 1.5, -65504.0, np.inf], dtype=np.float16)
    got = dequantize_blocks("F16", values.view(np.uint8))
    assert got is not None and torch.equal(got, torch.from_numpy(values.astype(np.float32)))
    assert dequantize_blocks("Q2_K", np.zeros(84, dtype=np.uint8)) is None


def test_every_tensor_of_the_real_file_as_the_reference() -> None:
    g = GgufFile(packaged_model.resolve(packaged_model.DEFAULT_MODEL))
    seen = set()
    for name, t in g.tensors.items():
        if t.type_name not in SIZES:
            continue
        seen.add(t.type_name)
        n_rows = int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1
        rows = g.raw(name).reshape(n_rows, t.nbytes // n_rows)
        ref = torch.from_numpy(np.ascontiguousarray(dequantize(rows, GGMLQuantizationType(t.type_id))))
        assert torch.equal(_bits(g.dequantize(name)), _bits(ref.reshape(t.shape))), name
    assert seen == {"Q4_1", "Q8_0"}
