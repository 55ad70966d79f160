"""Tokenizer: ids, decoding and streaming equal transformers' on real tokenizer folders
(byte-level BPE trained on the shipped corpus: a ChatML/Qwen2 one and a Llama-3-style one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from keepwarm.engine.demo.demo_model import (
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    tokenizer_config,
    train_bpe,
)
from keepwarm.engine.loading.tokenizer import Tokenizer, TokenizerError

LLAMA3_SPECIAL = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\n\nand  double  newlines\r\n",
    "def f(x: int) -> int:\n    return x * 42  # 12345 digits",
    "Café naïve façade — «quotes» and 東京の天気 and 你好 and emoji 🙂🚀👍🏽",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>\n",
    "",
]


def write_dir(path: Path, tok_json: str, config: dict, generation_config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")
    return path


def chatml_dir(path: Path) -> Path:
    tok = train_bpe(1000, CHATML_SPECIAL_TOKENS)
    cfg = tokenizer_config(
        tok,
        CHATML_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special=("<|im_start|>",),
    )
    gen = {"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}
    return write_dir(path, tok.to_str(), cfg, gen)


LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def llama3_dir(path: Path) -> Path:
    """Llama-3 layout: the post-processor prepends <|begin_of_text|>. Its ByteLevel step
    trims offsets (GPT-2 style) on purpose, to exercise untrimmed-offset handling."""
    tok = train_bpe(900, LLAMA3_SPECIAL)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, tok.token_to_id(bos))],
            ),
        ]
    )
    cfg = tokenizer_config(
        tok,
        LLAMA3_TEMPLATE,
        eos_token="<|eot_id|>",
        pad_token=None,
        bos_token=bos,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    gen = {"eos_token_id": [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]}
    return write_dir(path, tok.to_str(), cfg, gen)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tok")
    return {"chatml": chatml_dir(base / "chatml"), "llama3": llama3_dir(base / "llama3")}


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
def test_encode_decode_match_transformers(dirs: dict[str, Path], kind: str) -> None:
    ours = Tokenizer.from_dir(dirs[kind])
    hf = AutoTokenizer.from_pretrained(str(dirs[kind]))
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text
        # Byte-level BPE round-trips every string exactly (the NFC normalizer is a no-op on these).
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_llama3_bos_from_post_processor(dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(dirs["llama3"])
    bos = tok.token_to_id("<|begin_of_text|>")
    assert tok.special_token_id("bos_token") == bos
    assert tok.encode("hi", add_special_tokens=True) == [bos, *tok.encode("hi")]
    assert tok.encode("hi")[0] != bos


def test_special_tokens_and_eos_ids(dirs: dict[str, Path]) -> None:
    chatml = Tokenizer.from_dir(dirs["chatml"])
    # trained ids 0..996, then the specials in order
    assert [chatml.token_to_id(t) for t in CHATML_SPECIAL_TOKENS] == [997, 998, 999]
    assert chatml.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert chatml.eos_token_ids == frozenset({999, 997})
    assert chatml.encode("<|im_start|>") == [998]

    llama = Tokenizer.from_dir(dirs["llama3"])
    assert llama.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert llama.eos_token_ids == frozenset(
        {llama.token_to_id("<|eot_id|>"), llama.token_to_id("<|end_of_text|>")}
    )
    assert llama.vocab_size == 900


def test_tokens_only_in_config_are_added_like_transformers(tmp_path: Path) -> None:
    src = chatml_dir(tmp_path / "base")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"]["1000"] = {
        "content": "<think>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": False,
    }
    cfg["mask_token"] = "<mask>"  # named but in neither file: added as a special token
    d = write_dir(tmp_path / "extra", (src / "tokenizer.json").read_text(), cfg)
    ours = Tokenizer.from_dir(d)
    hf = AutoTokenizer.from_pretrained(str(d))
    assert ours.token_to_id("<think>") == 1000
    assert ours.token_to_id("<mask>") == 1001
    assert ours.vocab_size == len(hf) == 1002
    text = "a <think> b <mask> c"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == hf.decode(
        hf.encode(text, add_special_tokens=False), skip_special_tokens=True
    )


def test_content_hash_tracks_both_files(tmp_path: Path, dirs: dict[str, Path]) -> None:
    a = Tokenizer.from_dir(dirs["chatml"])
    copy = shutil.copytree(dirs["chatml"], tmp_path / "copy")
    assert Tokenizer.from_dir(copy).content_hash == a.content_hash
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|endoftext|>"
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    b = Tokenizer.from_dir(copy)
    assert b.content_hash != a.content_hash
    assert len(a.content_hash) == 64
    assert Tokenizer.from_dir(dirs["llama3"]).content_hash not in (a.content_hash, b.content_hash)


def test_stream_decoder_reassembles_multibyte(dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(dirs["chatml"])
    text = "Plain start, then 東京 and 你好世界, emoji 🙂🚀👍🏽 and Ωmega.<|im_end|>"
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == text.removesuffix("<|im_end|>")
    # No piece ever carries a broken character.
    assert all("\ufffd" not in p for p in pieces)
    # The emoji is 4 UTF-8 bytes; a 1k-vocab BPE splits it, so pushes inside it return "".
    rocket = tok.encode("🚀")
    assert len(rocket) > 1
    s = tok.stream_decoder()
    assert [s.push(i) for i in rocket] == [""] * (len(rocket) - 1) + ["🚀"]


def test_stream_decoder_special_tokens_and_flush(dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_dir(dirs["chatml"])
    ids = tok.encode("ok<|im_end|>")
    keep = tok.stream_decoder(skip_special_tokens=False)
    assert "".join(keep.push(i) for i in ids) == "ok<|im_end|>"
    skip = tok.stream_decoder()
    assert "".join(skip.push(i) for i in ids) == "ok"
    # A stream cut inside a character: flush hands back the replacement char.
    partial = tok.stream_decoder()
    first = tok.encode("🚀")[0]
    assert partial.push(first) == ""
    assert partial.flush() == "\ufffd"
    assert partial.flush() == ""


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json is missing"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
