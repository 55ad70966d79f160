"""The weight loading every family's `build` shares: a `Loader` that reads tensors by Hugging
Face name onto the stage being built, and the output projection, stored or tied to the
embedding (`lm_head`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.models.placement import Placement
from keepwarm.kernels.quant_weight import Weight


class _Movable(Protocol):
    def to(self, device: torch.device) -> _Movable: ...


W = TypeVar("W")

LM_HEAD = "lm_head.weight"


def lm_head(
    ckpt: Checkpoint,
    load: Callable[[], W],
    embed: W,
    device: torch.device,
    tied: bool,
    tied_wins: bool = False,
) -> W:
    """The output projection on `device` (the last stage): `load()` (the stored lm_head.weight)
    where the checkpoint has one, else the embedding where the config ties them (the same tensor
    unless the first and last stage differ). `tied_wins`: a tied config ignores a stored copy
    (as transformers does for gemma3)."""
    if ckpt.has(LM_HEAD) and not (tied_wins and tied):
        return load()
    if tied:
        return embed.to(device)  # type: ignore[attr-defined,no-any-return]
    raise CheckpointError(f"{ckpt.path}: lm_head.weight is missing and tie_word_embeddings is false")


class Loader:
    """Reads a checkpoint's tensors by name (below `prefix`), checked against their shapes, in
    the runtime dtype, onto `device`: the first stage until `at_layer(i)` moves it to layer
    i's stage; `ends` loads the embedding on the first stage and leaves it on the last."""

    def __init__(self, ckpt: Checkpoint, placement: Placement, dtype: torch.dtype, prefix: str = "") -> None:
        self.ckpt, self.placement, self.dtype, self.prefix = ckpt, placement, dtype, prefix
        self.device = placement.first

    def at_layer(self, i: int) -> None:
        self.device = self.placement.device_of(i)

    def has(self, name: str) -> bool:
        return self.ckpt.has(self.prefix + name)

    def __call__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.ckpt.load(self.prefix + name, dtype or self.dtype, self.device, shape=shape)

    def linear(self, name: str, shape: tuple[int, int]) -> Weight:
        """A projection, in its quantized blocks where the checkpoint keeps them."""
        return self.ckpt.load_linear(self.prefix + name, self.dtype, self.device, shape)

    def rows(self, *parts: tuple[str, tuple[int, ...]]) -> torch.Tensor:
        """Several tensors stacked along the first dim (a fused q/k/v projection, say)."""
        return torch.cat([self(name, shape) for name, shape in parts])

    def qkv(self, sa: str, q: int, kv: int, hidden: int | None = None) -> torch.Tensor:
        """q_proj, k_proj and v_proj under `sa` (`...self_attn.`) stacked: their weights
        [q + 2 kv, hidden], or with `hidden` None their biases [q + 2 kv]."""
        kind, tail = ("bias", ()) if hidden is None else ("weight", (hidden,))
        return self.rows(
            *((f"{sa}{n}_proj.{kind}", (size, *tail)) for n, size in (("q", q), ("k", kv), ("v", kv)))
        )

    def norm_1p(self, name: str, size: int) -> torch.Tensor:
        """An RMSNorm scale stored as `weight` and applied as 1 + weight, in float32 (the weight
        rounded to the runtime dtype first, as transformers does)."""
        return 1.0 + self(name, (size,)).float()

    def gate_up_down(self, mp: str, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A gated MLP under `mp` (`...mlp.`): gate and up fused as [2 I, hidden], and down."""
        gate_up = self.rows(
            (mp + "gate_proj.weight", (inter, hidden)), (mp + "up_proj.weight", (inter, hidden))
        )
        return gate_up, self(mp + "down_proj.weight", (hidden, inter))

    def ends(
        self,
        load: Callable[[str, tuple[int, int]], W],
        embed: str,
        vocab: int,
        hidden: int,
        tied: bool,
        tied_wins: bool = False,
    ) -> tuple[W, W]:
        """The embedding `embed` on the first stage and the output projection (`lm_head.weight`,
        never below the prefix) on the last, both read with `load` (this loader, or its `linear`);
        the loader stays on the last stage for the final norm."""
        self.device = self.placement.first
        embedding = load(embed, (vocab, hidden))
        self.device = self.placement.last
        prefix, self.prefix = self.prefix, ""
        try:
            head = lm_head(
                self.ckpt, lambda: load(LM_HEAD, (vocab, hidden)), embedding, self.device, tied, tied_wins
            )
        finally:
            self.prefix = prefix
        return embedding, head
