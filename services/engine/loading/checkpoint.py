"""A model checkpoint: a Hugging Face folder (config.json, safetensors weights in a single
file or sharded with an index, tokenizer.json and tokenizer_config.json), or a GGUF file
(loading/gguf_checkpoint.py), both seen through the same interface: a config.json-shaped
`config`, weights by Hugging Face name, the tokenizer and the chat template.

Weights are read one tensor at a time straight into the runtime dtype and
device, so a full second copy of the model never exists in memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from keepwarm.engine.loading.chat_template import ChatTemplate
from keepwarm.engine.loading.quantized_store import QuantizedStore
from keepwarm.engine.loading.tokenizer import Tokenizer
from keepwarm.kernels.quant_weight import QuantKind, QuantWeight, quantize_q4_k, quantize_q8_0, row_bytes

_DTYPE_BYTES = {"I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class CheckpointError(ValueError):
    """The checkpoint folder is unusable; the message names the file or key to fix."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    config: dict[str, Any]
    name_to_file: dict[str, Path]  # tensor name -> the safetensors file holding it
    # projections stay in their quantized blocks where the file has blocks the kernels multiply
    # (`load_linear`; a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K): --weights as-file
    keep_blocks: bool = field(default=False, compare=False)
    # "q8_0" / "q4_k": a Hugging Face folder's projections quantized to blocks at load (--quantize),
    # read from and kept in `quantized_store` where there is one (a cache folder)
    quantize: str = field(default="", compare=False)
    quantized_store: QuantizedStore | None = field(default=None, compare=False, repr=False)
    # called after each weight is read (load progress: models/__init__.py's build_backend)
    on_load: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False, compare=False)

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

    @property
    def weights_format(self) -> str:
        """How the weights are stored and run (part of a snapshot's namespace)."""
        return f"safetensors-{self.quantize}" if self.quantize else "safetensors"

    @property
    def weight_names_matter(self) -> bool:
        """Whether the weight files' base names are part of the weights' identity (a sharded
        folder's index names its shards; one GGUF file is its bytes alone)."""
        return True

    def runtime_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the weights take loaded at `dtype` (integer tensors as stored)."""
        size = torch.empty((), dtype=dtype).element_size()
        total = 0
        for f in self.weight_files:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for name in h.keys():
                    s = h.get_slice(name)
                    n = 1
                    for d in s.get_shape():
                        n *= int(d)
                    kind = s.get_dtype()
                    shape = s.get_shape()
                    made = _quantize_kind(self.quantize, int(shape[1])) if len(shape) == 2 else None
                    if made is not None and kind.startswith(("F", "BF")):
                        # a matrix --quantize may make blocks (the projections)
                        total += int(shape[0]) * row_bytes(made, int(shape[1]))
                        continue
                    total += n * (size if kind.startswith(("F", "BF")) else _DTYPE_BYTES.get(kind, 1))
        return total

    def open_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.path)

    def open_chat_template(self, tokenizer: Tokenizer) -> ChatTemplate:
        return ChatTemplate.from_dir(self.path, tokenizer)

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
        t, where = self._read(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{where}: weight {name!r} has shape {tuple(t.shape)}, the config implies {tuple(shape)}"
            )
        for report in self.on_load:
            report()
        return fresh_tensor(t, dtype, device)

    def load_linear(
        self, name: str, dtype: torch.dtype, device: torch.device | str, shape: tuple[int, int]
    ) -> torch.Tensor | QuantWeight:
        """A projection's weight [N, K]: in its blocks where `keep_blocks` and the file has
        blocks the kernels multiply, made Q8_0 blocks with `quantize` (K a multiple of 32), else
        as `load` reads it."""
        kind = _quantize_kind(self.quantize, shape[1])
        if kind is None:
            return self.load(name, dtype, device, shape=shape)
        store = self.quantized_store
        kept = store.get(name) if store is not None else None
        if kept is not None and tuple(kept.shape) == (shape[0], row_bytes(kind, shape[1])):
            for report in self.on_load:
                report()
            return QuantWeight(kind, kept, shape[1]).to(device)
        dense = self.load(name, torch.float32, "cpu", shape=shape)
        made = quantize_q4_k(dense) if kind == "Q4_K" else quantize_q8_0(dense)
        if store is not None:
            store.put(name, made.blocks)
        return made.to(device)

    def _read(self, name: str) -> tuple[torch.Tensor, str]:
        """Tensor `name` as stored, and where it was read (for messages)."""
        file = self.name_to_file.get(name)
        if file is None:
            raise CheckpointError(f"{self.path}: weight {name!r} is missing from the safetensors files")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return f.get_tensor(name), file.name

    def file(self, name: str) -> Path:
        p = self.path / name
        if not p.is_file():
            raise CheckpointError(f"{self.path}: {name} is missing")
        return p


def _quantize_kind(quantize: str, k: int) -> QuantKind | None:
    """The block kind --quantize makes of a projection K wide: Q4_K where K is whole super-blocks
    (else Q8_0, as llama.cpp falls back), Q8_0 where K is whole blocks; None: kept dense."""
    if quantize == "q4_k" and k % 256 == 0:
        return "Q4_K"
    if quantize in ("q8_0", "q4_k") and k % 32 == 0:
        return "Q8_0"
    return None


def fresh_tensor(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str) -> torch.Tensor:
    """`t` cast to `dtype` on `device` in newly allocated, contiguous memory. A tensor read
    from a file can start at any byte offset (safetensors packs them back to back), and torch's
    CPU kernels pick paths by alignment: the same values at another offset can give other bits.
    Fresh memory has the allocator's alignment, so a weight's bits never depend on where the file
    put it, nor on how the file laid it out (one 3-D tensor or one per expert)."""
    return t.to(
        device=device,
        dtype=dtype if dtype is not None else t.dtype,
        memory_format=torch.contiguous_format,
        copy=True,
    )


def gguf_in(path: Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a folder without a
    config.json. None for a Hugging Face folder; several .gguf files in one folder are refused."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise CheckpointError(
                f"{path}: holds {len(found)} .gguf files ({', '.join(f.name for f in found)}); "
                "pass the one to serve as --model FILE.gguf"
            )
        return found[0] if found else None
    return None


def open_checkpoint(
    path: str | Path, keep_blocks: bool = False, quantize: str = "", cache_dir: Path | None = None
) -> Checkpoint:
    """The checkpoint at `path` (a Hugging Face folder or a GGUF file); `keep_blocks`: a GGUF
    file's quantized projections are loaded as blocks; `quantize` ("q8_0", "q4_k"): a folder's are
    quantized to blocks at load (Checkpoint.load_linear), kept in `cache_dir` for the next load
    (loading/quantized_store.py; the engine writes them once the model is built)."""
    root = Path(path).expanduser()
    gguf = gguf_in(root)
    if gguf is not None:
        from keepwarm.engine.loading.gguf_checkpoint import open_gguf

        return open_gguf(gguf, keep_blocks=keep_blocks)
    if not root.is_dir():
        raise CheckpointError(
            f"model {root} does not exist (pass a Hugging Face checkpoint folder or a .gguf file)"
        )
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{root}: config.json is missing (or pass a .gguf file)")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
    weights = _index_weights(root)
    store = None
    if quantize and cache_dir is not None:
        store = QuantizedStore(Path(cache_dir), sorted(set(weights.values())), quantize)
    return Checkpoint(root, config, weights, quantize=quantize, quantized_store=store)


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
