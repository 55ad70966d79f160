"""A batch-invariant CPU matrix product (bf16 and fp32, any row count), with torch as the fallback.

`linear(x, weight, bias)` is a drop-in for `torch.nn.functional.linear` whose every output
is reduced over K in one fixed order whatever the number of rows M (decode step, prefill
chunk of any size, batch of any composition): a token's row is the same bits alone or in a
batch, so a prefix restored from the cache computes exactly like the uncached prefill.
torch's own product cannot promise that (oneDNN's bf16 GEMM changes its per-row order past
some M; fp32 differs between 1 and 2 rows). The C++ kernel (kernels/csrc/cpu_linear.cpp)
has a streaming path for M <= STREAM_ROWS (decode: bound by DRAM) and a register-tiled path
above (prefill: bound by arithmetic), giving identical bits.

The bf16 product has two forms with the same bits where both are used: "dpbf16" (one
vdpbf16ps per 32 products, right on every CPU) and "fma" (the same products as two fp32 FMAs
under DAZ/FTZ on unpacked x: a prefill inner loop ~2x faster, prefill 1.3-1.6x, decode of
DECODE_FMA_ROWS..STREAM_ROWS rows 1.1-1.2x where its arithmetic binds, where vdpbf16ps runs at a
quarter of the FMA rate, as on Sapphire/Emerald Rapids without AMX; ~2x slower where it runs
at the FMA rate, as on Zen 4). The form holds for both paths (decode below DECODE_FMA_ROWS rows
keeps vdpbf16ps: bound by DRAM, the FMA form is no faster there). Once per process, at load, a
probe picks: "fma" only when it matches vdpbf16ps on every probed lane (random bits plus
denormals, zeros, inf, NaN, values near overflow and near 2^-126) AND its prefill inner loop
wins the race by MIN_FMA_SPEEDUP; else "dpbf16". `prefill_form()` says which (the name predates
the decode form). KEEPWARM_CPU_PREFILL_FORM=fma|dpbf16 forces one (tests); forcing "fma" where
the probe finds it inexact raises instead of running it.

Two builds of the same source, chosen once per process from the CPU's flags (`kernel_isa`):
  - "avx512_bf16" (CPUs with avx512f/bw/vl, avx512_bf16 and avx512_vnni: Cooper Lake, Sapphire
    Rapids and later, Zen 4 and later): -mavx512* as below;
  - "avx2" (x86 CPUs without those but with avx2, fma and f16c: Zen 2/3, Haswell to Alder
    Lake): -mavx2 -mfma -mf16c -DKEEPWARM_AVX2, the AVX-512 intrinsics emulated lane by lane on
    pairs of 256-bit vectors (kernels/csrc/avx512_compat.h). The same contract, so the same
    invariance; its bits need not equal the AVX-512 build's (there "vdpbf16ps" is the same two
    FMAs as the "fma" form, under the caller's MXCSR: denormals kept, the forms one result by
    construction, so the race alone picks). Its extension has its own name (EXTENSION_NAME +
    "_avx2"), so a cached build of one never loads as the other.
  Else torch. KEEPWARM_CPU_KERNEL_BUILD=avx2 picks the AVX2 build on an AVX-512 CPU (tests).

  kernel when: the extension loaded (CPU has one build's flags and it built), x and
  weight share a dtype, bf16 or fp32, on CPU, weight is contiguous [N, K], x has >= 1 row
  (leading dims flattened), bias is None or a [N] CPU tensor of that dtype, and no autograd
  graph is being recorded through x, weight or bias. Otherwise torch (not invariant).

The extension is compiled when the project is installed (`python -m keepwarm.kernels.build`,
which ops/lib.sh's set-up and the engine image run: torch.utils.cpp_extension, a C++ compiler
and `ninja`) into the install's kernel folder, and loaded from there (kernels/prebuilt.py);
without that build it is compiled at first use. Any failure logs one warning and leaves
`available()` False: the engine then runs on torch alone.
Set KEEPWARM_CPU_LINEAR=0 to keep the kernel off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from keepwarm.kernels.kernel_settings import ISA_ENV, PREFILL_FORM_ENV, kernel_settings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_linear.cpp"
EXTENSION_NAME = "keepwarm_cpu_linear"
STREAM_ROWS = 16  # rows up to which the streaming (decode) path runs (kStreamRows in C++)
DECODE_FMA_ROWS = 4  # rows from which the decode path runs the "fma" form (kStreamFmaRows in C++)
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni")  # the AVX-512 build
AVX2_FLAGS = ("avx2", "fma", "f16c")  # the AVX2 build
# Explicit ISA flags rather than -march=native: a cached build must not use instructions the
# runtime check did not verify.
# -ffp-contract=off: no compiler-chosen fused multiply-adds, whose use could differ between
# the template instances that compute the same row in different paths.
CFLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
    "-ffp-contract=off",
    "-fopenmp",
)
AVX2_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-DKEEPWARM_AVX2")
# torch ships libgomp.so.1 and has it loaded already; linking against the same soname makes
# the kernel share torch's OpenMP pool (and its thread count) instead of starting a second.
LDFLAGS = ("-fopenmp",)

Isa = Literal["avx512_bf16", "avx2"]  # the two builds, preferred first
ISAS: tuple[Isa, ...] = get_args(Isa)
ISA_FLAGS: dict[Isa, tuple[str, ...]] = {"avx512_bf16": REQUIRED_FLAGS, "avx2": AVX2_FLAGS}
ISA_CFLAGS: dict[Isa, tuple[str, ...]] = {"avx512_bf16": CFLAGS, "avx2": AVX2_CFLAGS}
ISA_SUFFIX: dict[Isa, str] = {"avx512_bf16": "", "avx2": "_avx2"}
CSRC = SOURCE.parent
COMPAT_HEADER = CSRC / "avx512_compat.h"  # the AVX2 build's emulation of the AVX-512 intrinsics
RAW_HEADER = CSRC / "raw_kernels.h"  # every extension's raw entry points (cpu_decode_step calls them)

PrefillForm = Literal["fma", "dpbf16"]
PREFILL_FORMS: tuple[PrefillForm, ...] = get_args(PrefillForm)
MIN_FMA_SPEEDUP = 1.2  # the FMA form's inner loop must be this much faster (it also packs)
PROBE_VECTORS = 1 << 14  # x 16 lanes of the exactness probe (~15 ms)
PROBE_SEED = 0x5EED
RACE_REPS, RACE_ROUNDS = 256, 5  # each round ~0.1 ms per form; the best round of each counts


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (the first `flags` line of cpuinfo); empty when unreadable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def kernel_isa(flags: frozenset[str], forced: str | None = None) -> Isa | None:
    """The build for a CPU with these flags: "avx512_bf16" where it has REQUIRED_FLAGS, else
    "avx2" where it has AVX2_FLAGS, else None (torch). `forced` (default: KEEPWARM_CPU_KERNEL_BUILD,
    "" when unset) picks a build the CPU supports; an unknown or unsupported one is ignored."""
    forced = kernel_settings().isa if forced is None else forced
    supported = [isa for isa in ISAS if all(f in flags for f in ISA_FLAGS[isa])]
    for isa in supported:
        if isa == forced:
            return isa
    if forced:
        log.warning(
            "%s=%r: not a build this CPU supports (%s); ignored", ISA_ENV, forced, supported or "none"
        )
    return supported[0] if supported else None


def cpu_supports_kernel(flags: frozenset[str]) -> bool:
    """Whether one of the builds runs on a CPU with these flags."""
    return kernel_isa(flags, forced="") is not None


def missing_flags(flags: frozenset[str]) -> str:
    """What a CPU with these flags lacks for each build (for the log line)."""
    return "; ".join(
        f"{', '.join(f for f in ISA_FLAGS[isa] if f not in flags)} (the {isa} build)" for isa in ISAS
    )


def headers_digest(headers: tuple[Path, ...]) -> str:
    """A short hash of the headers' bytes: torch rebuilds when a source or a flag changes, not a
    header, so the builds pass it as a flag."""
    return hashlib.sha256(b"".join(h.read_bytes() for h in headers)).hexdigest()[:16]


def compile_flags(isa: Isa, headers: tuple[Path, ...] = ()) -> list[str]:
    """The compiler flags of a build, the headers it includes hashed in (every build: the raw
    entry points' header; the AVX2 build: also the compat header)."""
    headers = (*headers, RAW_HEADER)
    if isa == "avx2":
        headers = (*headers, COMPAT_HEADER)
    return [*ISA_CFLAGS[isa], f"-DKEEPWARM_HEADERS={headers_digest(headers)}"]


def extension_name(name: str, isa: Isa) -> str:
    """The extension's name for a build: the builds never share a cached module."""
    return name + ISA_SUFFIX[isa]


def build_extension(
    source: Path = SOURCE,
    name: str = EXTENSION_NAME,
    build_dir: Path | None = None,
    verbose: bool = False,
    isa: Isa = "avx512_bf16",
) -> ModuleType:
    """Load the C++ kernel's `isa` build, as extension `name` (callers pass
    extension_name(...)): the one `python -m keepwarm.kernels.build` made at install
    (kernels/prebuilt.py), compiled now when there is none. `build_dir` compiles there instead
    (tests). Raises on any build error."""
    from keepwarm.kernels import prebuilt

    return prebuilt.load(name, source, compile_flags(isa), LDFLAGS, folder=build_dir, verbose=verbose)


@dataclass(frozen=True)
class PrefillProbe:
    """What the one-time probe of an extension found on this CPU."""

    lanes: int  # lanes of the exactness probe
    mismatches: int  # of them, where the FMA form differs from vdpbf16ps (NaN matching any NaN)
    dpbf16_s: float  # best time of the vdpbf16ps inner loop
    fma_s: float  # best time of the FMA-form inner loop (same products)

    @property
    def exact(self) -> bool:
        return self.mismatches == 0

    @property
    def fma_speedup(self) -> float:
        return self.dpbf16_s / self.fma_s

    def form(self) -> PrefillForm:
        return "fma" if self.exact and self.fma_speedup >= MIN_FMA_SPEEDUP else "dpbf16"


@functools.cache
def probe_prefill(ext: ModuleType) -> PrefillProbe:
    """Run the extension's probes once per process (exactness ~15 ms, race ~1 ms)."""
    dpbf16_s, fma_s = ext.time_prefill_forms(RACE_REPS, RACE_ROUNDS)
    return PrefillProbe(
        lanes=PROBE_VECTORS * 16,
        mismatches=int(ext.fma_form_mismatches(PROBE_VECTORS, PROBE_SEED)),
        dpbf16_s=float(dpbf16_s),
        fma_s=float(fma_s),
    )


def decide_prefill_form(forced: str, probe: PrefillProbe) -> PrefillForm:
    """`forced` (KEEPWARM_CPU_PREFILL_FORM's value, "" when unset) if valid, else the probe's
    choice. Raises ValueError naming the variable for an unknown value, or for "fma" where the
    probe found the FMA form inexact."""
    if forced == "":
        return probe.form()
    if forced not in PREFILL_FORMS:
        raise ValueError(
            f"{PREFILL_FORM_ENV}={forced!r}: must be one of {', '.join(PREFILL_FORMS)} "
            "(or unset, to let the start-up probe choose)"
        )
    if forced == "fma" and not probe.exact:
        raise ValueError(
            f"{PREFILL_FORM_ENV}=fma: on this CPU the FMA form differs from vdpbf16ps on {probe.mismatches} of "
            f"{probe.lanes} probed lanes, so it would break the kernel's invariance; unset it or set dpbf16"
        )
    return "fma" if forced == "fma" else "dpbf16"


def choose_prefill_form(ext: ModuleType) -> PrefillForm:
    """The bf16 form (prefill, and decode from DECODE_FMA_ROWS rows) for this extension, from
    KEEPWARM_CPU_PREFILL_FORM (read now) and the extension's probe (`decide_prefill_form`)."""
    forced = kernel_settings().prefill_form
    probe = probe_prefill(ext)
    form = decide_prefill_form(forced, probe)
    log.info(
        "cpu_linear: bf16 form %s (%s; FMA form exact: %s, prefill inner loop %.2fx vdpbf16ps)",
        form,
        f"forced by {PREFILL_FORM_ENV}" if forced else "probed",
        probe.exact,
        probe.fma_speedup,
    )
    return form


@dataclass(frozen=True)
class CpuLinear:
    """`linear` bound to one loaded extension (or none: then it is torch's F.linear) and its
    bf16 form (both paths)."""

    ext: ModuleType | None
    prefill_form: PrefillForm = "dpbf16"

    def available(self) -> bool:
        return self.ext is not None

    def uses_kernel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """Whether `linear(x, weight, bias)` runs the C++ kernel (else torch). The rules live
        in the C++ `eligible` (one source of truth, checked in ~1 us per call)."""
        return self.ext is not None and bool(self.ext.eligible(x, weight, bias))

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        force_tiled: bool = False,
    ) -> torch.Tensor:
        """F.linear(x, weight, bias): x [..., K], weight [N, K], bias [N] -> [..., N].

        `out_dtype=torch.float32` returns the kernel's fp32 sums unrounded (on the fallback,
        torch's result cast to fp32); None keeps torch's result dtype (bf16 for bf16 inputs).
        `force_tiled` runs the prefill path whatever M (tests: both paths agree bitwise)."""
        if out_dtype is not None and out_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"out_dtype must be None, torch.bfloat16 or torch.float32, not {out_dtype}")
        if self.ext is not None:
            y = self.ext.try_linear(
                x, weight, bias, out_dtype == torch.float32, force_tiled, self.prefill_form == "fma"
            )
            if y is not None:
                return y
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)


def load(
    source: Path = SOURCE,
    name: str = EXTENSION_NAME,
    flags: frozenset[str] | None = None,
    build_dir: Path | None = None,
) -> CpuLinear:
    """Build and load the kernel's build for this CPU (`kernel_isa`), and choose its bf16 form
    (`bind`). Without either build's CPU features, or when the build fails, or with KEEPWARM_CPU_LINEAR=0, the result falls back
    to torch (and says why in one log line). Raises only for a bad KEEPWARM_CPU_PREFILL_FORM."""
    if not kernel_settings().cpu_linear:
        log.info("cpu_linear: disabled by KEEPWARM_CPU_LINEAR=0; using torch F.linear")
        return CpuLinear(None)
    flags = cpu_flags() if flags is None else flags
    isa = kernel_isa(flags)
    if isa is None:
        log.info("cpu_linear: CPU lacks %s; using torch F.linear", missing_flags(flags))
        return CpuLinear(None)
    if isa == "avx2":
        lacks = [f for f in REQUIRED_FLAGS if f not in flags]
        why = f"CPU lacks {', '.join(lacks)}" if lacks else f"chosen by {ISA_ENV}"
        log.info("cpu_linear: the AVX2 build, AVX-512 intrinsics emulated (%s)", why)
    try:
        ext = build_extension(source, extension_name(name, isa), build_dir, isa=isa)
    except Exception as e:  # any build/load failure must leave the engine on torch
        log.warning(
            "cpu_linear: building %s failed (%s: %s); using torch F.linear", source, type(e).__name__, e
        )
        return CpuLinear(None)
    return bind(ext)


def bind(ext: ModuleType) -> CpuLinear:
    """The kernel of a loaded extension in the bf16 form chosen now (KEEPWARM_CPU_PREFILL_FORM
    read again; the probe runs once per extension)."""
    return CpuLinear(ext, choose_prefill_form(ext))


@functools.cache
def default() -> CpuLinear:
    """The process's kernel, built once on first use (the compiled module is per-process
    state anyway: a Python extension loads once)."""
    return load()


def available() -> bool:
    """True when the C++ kernel is loaded and `linear` uses it for bf16/fp32 inputs."""
    return default().available()


def prefill_form() -> PrefillForm | None:
    """The process kernel's bf16 form (prefill, and decode from DECODE_FMA_ROWS rows); None when
    the kernel is not loaded."""
    k = default()
    return k.prefill_form if k.available() else None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Drop-in for F.linear(x, weight, bias); the invariant kernel for bf16/fp32 inputs."""
    return default()(x, weight, bias, out_dtype)
