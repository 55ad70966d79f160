"""The GGUF reader against the `gguf` package's own reader and reference dequantization: the
real SmolLM2 file (Q4_1, Q8_0, F32), every supported block type, refusals by name."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from keepwarm.engine.loading.gguf_file import SUPPORTED_TYPES, GgufError, GgufFile
from tests.engine.loading.gguf_fixtures import smollm2_path

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def real() -> tuple[GgufFile, gguf.GGUFReader]:
    path = smollm2_path()
    return GgufFile(path), gguf.GGUFReader(str(path))


def test_real_file_metadata_and_directory_equal_the_gguf_package(
    real: tuple[GgufFile, gguf.GGUFReader],
) -> None:
    ours, ref = real
    assert ours.version == 3
    assert set(ours.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
    for key, value in ours.metadata.items():
        assert value == ref.fields[key].contents(), key
    assert ours.architecture == "llama"
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.type_id == int(t.tensor_type) and mine.nbytes == t.n_bytes
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert mine.offset == t.data_offset
    kinds = sorted({t.type_name for t in ours.tensors.values()})
    assert kinds == ["F32", "Q4_1", "Q8_0"]
    assert sum(t.type_name == "Q4_1" for t in ours.tensors.values()) == 210


def test_real_file_dequantizes_bit_for_bit_as_the_reference(real: tuple[GgufFile, gguf.GGUFReader]) -> None:
    ours, ref = real
    for t in ref.tensors:
        want = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type))).reshape(
            ours.tensors[t.name].shape
        )
        got = ours.dequantize(t.name)
        assert got.dtype == torch.float32 and torch.equal(got, want), t.name


def _k_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with small finite f16 scales (the gguf package cannot quantize
    K types; any bytes are valid blocks, only the f16 scale fields must be finite)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale_at = {
        Q.Q2_K: [size - 4, size - 2],
        Q.Q3_K: [size - 2],
        Q.Q4_K: [0, 2],
        Q.Q5_K: [0, 2],
        Q.Q6_K: [size - 2],
    }
    for off in scale_at[qtype]:
        data[..., off : off + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, cols // block * size)


def test_every_supported_type_reads_as_the_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    expect: dict[str, torch.Tensor] = {}
    w.add_tensor("f32", x)
    expect["f32"] = torch.from_numpy(x)
    w.add_tensor("f16", x.astype(np.float16))
    expect["f16"] = torch.from_numpy(x.astype(np.float16).astype(np.float32))
    bf16 = torch.from_numpy(x).bfloat16()
    w.add_tensor("bf16", bf16.view(torch.int16).numpy().view(np.uint8), raw_dtype=Q.BF16)
    expect["bf16"] = bf16.float()
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        blocks = gguf.quants.quantize(x, qtype)
        w.add_tensor(qtype.name, blocks, raw_dtype=qtype)
        expect[qtype.name] = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, qtype)))
    for i, qtype in enumerate((Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)):
        blocks = _k_blocks(qtype, 8, 512, i)
        w.add_tensor(qtype.name, blocks, raw_dtype=qtype)
        expect[qtype.name] = torch.from_numpy(np.ascontiguousarray(dequantize(blocks, qtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GgufFile(tmp_path / "t.gguf")
    assert {t.type_name for t in f.tensors.values()} == SUPPORTED_TYPES
    for name, want in expect.items():
        got = f.dequantize(name)
        assert got.shape == (8, 512) and torch.isfinite(got).all(), name
        assert torch.equal(got, want), name
    # the quantized types are close to what was quantized (the blocks are the right ones)
    assert (f.dequantize("Q8_0") - expect["f32"]).abs().max().item() < 0.05


def test_unsupported_type_is_refused_by_name(tmp_path: Path) -> None:
    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    w.add_tensor("w", gguf.quants.quantize(x, Q.Q8_0)[:, : 256 // 32 * 18], raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GgufFile(tmp_path / "iq.gguf")
    with pytest.raises(GgufError, match=r"'w' is IQ4_NL, which this loader does not read"):
        f.dequantize("w")


def test_not_gguf_and_truncated_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(GgufError, match="not a GGUF file"):
        GgufFile(bad)
    head = smollm2_path().read_bytes()[:200_000]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(head)
    with pytest.raises(GgufError, match=r"truncated"):
        GgufFile(cut)
