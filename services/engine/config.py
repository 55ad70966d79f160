"""Engine process configuration: one dataclass, filled from CLI flags or
KEEPWARM_* environment variables, passed down explicitly."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from keepwarm.engine.cache.policy import Policy, parse_policy

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ConfigError(ValueError):
    """Bad engine configuration; the message names the flag and what to change."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "keepwarm" / "prefix-cache"


def parse_size(text: str) -> int:
    """Bytes from '4096', '512m', '4g', '1.5G' (binary units)."""
    s = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if s and s[-1] in "kmgt":
        mult = 1024 ** ("kmgt".index(s[-1]) + 1)
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ConfigError(f"size {text!r} is not a number with an optional k/m/g/t suffix") from None
    if value < 0:
        raise ConfigError(f"size {text!r} must not be negative")
    return int(value * mult)


@dataclass(frozen=True)
class EngineConfig:
    model: Path
    # Every served model when there are several (`--model` repeated, or a models folder: each
    # subfolder with a config.json); `model` is then the first, the default. () = `model` alone.
    models: tuple[Path, ...] = ()
    # Bytes of weights (at the runtime dtype) the loaded models may hold together; loading one
    # more parks the least recently used idle ones (serving/model_set.py). 0 = no limit.
    models_budget: int = 0
    device: str = "cpu"
    # Layers per device (models/placement.py): `cuda:0:0-23,cuda:1:24-47`, or a bare device
    # list (`cpu,cpu`, `cuda:0,cuda:1`) for an even split; "" runs every layer on --device.
    layer_split: str = ""
    dtype: str = "bfloat16"
    num_threads: int = 0  # 0 = torch default
    max_context: int = 8192  # state capacity in tokens; longer prompts are rejected
    chunk_size: int = 2048  # prefill chunk (tokens per forward)
    cache_dir: Path | None = None  # None disables the disk tier
    disk_budget: int = 16 * 1024**3
    min_free_disk: int | None = None  # None ("auto"): 5% of the cache volume, at most 1 GiB
    memory_budget: int = 2 * 1024**3
    min_tokens: int = 64  # never cache a prefix shorter than this
    disk_prefix_cache: str = "full"
    writer_queue: int = 8
    fsync: bool = True
    queue_size: int = 16  # requests waiting to be admitted (beyond: HTTP 429)
    max_seqs: int = 16  # sequences running at once (decoding or prefilling)
    max_batch_tokens: int = 2048  # tokens per step: one per decoding sequence + prefill chunks
    kv_budget: int = 0  # bytes for every sequence's state; 0 = 80% of free GPU memory, 16 GiB on CPU
    max_tokens_limit: int = 4096
    host: str = "127.0.0.1"
    port: int = 8100
    model_name: str = ""  # the id /v1/models reports; defaults to the folder name
    use_triton: bool | None = None
    keepalive_s: float = 5.0  # SSE keep-alive comment interval while a stream waits (queue, prefill)
    # Shared with the gateway (set it by environment, KEEPWARM_ENGINE_TOKEN): when set, every
    # endpoint but /health wants `Authorization: Bearer <token>`; "" serves anyone (local use).
    engine_token: str = field(default="", repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def policy(self) -> Policy:
        return parse_policy(self.disk_prefix_cache)

    @property
    def served_name(self) -> str:
        return self.model_name or self.model.name

    def validate(self) -> EngineConfig:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: use one of {', '.join(sorted(DTYPES))}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(
                f"--device {self.device!r}: use cpu or cuda[:N] (ROCm builds of torch report cuda)"
            )
        if self.models and self.model_name:
            raise ConfigError(
                "--model-name names one model; with several --model each is served under its folder name"
            )
        if self.layer_split:
            from keepwarm.engine.models.placement import LayerSplit, PlacementError

            if self.device != "cpu":
                raise ConfigError(
                    f"--device {self.device} and --layer-split both place the model: drop --device "
                    "(the split names each stage's device)"
                )
            try:
                LayerSplit.parse(self.layer_split)
            except PlacementError as e:
                raise ConfigError(str(e)) from e
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: torch sees no GPU here; use --device cpu")
        if self.keepalive_s <= 0:
            raise ConfigError("--keepalive-s must be > 0 seconds")
        if self.engine_token and len(self.engine_token) < 16:
            raise ConfigError("KEEPWARM_ENGINE_TOKEN must be at least 16 characters (or unset)")
        if self.max_batch_tokens < self.max_seqs:
            raise ConfigError(
                f"--max-batch-tokens {self.max_batch_tokens} must be >= --max-seqs {self.max_seqs} "
                "(every running sequence decodes one token per step)"
            )
        for name in (
            "max_context",
            "chunk_size",
            "writer_queue",
            "queue_size",
            "max_tokens_limit",
            "max_seqs",
            "max_batch_tokens",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        try:
            self.policy  # noqa: B018 - parse for the error
        except ValueError as e:
            raise ConfigError(f"--disk-prefix-cache: {e}") from e
        return self


_ENV_PREFIX = "KEEPWARM_"
_SIZES = {"disk_budget", "min_free_disk", "memory_budget", "kv_budget", "models_budget"}


def _convert(name: str, raw: str) -> object:
    field_type = {f.name: f.type for f in fields(EngineConfig)}[name]
    if name == "min_free_disk" and raw.strip().lower() in ("", "auto"):
        return None
    if name in _SIZES:
        return parse_size(raw)
    if name in ("model",):
        return Path(raw)
    if name == "cache_dir":
        return None if raw.lower() in ("", "none", "off") else Path(raw)
    if name == "fsync":
        return raw.lower() in ("1", "true", "yes", "on")
    if name == "use_triton":
        return None if raw.lower() in ("", "auto") else raw.lower() in ("1", "true", "yes", "on")
    if name == "keepalive_s":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"keepalive_s must be a number of seconds, got {raw!r}") from None
    if "int" in str(field_type):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    return raw


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        action="append",
        help="Hugging Face checkpoint folder; repeat it, or name a folder of checkpoint folders, to "
        f"serve several (env KEEPWARM_MODEL, several separated by {os.pathsep!r})",
    )
    for f in fields(EngineConfig):
        if f.name in ("model", "models"):
            continue
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            help=f"(env {_ENV_PREFIX}{f.name.upper()}; default {f.default})",
        )


def config_from(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    cache_dir_default: bool = True,
) -> EngineConfig:
    """Flags override env, env overrides defaults. Without a cache dir flag or env the
    disk tier lives under the user's cache dir (`cache_dir_default`)."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    given = getattr(args, "model", None) if args is not None else None
    if isinstance(given, list):
        given = os.pathsep.join(given)
    given = given if given is not None else env.get(_ENV_PREFIX + "MODEL")
    if given:
        paths = [p for raw in given.split(os.pathsep) if raw for p in models_in(Path(raw))]
        values["model"] = paths[0]
        if len(paths) > 1:
            values["models"] = tuple(paths)
    for f in fields(EngineConfig):
        if f.name in ("model", "models"):
            continue
        raw = getattr(args, f.name, None) if args is not None else None
        if raw is None:
            raw = env.get(_ENV_PREFIX + f.name.upper())
        if raw is not None:
            values[f.name] = _convert(f.name, str(raw))
    if "model" not in values:
        raise ConfigError("no model given: pass --model DIR or set KEEPWARM_MODEL")
    if "cache_dir" not in values and cache_dir_default:
        values["cache_dir"] = default_cache_dir()
    return EngineConfig(**values).validate()  # type: ignore[arg-type]


def models_in(path: Path) -> list[Path]:
    """`path` itself, or, for a models folder (no config.json, subfolders with one), each
    such subfolder by name."""
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(p for p in path.iterdir() if p.is_dir() and (p / "config.json").is_file())
        if found:
            return found
    return [path]
