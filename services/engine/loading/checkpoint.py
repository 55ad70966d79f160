"""A Hugging Face checkpoint folder: config.json, safetensors weights (single file
or sharded with an index), tokenizer.json and tokenizer_config.json.

Weights are read one tensor at a time straight into the runtime dtype and
device, so a full second copy of the model never exists in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """The checkpoint folder is unusable; the message names the file or key to fix."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict[str, Any]
    name_to_file: dict[str, Path]  # tensor name -> the safetensors file holding it

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def num_layers(self) -> int:
        """`num_hidden_layers` of the language model (under `text_config` for a multimodal
        config.json): what a layer split places."""
        sub = self.config.get("text_config")
        cfg = sub if isinstance(sub, dict) and "num_hidden_layers" in sub else self.config
        try:
            return int(cfg["num_hidden_layers"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{self.path / 'config.json'}: num_hidden_layers is missing or not an integer"
            ) from None

    @property
    def weight_files(self) -> tuple[Path, ...]:
        return tuple(sorted(set(self.name_to_file.values())))

    def has(self, name: str) -> bool:
        return name in self.name_to_file

    def load(
        self,
        name: str,
        dtype: torch.dtype | None,
        device: torch.device | str,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Read tensor `name`, cast to `dtype` (None keeps it) on `device`.
        With `shape`, a mismatch raises a CheckpointError naming the key and file."""
        file = self.name_to_file.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: weight {name!r} is missing from the safetensors files")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            t = f.get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{file.name}: weight {name!r} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}"
            )
        return t.to(device=device, dtype=dtype if dtype is not None else t.dtype)

    def file(self, name: str) -> Path:
        p = self.path / name
        if not p.is_file():
            raise CheckpointError(f"{self.path}: {name} is missing")
        return p


def open_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"model folder {root} does not exist (pass a Hugging Face checkpoint folder)")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root}: config.json is missing")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    return Checkpoint(root, config, _index_weights(root))


def _index_weights(root: Path) -> dict[str, Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: needs a JSON object with a 'weight_map' ({e})") from e
        out: dict[str, Path] = {}
        for name, fname in weight_map.items():
            f = root / fname
            if not f.is_file():
                raise CheckpointError(f"{index}: shard {fname} (holding {name!r}) is missing")
            out[name] = f
        return out
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{root}: no model.safetensors (or *.safetensors with model.safetensors.index.json)"
        )
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for name in h.keys():
                    out[name] = f
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
    return out
