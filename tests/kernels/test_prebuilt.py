"""The CPU kernels are built at install (`python -m keepwarm.kernels.build`, kernels/prebuilt.py)
and loaded from there by a new process without compiling anything; the build step and the
runtime agree on every key; a changed source is a new key, never a stale module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from keepwarm.kernels import build, cpu_extension, cpu_linear, prebuilt
from keepwarm.kernels.kernel_settings import KERNEL_DIR_ENV

TINY = """#include <pybind11/pybind11.h>
int answer() { return ANSWER; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


def test_the_build_step_and_the_runtime_load_the_same_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """For each kernel and build, what the runtime asks prebuilt.load for has the key that
    `python -m keepwarm.kernels.build` builds under."""
    asked: list[tuple[str, str]] = []

    def fake_load(name: str, source: Path, cflags: Any, ldflags: Any, **kw: Any) -> ModuleType:
        assert kw.get("folder") is None  # the install's build, not a folder of the caller's
        asked.append((name, prebuilt.build_key(name, source, cflags, ldflags)))
        return ModuleType(name)

    monkeypatch.setattr(prebuilt, "load", fake_load)
    for isa in cpu_linear.ISAS:
        for k in build.KERNELS:
            name, cflags, _ = k.spec(isa)
            if k.shared_headers:
                cpu_extension.build(k.source, name, isa, extra_flags=k.extra_flags)
            else:
                cpu_linear.build_extension(k.source, name, isa=isa)
            assert asked.pop() == (name, prebuilt.build_key(name, k.source, cflags, cpu_linear.LDFLAGS))
    names = {k.spec(isa)[0] for isa in cpu_linear.ISAS for k in build.KERNELS}
    assert len(names) == 2 * len(build.KERNELS)  # every build of every kernel has its own name


def test_the_build_step_builds_what_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_linear.ISA_ENV, raising=False)
    zen4 = frozenset({*cpu_linear.AVX2_FLAGS, *cpu_linear.REQUIRED_FLAGS})
    zen3 = frozenset(cpu_linear.AVX2_FLAGS)
    assert build.isas_for("auto", zen4) == ["avx512_bf16"]
    assert build.isas_for("supported", zen4) == ["avx512_bf16", "avx2"]
    assert build.isas_for("auto", zen3) == build.isas_for("supported", zen3) == ["avx2"]
    assert build.isas_for("avx2", zen4) == ["avx2"]
    assert build.isas_for("auto", frozenset()) == []
    with pytest.raises(ValueError, match="lacks avx512f"):
        build.isas_for("avx512_bf16", zen3)  # its import could fault here
    with pytest.raises(ValueError, match="one of"):
        build.isas_for("sse", zen4)
    monkeypatch.setenv(cpu_linear.ISA_ENV, "avx2")
    assert build.isas_for("auto", zen4) == ["avx2"]  # what the engine will load


def _load_in_new_process(tmp: Path, source: Path, name: str) -> dict[str, Any]:
    """prebuilt.load in a fresh process whose compiler is gone (any compile raises), with a new
    HOME and no torch extension cache."""
    code = f"""
import json, sys
from pathlib import Path
from keepwarm.kernels import prebuilt
def no_compiler(*a, **kw):
    raise RuntimeError("compiled at first use")
prebuilt._compile = no_compiler
try:
    m = prebuilt.load({name!r}, Path({str(source)!r}), ["-DANSWER=42"], ["-fopenmp"])
    print(json.dumps({{"answer": m.answer(), "file": m.__file__}}))
except RuntimeError as e:
    print(json.dumps({{"error": str(e)}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env.update(HOME=str(tmp / "new-home"), KEEPWARM_KERNEL_DIR=str(tmp / "kernels"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def test_a_built_extension_loads_in_a_new_process_without_a_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KERNEL_DIR_ENV, str(tmp_path / "kernels"))
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    name = "keepwarm_test_tiny"
    assert _load_in_new_process(tmp_path, source, name) == {"error": "compiled at first use"}
    folder, compiled = prebuilt.build(name, source, ["-DANSWER=42"], ["-fopenmp"])
    assert compiled and (folder / prebuilt.MARKER).is_file() and folder.parent == tmp_path / "kernels"
    assert prebuilt.build(name, source, ["-DANSWER=42"], ["-fopenmp"]) == (folder, False)  # kept
    got = _load_in_new_process(tmp_path, source, name)
    assert got == {"answer": 42, "file": str(folder / f"{name}.so")}
    # a changed source is another key: the old build is never loaded for it
    source.write_text(TINY + "// changed\n")
    assert _load_in_new_process(tmp_path, source, name) == {"error": "compiled at first use"}
    assert prebuilt.load_built(name, prebuilt.build_key(name, source, ["-DANSWER=42"], ["-fopenmp"])) is None
    # a folder without its marker (a build that died half-way) is not used either
    source.write_text(TINY)
    (folder / prebuilt.MARKER).unlink()
    assert _load_in_new_process(tmp_path, source, name) == {"error": "compiled at first use"}


def test_the_installed_kernels_load_in_a_new_home_without_compiling(tmp_path: Path) -> None:
    """After the install's build step (ops/lib.sh runs it), an engine in a new home folder
    loads every kernel of this CPU from the install: nothing is compiled at first use."""
    check = subprocess.run(
        [sys.executable, "-m", "keepwarm.kernels.build", "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "nothing to build" in check.stdout:
        pytest.skip("this CPU runs none of the kernel builds")
    if check.returncode != 0:
        pytest.skip(f"the kernels were not built at install (`{prebuilt.BUILD_COMMAND}`):\n{check.stdout}")
    code = """
import json, torch
from keepwarm.kernels import cpu_attention, cpu_delta_rule, cpu_linear, cpu_rowwise, ops, prebuilt
def no_compiler(*a, **kw):
    raise RuntimeError("compiled at first use")
prebuilt._compile = no_compiler
print(json.dumps({
    "ops": ops.ops_for(torch.device("cpu")).name,
    "files": [cpu_linear.default().ext.__file__] + [m.extension().__file__ for m in (cpu_attention, cpu_rowwise, cpu_delta_rule)],
    "root": str(prebuilt.kernel_root()),
}))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "KEEPWARM_CPU_KERNELS")}
    env["HOME"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["ops"] == "cpu_invariant"
    assert all(f.startswith(doc["root"] + os.sep) for f in doc["files"]), doc
    assert not (tmp_path / ".cache" / "torch_extensions").exists()
