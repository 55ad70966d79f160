"""A Hugging Face folder's projections quantized at load (--quantize), kept in the cache folder
so that a restart reads them instead of quantizing again.

One file per source and kind: `<cache dir>/.quantized/<source fingerprint>.<kind>.safetensors`
(the weights' content fingerprint, as the snapshot namespace takes it; the leading dot keeps the
disk tier's folder scan off it). Each tensor is a projection's blocks in the kernels' row layout,
by its Hugging Face name; the metadata names the kind, the source and the kernels' sources digest,
and a file whose metadata does not match (another kind, other weights, other kernel code) is
ignored and replaced. Written once per new set of blocks, atomically (a temporary file in the same
folder, then renamed), by the engine that made them; a file that cannot be read is logged and
quantized again: the store only ever saves work, it never changes what is computed.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FOLDER = ".quantized"


class QuantizedStore:
    """`files`: the checkpoint's weight files, fingerprinted (through the cache folder's
    fingerprints.json) only when a projection is first loaded, never by opening the checkpoint."""

    def __init__(self, cache_dir: Path, files: Sequence[Path], kind: str) -> None:
        self.cache_dir, self.files, self.kind = Path(cache_dir), tuple(files), kind
        self._blocks: dict[str, torch.Tensor] | None = None  # read at the first get
        self._new = False

    @functools.cached_property
    def metadata(self) -> dict[str, str]:
        from keepwarm.engine.cache.namespace import weights_fingerprint
        from keepwarm.kernels.ops import kernel_sources_digest

        source = weights_fingerprint(self.files, self.cache_dir / "fingerprints.json")
        return {"kind": self.kind, "source": source, "kernels": kernel_sources_digest()}

    @property
    def path(self) -> Path:
        return self.cache_dir / FOLDER / f"{self.metadata['source']}.{self.kind}.safetensors"

    def _read(self) -> dict[str, torch.Tensor]:
        if not self.path.is_file():
            return {}
        try:
            from safetensors import safe_open

            with safe_open(str(self.path), framework="pt", device="cpu") as f:
                if f.metadata() != self.metadata:
                    log.info("%s: made for other weights or kernels; quantizing again", self.path)
                    return {}
                return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        except Exception as e:  # unreadable: the blocks are made again and the file replaced
            log.warning("%s: unreadable (%s: %s); quantizing again", self.path, type(e).__name__, e)
            return {}

    def get(self, name: str) -> torch.Tensor | None:
        """Weight `name`'s stored blocks, or None."""
        if self._blocks is None:
            self._blocks = self._read()
        return self._blocks.get(name)

    def put(self, name: str, blocks: torch.Tensor) -> None:
        if self._blocks is None:
            self._blocks = self._read()
        self._blocks[name] = blocks
        self._new = True

    def flush(self) -> None:
        """Write the file when this load made blocks it lacked (atomically: never a torn file)."""
        if not self._new or self._blocks is None:
            return
        from safetensors.torch import save_file

        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            save_file({k: v.contiguous() for k, v in self._blocks.items()}, str(tmp), metadata=self.metadata)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:  # a full or read-only disk: the next start quantizes again
            log.warning("%s: not written (%s); the next start quantizes again", self.path, e)
            tmp.unlink(missing_ok=True)
            return
        self._new = False
        log.info("kept the quantized projections in %s", self.path)
