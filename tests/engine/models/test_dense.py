"""Dense family parity against transformers on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.geometry import SnapshotMismatch
from keepwarm.kernels.ops import TORCH_OPS

transformers = pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(
    vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512
)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-mha-untied": (
        "llama",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    ),
    "llama-gqa4-llama3rope": (
        "llama",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-mqa-linear": (
        "llama",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
    ),
    "qwen2-gqa-bias-tied": (
        "qwen2",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3-gqa4-untied": (
        "qwen3",
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    ),
    "qwen3-mqa-yarn": (
        "qwen3",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128
            ),
        ),
    ),
}


def _save(tmp: Path, model_type: str, extra: dict[str, Any], seed: int = 0) -> Any:
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # make biases and norms non-trivial so they are really tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    model_type, extra = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    ref = _save(path, model_type, extra)
    ours = build_backend(open_checkpoint(path), torch.device("cpu"), torch.float32, TORCH_OPS)
    return ref, ours


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], (n,), generator=g)


@pytest.mark.parametrize("n", [1, 13, 71])
def test_logits_match_transformers(pair: tuple[Any, Any], n: int) -> None:
    ref, ours = pair
    toks = _tokens(n)
    with torch.no_grad():
        want = ref(toks[None]).logits[0].float()
    got = ours.forward(ours.new_state(128), toks, all_logits=True)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


def test_greedy_32_tokens_match_transformers(pair: tuple[Any, Any]) -> None:
    ref, ours = pair
    prompt = _tokens(11, seed=2)
    with torch.no_grad():
        out = ref.generate(
            prompt[None],
            max_new_tokens=32,
            do_sample=False,
            min_new_tokens=32,
            attention_mask=torch.ones(1, 11, dtype=torch.long),
        )
    want = out[0, 11:].tolist()
    state = ours.new_state(64)
    logits = ours.prefill(state, prompt)
    got = []
    for _ in range(32):
        tok = int(torch.argmax(logits))
        got.append(tok)
        logits = ours.decode(state, tok)
    assert got == want


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(pair: tuple[Any, Any], chunk: int) -> None:
    _, ours = pair
    toks = _tokens(90, seed=3)
    one = ours.forward(ours.new_state(128), toks, all_logits=True)
    state = ours.new_state(128)
    parts = [ours.forward(state, toks[i : i + chunk], all_logits=True) for i in range(0, 90, chunk)]
    assert (torch.cat(parts) - one).abs().max().item() <= 1e-5
    assert state.position == 90


def test_export_adopt_continues_identically(pair: tuple[Any, Any]) -> None:
    _, ours = pair
    toks = _tokens(40, seed=4)
    a = ours.new_state(64)
    ours.prefill(a, toks[:25])
    snap = ours.export(a)
    assert snap.position == 25 and snap.tensors["layers.0.k"].shape[0] == 25
    b = ours.adopt(snap.detached(), 64)
    la, lb = ours.prefill(a, toks[25:]), ours.prefill(b, toks[25:])
    assert torch.equal(la, lb)


def test_adopt_rejects_wrong_geometry_without_half_adopting(pair: tuple[Any, Any]) -> None:
    _, ours = pair
    state = ours.new_state(32)
    ours.prefill(state, _tokens(5))
    snap = ours.export(state).detached()
    bad = dict(snap.tensors)
    bad["layers.1.v"] = bad["layers.1.v"][:, :, :-1]
    with pytest.raises(SnapshotMismatch, match="layers.1.v"):
        ours.adopt(type(snap)(snap.position, bad), 32)
    wrong_dtype = dict(snap.tensors)
    wrong_dtype["layers.0.k"] = wrong_dtype["layers.0.k"].to(torch.float16)
    with pytest.raises(SnapshotMismatch, match="dtype"):
        ours.adopt(type(snap)(snap.position, wrong_dtype), 32)
    with pytest.raises(SnapshotMismatch, match="missing"):
        ours.adopt(
            type(snap)(snap.position, {k: v for k, v in snap.tensors.items() if k != "layers.0.k"}), 32
        )


def test_bf16_runs_and_mostly_agrees(pair: tuple[Any, Any], tmp_path: Path) -> None:
    ref, _ = pair
    ref.save_pretrained(tmp_path)
    ours = build_backend(open_checkpoint(tmp_path), torch.device("cpu"), torch.bfloat16, TORCH_OPS)
    toks = _tokens(30, seed=5)
    got = ours.forward(ours.new_state(32), toks, all_logits=True)
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    assert torch.isfinite(got).all()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agree >= 0.8


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    model_type, extra = CASES["qwen3-gqa4-untied"]
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **extra})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = build_backend(open_checkpoint(tmp_path), torch.device("cpu"), torch.float32, TORCH_OPS)
    toks = _tokens(9)
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    assert (ours.forward(ours.new_state(16), toks, all_logits=True) - want).abs().max().item() <= 1e-4


def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        open_checkpoint(tmp_path)
    _save(tmp_path, "qwen3", CASES["qwen3-gqa4-untied"][1])
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        build_backend(open_checkpoint(tmp_path), torch.device("cpu"), torch.float32, TORCH_OPS)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 100}))
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight.*shape"):
        build_backend(open_checkpoint(tmp_path), torch.device("cpu"), torch.float32, TORCH_OPS)


@pytest.mark.parametrize("case", ["qwen2-gqa-bias-tied", "llama-mha-untied"])
def test_quantize_q8_0_runs_the_projections_on_blocks_close_to_transformers(
    case: str, tmp_path: Path
) -> None:
    """--quantize q8_0: the folder's projections become Q8_0 blocks at load (ggml's rounding); the
    logits stay within the quantization's reach of transformers', a namespace of their own."""
    from keepwarm.kernels.ops import cpu_ops
    from keepwarm.kernels.quant_weight import QuantWeight, quantize_q8_0

    model_type, extra = CASES[case]
    ref = _save(tmp_path, model_type, extra)
    ckpt = open_checkpoint(tmp_path, quantize="q8_0")
    assert (
        ckpt.weights_format == "safetensors-q8_0"
        and open_checkpoint(tmp_path).weights_format == "safetensors"
    )
    ours = build_backend(ckpt, torch.device("cpu"), torch.float32, cpu_ops())
    layer = ours.layers[0]
    assert isinstance(layer.w_qkv, QuantWeight) and layer.w_qkv.kind == "Q8_0"
    want_o = quantize_q8_0(ref.model.layers[0].self_attn.o_proj.weight.detach())
    assert torch.equal(layer.w_o.blocks, want_o.blocks)  # the exact blocks of the source matrix
    toks = _tokens(40)
    with torch.no_grad():
        want = ref(toks[None]).logits[0].float()
    got = ours.forward(ours.new_state(64), toks, all_logits=True)
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_quantize_q4_k_runs_whole_super_blocks_as_q4_k_the_rest_as_q8_0(tmp_path: Path) -> None:
    """--quantize q4_k: projections whose rows are whole super-blocks (K a multiple of 256) are
    made Q4_K, narrower ones Q8_0; the model on its blocks computes what the same model with
    those blocks' exact values (dequantized) computes, to the activations' rounding."""
    from keepwarm.kernels.ops import cpu_ops
    from keepwarm.kernels.quant_weight import QuantWeight

    extra = dict(hidden_size=256, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
    ref = _save(tmp_path, "llama", {**extra, "tie_word_embeddings": False})
    ckpt = open_checkpoint(tmp_path, quantize="q4_k")
    assert ckpt.weights_format == "safetensors-q4_k"
    ours = build_backend(ckpt, torch.device("cpu"), torch.float32, cpu_ops())
    layer = ours.layers[0]
    assert isinstance(layer.w_qkv, QuantWeight) and layer.w_qkv.kind == "Q4_K"  # K = 256
    assert isinstance(layer.w_down, QuantWeight) and layer.w_down.kind == "Q8_0"  # K = 320
    toks = _tokens(40)
    got = ours.forward(ours.new_state(64), toks, all_logits=True)
    exact = build_backend(ckpt, torch.device("cpu"), torch.float32, cpu_ops())
    for layer in exact.layers:
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            setattr(layer, name, getattr(layer, name).dequantize())
    want = exact.forward(exact.new_state(64), toks, all_logits=True)
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()
    with torch.no_grad():  # and the 4-bit model's logits still follow transformers' (random weights:
        dense = ref(toks[None]).logits[0].float()  # margins too thin for the argmax to hold)
    assert torch.nn.functional.cosine_similarity(got, dense, dim=-1).min().item() >= 0.8
