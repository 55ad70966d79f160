"""Build-and-load for the row-invariant CPU kernels beside cpu_linear (attention, row-wise
ops): the same rules as cpu_linear (the build `cpu_linear.kernel_isa` picks for this CPU:
AVX-512 BF16 where the CPU has it, else the AVX2 build with the AVX-512 intrinsics emulated
(avx2 + fma + f16c; its own extension name), else none; compiled at first use with
torch.utils.cpp_extension and cached, any failure logged once and answered with None so the
caller stays on torch). KEEPWARM_CPU_KERNELS=0 keeps them off."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

from keepwarm.kernels.cpu_linear import (
    LDFLAGS,
    compile_flags,
    cpu_flags,
    extension_name,
    kernel_isa,
    missing_flags,
)

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
HEADERS = (CSRC / "vec_math.h",)


def load(source: Path, name: str, build_dir: Path | None = None) -> ModuleType | None:
    """The compiled extension `name` (with the build's suffix) from `source`, or None (with one
    log line saying why)."""
    if os.environ.get("KEEPWARM_CPU_KERNELS", "1") == "0":
        log.info("%s: disabled by KEEPWARM_CPU_KERNELS=0; using torch", name)
        return None
    flags = cpu_flags()
    isa = kernel_isa(flags)
    if isa is None:
        log.info("%s: this CPU lacks %s; using torch", name, missing_flags(flags))
        return None
    from torch.utils import cpp_extension

    name = extension_name(name, isa)
    try:
        if build_dir is not None:
            build_dir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(source)],
            # torch rebuilds when a source or a flag changes, not a header: their hash is a flag
            extra_cflags=compile_flags(isa, HEADERS),
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(CSRC)],
            build_directory=None if build_dir is None else str(build_dir),
        )
    except Exception as e:  # any build/load failure must leave the engine on torch
        log.warning("%s: building %s failed (%s: %s); using torch", name, source, type(e).__name__, e)
        return None
