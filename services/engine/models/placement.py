"""Which device runs each layer (docs/architecture.md, 'Layer split'): contiguous layer ranges, one per stage.

`--layer-split cuda:0:0-23,cuda:1:24-47` names each stage's device and layers (inclusive
ranges); a bare device list such as `cpu,cpu` or `cuda:0,cuda:1` splits the layers evenly
(the first stages take one more when they do not divide). One device with no split is the
one-stage placement. A family reads `device_of(i)` for layer i's weights and state, puts the
embedding on `first` and the final norm and head on `last`, and moves its hidden state with
`x.to(device_of(i))` as it enters each layer (a no-op inside a stage). Nothing in a snapshot
depends on the placement: its tensors keep their global names (`layers.{i}.k`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch

from keepwarm.kernels.ops import Ops, ops_for
from keepwarm.kernels.sliding_attention import SlidingAttentionOps, sliding_attention_for

T = TypeVar("T")

_RANGED = re.compile(r"^(?P<device>.+?):(?P<first>\d+)-(?P<last>\d+)$")


class PlacementError(ValueError):
    """A bad `--layer-split`; the message says what to change."""


@dataclass(frozen=True)
class Stage:
    device: torch.device
    first: int  # first layer
    stop: int  # one past the last layer

    @property
    def layers(self) -> range:
        return range(self.first, self.stop)

    def __str__(self) -> str:
        return f"{self.device}:{self.first}-{self.stop - 1}"


@dataclass(frozen=True)
class LayerSplit:
    """A parsed `--layer-split` before the model's layer count is known: either every stage
    names its layers (`ranges`), or none does (an even split over `devices`)."""

    devices: tuple[torch.device, ...]
    ranges: tuple[tuple[int, int], ...] | None  # inclusive (first, last) per stage, as given

    @staticmethod
    def parse(text: str) -> LayerSplit:
        items = [s.strip() for s in text.split(",")]
        if not text.strip() or any(not s for s in items):
            raise PlacementError(
                f"--layer-split {text!r}: give comma-separated stages, e.g. cuda:0:0-23,cuda:1:24-47 "
                "or a device list such as cuda:0,cuda:1"
            )
        devices: list[torch.device] = []
        ranges: list[tuple[int, int]] = []
        for item in items:
            m = _RANGED.match(item)
            if m is not None:
                first, last = int(m["first"]), int(m["last"])
                if last < first:
                    raise PlacementError(
                        f"--layer-split stage {item!r}: layer range {first}-{last} is backwards; write {last}-{first}"
                    )
                ranges.append((first, last))
                devices.append(_device(m["device"], item))
            else:
                devices.append(_device(item, item))
        if ranges and len(ranges) != len(items):
            raise PlacementError(
                f"--layer-split {text!r}: either every stage names its layers (device:first-last) "
                "or none does (an even split)"
            )
        if ranges:
            order = sorted(range(len(ranges)), key=lambda i: ranges[i])
            for a, b in zip(order, order[1:], strict=False):
                l0, f1 = ranges[a][1], ranges[b][0]
                if f1 <= l0:
                    raise PlacementError(
                        f"--layer-split: stages {items[a]!r} and {items[b]!r} overlap at layer {f1}; "
                        "give each layer to exactly one stage"
                    )
                if f1 > l0 + 1:
                    raise PlacementError(
                        f"--layer-split: layers {l0 + 1}-{f1 - 1} belong to no stage (between {items[a]!r} "
                        f"and {items[b]!r}); extend a range to cover them"
                    )
            return LayerSplit(tuple(devices[i] for i in order), tuple(ranges[i] for i in order))
        return LayerSplit(tuple(devices), None)

    def place(self, num_layers: int) -> Placement:
        """The placement for a model of `num_layers` layers; raises PlacementError when the
        ranges do not cover exactly 0..num_layers-1 or there are more stages than layers."""
        if self.ranges is None:
            return Placement.even(self.devices, num_layers)
        first, last = self.ranges[0][0], self.ranges[-1][1]
        if first != 0:
            raise PlacementError(
                f"--layer-split: layers 0-{first - 1} belong to no stage; start the first range at 0"
            )
        if last >= num_layers:
            raise PlacementError(
                f"--layer-split: layer {last} is out of range; this model has {num_layers} layers "
                f"(0-{num_layers - 1}): end the last range at {num_layers - 1}"
            )
        if last < num_layers - 1:
            raise PlacementError(
                f"--layer-split: layers {last + 1}-{num_layers - 1} belong to no stage; this model has "
                f"{num_layers} layers: end the last range at {num_layers - 1}"
            )
        stages = tuple(Stage(d, f, lst + 1) for d, (f, lst) in zip(self.devices, self.ranges, strict=True))
        return Placement(stages)


@dataclass(frozen=True)
class Placement:
    """Contiguous stages covering layers 0..num_layers-1 in order."""

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        assert self.stages and self.stages[0].first == 0, "stages start at layer 0"
        for a, b in zip(self.stages, self.stages[1:], strict=False):
            assert a.stop == b.first and a.first < a.stop, "stages are contiguous and non-empty"
        object.__setattr__(
            self, "_by_layer", tuple(s.device for s in self.stages for _ in s.layers)
        )  # layer -> device, read once per layer per forward

    @staticmethod
    def single(device: torch.device | str, num_layers: int) -> Placement:
        return Placement((Stage(torch.device(device), 0, max(num_layers, 1)),))

    @staticmethod
    def even(devices: tuple[torch.device, ...], num_layers: int) -> Placement:
        k = len(devices)
        if k > num_layers:
            raise PlacementError(
                f"--layer-split names {k} devices but this model has {num_layers} layers: "
                f"use at most {num_layers} stages"
            )
        stages, start = [], 0
        for i, d in enumerate(devices):
            n = num_layers // k + (1 if i < num_layers % k else 0)
            stages.append(Stage(d, start, start + n))
            start += n
        return Placement(tuple(stages))

    @staticmethod
    def of(where: torch.device | Placement, num_layers: int) -> Placement:
        """`where` itself, or every layer on that one device."""
        return where if isinstance(where, Placement) else Placement.single(where, num_layers)

    @staticmethod
    def from_config(layer_split: str, device: str, num_layers: int) -> Placement:
        """`--layer-split` when given, else every layer on `--device`."""
        if layer_split:
            return LayerSplit.parse(layer_split).place(num_layers)
        return Placement.single(device, num_layers)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].stop

    @property
    def first(self) -> torch.device:
        """Where tokens enter: the embedding."""
        return self.stages[0].device

    @property
    def last(self) -> torch.device:
        """Where the final norm and the head run, and logits come out."""
        return self.stages[-1].device

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """Distinct devices, in stage order."""
        return tuple(dict.fromkeys(s.device for s in self.stages))

    def device_of(self, layer: int) -> torch.device:
        by_layer: tuple[torch.device, ...] = self._by_layer  # type: ignore[attr-defined]
        return by_layer[layer]

    def device_for(self, name: str) -> torch.device:
        """Where a state tensor of canonical name `layers.{i}.…` lives: layer i's stage; any
        other (`sidecar.logits`, model-wide state) on the last stage."""
        parts = name.split(".", 2)
        if parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit():
            return self.device_of(int(parts[1]))
        return self.last

    def __str__(self) -> str:
        return ",".join(str(s) for s in self.stages)

    # -- kernels per device --------------------------------------------------------
    def ops(self, use_triton: bool | None = None, deterministic: bool = True) -> Ops:
        """The hot ops for every stage: one device kind's bundle, or one that picks by the
        device of each call's first tensor (a GPU stage and a CPU stage). `deterministic`:
        the batch- and chunk-invariant bundles, CPU and Triton (kernels/ops.py)."""
        return self.per_device(lambda d: ops_for(d, use_triton, invariant=deterministic))

    def sliding_attention(self, use_triton: bool | None = None) -> SlidingAttentionOps:
        return self.per_device(lambda d: sliding_attention_for(d, use_triton))

    def per_device(self, make: Callable[[torch.device], T]) -> T:
        """`make(device)` when every stage is one kind of device; otherwise a bundle of the same
        frozen-dataclass type whose functions pick each kind's implementation by the device of
        their first (tensor) argument."""
        by_kind = {d.type: make(d) for d in self.devices}
        first = next(iter(by_kind.values()))
        if len(by_kind) == 1:
            return first
        changes: dict[str, Any] = {}
        for f in fields(first):  # type: ignore[arg-type]
            impls = {kind: getattr(bundle, f.name) for kind, bundle in by_kind.items()}
            if f.name == "name":
                changes["name"] = "|".join(f"{k}:{v}" for k, v in impls.items())
            else:
                changes[f.name] = _dispatch(impls)
        return replace(first, **changes)  # type: ignore[type-var]


def _dispatch(impls: dict[str, Callable[..., torch.Tensor]]) -> Callable[..., torch.Tensor]:
    def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return impls[x.device.type](x, *args, **kwargs)

    return call


def _device(text: str, item: str) -> torch.device:
    """A device a stage may run on: cpu, or cuda[:N] that torch sees."""
    try:
        d = torch.device(text)
    except RuntimeError:
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise PlacementError(
            f"--layer-split stage {item!r}: unknown device {text!r}; use cpu or cuda[:N] "
            "(ROCm builds of torch report cuda)"
        )
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise PlacementError(f"--layer-split stage {item!r}: torch sees no GPU here; use cpu stages")
        n = torch.cuda.device_count()
        if d.index is not None and d.index >= n:
            raise PlacementError(
                f"--layer-split stage {item!r}: {d} does not exist; this machine has cuda:0..cuda:{n - 1}"
            )
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    if d.type == "cpu":
        d = torch.device("cpu")  # cpu:N names the same memory
    return d
