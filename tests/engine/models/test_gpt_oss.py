"""gpt-oss against transformers' GptOssForCausalLM on tiny random checkpoints written by
transformers itself: logits, greedy decoding, chunked prefill, batched step, snapshots whose
sliding layers hold min(p, W) rows (and what that saves on disk), config fields refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_file import write_snapshot
from keepwarm.engine.demo.gpt_oss import demo_config, init_weights
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.geometry import SnapshotMismatch
from keepwarm.engine.models.gpt_oss import GptOssBackend, build
from keepwarm.engine.models.sliding import FULL, SLIDING
from keepwarm.kernels.ops import TORCH_OPS
from keepwarm.kernels.sliding_attention import TRITON_SLIDING
from tests.engine.models import sliding_checks as checks

CPU = torch.device("cpu")
S, F = "sliding_attention", "full_attention"
BASE: dict[str, Any] = dict(vocab_size=211, hidden_size=48, intermediate_size=32, head_dim=8)
CASES: dict[str, dict[str, Any]] = {
    # the default alternating pattern, window 8 (smaller than the prompts), learned sinks,
    # top-2 of 4, transformers' default YaRN rope, GQA 4:2
    "w8-sinks-top2": dict(
        num_hidden_layers=4,
        sliding_window=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    ),  # fmt: skip
    # window 128 (larger than the prompts), sinks off (-inf), top-1 of 3, MQA, no attention
    # biases, plain rope, a tight SwiGLU clamp that really clips
    "w128-nosinks-top1": dict(
        num_hidden_layers=3,
        layer_types=[F, S, S],
        sliding_window=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        num_local_experts=3,
        num_experts_per_tok=1,
        attention_bias=False,
        tie_word_embeddings=True,
        swiglu_limit=0.5,
        swiglu_alpha=1.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),  # fmt: skip
}


def _model(name: str, seed: int = 0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    cfg = GptOssConfig(**BASE, **CASES[name], max_position_embeddings=4096)
    model = checks.randomize(GptOssForCausalLM(cfg), seed)
    if "nosinks" in name:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(float("-inf"))
            # with weak attention the last token's embedding dominates and greedy decoding
            # settles on a repeat; smaller embeddings let the layers speak
            model.model.embed_tokens.weight.mul_(0.2)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, GptOssBackend, Path]:
    path = tmp_path_factory.mktemp(request.param)
    ref = _model(request.param)
    ref.save_pretrained(path)
    ours = build_backend(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    assert isinstance(ours, GptOssBackend)
    return ref, ours, path


def test_saved_checkpoint_and_geometry(case: tuple[Any, GptOssBackend, Path]) -> None:
    _, ours, path = case
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss"
    w, hkv = ours.cfg.sliding_window, ours.cfg.num_kv_heads
    for i, kind in enumerate(ours.cfg.layer_types):
        assert ours.geometry.spec(f"layers.{i}.v").shape_at(500) == (
            (min(500, w) if kind == S else 500),
            hkv,
            8,
        )
    assert ours.cfg.layer_types == tuple(cfg["layer_types"])


@pytest.mark.parametrize("n", [1, 13, 40])
def test_logits_match_transformers(case: tuple[Any, GptOssBackend, Path], n: int) -> None:
    checks.check_logits(case[0], case[1], n)


def test_greedy_32_tokens_match_transformers_generate(case: tuple[Any, GptOssBackend, Path]) -> None:
    checks.check_greedy(case[0], case[1], seed=3)  # a prompt whose continuation varies on both


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(case: tuple[Any, GptOssBackend, Path], chunk: int) -> None:
    checks.check_chunked(case[1], chunk)


def test_batched_step_equals_prefill_per_sequence(case: tuple[Any, GptOssBackend, Path]) -> None:
    checks.check_step(case[1], min(case[1].cfg.sliding_window, 16))


def test_snapshots_below_at_above_the_window_continue_in_a_fresh_process(
    oss_dir: Path, tmp_path: Path
) -> None:
    path = oss_dir
    ours = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    checks.check_snapshots_in_fresh_process(ours, path, tmp_path, window=8)
    checks.check_views_survive_the_ring_wrapping(ours, window=8)


def test_adopt_rejects_rows_that_disagree_with_position_and_window(
    case: tuple[Any, GptOssBackend, Path],
) -> None:
    _, ours, _ = case
    w, hkv = ours.cfg.sliding_window, ours.cfg.num_kv_heads
    n = w + 5 if w < 40 else 30
    st = ours.new_state(n + 4)
    ours.prefill(st, checks.prompt(n, ours.vocab_size))
    good = ours.export(st).detached()
    checks.check_snapshot_rows(ours, good, w)
    with pytest.raises(SnapshotMismatch, match=rf"shape .* at position {n + 1}"):
        ours.adopt(Snapshot(n + 1, good.tensors), n + 4)
    i = checks.sliding_layers(ours)[0]
    if w < n:  # a sliding layer with every row, as a window-less engine would write it
        bad = {**good.tensors, f"layers.{i}.v": torch.zeros(n, hkv, 8)}
        with pytest.raises(
            SnapshotMismatch, match=rf"layers.{i}.v: shape \({n}, {hkv}, 8\), model needs \({w},"
        ):
            ours.adopt(Snapshot(n, bad), n + 4)
    assert torch.equal(ours.adopt(good, n + 4).logits, good.tensors["sidecar.logits"])


def test_bf16_runs_and_mostly_agrees(oss_dir: Path) -> None:
    ref, path = _model("w8-sinks-top2"), oss_dir
    b16 = build(open_checkpoint(path), CPU, torch.bfloat16, TORCH_OPS)
    assert b16.layers[0].input_norm.dtype == torch.float32  # norms stay float32, as transformers keeps them
    toks = checks.prompt(30, b16.vocab_size, seed=5)
    got = b16.forward(b16.new_state(32), toks, all_logits=True)
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    assert torch.isfinite(got).all()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


def test_triton_attention_in_model(oss_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path's kernels (sinks included), on CPU under the Triton interpreter, in the model."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ref, path = _model("w8-sinks-top2"), oss_dir
    b = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    b.attention = TRITON_SLIDING
    toks = checks.prompt(20, b.vocab_size, seed=9)
    with torch.no_grad():
        want = ref(toks[None]).logits[0]
    st = b.new_state(24)
    b.prefill(st, toks[:17])
    assert (b.decode(st, int(toks[17])) - want[17]).abs().max().item() <= 1e-4


def test_snapshot_file_of_2048_tokens_with_window_128(tmp_path: Path) -> None:
    """The issue's yardstick: a 2,048-token prompt, window 128. Sliding layers hold 128 rows;
    the file is the all-rows file minus exactly the dropped rows."""
    cfg = {**demo_config("tiny"), "sliding_window": 128, "vocab_size": 211}
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(init_weights(cfg, seed=1), str(tmp_path / "model.safetensors"))
    ours = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    n = 2048
    toks = checks.prompt(n, 211, seed=12)
    st = ours.new_state(n)
    for lo in range(0, n, 512):
        ours.prefill(st, toks[lo : lo + 512])
    snap = ours.export(st)
    checks.check_snapshot_rows(ours, snap, 128)
    sliding = checks.sliding_layers(ours)
    assert all(snap.tensors[f"layers.{i}.k"].shape[0] == 128 for i in sliding) and len(sliding) == 2
    all_rows = Snapshot(
        n,
        {
            k: (torch.zeros(n, *t.shape[1:]) if k.startswith("layers.") else t)
            for k, t in snap.tensors.items()
        },
    )
    size = write_snapshot(
        tmp_path / "w.safetensors", namespace="t", key="w", tokens=toks.tolist(), snapshot=snap, fsync=False
    )
    full = write_snapshot(
        tmp_path / "f.safetensors",
        namespace="t",
        key="f",
        tokens=toks.tolist(),
        snapshot=all_rows,
        fsync=False,
    )
    assert size is not None and full is not None
    row_bytes = 2 * ours.cfg.num_kv_heads * ours.cfg.head_dim * 4  # k and v, float32
    dropped = len(sliding) * (n - 128) * row_bytes
    assert abs((full - size) - dropped) < 256  # the rest: header digits and alignment
    print(f"2048 tokens, window 128: {size} bytes vs {full} bytes with every row ({size / full:.3f})")
    assert size / full < 0.6  # half the layers are sliding: they shrink 16x


def _with(path: Path, tmp: Path, **edit: Any) -> Path:
    cfg = {**json.loads((path / "config.json").read_text()), **edit}
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    if not (tmp / "model.safetensors").exists():
        (tmp / "model.safetensors").symlink_to(path / "model.safetensors")
    return tmp


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt-oss-w8")
    _model("w8-sinks-top2").save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"quantization_config": {"quant_method": "mxfp4"}}, r"quantization_config \(mxfp4\)"),
        ({"experts_per_token": 3}, "experts_per_token"),
        ({"num_experts": 5}, "num_experts disagrees"),
        ({"sliding_window": None}, "sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"some_new_field": 1}, "some_new_field"),
        ({"layer_types": [S, F, S]}, "layer_types has 3 entries"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"num_local_experts": 5}, r"experts.gate_up_proj.*shape"),
    ],
)
def test_config_fields_are_implemented_or_refused_by_name(
    tmp_path: Path, oss_dir: Path, edit: dict[str, Any], match: str
) -> None:
    with pytest.raises(CheckpointError, match=match):
        build(open_checkpoint(_with(oss_dir, tmp_path / "m", **edit)), CPU, torch.float32, TORCH_OPS)


def test_hub_style_config_loads(oss_dir: Path, tmp_path: Path) -> None:
    """OpenAI's config.json form: rope_scaling + rope_theta instead of rope_parameters,
    experts_per_token and initial_context_length alongside the transformers names."""
    cfg = json.loads((oss_dir / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    path = _with(
        oss_dir,
        tmp_path / "hub",
        rope_scaling=rope,
        rope_theta=theta,
        experts_per_token=2,
        initial_context_length=4096,
    )
    cfg_hub = json.loads((path / "config.json").read_text())
    del cfg_hub["rope_parameters"]
    (path / "config.json").write_text(json.dumps(cfg_hub))
    a = build(open_checkpoint(oss_dir), CPU, torch.float32, TORCH_OPS)
    b = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    ra, rb = a.ropes[FULL], b.ropes[FULL]
    assert a.ropes[SLIDING] is ra  # one rope for both layer kinds
    assert torch.equal(ra.inv_freq, rb.inv_freq) and ra.attention_scaling == rb.attention_scaling
    assert not math.isclose(ra.attention_scaling, 1.0)  # yarn really applies its scaling


def test_demo_tiny_loads_in_transformers_and_matches(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    cfg = demo_config("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(init_weights(cfg, seed=3), str(tmp_path / "model.safetensors"))
    model = GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    toks = checks.prompt(40, cfg["vocab_size"], seed=8)  # longer than the tiny window (16)
    with torch.no_grad():
        want = model(toks[None]).logits[0, -1]
    assert (ours.prefill(ours.new_state(40), toks) - want).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="'huge' is unknown"):
        demo_config("huge")
