"""Build-and-load for the row-invariant CPU kernels beside cpu_linear (attention, row-wise
ops): the same rules as cpu_linear (the build `cpu_linear.kernel_isa` picks for this CPU:
AVX-512 BF16 where the CPU has it, else the AVX2 build with the AVX-512 intrinsics emulated
(avx2 + fma + f16c; its own extension name), else none; built at install by
`python -m keepwarm.kernels.build` and loaded from the install's kernel folder
(kernels/prebuilt.py), compiled at first use only without that build; any failure logged
once and answered with None so the caller stays on torch). KEEPWARM_CPU_KERNELS=0 keeps them
off. Every tensor entry point releases the GIL while it computes (as torch's own ops do), so the
HTTP thread answers and streams while the generation thread is inside a kernel."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from keepwarm.kernels.cpu_linear import (
    LDFLAGS,
    Isa,
    compile_flags,
    cpu_flags,
    extension_name,
    kernel_isa,
    missing_flags,
)
from keepwarm.kernels.kernel_settings import kernel_settings

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
HEADERS = (CSRC / "vec_math.h",)


def load(
    source: Path, name: str, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()
) -> ModuleType | None:
    """The compiled extension `name` (with the build's suffix) from `source` (compiled with the
    build's flags plus `extra_flags`), or None (with one log line saying why)."""
    if not kernel_settings().cpu_kernels:
        log.info("%s: disabled by KEEPWARM_CPU_KERNELS=0; using torch", name)
        return None
    flags = cpu_flags()
    isa = kernel_isa(flags)
    if isa is None:
        log.info("%s: this CPU lacks %s; using torch", name, missing_flags(flags))
        return None
    name = extension_name(name, isa)
    try:
        return build(source, name, isa, build_dir, extra_flags)
    except Exception as e:  # any build/load failure must leave the engine on torch
        log.warning("%s: building %s failed (%s: %s); using torch", name, source, type(e).__name__, e)
        return None


def flags(isa: Isa, extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The compiler flags of an extension's `isa` build (the shared headers hashed in)."""
    return [*compile_flags(isa, HEADERS), *extra_flags]


def build(
    source: Path, name: str, isa: Isa, build_dir: Path | None = None, extra_flags: tuple[str, ...] = ()
) -> ModuleType:
    """The extension `name` (already suffixed for `isa`) from `source`: the install's build
    (kernels/prebuilt.py), compiled now when there is none, or compiled into `build_dir`.
    Raises on any build error."""
    from keepwarm.kernels import prebuilt

    # torch rebuilds when a source or a flag changes, not a header: their hash is a flag
    return prebuilt.load(
        name, source, flags(isa, extra_flags), LDFLAGS, include_paths=[str(CSRC)], folder=build_dir
    )
