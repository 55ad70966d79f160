"""Hybrid family qwen3_5 against transformers' Qwen3_5ForCausalLM on tiny random checkpoints
written by transformers itself: logits, greedy decoding, chunked prefill, snapshots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.demo.qwen3_5 import demo_config, init_weights
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.geometry import SnapshotMismatch
from keepwarm.engine.models.qwen3_5 import Qwen35Backend, build
from keepwarm.kernels.delta_rule import TRITON_DELTA_RULE
from keepwarm.kernels.ops import TORCH_OPS

CPU = torch.device("cpu")
LINEAR, FULL = "linear_attention", "full_attention"
PATTERN = [LINEAR, LINEAR, FULL, LINEAR]
SWAPPED = [FULL, FULL, LINEAR, FULL]


def _hf_config(layer_types: list[str], tie: bool = False) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )


def _make_model(layer_types: list[str], seed: int, tie: bool = False) -> Qwen3_5ForCausalLM:
    """A random model whose every weight matters: norms away from their zero init (so the
    1 + w convention is tested), projections large enough for peaked logits."""
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(_hf_config(layer_types, tie)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 8.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
            elif "norm" in name:
                p.copy_(
                    torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "linear_attn.norm" in name else 0.0)
                )
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5))
    return model


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen3_5ForCausalLM, Path]:
    model = _make_model(PATTERN, seed=0)
    path = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def backend(hf_model: tuple[Qwen3_5ForCausalLM, Path]) -> Qwen35Backend:
    b = build_backend(open_checkpoint(hf_model[1]), CPU, torch.float32, TORCH_OPS)
    assert isinstance(b, Qwen35Backend)
    return b


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed))


def test_saved_model_type_and_geometry(
    hf_model: tuple[Qwen3_5ForCausalLM, Path], backend: Qwen35Backend
) -> None:
    assert json.loads((hf_model[1] / "config.json").read_text())["model_type"] == "qwen3_5_text"
    assert backend.family == "qwen3_5"
    g = backend.geometry
    assert g.names == (
        "layers.0.conv", "layers.0.recurrent", "layers.1.conv", "layers.1.recurrent",
        "layers.2.k", "layers.2.v", "layers.3.conv", "layers.3.recurrent", LOGITS,
    )  # fmt: skip
    conv_dim = 2 * 2 * 16 + 4 * 8
    assert g.spec("layers.0.conv").shape == (conv_dim, 3) and g.spec("layers.0.conv").dtype == torch.float32
    assert (
        g.spec("layers.3.recurrent").shape == (4, 16, 8) and g.spec("layers.3.recurrent").length_dim is None
    )
    assert g.spec("layers.2.k").shape_at(37) == (37, 2, 16)
    assert g.spec(LOGITS).shape == (320,)


def test_logits_match_transformers(hf_model: tuple[Qwen3_5ForCausalLM, Path], backend: Qwen35Backend) -> None:
    model, _ = hf_model
    tokens = _prompt(57)
    with torch.no_grad():
        ref = model(tokens[None]).logits[0].float()  # [T, V]
    assert ref.std().item() > 0.5  # the random model has peaked, informative logits
    state = backend.new_state(64)
    ours = backend.forward(state, tokens, all_logits=True)
    assert ours.shape == (57, 320) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-4
    state2 = backend.new_state(64)
    last = backend.prefill(state2, tokens)
    assert (last - ref[-1]).abs().max().item() <= 1e-4
    assert state2.position == 57 and torch.equal(state2.logits, last)


def test_greedy_matches_transformers_generate(
    hf_model: tuple[Qwen3_5ForCausalLM, Path], backend: Qwen35Backend
) -> None:
    model, _ = hf_model
    tokens = _prompt(41, seed=2)
    with torch.no_grad():
        ref = model.generate(
            tokens[None], attention_mask=torch.ones(1, 41, dtype=torch.long), max_new_tokens=32,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, 41:].tolist()  # fmt: skip
    state = backend.new_state(80)
    logits = backend.prefill(state, tokens)
    out: list[int] = []
    for _ in range(32):
        nxt = int(logits.argmax())
        out.append(nxt)
        logits = backend.decode(state, nxt)
    assert out == ref
    assert state.position == 41 + 32


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_equals_one_shot(backend: Qwen35Backend, chunk: int) -> None:
    tokens = _prompt(50, seed=3)
    one = backend.new_state(60)
    ref_logits = backend.prefill(one, tokens)
    st = backend.new_state(60)
    for s in range(0, 50, chunk):  # chunk 3 and 7 split conv windows (K=4) at most boundaries
        logits = backend.prefill(st, tokens[s : s + chunk])
    assert st.position == 50
    assert (logits - ref_logits).abs().max().item() < 1e-4
    for name, t in backend.export(one).tensors.items():
        assert (backend.export(st).tensors[name] - t).abs().max().item() < 1e-4, name
    # and decoding continues identically from either
    a, b = backend.decode(one, 5), backend.decode(st, 5)
    assert (a - b).abs().max().item() < 1e-4


def test_snapshot_round_trip_continues_exactly(backend: Qwen35Backend) -> None:
    tokens = _prompt(30, seed=4)
    follow = [7, 300, 12, 12, 99, 0, 1, 42]
    never = backend.new_state(48)
    backend.prefill(never, tokens)
    ref = [backend.decode(never, t) for t in follow]

    live = backend.new_state(48)
    backend.prefill(live, tokens)
    snap = backend.export(live)
    assert snap.position == 30
    assert snap.tensors["layers.2.k"].shape == (30, 2, 16)
    assert snap.tensors["layers.2.k"].data_ptr() == live.tensors["layers.2.k"].data_ptr()  # a view, no copy
    stored = snap.detached()
    for t in follow:  # the live state moves on; the exported views must stay valid
        backend.decode(live, t)
    for s in (snap, stored):
        for name in backend.geometry.names:
            assert torch.equal(s.tensors[name], stored.tensors[name]), name
        adopted = backend.adopt(s, capacity=64)
        assert adopted.position == 30 and adopted.capacity == 64
        assert torch.equal(adopted.logits, ref_logits_at(backend, tokens))
        got = [backend.decode(adopted, t) for t in follow]
        for x, y in zip(got, ref, strict=True):
            assert torch.equal(x, y)


def ref_logits_at(backend: Qwen35Backend, tokens: torch.Tensor) -> torch.Tensor:
    st = backend.new_state(len(tokens))
    return backend.prefill(st, tokens)


def test_adopt_rejects_other_layer_pattern(backend: Qwen35Backend, tmp_path: Path) -> None:
    other_model = _make_model(SWAPPED, seed=5)
    other_model.save_pretrained(tmp_path)
    other = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    st = other.new_state(16)
    other.prefill(st, _prompt(10))
    foreign = other.export(st)
    with pytest.raises(SnapshotMismatch, match="names differ"):
        backend.adopt(foreign, 16)
    with pytest.raises(SnapshotMismatch):
        other.adopt(backend.export(_prefilled(backend, 10)), 16)


def _prefilled(backend: Qwen35Backend, n: int) -> object:
    st = backend.new_state(n + 4)
    backend.prefill(st, _prompt(n))
    return st


def test_adopt_rejects_bad_tensors(backend: Qwen35Backend) -> None:
    st = backend.new_state(20)
    backend.prefill(st, _prompt(12))
    good = backend.export(st)

    def variant(name: str, t: torch.Tensor) -> Snapshot:
        return Snapshot(12, {**good.tensors, name: t})

    with pytest.raises(SnapshotMismatch, match="layers.1.recurrent: dtype"):
        backend.adopt(variant("layers.1.recurrent", good.tensors["layers.1.recurrent"].bfloat16()), 20)
    with pytest.raises(SnapshotMismatch, match="layers.0.conv: shape"):
        backend.adopt(variant("layers.0.conv", torch.zeros(96, 4)), 20)
    with pytest.raises(SnapshotMismatch, match="layers.2.v: shape"):
        backend.adopt(variant("layers.2.v", good.tensors["layers.2.v"][:11]), 20)
    with pytest.raises(SnapshotMismatch, match="capacity"):
        backend.adopt(good, 11)
    missing = {k: v for k, v in good.tensors.items() if k != "layers.3.conv"}
    with pytest.raises(SnapshotMismatch, match="missing"):
        backend.adopt(Snapshot(12, missing), 20)
    assert backend.adopt(good, 12).position == 12


def test_capacity_and_input_errors(backend: Qwen35Backend) -> None:
    st = backend.new_state(8)
    with pytest.raises(ValueError, match="capacity 8"):
        backend.prefill(st, _prompt(9))
    assert st.position == 0
    with pytest.raises(ValueError, match="non-empty"):
        backend.prefill(st, torch.zeros(0, dtype=torch.int64))


def test_bf16_runs_and_mostly_agrees(hf_model: tuple[Qwen3_5ForCausalLM, Path]) -> None:
    model, path = hf_model
    b16 = build(open_checkpoint(path), CPU, torch.bfloat16, TORCH_OPS)
    assert b16.geometry.spec("layers.0.conv").dtype == torch.bfloat16
    assert b16.geometry.spec("layers.0.recurrent").dtype == torch.float32  # recurrent state stays fp32
    tokens = _prompt(60, seed=6)
    with torch.no_grad():
        ref = model(tokens[None]).logits[0]
    st = b16.new_state(64)
    ours = b16.forward(st, tokens, all_logits=True)
    assert torch.isfinite(ours).all()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
    assert torch.isfinite(b16.decode(st, 3)).all()


def test_shape_mismatch_raises_checkpoint_error(
    hf_model: tuple[Qwen3_5ForCausalLM, Path], tmp_path: Path
) -> None:
    _, path = hf_model
    cfg = json.loads((path / "config.json").read_text())
    cfg["linear_value_head_dim"] = 16
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(CheckpointError, match="in_proj_qkv.weight"):
        build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    cfg["layer_types"] = cfg["layer_types"][:3]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer_types has 3 entries"):
        build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)


def test_multimodal_layout_loads_the_same(hf_model: tuple[Qwen3_5ForCausalLM, Path], tmp_path: Path) -> None:
    """A `qwen3_5` (ForConditionalGeneration) folder: text_config + model.language_model.* names."""
    model, path = hf_model
    text = json.loads((path / "config.json").read_text())
    cfg = {"model_type": "qwen3_5", "text_config": text, "vision_config": {}, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v.contiguous()
        for k, v in model.state_dict().items()
    }
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    mm = build_backend(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    tokens = _prompt(20, seed=7)
    with torch.no_grad():
        ref = model(tokens[None]).logits[0, -1]
    assert (mm.prefill(mm.new_state(20), tokens) - ref).abs().max().item() <= 1e-4


def test_demo_tiny_loads_in_transformers_and_matches(tmp_path: Path) -> None:
    cfg = demo_config("tiny")
    wts = init_weights(cfg, seed=3)
    assert all(t.dtype == torch.bfloat16 for t in wts.values())
    assert torch.equal(
        init_weights(cfg, seed=3)["model.layers.0.linear_attn.A_log"], wts["model.layers.0.linear_attn.A_log"]
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(wts, str(tmp_path / "model.safetensors"))
    model = Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert model.config.layer_types == cfg["layer_types"]
    ours = build_backend(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    tokens = _prompt(24, seed=8)
    with torch.no_grad():
        ref = model(tokens[None]).logits[0, -1]
    assert (ours.prefill(ours.new_state(24), tokens) - ref).abs().max().item() <= 1e-4


def test_demo_small_size() -> None:
    cfg = demo_config("small")
    assert cfg["layer_types"].count(LINEAR) == 3 * cfg["layer_types"].count(FULL)
    wts = init_weights(cfg, seed=0)
    params = sum(t.numel() for t in wts.values())
    assert 100e6 <= params <= 300e6, params
    with pytest.raises(ValueError, match="'huge' is unknown"):
        demo_config("huge")


def test_triton_delta_rule_in_model(
    hf_model: tuple[Qwen3_5ForCausalLM, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path's delta rule, run on CPU under the Triton interpreter, inside the model."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, path = hf_model
    b = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    b.delta_rule = TRITON_DELTA_RULE
    tokens = _prompt(20, seed=9)
    with torch.no_grad():
        ref = model(tokens[None]).logits[0, -1]
    st = b.new_state(24)
    backend_logits = b.prefill(st, tokens[:17])
    backend_logits = b.prefill(st, tokens[17:])
    assert (backend_logits - ref).abs().max().item() <= 1e-4


def test_moe_variant_matches_transformers(tmp_path: Path) -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=3, layer_types=[LINEAR, FULL, LINEAR],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )  # fmt: skip
    torch.manual_seed(10)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")) or "linear_attn.norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else p.shape[-1] ** -0.5))
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    ours = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    tokens = _prompt(45, seed=11)
    with torch.no_grad():
        ref = model(tokens[None]).logits[0]
    got = ours.forward(ours.new_state(60), tokens, all_logits=True)
    assert (got - ref).abs().max().item() <= 1e-4
    st = ours.new_state(60)  # chunked prefill then decode, against the full forward
    ours.prefill(st, tokens[:20])
    ours.prefill(st, tokens[20:44])
    assert (ours.decode(st, int(tokens[44])) - ref[-1]).abs().max().item() <= 1e-4


# -- batched step ------------------------------------------------------------------
# Per step, each sequence's chunk size (0: it sits this step out; 1: a greedy decode of its
# own last logits). Sequences start at the positions in PREFIXES, so every step mixes
# decodes with 7- and 19-token chunks at different offsets (conv windows split anywhere).
PREFIXES = (5, 12, 0, 30, 3)
PLAN = (
    (1, 1, 7, 19, 7),
    (1, 19, 1, 1, 0),
    (7, 1, 19, 7, 1),
    (1, 1, 1, 1, 1),
    (19, 7, 1, 0, 19),
)


def _run_batched_plan(
    backend: Qwen35Backend, together: bool
) -> tuple[list[list[int]], list[torch.Tensor], list]:
    """Runs PLAN with one `step` per plan row (together) or one `prefill` per chunk; returns
    each sequence's greedy tokens, every logits row in order, and the final states."""
    states = []
    for j, n in enumerate(PREFIXES):
        st = backend.new_state(128)
        if n:
            backend.prefill(st, _prompt(n, seed=20 + j))
        states.append(st)
    greedy: list[list[int]] = [[] for _ in states]
    rows: list[torch.Tensor] = []
    for r, sizes in enumerate(PLAN):
        live = [j for j, n in enumerate(sizes) if n]
        chunks = []
        for j in live:
            if sizes[j] == 1 and states[j].logits is not None:
                greedy[j].append(int(states[j].logits.argmax()))
                chunks.append(torch.tensor([greedy[j][-1]]))
            else:
                chunks.append(_prompt(sizes[j], seed=100 * r + j))
        if together:
            out = backend.step([states[j] for j in live], chunks)
            assert out.shape == (len(live), backend.vocab_size) and out.dtype == torch.float32
            rows += list(out)
        else:
            rows += [backend.prefill(states[j], c) for j, c in zip(live, chunks, strict=True)]
    return greedy, rows, states


def test_batched_step_equals_each_alone(backend: Qwen35Backend) -> None:
    solo_tokens, solo_rows, solo_states = _run_batched_plan(backend, together=False)
    tokens, rows, states = _run_batched_plan(backend, together=True)
    assert tokens == solo_tokens and sum(len(t) for t in tokens) >= 10
    assert len(rows) == len(solo_rows)
    for a, b in zip(rows, solo_rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    for st, ref in zip(states, solo_states, strict=True):
        assert st.position == ref.position
        assert st.logits is not None and ref.logits is not None and st.logits.dtype == torch.float32
        assert (st.logits - ref.logits).abs().max().item() <= 1e-4
        got, want = backend.export(st).tensors, backend.export(ref).tensors
        for name, t in want.items():
            assert got[name].shape == t.shape, name
            assert (got[name] - t).abs().max().item() <= 1e-4, name


def test_batched_step_exported_views_survive_the_next_step(backend: Qwen35Backend) -> None:
    """A snapshot taken between steps stays valid while the sequences move on together."""
    a, b = backend.new_state(40), backend.new_state(40)
    backend.prefill(a, _prompt(9, seed=30))
    backend.prefill(b, _prompt(14, seed=31))
    backend.step([a, b], [torch.tensor([3]), torch.tensor([4])])
    snap = backend.export(a)
    stored = snap.detached()
    backend.step([a, b], [torch.tensor([5]), _prompt(7, seed=32)])
    for name, t in stored.tensors.items():
        assert torch.equal(snap.tensors[name], t), name


def test_batched_step_rejects_bad_input_before_any_write(backend: Qwen35Backend) -> None:
    a, b = backend.new_state(10), backend.new_state(10)
    backend.prefill(a, _prompt(4))
    before = {k: v.clone() for k, v in a.tensors.items()}
    with pytest.raises(ValueError, match="capacity 10"):
        backend.step([a, b], [torch.tensor([1]), _prompt(11)])
    with pytest.raises(ValueError, match="appears twice"):
        backend.step([a, a], [torch.tensor([1]), torch.tensor([2])])
    with pytest.raises(ValueError, match="one chunk per state"):
        backend.step([a, b], [torch.tensor([1])])
    assert a.position == 4 and b.position == 0
    for k, v in a.tensors.items():
        assert torch.equal(v, before[k]), k


def test_triton_delta_rule_batched_decode(
    hf_model: tuple[Qwen3_5ForCausalLM, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes of several sequences folded into one Triton delta-rule call (interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, path = hf_model
    ref = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    tri = build(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    tri.delta_rule = TRITON_DELTA_RULE

    def run(b: Qwen35Backend) -> torch.Tensor:
        states = [b.new_state(24) for _ in range(3)]
        for j, st in enumerate(states):
            b.prefill(st, _prompt(6 + 4 * j, seed=40 + j))
        return b.step(states, [torch.tensor([7]), torch.tensor([8]), _prompt(5, seed=43)])

    assert (run(tri) - run(ref)).abs().max().item() <= 1e-4
