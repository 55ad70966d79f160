"""Device-safe host paths (issue 12 item 3): a disk hit read into state buffers that are
not CPU memory never hands that memory to a host read, numpy view or checksum. The
`meta` device stands in for a GPU on machines without one: any host access to a meta
tensor raises, exactly as `.numpy()` on a CUDA tensor does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from snapshot_fixtures import NAMESPACE, make_snapshot, same_bytes

from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_error import SnapshotFileError
from keepwarm.engine.cache.snapshot_file import read_snapshot, write_snapshot
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.kernels.ops import TORCH_OPS

transformers = pytest.importorskip("transformers")

KEY = "0123456789abcdef0123456789abcdef"
DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


def _write(path: Path, snap: Snapshot, tokens: list[int]) -> None:
    write_snapshot(path, namespace=NAMESPACE, key=KEY, tokens=tokens, snapshot=snap, fsync=False)


@pytest.mark.parametrize("device", DEVICES)
def test_read_into_device_memory_goes_through_host_buffers(tmp_path: Path, device: str) -> None:
    path = tmp_path / "k.safetensors"
    snap = make_snapshot(8)
    tokens = list(range(10))
    _write(path, snap, tokens)
    dests = {name: torch.empty(t.shape, dtype=t.dtype, device=device) for name, t in snap.tensors.items()}

    got, toks = read_snapshot(path, namespace=NAMESPACE, tokens=tokens, alloc=lambda n, d, s: dests[n])
    assert toks == tokens
    assert all(got.tensors[n] is dests[n] for n in dests)  # read into the caller's device memory
    if device != "meta":
        assert same_bytes(Snapshot(8, {n: t.cpu() for n, t in got.tensors.items()}), snap)

    data = bytearray(path.read_bytes())
    data[-30] ^= 0x04  # the checksum still runs, on the host copy of the bytes
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotFileError) as e:
        read_snapshot(path, namespace=NAMESPACE, tokens=tokens, alloc=lambda n, d, s: dests[n])
    assert e.value.reason == "checksum"


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = tmp_path_factory.mktemp("dense")
    cfg = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return build_backend(open_checkpoint(path), torch.device("cpu"), torch.float32, TORCH_OPS)


@pytest.mark.parametrize("device", DEVICES)
def test_dense_disk_hit_into_device_state_buffers(tmp_path: Path, dense: object, device: str) -> None:
    """The dense family's restore_target offers its state buffers to the file read; with
    those buffers on a device (a GPU engine), the read must bounce through host memory."""
    backend = dense
    state = backend.new_state(32)  # type: ignore[attr-defined]
    tokens = list(range(3, 15))
    backend.prefill(state, torch.tensor(tokens))  # type: ignore[attr-defined]
    snap = backend.export(state).detached()  # type: ignore[attr-defined]
    path = tmp_path / "k.safetensors"
    _write(path, snap, tokens)

    target = backend.new_state(32)  # type: ignore[attr-defined]
    target.tensors = {n: torch.zeros_like(t, device=device) for n, t in target.tensors.items()}
    alloc = backend.restore_target(target)  # type: ignore[attr-defined]
    got, _ = read_snapshot(path, namespace=NAMESPACE, tokens=tokens, alloc=alloc)
    for name, buf in target.tensors.items():
        assert got.tensors[name].device.type == device
        assert got.tensors[name].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        if device != "meta":
            assert torch.equal(buf[: len(tokens)].cpu(), snap.tensors[name])
