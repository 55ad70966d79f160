"""DeepSeek V4 family: parity with transformers' DeepseekV4ForCausalLM on tiny random
checkpoints (two layer schedules), chunked prefill, and exact snapshots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from keepwarm.engine.cache.snapshot import LOGITS, Snapshot
from keepwarm.engine.demo.deepseek_v4 import demo_config, init_weights
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.deepseek_v4 import DeepseekV4Backend
from keepwarm.engine.models.geometry import SnapshotMismatch
from keepwarm.kernels.ops import TORCH_OPS

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
VOCAB = 300
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=1,
    head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, max_position_embeddings=4096,
)  # fmt: skip

# A: every layer type, CSA rate 4 (top-3 of up to 17 blocks), HCA rate 8, window 8, 2 streams.
# B: other rates (CSA 3, HCA 5), window 5, 3 streams, top-2, YaRN on the compress rope,
#    sigmoid router scores.
SCHEDULES: dict[str, dict[str, Any]] = {
    "A": dict(
        num_hidden_layers=4, layer_types=[H, C, S, C], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={C: 4, H: 8}, sliding_window=8, hc_mult=2, index_topk=3,
    ),
    "B": dict(
        num_hidden_layers=3, layer_types=[C, H, H], mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        compress_rates={C: 3, H: 5}, sliding_window=5, hc_mult=3, index_topk=2, scoring_func="sigmoid",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    # A with HCA rate 16: same tensor names as A, other row counts
    "A16": dict(
        num_hidden_layers=4, layer_types=[H, C, S, C], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={C: 4, H: 16}, sliding_window=8, hc_mult=2, index_topk=3,
    ),
}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny models gain nothing from threads, and a shared 2-core box makes their syncs slow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randomize(model: Any, seed: int) -> None:
    """Non-trivial values everywhere (transformers initializes sinks, position biases, mHC
    bases, tid2eid and score biases to zero), scaled so logits stay informative."""
    g = torch.Generator().manual_seed(seed)
    n_exp, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1 or "position_bias" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(n_exp, generator=g)[:k] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _make(schedule: str, seed: int = 0) -> Any:
    cfg = transformers.DeepseekV4Config(**BASE, **SCHEDULES[schedule])
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    _randomize(model, seed)
    return model


def _built(model: Any, path: Path) -> DeepseekV4Backend:
    model.save_pretrained(path)
    b = build_backend(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    assert isinstance(b, DeepseekV4Backend)
    return b


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, DeepseekV4Backend]]:
    """Schedule name -> (transformers model, our backend on its save_pretrained folder)."""
    out = {}
    for name, seed in (("A", 0), ("B", 1), ("A16", 2)):
        model = _make(name, seed)
        out[name] = (model, _built(model, tmp_path_factory.mktemp(f"dsv4_{name}")))
    return out


@pytest.fixture(params=["A", "B"])
def pair(
    request: pytest.FixtureRequest, built: dict[str, tuple[Any, DeepseekV4Backend]]
) -> tuple[Any, DeepseekV4Backend]:
    return built[request.param]


@pytest.fixture
def backend_a(built: dict[str, tuple[Any, DeepseekV4Backend]]) -> DeepseekV4Backend:
    return built["A"][1]


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


# -- layout ------------------------------------------------------------------------
def test_geometry_names_and_row_counts(backend_a: DeepseekV4Backend) -> None:
    g = backend_a.geometry
    assert backend_a.family == "deepseek_v4"
    assert g.names == (
        "layers.0.window", "layers.0.compressed", "layers.0.pending_kv", "layers.0.pending_gate",
        "layers.1.window", "layers.1.compressed", "layers.1.pending_kv", "layers.1.pending_gate",
        "layers.1.overlap_kv", "layers.1.overlap_gate",
        "layers.1.indexer.compressed", "layers.1.indexer.pending_kv", "layers.1.indexer.pending_gate",
        "layers.1.indexer.overlap_kv", "layers.1.indexer.overlap_gate",
        "layers.2.window",
        "layers.3.window", "layers.3.compressed", "layers.3.pending_kv", "layers.3.pending_gate",
        "layers.3.overlap_kv", "layers.3.overlap_gate",
        "layers.3.indexer.compressed", "layers.3.indexer.pending_kv", "layers.3.indexer.pending_gate",
        "layers.3.indexer.overlap_kv", "layers.3.indexer.overlap_gate",
        LOGITS,
    )  # fmt: skip
    at = {name: g.spec(name).shape_at(23) for name in g.names}
    assert at["layers.0.window"] == (7, 32)  # W - 1 rows once position >= W - 1
    assert at["layers.0.compressed"] == (2, 32)  # HCA rate 8: blocks 0..7, 8..15 completed
    assert at["layers.0.pending_kv"] == (7, 32)  # 16..22 open
    assert at["layers.1.compressed"] == (5, 32)
    assert at["layers.1.pending_gate"] == (3, 64)  # CSA projects Ca | Cb
    assert at["layers.1.overlap_kv"] == (4, 32)
    assert at["layers.1.indexer.compressed"] == (5, 16)
    assert at["layers.1.indexer.pending_kv"] == (3, 32)
    assert at["layers.1.indexer.overlap_gate"] == (4, 16)
    assert g.spec("layers.1.overlap_gate").dtype == torch.float32
    assert at[LOGITS] == (VOCAB,)
    at3 = {name: g.spec(name).shape_at(3) for name in g.names}
    assert at3["layers.0.window"] == (3, 32) and at3["layers.1.compressed"] == (0, 32)
    assert at3["layers.1.overlap_kv"] == (0, 32) and at3["layers.1.pending_kv"] == (3, 64)


# -- parity ------------------------------------------------------------------------
def test_logits_match_transformers(pair: tuple[Any, DeepseekV4Backend]) -> None:
    model, backend = pair
    tokens = _prompt(70)  # crosses >= 8 blocks of every compressed layer
    with torch.no_grad():
        ref = model(tokens[None], use_cache=False).logits[0]
    assert ref.std().item() > 0.3  # informative logits
    state = backend.new_state(80)
    ours = backend.forward(state, tokens, all_logits=True)
    assert ours.shape == (70, VOCAB) and ours.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= 1e-4
    assert state.position == 70 and torch.equal(state.logits, ours[-1])


def test_token_by_token_matches_transformers(pair: tuple[Any, DeepseekV4Backend]) -> None:
    model, backend = pair
    tokens = _prompt(40, seed=5)
    with torch.no_grad():
        ref = model(tokens[None], use_cache=False).logits[0]
    state = backend.new_state(40)
    for i in range(40):
        got = backend.decode(state, int(tokens[i]))
        assert (got - ref[i]).abs().max().item() <= 1e-4, i


def test_greedy_matches_transformers_generate(pair: tuple[Any, DeepseekV4Backend]) -> None:
    model, backend = pair
    tokens = _prompt(37, seed=2)
    with torch.no_grad():
        ref = model.generate(
            tokens[None], attention_mask=torch.ones(1, 37, dtype=torch.long), max_new_tokens=32,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, 37:].tolist()  # fmt: skip
    state = backend.new_state(80)
    logits = backend.prefill(state, tokens)
    out: list[int] = []
    for _ in range(32):
        out.append(int(logits.argmax()))
        logits = backend.decode(state, out[-1])
    assert out == ref
    assert len(set(out)) > 3  # not a degenerate repeat
    assert state.position == 37 + 32


def test_transformers_chunked_cache_agrees(pair: tuple[Any, DeepseekV4Backend]) -> None:
    """transformers' own cache, fed chunks split inside blocks, reproduces its one-shot
    logits: the semantics our chunked prefill follows."""
    model, backend = pair
    tokens = _prompt(45, seed=6)
    cache = transformers.DynamicCache(config=model.config)
    parts = []
    with torch.no_grad():
        for a, b in [(0, 6), (6, 7), (7, 22), (22, 45)]:
            parts.append(model(tokens[None, a:b], cache=cache, use_cache=True).logits[0])
    state = backend.new_state(45)
    ours = backend.forward(state, tokens, all_logits=True)
    assert (torch.cat(parts) - ours).abs().max().item() <= 1e-4


# -- chunking ------------------------------------------------------------------------
@pytest.mark.parametrize("cuts", [[5, 6, 19, 30, 31, 45], [1, 2, 3, 9, 13, 27], [*range(1, 20), 41]])
def test_chunked_prefill_equals_one_shot(pair: tuple[Any, DeepseekV4Backend], cuts: list[int]) -> None:
    _, backend = pair
    tokens = _prompt(60, seed=3)
    one = backend.new_state(70)
    ref = backend.forward(one, tokens, all_logits=True)
    st = backend.new_state(70)
    parts = []
    for a, b in zip([0, *cuts], [*cuts, 60], strict=True):  # boundaries fall inside blocks
        parts.append(backend.forward(st, tokens[a:b], all_logits=True))
    assert st.position == 60
    assert (torch.cat(parts) - ref).abs().max().item() <= 1e-5
    snap_one, snap_st = backend.export(one), backend.export(st)
    for name, t in snap_one.tensors.items():
        assert snap_st.tensors[name].shape == t.shape, name
        assert torch.allclose(snap_st.tensors[name], t, rtol=0, atol=1e-5), name
    assert (backend.decode(one, 11) - backend.decode(st, 11)).abs().max().item() <= 1e-5


# -- snapshots ------------------------------------------------------------------------
def _continue(backend: DeepseekV4Backend, state: Any, rest: torch.Tensor) -> list[torch.Tensor]:
    """A 5-token chunk then 6 decodes: crosses block boundaries of every rate from any start."""
    out = [backend.prefill(state, rest[:5])]
    out += [backend.decode(state, int(t)) for t in rest[5:11]]
    return out


@pytest.mark.parametrize("at", [23, 3, 1])  # inside blocks; 3 and 1: below every rate (zero rows)
def test_snapshot_restores_exactly(pair: tuple[Any, DeepseekV4Backend], at: int) -> None:
    _, backend = pair
    tokens = _prompt(45, seed=4)
    never = backend.new_state(64)
    backend.prefill(never, tokens[:at])
    ref = _continue(backend, never, tokens[at:])

    live = backend.new_state(64)
    backend.prefill(live, tokens[:at])
    snap = backend.export(live)
    assert snap.position == at
    backend.geometry.validate(snap.tensors, at)
    for name, t in snap.tensors.items():  # right-sized views of the live state, no copy
        if name != LOGITS and t.numel():
            assert t.data_ptr() == live.tensors[name].data_ptr(), name
    if at < 3:
        zero = [n for n, t in snap.tensors.items() if t.dim() == 2 and t.shape[0] == 0]
        assert any(n.endswith(".compressed") for n in zero) and any(n.endswith("overlap_kv") for n in zero)
    stored = snap.detached()
    _continue(backend, live, tokens[at:])  # the live state moves on; the views must stay valid
    for s in (snap, stored):
        for name in backend.geometry.names:
            assert torch.equal(s.tensors[name], stored.tensors[name]), name
        adopted = backend.adopt(s, capacity=64)
        assert adopted.position == at and adopted.capacity == 64
        got = _continue(backend, adopted, tokens[at:])
        for x, y in zip(got, ref, strict=True):
            assert torch.equal(x, y)


def test_snapshot_file_round_trip(backend_a: DeepseekV4Backend, tmp_path: Path) -> None:
    """Through a safetensors file (as the disk cache stores it), zero-row tensors included."""
    from safetensors.torch import load_file

    tokens = _prompt(30, seed=7)
    for at in (2, 21):
        st = backend_a.new_state(40)
        backend_a.prefill(st, tokens[:at])
        snap = backend_a.export(st).detached()
        path = tmp_path / f"s{at}.safetensors"
        save_file({k: v.contiguous() for k, v in snap.tensors.items()}, str(path))
        back = backend_a.adopt(Snapshot(at, load_file(str(path))), capacity=40)
        a = backend_a.prefill(back, tokens[at:])
        b = backend_a.prefill(st, tokens[at:])
        assert torch.equal(a, b)


def test_adopt_rejects_wrong_row_counts(backend_a: DeepseekV4Backend) -> None:
    st = backend_a.new_state(40)
    backend_a.prefill(st, _prompt(23))
    snap = backend_a.export(st).detached()
    for pos in (22, 24, 20, 31):  # the same tensors claimed at another position
        with pytest.raises(SnapshotMismatch):
            backend_a.adopt(Snapshot(pos, snap.tensors), capacity=40)
    for name, cut in (
        ("layers.1.compressed", 1),
        ("layers.0.pending_kv", 2),
        ("layers.3.indexer.overlap_kv", 1),
    ):
        bad = dict(snap.tensors)
        bad[name] = bad[name][:-cut]
        with pytest.raises(SnapshotMismatch, match=name.replace(".", r"\.")):
            backend_a.adopt(Snapshot(23, bad), capacity=40)
    bad = dict(snap.tensors)
    bad["layers.1.overlap_gate"] = bad["layers.1.overlap_gate"].double()
    with pytest.raises(SnapshotMismatch, match="dtype"):
        backend_a.adopt(Snapshot(23, bad), capacity=40)
    with pytest.raises(SnapshotMismatch, match="capacity"):
        backend_a.adopt(snap, capacity=22)
    assert backend_a.adopt(snap, capacity=23).position == 23  # the good one still adopts


def test_adopt_rejects_other_schedule(built: dict[str, tuple[Any, DeepseekV4Backend]]) -> None:
    a, b, a16 = built["A"][1], built["B"][1], built["A16"][1]
    tokens = _prompt(23, seed=8)
    snaps = {}
    for name, backend in (("A", a), ("B", b), ("A16", a16)):
        st = backend.new_state(30)
        backend.prefill(st, tokens)
        snaps[name] = backend.export(st)
    # other layer types: other tensor names
    with pytest.raises(SnapshotMismatch, match="names differ"):
        b.adopt(snaps["A"], capacity=30)
    with pytest.raises(SnapshotMismatch, match="names differ"):
        a.adopt(snaps["B"], capacity=30)
    # same layer types, HCA rate 8 vs 16: same names, HCA rows 23 // 8 = 2 vs 23 // 16 = 1
    assert a.geometry.names == a16.geometry.names
    with pytest.raises(SnapshotMismatch, match=r"layers\.0\.compressed"):
        a16.adopt(snaps["A"], capacity=30)
    with pytest.raises(SnapshotMismatch, match=r"layers\.0\.compressed"):
        a.adopt(snaps["A16"], capacity=30)
    assert a.adopt(snaps["A"], capacity=30).position == 23


# -- checkpoint forms and demo weights --------------------------------------------------
def test_module_named_checkpoint_loads(tmp_path: Path) -> None:
    """transformers' module names with packed experts (a raw state_dict) load the same."""
    model = _make("B", seed=9)
    model.save_pretrained(tmp_path / "saved")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "config.json").write_text((tmp_path / "saved" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(raw / "model.safetensors"))
    a = build_backend(open_checkpoint(tmp_path / "saved"), CPU, torch.float32, TORCH_OPS)
    b = build_backend(open_checkpoint(raw), CPU, torch.float32, TORCH_OPS)
    tokens = _prompt(33, seed=10)
    la = a.forward(a.new_state(33), tokens, all_logits=True)
    lb = b.forward(b.new_state(33), tokens, all_logits=True)
    assert torch.equal(la, lb)


def test_demo_weights_load_in_transformers_and_match(tmp_path: Path) -> None:
    cfg = demo_config("tiny")
    w = init_weights(cfg, seed=0)
    again = init_weights(cfg, seed=0)
    assert w.keys() == again.keys() and all(torch.equal(w[k], again[k]) for k in w)
    assert not torch.equal(
        w["model.layers.0.attn.wq_a.weight"], init_weights(cfg, seed=1)["model.layers.0.attn.wq_a.weight"]
    )
    assert {t.dtype for t in w.values()} == {torch.bfloat16, torch.int64}
    save_file(w, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert list(model.config.layer_types) == [H, C, S]
    ours = build_backend(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    tokens = torch.randint(0, cfg["vocab_size"], (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.eval()(tokens[None], use_cache=False).logits[0]
    got = ours.forward(ours.new_state(40), tokens, all_logits=True)
    assert (got - ref).abs().max().item() <= 1e-4


def test_demo_small_config_loads_in_transformers() -> None:
    cfg = demo_config("small")
    hf = transformers.DeepseekV4Config(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    )
    assert hf.layer_types == cfg["layer_types"] and hf.compress_rates == cfg["compress_rates"]
    with pytest.raises(ValueError, match="unknown"):
        demo_config("huge")


def test_bf16_matches_transformers_bf16(tmp_path: Path) -> None:
    """In bf16 transformers keeps mHC, norms, sinks, position biases and score biases in
    float32; so do we, op for op."""
    _make("A", seed=4).save_pretrained(tmp_path)
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ours = build_backend(open_checkpoint(tmp_path), CPU, torch.bfloat16, TORCH_OPS)
    assert ours.geometry.spec("layers.1.window").dtype == torch.bfloat16
    tokens = _prompt(50, seed=11)
    with torch.no_grad():
        ref = model(tokens[None], use_cache=False).logits[0].float()
    got = ours.forward(ours.new_state(50), tokens, all_logits=True)
    assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_bad_config_raises_with_a_fix() -> None:
    from keepwarm.engine.loading.checkpoint import CheckpointError
    from keepwarm.engine.models.deepseek_v4_config import DeepseekV4Config

    cfg = demo_config("tiny")
    with pytest.raises(CheckpointError, match="layer_types"):
        DeepseekV4Config.from_dict({**cfg, "layer_types": [H, "full_attention", S]})
    with pytest.raises(CheckpointError, match="dequantize"):
        DeepseekV4Config.from_dict({**cfg, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        DeepseekV4Config.from_dict({**cfg, "num_key_value_heads": 2})
    with pytest.raises(CheckpointError, match="'q_lora_rank' is missing"):
        DeepseekV4Config.from_dict({k: v for k, v in cfg.items() if k != "q_lora_rank"})


# -- batched step ------------------------------------------------------------------
# Per step, each sequence's chunk size (0: it sits this step out; 1: a greedy decode of its
# own last logits). Starts in PREFIXES put the 7- and 19-token chunks and the decodes at
# every phase of the windows, the compressor blocks and their overlaps.
PREFIXES = (5, 12, 0, 30, 3, 23)
PLAN = (
    (1, 1, 7, 19, 7, 1),
    (1, 19, 1, 1, 0, 7),
    (7, 1, 19, 7, 1, 1),
    (1, 1, 1, 1, 1, 1),
    (19, 7, 1, 0, 19, 1),
    (1, 1, 7, 1, 1, 19),
)


def _run_batched_plan(
    backend: DeepseekV4Backend, together: bool
) -> tuple[list[list[int]], list[torch.Tensor], list[Any]]:
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
            assert out.shape == (len(live), VOCAB) and out.dtype == torch.float32
            rows += list(out)
        else:
            rows += [backend.prefill(states[j], c) for j, c in zip(live, chunks, strict=True)]
    return greedy, rows, states


def test_batched_step_equals_each_alone(pair: tuple[Any, DeepseekV4Backend]) -> None:
    _, backend = pair
    solo_tokens, solo_rows, solo_states = _run_batched_plan(backend, together=False)
    tokens, rows, states = _run_batched_plan(backend, together=True)
    assert tokens == solo_tokens and sum(len(t) for t in tokens) >= 15
    assert len(rows) == len(solo_rows)
    for a, b in zip(rows, solo_rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
    for st, ref in zip(states, solo_states, strict=True):
        assert st.position == ref.position
        assert (st.logits - ref.logits).abs().max().item() <= 1e-4
        got, want = backend.export(st).tensors, backend.export(ref).tensors
        for name, t in want.items():
            assert got[name].shape == t.shape, name
            assert torch.allclose(got[name], t, rtol=0, atol=1e-4), name


def test_batched_step_rejects_bad_input_before_any_write(backend_a: DeepseekV4Backend) -> None:
    a, b = backend_a.new_state(10), backend_a.new_state(10)
    backend_a.prefill(a, _prompt(6))
    before = {k: v.clone() for k, v in backend_a.export(a).tensors.items()}
    with pytest.raises(ValueError, match="capacity 10"):
        backend_a.step([a, b], [torch.tensor([1]), _prompt(11)])
    with pytest.raises(ValueError, match="appears twice"):
        backend_a.step([a, a], [torch.tensor([1]), torch.tensor([2])])
    with pytest.raises(ValueError, match="non-empty"):
        backend_a.step([a, b], [torch.tensor([1]), torch.zeros(0, dtype=torch.int64)])
    assert a.position == 6 and b.position == 0
    for k, v in backend_a.export(a).tensors.items():
        assert torch.equal(v, before[k]), k
