"""Qwen3-MoE (dense family, model_type qwen3_moe) against transformers' Qwen3MoeForCausalLM on
tiny random checkpoints written by transformers itself: dense and sparse layers mixed by
decoder_sparse_step / mlp_only_layers, both norm_topk_prob values; logits, greedy decoding,
chunked prefill and a batched step (bit-exact with the invariant CPU kernels), both expert
layouts, and config fields refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.dense import HONOURED_FIELDS, NO_MATH_FIELDS, DenseBackend, DenseConfig, build
from keepwarm.engine.models.moe import Moe
from keepwarm.kernels.ops import TORCH_OPS, cpu_ops
from tests.engine.models.sliding_checks import prompt, randomize

CPU = torch.device("cpu")
ATOL = 1e-4
BASE: dict[str, Any] = dict(
    vocab_size=211, hidden_size=48, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, moe_intermediate_size=24, max_position_embeddings=512,
)  # fmt: skip
CASES: dict[str, dict[str, Any]] = {
    # layers 0, 1, 3 sparse (2 is listed dense); 8 experts, top-2 renormalized
    "4l-e8-norm": dict(
        num_hidden_layers=4, decoder_sparse_step=1, mlp_only_layers=[2], num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    ),
    # layers 1 and 3 sparse (every second), 4 experts, top-2 not renormalized; attention biases
    "4l-step2-e4-raw": dict(
        num_hidden_layers=4, decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, attention_bias=True, tie_word_embeddings=False,
    ),
}  # fmt: skip
SPARSE = {"4l-e8-norm": [0, 1, 3], "4l-step2-e4-raw": [1, 3]}


def _model(extra: dict[str, Any], seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**BASE, **extra))
    return randomize(model, seed)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    path = tmp_path_factory.mktemp(request.param)
    ref = _model(CASES[request.param])
    ref.save_pretrained(path)
    ours = build_backend(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    assert isinstance(ours, DenseBackend)
    assert [i for i, layer in enumerate(ours.layers) if layer.moe is not None] == SPARSE[request.param]
    return ref, ours, path


NEEDS_INVARIANT = pytest.mark.skipif(
    cpu_ops().name != "cpu_invariant",
    reason="the invariant CPU kernels need AVX-512 BF16 or AVX2 + FMA + F16C",
)
# the torch ops agree within ATOL; the invariant kernels give the same bits
KERNELS = [pytest.param(False, id="torch"), pytest.param(True, id="invariant", marks=NEEDS_INVARIANT)]


def _backend(case: tuple[Any, Any, Path], exact: bool) -> DenseBackend:
    if not exact:
        return case[1]
    ops = cpu_ops()
    assert ops.name == "cpu_invariant"
    return build(open_checkpoint(case[2]), CPU, torch.float32, ops)


def _same(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    return torch.equal(a, b) if exact else (a - b).abs().max().item() <= ATOL


def test_saved_checkpoint_has_per_expert_weights_and_the_config_fields(case: tuple[Any, Any, Path]) -> None:
    _, ours, path = case
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe"
    assert set(cfg) - HONOURED_FIELDS - NO_MATH_FIELDS == set()
    assert ours.cfg.qk_norm and ours.static_decode(64) is False  # routing reads host values


@pytest.mark.parametrize("n", [1, 13, 40])
def test_logits_match_transformers(case: tuple[Any, Any, Path], n: int) -> None:
    ref, ours, _ = case
    toks = prompt(n, ours.vocab_size, seed=n)
    with torch.no_grad():
        want = ref(toks[None]).logits[0].float()
    assert want.std().item() > 0.5  # peaked, informative logits
    got = ours.forward(ours.new_state(n + 4), toks, all_logits=True)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= ATOL


def test_greedy_32_tokens_match_transformers_generate(case: tuple[Any, Any, Path]) -> None:
    ref, ours, _ = case
    n, new = 11, 32
    toks = prompt(n, ours.vocab_size, seed=2)
    with torch.no_grad():
        out = ref.generate(
            toks[None], attention_mask=torch.ones(1, n, dtype=torch.long), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    want = out[0, n:].tolist()
    state = ours.new_state(n + new)
    logits = ours.prefill(state, toks)
    got = []
    for _ in range(new):
        got.append(int(logits.argmax()))
        logits = ours.decode(state, got[-1])
    assert got == want
    assert len(set(got)) > 3  # a varied continuation, not one token repeated


@pytest.mark.parametrize("exact", KERNELS)
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot(case: tuple[Any, Any, Path], chunk: int, exact: bool) -> None:
    backend = _backend(case, exact)  # the experts see different token subsets per chunk
    n = 30 if chunk == 1 else 70
    toks = prompt(n, backend.vocab_size, seed=3)
    one = backend.forward(backend.new_state(n), toks, all_logits=True)
    state = backend.new_state(n)
    parts = torch.cat(
        [backend.forward(state, toks[i : i + chunk], all_logits=True) for i in range(0, n, chunk)]
    )
    assert state.position == n
    assert _same(parts, one, exact)


@pytest.mark.parametrize("exact", KERNELS)
def test_batched_step_equals_each_sequence_alone(case: tuple[Any, Any, Path], exact: bool) -> None:
    backend = _backend(case, exact)

    def states() -> tuple[list[Any], list[torch.Tensor]]:
        plan = [(0, 19), (5, 7), (23, 1), (3, 1), (0, 1)]  # fresh, mid-prefill, decoding
        sts, chunks = [], []
        for k, (pre, n) in enumerate(plan):
            st = backend.new_state(pre + n + 2)
            if pre:
                backend.prefill(st, prompt(pre, backend.vocab_size, seed=10 + k))
            sts.append(st)
            chunks.append(prompt(n, backend.vocab_size, seed=20 + k))
        return sts, chunks

    a, chunks = states()
    b, _ = states()
    batched = backend.step(a, chunks)
    each = torch.stack([backend.prefill(s, c) for s, c in zip(b, chunks, strict=True)])
    assert batched.shape == (5, backend.vocab_size)
    assert _same(batched, each, exact)
    nxt = [torch.tensor([int(x)]) for x in batched.argmax(-1)]  # then a step of decodes only
    again = backend.step(a, nxt)
    alone = torch.stack([backend.prefill(s, c) for s, c in zip(b, nxt, strict=True)])
    assert _same(again, alone, exact)


@NEEDS_INVARIANT
def test_moe_ties_go_to_the_lowest_expert_and_weights_stay_unnormalized_when_asked() -> None:
    """Equal router logits: the lowest ids win (the invariant bundle's ops.topk);
    norm_topk_prob False keeps the softmax weights (1/E each), True renormalizes them over the
    k (1/k each)."""
    from keepwarm.engine.models.moe import moe

    e, hid, inter = 4, 8, 4
    gate_up = torch.zeros(e, 2 * inter, hid)
    down = torch.zeros(e, hid, inter)
    for x in range(e):  # expert x: silu(1) * 1 on every unit, down to (x + 1) on every channel
        gate_up[x, :, 0] = 1.0
        down[x] = x + 1.0
    h = torch.zeros(3, hid)
    h[:, 0] = 1.0
    silu1 = torch.nn.functional.silu(torch.tensor(1.0)).item()
    for normalize, weight in ((False, 1 / e), (True, 1 / 2)):
        w = Moe(router=torch.zeros(e, hid), gate_up=gate_up, down=down, top_k=2, normalize=normalize)
        out = moe(w, h, cpu_ops())
        want = weight * silu1 * inter * (1.0 + 2.0)  # experts 0 and 1
        torch.testing.assert_close(out, torch.full((3, hid), want))


def test_fused_expert_layout_loads_the_same(case: tuple[Any, Any, Path], tmp_path: Path) -> None:
    """Experts as 3-D mlp.experts.gate_up_proj / down_proj (transformers' runtime form)."""
    from safetensors.torch import load_file, save_file

    _, ours, path = case
    sd = load_file(str(path / "model.safetensors"))
    e_n = ours.cfg.num_experts
    for i, layer in enumerate(ours.layers):
        if layer.moe is None:
            continue
        mp = f"model.layers.{i}.mlp."
        ex = [f"{mp}experts.{e}." for e in range(e_n)]
        sd[mp + "experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd.pop(x + "gate_proj.weight"), sd.pop(x + "up_proj.weight")]) for x in ex]
        )
        sd[mp + "experts.down_proj"] = torch.stack([sd.pop(x + "down_proj.weight") for x in ex])
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    save_file(sd, str(tmp_path / "model.safetensors"))
    fused = build(open_checkpoint(tmp_path), CPU, torch.float32, TORCH_OPS)
    toks = prompt(12, ours.vocab_size)
    assert torch.equal(ours.prefill(ours.new_state(12), toks), fused.prefill(fused.new_state(12), toks))


def _edited(path: Path, tmp: Path, **edit: Any) -> Path:
    cfg = {**json.loads((path / "config.json").read_text()), **edit}
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    if not (tmp / "model.safetensors").exists():
        (tmp / "model.safetensors").symlink_to(path / "model.safetensors")
    return tmp


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"num_local_experts": 3}, r"mlp.gate.weight.*shape"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"moe_intermediate_size": 32}, r"experts.0.gate_proj.weight.*shape"),
        ({"mlp_only_layers": [0, 1, 3]}, r"mlp.gate_proj.weight.*missing"),
    ],
)
def test_config_fields_are_implemented_or_refused_by_name(
    case: tuple[Any, Any, Path], tmp_path: Path, edit: dict[str, Any], match: str
) -> None:
    _, _, path = case
    with pytest.raises(CheckpointError, match=match):
        build(open_checkpoint(_edited(path, tmp_path / "m", **edit)), CPU, torch.float32, TORCH_OPS)


def test_sliding_window_without_a_window_is_plain_attention(case: tuple[Any, Any, Path]) -> None:
    """transformers: use_sliding_window with sliding_window null is full attention."""
    _, _, path = case
    cfg = {
        **json.loads((path / "config.json").read_text()),
        "use_sliding_window": True,
        "sliding_window": None,
    }
    assert DenseConfig.from_dict(cfg).sparse_layers


def test_every_transformers_field_of_qwen3_moe_is_classified() -> None:
    assert set(Qwen3MoeConfig.__annotations__) - HONOURED_FIELDS - NO_MATH_FIELDS == set()
