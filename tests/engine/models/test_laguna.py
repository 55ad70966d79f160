"""Laguna against transformers' LagunaForCausalLM on tiny random checkpoints written by
transformers itself: logits, greedy decoding, chunked prefill, batched step, snapshots whose
sliding layers hold min(p, W) rows, and config fields refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LagunaConfig, LagunaForCausalLM

from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.demo.laguna import demo_config, init_weights
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.geometry import SnapshotMismatch
from keepwarm.engine.models.laguna import LagunaBackend, _Moe, build
from keepwarm.kernels.ops import TORCH_OPS, cpu_ops
from keepwarm.kernels.sliding_attention import TRITON_SLIDING
from tests.engine.models import sliding_checks as checks

CPU = torch.device("cpu")
S, F = "sliding_attention", "full_attention"
BASE: dict[str, Any] = dict(
    vocab_size=211, hidden_size=48, intermediate_size=64, num_key_value_heads=2, head_dim=8,
    moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=4,
)  # fmt: skip
CASES: dict[str, dict[str, Any]] = {
    # window 8, smaller than every prompt; per-layer heads; top-2; per-head gate
    "w8-top2-heads": dict(
        num_hidden_layers=4,
        layer_types=[S, F, S, S],
        sliding_window=8,
        num_attention_heads=4,
        num_attention_heads_per_layer=[4, 2, 6, 4],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_experts_per_tok=2,
        gating=True,
    ),  # fmt: skip
    # window 128, larger than the prompts; top-1; per-element gate; softcapping, routed scaling,
    # attention biases, tied embeddings, yarn rope on the full layers
    "w128-top1-capped": dict(
        num_hidden_layers=3,
        layer_types=[S, S, F],
        sliding_window=128,
        num_attention_heads=4,
        mlp_layer_types=["sparse", "dense", "sparse"],
        num_experts_per_tok=1,
        gating="per-element",
        moe_router_logit_softcapping=1.5,
        moe_routed_scaling_factor=2.5,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters={
            F: {
                "rope_type": "yarn",
                "rope_theta": 20000.0,
                "factor": 4.0,
                "partial_rotary_factor": 0.5,
                "original_max_position_embeddings": 64,
            },
            S: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
    ),  # fmt: skip
}


def _model(extra: dict[str, Any], seed: int = 0) -> LagunaForCausalLM:
    torch.manual_seed(seed)
    cfg = LagunaConfig(**BASE, **extra, max_position_embeddings=512)
    return checks.randomize(LagunaForCausalLM(cfg), seed)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, LagunaBackend, Path]:
    path = tmp_path_factory.mktemp(request.param)
    ref = _model(CASES[request.param])
    ref.save_pretrained(path)
    ours = build_backend(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    assert isinstance(ours, LagunaBackend)
    return ref, ours, path


def test_saved_checkpoint_and_geometry(case: tuple[Any, LagunaBackend, Path]) -> None:
    _, ours, path = case
    assert json.loads((path / "config.json").read_text())["model_type"] == "laguna"
    w = ours.cfg.sliding_window
    for i, kind in enumerate(ours.cfg.layer_types):
        spec = ours.geometry.spec(f"layers.{i}.k")
        assert spec.shape_at(300) == ((min(300, w) if kind == S else 300), 2, 8)
        assert spec.shape_at(5) == (5, 2, 8)
    st = ours.new_state(200)
    assert st.tensors["layers.0.k"].shape == (min(200, w), 2, 8)  # layer 0 is sliding: a ring


@pytest.mark.parametrize("n", [1, 13, 40])
def test_logits_match_transformers(case: tuple[Any, LagunaBackend, Path], n: int) -> None:
    checks.check_logits(case[0], case[1], n)


def test_greedy_32_tokens_match_transformers_generate(case: tuple[Any, LagunaBackend, Path]) -> None:
    checks.check_greedy(case[0], case[1])


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(case: tuple[Any, LagunaBackend, Path], chunk: int) -> None:
    checks.check_chunked(case[1], chunk)


def test_batched_step_equals_prefill_per_sequence(case: tuple[Any, LagunaBackend, Path]) -> None:
    checks.check_step(case[1], min(case[1].cfg.sliding_window, 16))


def test_snapshots_below_at_above_the_window_continue_in_a_fresh_process(
    laguna_dir: Path, tmp_path: Path
) -> None:
    path = laguna_dir
    ours = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    checks.check_snapshots_in_fresh_process(ours, path, tmp_path, window=8)
    checks.check_views_survive_the_ring_wrapping(ours, window=8)


def test_adopt_rejects_rows_that_disagree_with_position_and_window(
    case: tuple[Any, LagunaBackend, Path],
) -> None:
    _, ours, _ = case
    w = ours.cfg.sliding_window
    n = w + 5 if w < 40 else 30
    st = ours.new_state(n + 4)
    ours.prefill(st, checks.prompt(n, ours.vocab_size))
    good = ours.export(st)
    checks.check_snapshot_rows(ours, good, w)
    assert ours.adopt(good.detached(), n + 4).position == n
    # claimed one position further: the rows disagree with the position
    with pytest.raises(SnapshotMismatch, match=rf"layers.\d.k: shape .* at position {n + 1}"):
        ours.adopt(Snapshot(n + 1, good.tensors), n + 4)
    # a sliding layer holding every row (what a window-less engine would write)
    if w < n:
        full_rows = dict(good.tensors)
        full_rows["layers.0.k"] = torch.zeros(n, 2, 8)
        with pytest.raises(
            SnapshotMismatch, match=rf"layers.0.k: shape \({n}, 2, 8\), model needs \({w}, 2, 8\)"
        ):
            ours.adopt(Snapshot(n, full_rows), n + 4)
    with pytest.raises(SnapshotMismatch, match="capacity"):
        ours.adopt(good, n - 1)


def test_bf16_runs_and_mostly_agrees(laguna_dir: Path) -> None:
    ref, path = _model(CASES["w8-top2-heads"]), laguna_dir
    b16 = build(open_checkpoint(path), CPU, torch.bfloat16, TORCH_OPS)
    toks = checks.prompt(30, b16.vocab_size, seed=5)
    got = b16.forward(b16.new_state(32), toks, all_logits=True)
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


def test_triton_attention_in_model(laguna_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's kernels, run on CPU under the Triton interpreter, inside the model."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ref, path = _model(CASES["w8-top2-heads"]), laguna_dir
    b = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    b.attention = TRITON_SLIDING
    toks = checks.prompt(20, b.vocab_size, seed=9)
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    st = b.new_state(24)
    b.prefill(st, toks[:17])
    assert (b.decode(st, int(toks[17])) - want[17]).abs().max().item() <= 1e-4


def test_torch_tanh_gives_a_value_the_same_bits_at_any_offset_and_length() -> None:
    """The router's softcap relies on it (laguna.py route): torch's tanh runs one vectorised
    function over every element, partial vectors included, so no scalar tail rounds apart."""
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(80, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
        alone = torch.cat([torch.tanh(x[i : i + 1]) for i in range(80)])
        for n in range(1, 41):
            for off in range(40):
                assert torch.equal(torch.tanh(x[off : off + n]), alone[off : off + n]), (dtype, n, off)


@pytest.mark.skipif(
    cpu_ops().name != "cpu_invariant",
    reason="the invariant CPU kernels need AVX-512 BF16 or AVX2 + FMA + F16C",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_weights_of_a_token_are_the_same_bits_alone_and_in_a_batch(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """Softcapped scores, top-3 of 4 experts renormalised: a token's expert ids and weights
    do not depend on the other rows of the call; the model still matches transformers."""
    ref = _model({**CASES["w8-top2-heads"], "moe_router_logit_softcapping": 1.5, "num_experts_per_tok": 3})
    ref.save_pretrained(tmp_path)
    ours = build(open_checkpoint(tmp_path), CPU, dtype, cpu_ops())
    moes = [layer.mlp for layer in ours.layers if isinstance(layer.mlp, _Moe)]
    assert len(moes) == 3 and ours.cfg.router_softcap == 1.5
    h = (torch.randn(40, 48, generator=torch.Generator().manual_seed(6)) * 4).to(dtype)
    for moe in moes:
        alone = [ours.route(moe, h[i : i + 1]) for i in range(40)]
        for a, b in ((0, 2), (0, 17), (0, 40), (1, 37), (15, 33), (39, 40)):
            ids, weights = ours.route(moe, h[a:b])
            assert weights.dtype == dtype and ids.shape == (b - a, 3)
            for i in range(a, b):
                assert torch.equal(ids[i - a], alone[i][0][0]) and torch.equal(weights[i - a], alone[i][1][0])
    toks = checks.prompt(30, ours.vocab_size, seed=5)
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    got = ours.forward(ours.new_state(32), toks, all_logits=True)
    if dtype == torch.float32:
        assert (got - want).abs().max().item() <= checks.ATOL
    else:  # as test_bf16_runs_and_mostly_agrees
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


def _with(path: Path, tmp: Path, **edit: Any) -> Path:
    cfg = {**json.loads((path / "config.json").read_text()), **edit}
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    if not (tmp / "model.safetensors").exists():
        (tmp / "model.safetensors").symlink_to(path / "model.safetensors")
    return tmp


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"moe_apply_router_weight_on_input": True}, "moe_apply_router_weight_on_input"),
        ({"gating": False}, "gating False"),
        ({"some_new_field": 1}, "some_new_field"),
        ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
        ({"num_attention_heads_per_layer": [4, 3, 6, 4]}, "num_attention_heads_per_layer"),
        ({"layer_types": [S, F, S, "chunked_attention"]}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters"),
        ({"num_attention_heads_per_layer": [4, 2, 4, 4]}, r"q_proj.weight.*shape"),
    ],
)
def test_config_fields_are_implemented_or_refused_by_name(
    tmp_path: Path, laguna_dir: Path, edit: dict[str, Any], match: str
) -> None:
    with pytest.raises(CheckpointError, match=match):
        build(open_checkpoint(_with(laguna_dir, tmp_path / "m", **edit)), CPU, torch.float32, TORCH_OPS)


@pytest.fixture(scope="module")
def laguna_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("laguna-w8")
    _model(CASES["w8-top2-heads"]).save_pretrained(path)
    return path


def test_fused_expert_layout_and_module_names_load_the_same(laguna_dir: Path, tmp_path: Path) -> None:
    """Experts as 3-D gate_up_proj / down_proj, and the runtime module names
    (mlp.gate.e_score_correction_bias, mlp.shared_experts.*), as some exports write them."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(laguna_dir / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for i in range(1, 4):
        mp = f"model.layers.{i}.mlp."
        ex = [f"{mp}experts.{e}." for e in range(4)]
        out[mp + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(x + "gate_proj.weight"), sd.pop(x + "up_proj.weight")]) for x in ex]
        )
        out[mp + "experts.down_proj"] = torch.stack([sd.pop(x + "down_proj.weight") for x in ex])
        out[mp + "gate.e_score_correction_bias"] = sd.pop(mp + "experts.e_score_correction_bias")
        for part in ("gate_proj", "up_proj", "down_proj"):
            out[f"{mp}shared_experts.{part}.weight"] = sd.pop(f"{mp}shared_expert.{part}.weight")
    (tmp_path / "config.json").write_text((laguna_dir / "config.json").read_text())
    save_file({**sd, **out}, str(tmp_path / "model.safetensors"))
    a = build(open_checkpoint(laguna_dir), CPU, torch.float32, TORCH_OPS)
    b = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    toks = checks.prompt(12, a.vocab_size)
    assert torch.equal(a.prefill(a.new_state(12), toks), b.prefill(b.new_state(12), toks))


def test_demo_tiny_loads_in_transformers_and_matches(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = demo_config("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(init_weights(cfg, seed=3), str(tmp_path / "model.safetensors"))
    model = LagunaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    toks = checks.prompt(40, cfg["vocab_size"], seed=8)  # longer than the tiny window (16)
    with torch.no_grad():
        want = model(toks[None]).logits[0, -1]
    assert (ours.prefill(ours.new_state(40), toks) - want).abs().max().item() <= 1e-4
    small = demo_config("small")
    assert small["sliding_window"] == 128 and small["layer_types"].count(S) == 3 * small["layer_types"].count(
        F
    )
    with pytest.raises(ValueError, match="'huge' is unknown"):
        demo_config("huge")
