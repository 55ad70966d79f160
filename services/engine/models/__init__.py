"""Model families, keyed by config.json `model_type`. Each family module exposes
`build(checkpoint, placement, dtype, ops) -> Backend`: every layer's weights and state on
its stage's device (models/placement.py)."""

from __future__ import annotations

import importlib
import logging

import torch

from keepwarm.engine.loading.checkpoint import Checkpoint, CheckpointError
from keepwarm.engine.loading.load_progress import LoadProgress
from keepwarm.engine.loading.packaged_model import model_id
from keepwarm.engine.models.backend import Backend
from keepwarm.engine.models.placement import Placement, PlacementError
from keepwarm.kernels.ops import Ops

log = logging.getLogger(__name__)

# config.json model_type -> family (a module of this package, one of FAMILIES)
MODEL_TYPE_TO_FAMILY = {
    "llama": "dense",
    "qwen2": "dense",
    "qwen3": "dense",
    "qwen3_moe": "dense",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "deepseek_v4": "deepseek_v4",
    "laguna": "laguna",
    "gpt_oss": "gpt_oss",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # the multimodal folder: refused by name (models/gemma3.py)
}


FAMILIES = ("dense", "qwen3_5", "deepseek_v4", "laguna", "gpt_oss", "gemma3")  # module names here
FAMILY_ALIASES = {"hybrid": "qwen3_5"}  # other names a user may pass (demo_model --family hybrid)


def family_of(name: str) -> str:
    """The family module a family name or alias names, else a ValueError listing the names."""
    family = FAMILY_ALIASES.get(name, name)
    if family not in FAMILIES:
        known = ", ".join(sorted({*FAMILIES, *FAMILY_ALIASES}))
        raise ValueError(f"family {name!r} is unknown (use one of {known})")
    return family


BLOCK_FAMILIES = frozenset({"dense"})  # families whose projections run on quantized blocks


def _blocks_unsupported(ckpt: Checkpoint, placement: Placement, asked: bool) -> str | None:
    """Why this checkpoint's projections cannot run on quantized blocks here (None: they can).
    `asked`: the user asked for blocks (--weights as-file, --quantize); only then do GPU stages
    get them: the GPU block kernel (kernels/triton_quant_linear.py) has been checked under the
    Triton interpreter, not yet by a GPU run, so `auto` keeps a GPU's weights dequantized."""
    import importlib.util

    from keepwarm.kernels import cpu_quant_linear

    family = MODEL_TYPE_TO_FAMILY.get(ckpt.model_type, ckpt.model_type)
    if family not in BLOCK_FAMILIES:
        return f"the {family} family runs dequantized weights only (block weights: {', '.join(sorted(BLOCK_FAMILIES))})"
    kinds = {d.type for d in placement.devices}
    if "cuda" in kinds:
        if not asked:
            return "a GPU runs dequantized weights unless --weights as-file asks for its block kernel"
        if importlib.util.find_spec("triton") is None:
            return "quantized blocks on a GPU need Triton, which does not import here"
    if "cpu" in kinds and not cpu_quant_linear.available():
        return "the block kernel is not built for this CPU (x86 with AVX2, FMA and F16C)"
    return None


def keeps_blocks(weights: str, ckpt: Checkpoint, placement: Placement) -> bool:
    """Whether `--weights` (auto, as-file, bf16) keeps this checkpoint's quantized projections in
    their blocks: a GGUF file, a family in BLOCK_FAMILIES, every stage on the CPU, and the block
    kernel built for this CPU. `as-file` where one of those fails raises, naming it; `auto`
    then dequantizes."""
    if weights == "bf16":
        return False
    why = None
    if ckpt.weights_format not in ("gguf", "gguf-blocks"):
        why = f"{ckpt.path} is not a GGUF file (its weights have no quantized blocks)"
    else:
        why = _blocks_unsupported(ckpt, placement, asked=weights == "as-file")
    if why is not None and weights == "as-file":
        raise CheckpointError(f"--weights as-file: {why}; use --weights bf16 (or auto)")
    return why is None


def check_quantize(quantize: str, ckpt: Checkpoint, placement: Placement) -> None:
    """`--quantize` (a Hugging Face folder's projections made Q8_0 or Q4_K blocks at load) applies to
    this checkpoint here, else a CheckpointError naming why."""
    if ckpt.weights_format.startswith("gguf"):
        raise CheckpointError(
            f"--quantize {quantize}: {ckpt.path} is a GGUF file, quantized already (--weights picks how it runs)"
        )
    why = _blocks_unsupported(ckpt, placement, asked=True)
    if why is not None:
        raise CheckpointError(f"--quantize {quantize}: {why}; drop --quantize")


def build_backend(ckpt: Checkpoint, where: torch.device | Placement, dtype: torch.dtype, ops: Ops) -> Backend:
    """The family's backend with its layers placed by `where` (one device: every layer there).
    `ops` must run on every device of the placement (Placement.ops)."""
    family = MODEL_TYPE_TO_FAMILY.get(ckpt.model_type)
    if family is None:
        known = ", ".join(sorted(MODEL_TYPE_TO_FAMILY))
        raise CheckpointError(
            f"{ckpt.path / 'config.json'}: model_type {ckpt.model_type!r} is not supported (supported: {known})"
        )
    placement = Placement.of(where, ckpt.num_layers)
    if placement.num_layers != ckpt.num_layers:
        raise PlacementError(
            f"--layer-split places {placement.num_layers} layers; this model has {ckpt.num_layers}"
        )
    module = importlib.import_module(f"keepwarm.engine.models.{family}")
    progress = LoadProgress(model_id(ckpt.path), len(ckpt.name_to_file))
    ckpt.on_load.append(progress.step)
    try:
        backend: Backend = module.build(ckpt, placement, dtype, ops)
    finally:
        ckpt.on_load.remove(progress.step)
    seconds = progress.finish()
    log.info("loaded %s (%s, %s) in %.1f s", ckpt.path, ckpt.weights_format, dtype, seconds)
    return backend
