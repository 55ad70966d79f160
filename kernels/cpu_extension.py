"""Build-and-load for the row-invariant CPU kernels beside cpu_linear (attention, row-wise
ops): the same rules as cpu_linear (AVX-512 CPUs only, compiled at first use with
torch.utils.cpp_extension and cached, any failure logged once and answered with None so the
caller stays on torch). KEEPWARM_CPU_KERNELS=0 keeps them off."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

from keepwarm.kernels.cpu_linear import CFLAGS, LDFLAGS, cpu_flags, cpu_supports_kernel

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
HEADERS = (CSRC / "vec_math.h",)


def load(source: Path, name: str, build_dir: Path | None = None) -> ModuleType | None:
    """The compiled extension `name` from `source`, or None (with one log line saying why)."""
    if os.environ.get("KEEPWARM_CPU_KERNELS", "1") == "0":
        log.info("%s: disabled by KEEPWARM_CPU_KERNELS=0; using torch", name)
        return None
    if not cpu_supports_kernel(cpu_flags()):
        log.info("%s: this CPU lacks AVX-512 BF16; using torch", name)
        return None
    from torch.utils import cpp_extension

    # torch rebuilds when a source or a flag changes, not a header: the headers' hash is a flag
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    try:
        if build_dir is not None:
            build_dir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(
            name=name,
            sources=[str(source)],
            extra_cflags=[*CFLAGS, f"-DKEEPWARM_HEADERS={digest}"],
            extra_ldflags=list(LDFLAGS),
            extra_include_paths=[str(CSRC)],
            build_directory=None if build_dir is None else str(build_dir),
        )
    except Exception as e:  # any build/load failure must leave the engine on torch
        log.warning("%s: building %s failed (%s: %s); using torch", name, source, type(e).__name__, e)
        return None
