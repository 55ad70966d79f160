"""Demo checkpoints: deterministic bytes, loadable by transformers (model, tokenizer,
chat template), atomic creation, and a working command line."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from keepwarm.engine.demo import demo_model
from keepwarm.engine.demo.demo_model import dense_demo_config, make_demo_model
from keepwarm.engine.loading.chat_template import ChatTemplate
from keepwarm.engine.loading.tokenizer import Tokenizer

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("demo") / "tiny", size="tiny", seed=7)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, tiny: Path) -> None:
    again = make_demo_model(tmp_path / "again", size="tiny", seed=7)
    assert sorted(os.listdir(again)) == FILES
    assert digests(again) == digests(tiny)
    other = digests(make_demo_model(tmp_path / "other", size="tiny", seed=8))
    ref = digests(tiny)
    assert other["model.safetensors"] != ref["model.safetensors"]
    # only the weights depend on the seed
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in ref.items() if k != "model.safetensors"
    }
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_config_and_weight_names(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    tok = Tokenizer.from_dir(tiny)
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    assert cfg["vocab_size"] == tok.vocab_size == 512
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>") == 511
    assert cfg["bos_token_id"] == cfg["pad_token_id"] == tok.token_to_id("<|endoftext|>") == 509
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [511, 509]
    assert tok.eos_token_ids == frozenset({509, 511})

    with safe_open(str(tiny / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes == {"BF16"}
    hid, d, inter = 64, 16, 128
    expected = {"model.embed_tokens.weight": (512, hid), "model.norm.weight": (hid,)}
    for i in range(2):
        p = f"model.layers.{i}."
        expected |= {
            p + "self_attn.q_proj.weight": (4 * d, hid),
            p + "self_attn.k_proj.weight": (2 * d, hid),
            p + "self_attn.v_proj.weight": (2 * d, hid),
            p + "self_attn.o_proj.weight": (hid, 4 * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, hid),
            p + "mlp.up_proj.weight": (inter, hid),
            p + "mlp.down_proj.weight": (hid, inter),
            p + "input_layernorm.weight": (hid,),
            p + "post_attention_layernorm.weight": (hid,),
        }
    assert shapes == expected  # tied: no lm_head.weight
    with safe_open(str(tiny / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.norm.weight"), torch.ones(hid, dtype=torch.bfloat16))
        emb = f.get_tensor("model.embed_tokens.weight").float()
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight").float()
    assert abs(emb.std().item() - 0.02) < 0.002
    assert abs(down.std().item() - 0.02 / math.sqrt(4)) < 0.001


def test_loads_in_transformers_and_logits_are_not_degenerate(tiny: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny)).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.bfloat16
    ids = torch.arange(0, 500, 7).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    assert logits.shape == (ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 0.1
    assert logits.argmax(-1).unique().numel() > 10  # positions do not collapse to one token


def test_tokenizer_and_chat_template_match_transformers(tiny: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(tiny))
    tok = Tokenizer.from_dir(tiny)
    tpl = ChatTemplate.from_dir(tiny, tok)
    msgs = [
        {"role": "system", "content": "You are a demo."},
        {"role": "user", "content": "Hello 🙂, how are you?"},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "Tell me about the river."},
    ]
    for agp in (True, False):
        text = tpl.render(msgs, add_generation_prompt=agp)
        assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
        prompt = tpl.encode_chat(msgs, add_generation_prompt=agp)
        assert (
            prompt.tokens
            == hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=agp)["input_ids"]
        )
        assert len(prompt.boundaries) == 4
    assert text.startswith("<|im_start|>system\nYou are a demo.<|im_end|>\n<|im_start|>user\nHello 🙂")
    assert tpl.render(msgs).endswith(
        "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_small_size_is_in_the_target_range() -> None:
    cfg = dense_demo_config("small")
    hid, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = hid * (2 * q + 2 * kv) + 3 * hid * inter + 2 * hid + 2 * cfg["head_dim"]
    # the tokenizer trained on the shipped corpus ends up with ~11k ids
    params = layers * per_layer + 11_054 * hid + hid
    assert 200e6 <= params <= 400e6


def test_existing_folder_is_refused_then_force_replaces(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        make_demo_model(dest, size="tiny")
    assert os.listdir(dest) == ["keep.txt"]
    make_demo_model(dest, size="tiny", force=True)
    assert sorted(os.listdir(dest)) == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_interrupted_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(config: dict, seed: int) -> dict:
        raise KeyboardInterrupt

    monkeypatch.setitem(
        demo_model.FAMILIES, "dense", lambda: demo_model.DemoFamily(demo_model.dense_demo_config, boom)
    )
    with pytest.raises(KeyboardInterrupt):
        make_demo_model(tmp_path / "m", size="tiny")
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_say_what_to_change(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family 'nope' is unknown"):
        make_demo_model(tmp_path / "a", family="nope", size="tiny")
    with pytest.raises(ValueError, match="demo size 'huge' is unknown"):
        make_demo_model(tmp_path / "b", size="huge")
    assert list(tmp_path.iterdir()) == []


def test_hybrid_family_uses_its_model_module(tmp_path: Path) -> None:
    d = make_demo_model(tmp_path / "h", family="hybrid", size="tiny", seed=1)
    cfg = json.loads((d / "config.json").read_text())
    tok = Tokenizer.from_dir(d)
    assert cfg["model_type"] == "qwen3_5_text"
    assert cfg["vocab_size"] == tok.vocab_size
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_slice("model.embed_tokens.weight").get_shape())[0] == tok.vocab_size


def test_command_line(tmp_path: Path, tiny: Path) -> None:
    dest = tmp_path / "cli"
    cmd = [
        sys.executable,
        "-m",
        "keepwarm.engine.demo.demo_model",
        "--size",
        "tiny",
        "--seed",
        "7",
        str(dest),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "dense (qwen3), tiny, seed 7" in done.stdout
    assert digests(dest) == digests(tiny)  # same bytes from another process
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2
    assert "already exists (pass --force" in again.stderr


def test_family_names_come_from_the_one_registry() -> None:
    from keepwarm.engine.models import FAMILIES, FAMILY_ALIASES, family_of

    assert set(demo_model.FAMILIES) == {*FAMILIES, *FAMILY_ALIASES}
    assert family_of("hybrid") == family_of("qwen3_5") == "qwen3_5"
    with pytest.raises(ValueError, match="family 'nope' is unknown"):
        family_of("nope")
