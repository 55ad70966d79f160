"""Where the CPU kernels' compiled extensions live, and loading them without a compiler.

`python -m keepwarm.kernels.build` (run by ops/lib.sh's set-up, so by ops/up and ops/test, and
by the engine image build) compiles each extension once into the install's kernel folder

    $KEEPWARM_KERNEL_DIR, else <sys.prefix>/share/keepwarm/kernels/torch-<version>-py<X.Y>/
        <extension name>-<key>/   <extension name>.so, the build's files, and BUILT (written last)

where the key hashes everything that changes the binary: the source, every file in
kernels/csrc (the headers), the compiler and linker flags, torch's and Python's versions and
the machine. At run time `load` imports the matching build directly: no compiler, no ninja,
no write access. A changed source or flag is a new key, so an engine never loads a stale
build, and a build a running engine has loaded is never rewritten under it.

Without a matching build (the install step was skipped, or the sources changed since) the
extension is compiled at first use as before, with a warning naming the build command: into
the kernel folder when it is writable (so the next process finds it), else into torch's
extension cache (~/.cache/torch_extensions or $TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from keepwarm.kernels.kernel_settings import kernel_settings

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
MARKER = "BUILT"  # written after the build succeeded: a folder without it is not used
BUILD_COMMAND = "python -m keepwarm.kernels.build"


def kernel_root() -> Path:
    """The folder the builds go to and are loaded from (see the module docstring)."""
    folder = kernel_settings().kernel_dir
    if folder is not None:
        return folder
    tag = f"torch-{torch.__version__}-py{sys.version_info[0]}.{sys.version_info[1]}"
    return Path(sys.prefix) / "share" / "keepwarm" / "kernels" / tag


def build_key(name: str, source: Path, cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """A short hash of everything that makes extension `name`'s binary."""
    h = hashlib.sha256()
    for part in (
        name,
        torch.__version__,
        sys.implementation.cache_tag or "",
        platform.machine(),
        *cflags,
        "--",
        *ldflags,
    ):
        h.update(part.encode() + b"\0")
    h.update(source.read_bytes())
    for f in sorted(CSRC.iterdir()):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def build_dir(name: str, key: str) -> Path:
    return kernel_root() / f"{name}-{key}"


def _library(folder: Path, name: str) -> Path:
    return folder / f"{name}.so"  # torch.utils.cpp_extension's LIB_EXT on Linux


def load_built(name: str, key: str) -> ModuleType | None:
    """The built extension `name` with this key, imported; None when there is none."""
    folder = build_dir(name, key)
    lib = _library(folder, name)
    if not (folder / MARKER).is_file() or not lib.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, lib)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compile(
    folder: Path | None,
    name: str,
    source: Path,
    cflags: Sequence[str],
    ldflags: Sequence[str],
    include_paths: Sequence[str],
    verbose: bool,
) -> ModuleType:
    """torch.utils.cpp_extension.load: compile (or find torch's own cached build) and import."""
    from torch.utils import cpp_extension

    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    module: ModuleType = cpp_extension.load(
        name=name,
        sources=[str(source)],
        extra_cflags=list(cflags),
        extra_ldflags=list(ldflags),
        extra_include_paths=list(include_paths),
        build_directory=None if folder is None else str(folder),
        verbose=verbose,
    )
    return module


def _mark_built(folder: Path, name: str, key: str, seconds: float) -> None:
    doc = {"name": name, "key": key, "torch": torch.__version__, "seconds": round(seconds, 1)}
    tmp = folder / f"{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc) + "\n")
    os.replace(tmp, folder / MARKER)


def build(
    name: str,
    source: Path,
    cflags: Sequence[str],
    ldflags: Sequence[str],
    include_paths: Sequence[str] = (),
    verbose: bool = False,
) -> tuple[Path, bool]:
    """Compile extension `name` into the kernel folder unless its build is there already;
    (its folder, whether it was compiled now). Raises on a build error."""
    key = build_key(name, source, cflags, ldflags)
    folder = build_dir(name, key)
    if (folder / MARKER).is_file() and _library(folder, name).is_file():
        return folder, False
    t0 = time.monotonic()
    _compile(folder, name, source, cflags, ldflags, include_paths, verbose)
    _mark_built(folder, name, key, time.monotonic() - t0)
    return folder, True


def prune(name: str, keep: Path) -> list[Path]:
    """Remove the other builds of extension `name` (older sources or flags) from the kernel
    folder; a process that has one loaded keeps its mapping."""
    removed: list[Path] = []
    root = kernel_root()
    if not root.is_dir():
        return removed
    for folder in root.glob(f"{name}-*"):
        rest = folder.name[len(name) + 1 :]
        if (
            folder != keep
            and folder.is_dir()
            and len(rest) == 16
            and all(c in "0123456789abcdef" for c in rest)
        ):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def load(
    name: str,
    source: Path,
    cflags: Sequence[str],
    ldflags: Sequence[str],
    include_paths: Sequence[str] = (),
    folder: Path | None = None,
    verbose: bool = False,
) -> ModuleType:
    """Extension `name`: compiled into `folder` when one is given (torch decides whether to
    rebuild); else the install's build (see the module docstring), compiled now when there is
    none. Raises on a build or load error."""
    if folder is not None:
        return _compile(folder, name, source, cflags, ldflags, include_paths, verbose)
    key = build_key(name, source, cflags, ldflags)
    module = load_built(name, key)
    if module is not None:
        return module
    target = build_dir(name, key)
    where = target if _writable(target) else None
    log.warning(
        "%s: no build for these sources in %s (run `%s` after installing); compiling it now into %s",
        name,
        kernel_root(),
        BUILD_COMMAND,
        target if where is not None else "torch's extension cache",
    )
    t0 = time.monotonic()
    module = _compile(where, name, source, cflags, ldflags, include_paths, verbose)
    if where is not None:
        with contextlib.suppress(OSError):
            _mark_built(where, name, key, time.monotonic() - t0)
    return module
