"""The CPU kernels' settings: the environment variables that switch them off or force a build or
a bf16 form, declared once as a keepwarm.settings model and read when a kernel is loaded (each
call reads the environment again: a test sets a variable and loads once more)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from keepwarm import settings
from keepwarm.settings import setting

KERNEL_DIR_ENV = "KEEPWARM_KERNEL_DIR"
CPU_KERNELS_ENV = "KEEPWARM_CPU_KERNELS"
CPU_LINEAR_ENV = "KEEPWARM_CPU_LINEAR"
ISA_ENV = "KEEPWARM_CPU_KERNEL_BUILD"
PREFILL_FORM_ENV = "KEEPWARM_CPU_PREFILL_FORM"


def _on(text: str) -> bool:
    """Only "0" switches a kernel off (any other text leaves it on, as it always has)."""
    return text.strip() != "0"


def _folder(text: str) -> Path | None:
    return Path(text) if text.strip() else None


@dataclass(frozen=True)
class KernelSettings:
    kernel_dir: Path | None = setting(
        None,
        flag=None,
        env=(KERNEL_DIR_ENV,),
        parse=_folder,
        default_text="<python prefix>/share/keepwarm/kernels/torch-<version>-py<X.Y>",
        help="where `python -m keepwarm.kernels.build` puts the compiled CPU kernels and engines load them from",
    )
    cpu_kernels: bool = setting(
        True, flag=None, env=(CPU_KERNELS_ENV,), parse=_on, help="0 keeps the row-invariant CPU kernels off"
    )
    cpu_linear: bool = setting(
        True, flag=None, env=(CPU_LINEAR_ENV,), parse=_on, help="0 keeps the CPU linear kernel off"
    )
    # "" = the best build this CPU supports; an unknown or unsupported one is ignored (logged)
    isa: str = setting("", flag=None, env=(ISA_ENV,), help="`avx512_bf16` or `avx2`: the CPU kernels' build")
    # "" = the start-up probe chooses; checked by cpu_linear.decide_prefill_form
    prefill_form: str = setting(
        "", flag=None, env=(PREFILL_FORM_ENV,), help="`fma` or `dpbf16`: the CPU kernels' bf16 form"
    )


def kernel_settings(env: Mapping[str, str] | None = None) -> KernelSettings:
    """The kernels' settings from `env` (default: the process's environment, read now)."""
    return settings.load(KernelSettings, None, env)
