"""Gemma 3 against transformers' Gemma3ForCausalLM on tiny random checkpoints written by
transformers itself: logits, greedy decoding, chunked prefill, batched step, snapshots whose
local layers hold min(p, W) rows, bitwise invariance with the invariant CPU kernels, the Hub's
older config fields, and config fields refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.demo.gemma3 import demo_config, init_weights
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.gemma3 import (
    HONOURED_FIELDS,
    NO_MATH_FIELDS,
    Gemma3Backend,
    build,
    gelu_tanh,
)
from keepwarm.engine.models.geometry import SnapshotMismatch
from keepwarm.kernels.ops import TORCH_OPS, cpu_ops
from tests.engine.models import sliding_checks as checks

CPU = torch.device("cpu")
S, F_ = "sliding_attention", "full_attention"
BASE: dict[str, Any] = dict(
    vocab_size=211, hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512,
)  # fmt: skip
CASES: dict[str, dict[str, Any]] = {
    # window 8, smaller than every prompt; the default pattern (five local, one global, local);
    # query_pre_attn_scalar unlike head_dim; tied embeddings (Gemma's default)
    "w8-pattern": dict(num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=24),
    # window 128, larger than the prompts; explicit layer types; final-logit softcapping,
    # attention biases, untied head, linear rope scaling on the global layers, another local base
    "w128-capped": dict(
        num_hidden_layers=3,
        layer_types=[S, F_, S],
        sliding_window=128,
        query_pre_attn_scalar=16,
        final_logit_softcapping=3.0,
        attention_bias=True,
        tie_word_embeddings=False,
        rope_parameters={
            F_: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            S: {"rope_type": "default", "rope_theta": 20000.0},
        },
    ),
}


def _model(extra: dict[str, Any], seed: int = 0) -> Gemma3ForCausalLM:
    """checks.randomize, then Gemma's scales (its norms multiply by 1 + weight): layer norm
    scales around 2, q/k norm scales around 1 and V projections small (K/V rows O(1), as
    sliding_checks' tolerances assume), the embedding (scaled by sqrt(hidden) at the input,
    tied to the head) small enough that the layers, not the last token's own row, decide the
    next token."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(**{**BASE, **extra})
    model = checks.randomize(Gemma3ForCausalLM(cfg), seed)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                base = 0.0 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0
                p.copy_(base + 0.3 * torch.randn(p.shape, generator=gen))
            elif "embed" in name or "v_proj" in name:
                p.mul_(0.2)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, Gemma3Backend, Path]:
    path = tmp_path_factory.mktemp(request.param)
    ref = _model(CASES[request.param])
    ref.save_pretrained(path)
    ours = build_backend(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    assert isinstance(ours, Gemma3Backend)
    return ref, ours, path


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-w8")
    _model(CASES["w8-pattern"]).save_pretrained(path)
    return path


def test_saved_checkpoint_and_geometry(case: tuple[Any, Gemma3Backend, Path]) -> None:
    _, ours, path = case
    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma3_text"
    w = ours.cfg.sliding_window
    if ours.cfg.num_layers == 7:  # the default pattern: every sixth layer global
        assert ours.cfg.layer_types == (S, S, S, S, S, F_, S)
    for i, kind in enumerate(ours.cfg.layer_types):
        spec = ours.geometry.spec(f"layers.{i}.k")
        assert spec.shape_at(300) == ((min(300, w) if kind == S else 300), 2, 16)
        assert spec.shape_at(5) == (5, 2, 16)
    st = ours.new_state(200)
    assert st.tensors["layers.0.k"].shape == (min(200, w), 2, 16)  # layer 0 is local: a ring


@pytest.mark.parametrize("n", [1, 13, 40])
def test_logits_match_transformers(case: tuple[Any, Gemma3Backend, Path], n: int) -> None:
    checks.check_logits(case[0], case[1], n)


def test_greedy_32_tokens_match_transformers_generate(case: tuple[Any, Gemma3Backend, Path]) -> None:
    checks.check_greedy(case[0], case[1])


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(case: tuple[Any, Gemma3Backend, Path], chunk: int) -> None:
    checks.check_chunked(case[1], chunk)


def test_batched_step_equals_prefill_per_sequence(case: tuple[Any, Gemma3Backend, Path]) -> None:
    checks.check_step(case[1], min(case[1].cfg.sliding_window, 16))


def test_snapshots_below_at_above_the_window_continue_in_a_fresh_process(
    gemma_dir: Path, tmp_path: Path
) -> None:
    ours = build(open_checkpoint(gemma_dir), CPU, torch.float32, TORCH_OPS)
    checks.check_snapshots_in_fresh_process(ours, gemma_dir, tmp_path, window=8)
    checks.check_views_survive_the_ring_wrapping(ours, window=8)


def test_adopt_rejects_rows_that_disagree_with_position_and_window(gemma_dir: Path) -> None:
    ours = build(open_checkpoint(gemma_dir), CPU, torch.float32, TORCH_OPS)
    w, n = 8, 13
    st = ours.new_state(n + 4)
    ours.prefill(st, checks.prompt(n, ours.vocab_size))
    good = ours.export(st)
    checks.check_snapshot_rows(ours, good, w)
    assert good.tensors["layers.0.k"].shape[0] == w and good.tensors["layers.5.k"].shape[0] == n
    assert ours.adopt(good.detached(), n + 4).position == n
    with pytest.raises(SnapshotMismatch, match=rf"layers.\d.k: shape .* at position {n + 1}"):
        ours.adopt(Snapshot(n + 1, good.tensors), n + 4)
    full_rows = dict(good.tensors)
    full_rows["layers.0.k"] = torch.zeros(n, 2, 16)  # a local layer holding every row
    with pytest.raises(
        SnapshotMismatch, match=rf"layers.0.k: shape \({n}, 2, 16\), model needs \({w}, 2, 16\)"
    ):
        ours.adopt(Snapshot(n, full_rows), n + 4)
    with pytest.raises(SnapshotMismatch, match="capacity"):
        ours.adopt(good, n - 1)


def test_bf16_runs_and_mostly_agrees(gemma_dir: Path) -> None:
    ref = Gemma3ForCausalLM.from_pretrained(gemma_dir, dtype=torch.bfloat16).eval()
    b16 = build(open_checkpoint(gemma_dir), CPU, torch.bfloat16, TORCH_OPS)
    toks = checks.prompt(30, b16.vocab_size, seed=5)
    got = b16.forward(b16.new_state(32), toks, all_logits=True)
    with torch.no_grad():
        want = ref(toks[None]).logits[0].float()
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


def test_gelu_tanh_is_transformers_activation_and_the_same_bits_at_any_offset() -> None:
    """F.gelu's scalar tail differs from its vector body (so its bits depend on how the call is
    sliced across threads); the family's formula does not, and stays within 1 ulp of F.gelu."""
    torch.set_num_threads(max(torch.get_num_threads(), 2))
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(200_000, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
        whole = gelu_tanh(x)
        want = F.gelu(x, approximate="tanh").float()
        ulp = torch.finfo(dtype).eps  # within an ulp or so (fp32); bf16 rounds the same value
        torch.testing.assert_close(whole.float(), want, rtol=ulp, atol=1e-6)
        for n, off in ((1, 0), (17, 3), (33_001, 7), (70_000, 13), (199_000, 999)):
            assert torch.equal(gelu_tanh(x[off : off + n].clone()), whole[off : off + n]), (dtype, n, off)


@pytest.mark.skipif(
    cpu_ops().name != "cpu_invariant",
    reason="the invariant CPU kernels need AVX-512 BF16 or AVX2 + FMA + F16C",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_kernels_give_the_same_bits_in_any_chunking_and_batch(
    gemma_dir: Path, dtype: torch.dtype
) -> None:
    ours = build(open_checkpoint(gemma_dir), CPU, dtype, cpu_ops())
    toks = checks.prompt(40, ours.vocab_size, seed=7)
    one = ours.forward(ours.new_state(41), toks, all_logits=True)
    for chunk in (1, 7, 64):
        st = ours.new_state(41)
        parts = torch.cat(
            [ours.forward(st, toks[i : i + chunk], all_logits=True) for i in range(0, 40, chunk)]
        )
        assert torch.equal(parts, one), (dtype, chunk)
    a, chunks = checks._states(ours, 8)
    b, _ = checks._states(ours, 8)
    batched = ours.step(a, chunks)
    alone = torch.stack([ours.prefill(s, c) for s, c in zip(b, chunks, strict=True)])
    assert torch.equal(batched, alone), dtype
    if dtype == torch.float32:
        ref = _model(CASES["w8-pattern"])
        with torch.no_grad():
            want = ref(toks[None]).logits[0]
        assert (one - want).abs().max().item() <= checks.ATOL


def _with(path: Path, tmp: Path, drop: tuple[str, ...] = (), **edit: Any) -> Path:
    cfg = {
        k: v for k, v in {**json.loads((path / "config.json").read_text()), **edit}.items() if k not in drop
    }
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    if not (tmp / "model.safetensors").exists():
        (tmp / "model.safetensors").symlink_to(path / "model.safetensors")
    return tmp


def test_hub_style_config_with_older_fields_loads_and_matches(gemma_dir: Path, tmp_path: Path) -> None:
    """As google/gemma-3-*'s config.json: rope_theta, rope_local_base_freq, rope_scaling (linear,
    on the global layers), _sliding_window_pattern and no layer_types / rope_parameters."""
    path = _with(
        gemma_dir,
        tmp_path / "hub",
        drop=("layer_types", "rope_parameters"),
        rope_theta=500000.0,
        rope_local_base_freq=5000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=3,
        _sliding_window_pattern=3,
        hidden_act="gelu_pytorch_tanh",
        cache_implementation="hybrid",
    )
    ref = Gemma3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert ref.config.layer_types == [S, S, F_, S, S, F_, S]
    ours = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    assert ours.cfg.layer_types == tuple(ref.config.layer_types)
    checks.check_logits(ref, ours, 30)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"some_new_field": 1}, "some_new_field"),
        ({"layer_types": [S, F_, S, S, S, F_, "chunked_attention"]}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
        ({"rope_parameters": {F_: {"rope_type": "dynamic", "factor": 2.0}}}, "dynamic"),
        ({"model_type": "gemma3", "text_config": {}}, "multimodal"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"head_dim": 8}, r"q_proj.weight.*shape"),
    ],
)
def test_config_fields_are_implemented_or_refused_by_name(
    tmp_path: Path, gemma_dir: Path, edit: dict[str, Any], match: str
) -> None:
    with pytest.raises(CheckpointError, match=match):
        build_backend(
            open_checkpoint(_with(gemma_dir, tmp_path / "m", **edit)), CPU, torch.float32, TORCH_OPS
        )


def test_every_transformers_field_is_classified() -> None:
    # a new field in transformers must be implemented, refused or declared math-free here
    fields = set(Gemma3TextConfig.__annotations__)
    assert fields - HONOURED_FIELDS - NO_MATH_FIELDS == set()
    saved = set(Gemma3TextConfig(**BASE, num_hidden_layers=2).to_dict())
    assert saved - HONOURED_FIELDS - NO_MATH_FIELDS == set()


def test_demo_tiny_loads_in_transformers_and_matches(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = demo_config("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(init_weights(cfg, seed=3), str(tmp_path / "model.safetensors"))
    model = Gemma3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    toks = checks.prompt(40, cfg["vocab_size"], seed=8)  # longer than the tiny window (16)
    with torch.no_grad():
        want = model(toks[None]).logits[0, -1]
    assert (ours.prefill(ours.new_state(40), toks) - want).abs().max().item() <= 1e-4
    small = demo_config("small")
    assert small["sliding_window"] == 512 and small["layer_types"].count(S) == 15
    with pytest.raises(ValueError, match="'huge' is unknown"):
        demo_config("huge")
