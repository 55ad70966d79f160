"""Build the CPU kernels at install time, so that no engine compiles them at its first request.

  python -m keepwarm.kernels.build [--isa auto|supported|avx512_bf16|avx2] [--check] [--jobs N] [--quiet]

Compiles the six extensions (cpu_linear, cpu_attention, cpu_rowwise, cpu_delta_rule,
cpu_quant_linear, cpu_decode_step) into the install's kernel folder (kernels/prebuilt.py: $KEEPWARM_KERNEL_DIR,
else <sys.prefix>/share/keepwarm/kernels/...), where the engine loads them from. A build already
there for the same sources and flags is kept (a second run takes a second or two); older
builds of the same extensions are removed.

`--isa auto` (the default) builds what the engine will load on this CPU (`cpu_linear.kernel_isa`:
AVX-512 BF16 where the CPU has it, else AVX2, KEEPWARM_CPU_KERNEL_BUILD honoured);
`supported` every build this CPU runs (both on an AVX-512 BF16 CPU). A build this CPU cannot
run is refused: importing it could fault. On a CPU with neither there is nothing to build
(the engine runs on torch) and the exit status is 0. `--check` builds nothing and exits 1
when a build is missing. ops/lib.sh runs this after every install (ops/up, ops/test), and the
engine image's Dockerfile in its build.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from keepwarm.kernels import (
    cpu_attention,
    cpu_decode_step,
    cpu_delta_rule,
    cpu_extension,
    cpu_linear,
    cpu_quant_linear,
    cpu_rowwise,
    prebuilt,
)


@dataclass(frozen=True)
class Kernel:
    """One extension: its source, base name, and whether it takes the shared headers."""

    source: Path
    name: str
    shared_headers: bool = True  # cpu_extension's builds: vec_math.h hashed in, csrc on -I
    extra_flags: tuple[str, ...] = ()  # added to every build's flags (as its module loads it)

    def spec(self, isa: cpu_linear.Isa) -> tuple[str, list[str], list[str]]:
        """(extension name, compile flags, include paths) of its `isa` build, exactly as the
        engine loads it (so the keys match)."""
        name = cpu_linear.extension_name(self.name, isa)
        if self.shared_headers:
            return name, cpu_extension.flags(isa, self.extra_flags), [str(cpu_extension.CSRC)]
        return name, cpu_linear.compile_flags(isa), []


KERNELS = (
    Kernel(cpu_linear.SOURCE, cpu_linear.EXTENSION_NAME, shared_headers=False),
    Kernel(cpu_attention.SOURCE, cpu_attention.EXTENSION_NAME),
    Kernel(cpu_rowwise.SOURCE, cpu_rowwise.EXTENSION_NAME),
    Kernel(cpu_delta_rule.SOURCE, cpu_delta_rule.EXTENSION_NAME),
    Kernel(
        cpu_quant_linear.SOURCE, cpu_quant_linear.EXTENSION_NAME, extra_flags=cpu_quant_linear.EXTRA_FLAGS
    ),
    Kernel(cpu_decode_step.SOURCE, cpu_decode_step.EXTENSION_NAME),
)


def isas_for(choice: str, flags: frozenset[str]) -> list[cpu_linear.Isa]:
    """The builds `--isa choice` asks for on a CPU with these flags; ValueError for a build
    the CPU cannot run."""
    supported = [isa for isa in cpu_linear.ISAS if all(f in flags for f in cpu_linear.ISA_FLAGS[isa])]
    if choice == "auto":
        isa = cpu_linear.kernel_isa(flags)
        return [] if isa is None else [isa]
    if choice == "supported":
        return supported
    for isa in cpu_linear.ISAS:
        if isa == choice:
            if isa not in supported:
                lacks = ", ".join(f for f in cpu_linear.ISA_FLAGS[isa] if f not in flags)
                raise ValueError(
                    f"--isa {isa}: this CPU lacks {lacks}, so that build could not be loaded (nor checked) here"
                )
            return [isa]
    raise ValueError(f"--isa {choice!r}: one of auto, supported, {', '.join(cpu_linear.ISAS)}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m keepwarm.kernels.build",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--isa", default="auto", help="auto (default), supported, avx512_bf16 or avx2")
    p.add_argument("--check", action="store_true", help="build nothing; exit 1 when a build is missing")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.add_argument("--quiet", action="store_true", help="say nothing about builds already there")
    p.add_argument(
        "--jobs", type=int, default=min(4, os.cpu_count() or 1), help="extensions compiled at once"
    )
    a = p.parse_args(argv)
    flags = cpu_linear.cpu_flags()
    try:
        isas = isas_for(a.isa, flags)
    except ValueError as e:
        p.error(str(e))
    root = prebuilt.kernel_root()
    if not isas:
        print(
            f"keepwarm kernels: this CPU lacks {cpu_linear.missing_flags(flags)}: nothing to build "
            "(the engine runs on torch's kernels)",
            flush=True,
        )
        return 0
    specs = [(k, *k.spec(isa)) for isa in isas for k in KERNELS]
    failed = 0
    if a.check:
        for k, name, cflags, _ in specs:
            folder = prebuilt.build_dir(name, prebuilt.build_key(name, k.source, cflags, cpu_linear.LDFLAGS))
            ok = (folder / prebuilt.MARKER).is_file()
            print(f"keepwarm kernels: {name}: {'built' if ok else 'missing'} ({folder})", flush=True)
            failed += not ok
    else:

        def one(spec: tuple[Kernel, str, list[str], list[str]]) -> str:
            k, name, cflags, includes = spec
            t0 = time.monotonic()
            folder, compiled = prebuilt.build(name, k.source, cflags, cpu_linear.LDFLAGS, includes, a.verbose)
            prebuilt.prune(name, keep=folder)
            if not compiled:
                return "" if a.quiet else f"keepwarm kernels: {name}: up to date ({folder})"
            return f"keepwarm kernels: {name}: built in {time.monotonic() - t0:.1f} s ({folder})"

        # one source per extension: the compilers run side by side (ninja runs one each)
        with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
            futures = [(spec[1], pool.submit(one, spec)) for spec in specs]
            for name, fut in futures:
                try:
                    line = fut.result()
                    if line:
                        print(line, flush=True)
                except Exception as e:  # report every extension, then fail
                    print(f"keepwarm kernels: {name}: build failed: {type(e).__name__}: {e}", file=sys.stderr)
                    failed += 1
    if failed:
        print(
            f"keepwarm kernels: {failed} build(s) {'missing' if a.check else 'failed'} under {root}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
