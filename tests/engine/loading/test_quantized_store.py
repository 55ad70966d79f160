"""--quantize's blocks kept in the cache folder (loading/quantized_store.py): made once, read at the
next load instead of quantizing again, the same bytes; a damaged or foreign file is quantized
again and replaced."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from keepwarm.engine.loading import checkpoint as checkpoint_module
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.loading.quantized_store import FOLDER
from keepwarm.engine.models import build_backend
from keepwarm.kernels.ops import TORCH_OPS
from keepwarm.kernels.quant_weight import QuantWeight

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = transformers.AutoConfig.for_model(
        "llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def _load(folder: Path, cache: Path) -> Any:
    ckpt = open_checkpoint(folder, quantize="q8_0", cache_dir=cache)
    backend = build_backend(ckpt, torch.device("cpu"), torch.float32, TORCH_OPS)
    assert ckpt.quantized_store is not None
    ckpt.quantized_store.flush()
    return backend


def _blocks(backend: Any) -> list[torch.Tensor]:
    out = []
    for layer in backend.layers:
        for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down):
            assert isinstance(w, QuantWeight) and w.kind == "Q8_0"
            out.append(w.blocks)
    return out


def test_the_second_load_reads_the_blocks_the_first_made(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _blocks(_load(folder, tmp_path))
    files = list((tmp_path / FOLDER).iterdir())
    assert len(files) == 1 and files[0].name.endswith(".q8_0.safetensors")
    written = files[0].stat().st_mtime_ns

    def no_quantizing(*args: object) -> None:
        raise AssertionError("quantized again although the cache folder holds the blocks")

    monkeypatch.setattr(checkpoint_module, "quantize_q8_0", no_quantizing)
    second = _blocks(_load(folder, tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True)) and len(second) == 8
    assert files[0].stat().st_mtime_ns == written  # nothing new: not rewritten
    assert not list((tmp_path / FOLDER).glob("*.tmp-*"))


def test_a_damaged_or_foreign_file_is_quantized_again_and_replaced(folder: Path, tmp_path: Path) -> None:
    want = _blocks(_load(folder, tmp_path))
    (path,) = (tmp_path / FOLDER).iterdir()
    path.write_bytes(b"not a safetensors file")
    assert all(torch.equal(a, b) for a, b in zip(want, _blocks(_load(folder, tmp_path)), strict=True))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # rewritten, readable again
        assert f.metadata()["kind"] == "q8_0" and len(list(f.keys())) == 16  # every projection, the head too
    # a file of other weights under this name (a copied cache folder): its blocks are not used
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {k: torch.zeros_like(f.get_tensor(k)) for k in f.keys()}  # noqa: SIM118
        meta = {**f.metadata(), "source": "0" * 32}
    save_file(tensors, str(path), metadata=meta)
    assert all(torch.equal(a, b) for a, b in zip(want, _blocks(_load(folder, tmp_path)), strict=True))


def test_without_a_cache_folder_nothing_is_kept(folder: Path) -> None:
    ckpt = open_checkpoint(folder, quantize="q8_0")
    assert ckpt.quantized_store is None
    assert open_checkpoint(folder, cache_dir=folder).quantized_store is None  # no --quantize: no store
