"""models/weights.py: the output projection, stored or tied to the embedding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.weights import Loader, lm_head

CPU = torch.device("cpu")


def _ckpt(stored: bool) -> Checkpoint:
    names = {"lm_head.weight"} if stored else set()
    return cast(Checkpoint, SimpleNamespace(has=lambda n: n in names, path=Path("/m")))


def test_stored_head_is_loaded_unless_a_tied_config_wins() -> None:
    embed, stored = torch.zeros(3, 2), torch.ones(3, 2)
    assert lm_head(_ckpt(True), lambda: stored, embed, CPU, tied=False) is stored
    assert lm_head(_ckpt(True), lambda: stored, embed, CPU, tied=True) is stored
    assert lm_head(_ckpt(True), lambda: stored, embed, CPU, tied=True, tied_wins=True) is embed


def test_missing_head_ties_or_is_refused() -> None:
    embed = torch.zeros(3, 2)
    load: Any = lambda: pytest.fail("nothing stored to load")  # noqa: E731
    assert lm_head(_ckpt(False), load, embed, CPU, tied=True) is embed
    with pytest.raises(CheckpointError, match="lm_head.weight is missing and tie_word_embeddings is false"):
        lm_head(_ckpt(False), load, embed, CPU, tied=False)


class _Store:
    """A checkpoint's load interface over a dict, recording what was read and where."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.path, self.reads = tensors, Path("/m"), []

    def has(self, name: str) -> bool:
        return name in self.tensors

    def load(
        self, name: str, dtype: torch.dtype, device: torch.device, shape: tuple[int, ...]
    ) -> torch.Tensor:
        t = self.tensors[name]
        assert tuple(t.shape) == shape, (name, t.shape, shape)
        self.reads.append(name)
        return t.to(dtype)


def _loader(tensors: dict[str, torch.Tensor], prefix: str = "") -> tuple[Loader, _Store]:
    store = _Store(tensors)
    return Loader(cast(Checkpoint, store), Placement.of(CPU, 2), torch.bfloat16, prefix), store


def test_loader_stacks_qkv_weights_and_biases_in_order() -> None:
    a = "layers.0.self_attn."
    t = {f"{a}{n}_proj.{k}": torch.full((s, 2) if k == "weight" else (s,), v)
         for v, (n, s) in enumerate((("q", 4), ("k", 2), ("v", 2))) for k in ("weight", "bias")}  # fmt: skip
    w, store = _loader(t)
    assert w.qkv(a, 4, 2, 2)[:, 0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert w.qkv(a, 4, 2).tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    assert w.qkv(a, 4, 2).dtype == torch.bfloat16
    assert store.reads[:3] == [f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight"]


def test_loader_reads_below_its_prefix_but_the_head_at_the_top() -> None:
    p = "model.language_model."
    t = {
        p + "embed_tokens.weight": torch.zeros(5, 3),
        "lm_head.weight": torch.ones(5, 3),
        p + "norm.weight": torch.ones(3),
    }
    w, store = _loader(t, p)
    embed, head = w.ends(w, "embed_tokens.weight", 5, 3, tied=True)
    assert embed.sum().item() == 0 and head.sum().item() == 15  # stored head, not the tied embedding
    assert store.reads == [p + "embed_tokens.weight", "lm_head.weight"]
    assert w.prefix == p and w.has("norm.weight") and not w.has("lm_head.weight")


def test_loader_norm_1p_and_gated_mlp() -> None:
    m = "mlp."
    t = {"n": torch.tensor([0.5, -1.0]), m + "gate_proj.weight": torch.zeros(3, 2),
         m + "up_proj.weight": torch.ones(3, 2), m + "down_proj.weight": torch.full((2, 3), 2.0)}  # fmt: skip
    w, _ = _loader(t)
    norm = w.norm_1p("n", 2)
    assert norm.dtype == torch.float32 and norm.tolist() == [1.5, 0.0]
    gate_up, down = w.gate_up_down(m, 2, 3)
    assert gate_up[:, 0].tolist() == [0, 0, 0, 1, 1, 1] and down.shape == (2, 3)
