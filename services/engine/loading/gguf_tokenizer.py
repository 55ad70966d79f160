"""keepwarm's `Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary, merges, token types and
special-token ids as metadata. Token ids must equal what transformers (v5) produces for the same
file (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), so this builds the backend the way
transformers' `integrations/gguf/gguf_tokenizer_mapping.py` does, step by step:

1. the base tokenizer, by `tokenizer.ggml.model`:
   - `gpt2`: byte-level BPE as `GPT2Tokenizer` builds it (vocabulary keys outside the byte
     alphabet respelled as their UTF-8 bytes, the file's merges, `ByteLevel` pre-tokenizer and
     decoder); its constructor then adds its default `<|endoftext|>` as a special token;
   - `llama`: SentencePiece-style BPE as `LlamaTokenizer` builds it (byte fallback, `Metaspace`
     with prepend scheme "first" whatever `tokenizer.ggml.add_space_prefix` says, decoder
     Replace/ByteFallback/Fuse/Strip); merges from the file, else derived from the scores as
     `generate_merges` does; its constructor adds `<s>`, `</s>`, `<unk>` as special tokens;
   - `llama` in a `gemma2`/`gemma3` file: as transformers' `gemma_tokenizer` ->
     `GemmaTokenizer` (tokens of only spaces respelled as that many "\u2581", merges derived
     with the file's token order as the scores, a `Replace(" ", "\u2581")` normalizer, no prefix
     space, decoder Replace/ByteFallback/Fuse; `<unk>`, `<bos>`, `<eos>`, `<pad>`, `<mask>` special);
2. tokens of type 3 (control) as special added tokens (in a byte-level vocabulary only those
   spelled in the byte alphabet), then type 4 (user-defined) as plain added tokens;
3. `tokenizer.ggml.pre` in transformers' table of split regexes: a `Split` + `ByteLevel`
   pre-tokenizer; any other value keeps the model's default pre-tokenizer, as in transformers;
4. the named special tokens (`tokenizer.ggml.{bos,eos,unknown,padding}_token_id`) made special
   added tokens (a text missing from the vocabulary gets a new id at the end, as in transformers);
5. a `TemplateProcessing` post-processor adding BOS / EOS per `tokenizer.ggml.add_bos_token` /
   `add_eos_token` (a `llama` vocabulary without the flag adds BOS, as llama.cpp does).

Files whose tokenizer transformers builds some other way (another `tokenizer.ggml.model`, or a
SentencePiece vocabulary of a Gemma (1) or Phi-3 architecture) are refused with `TokenizerError`.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from keepwarm.engine.loading.gguf_file import GgufFile
from keepwarm.engine.loading.tokenizer import Tokenizer, TokenizerError

# llama.cpp's token types (tokenizer.ggml.token_type)
_CONTROL = 3
_USER_DEFINED = 4

# The pre-tokenizer split regexes transformers maps `tokenizer.ggml.pre` to
# (GGUF_PRE_TOKENIZER_SPLITS); the test checks this table equals transformers' own.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3,
    ),
    **dict.fromkeys(("jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}

# Architectures whose SentencePiece (`llama`) vocabulary transformers builds differently
# (GGUF_SENTENCEPIECE_BUILDERS); not implemented here.
_OTHER_SENTENCEPIECE_ARCHS = frozenset({"gemma", "phi3"})  # gemma: transformers reads no such GGUF
_GEMMA_ARCHS = frozenset({"gemma2", "gemma3"})

# tokenizer.ggml key -> the named special token transformers sets from it, in transformers' order
_NAMED_IDS = (
    ("bos_token", "tokenizer.ggml.bos_token_id"),
    ("eos_token", "tokenizer.ggml.eos_token_id"),
    ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ("pad_token", "tokenizer.ggml.padding_token_id"),
)


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


_BYTE_CHARS = _byte_alphabet()
_ALPHABET = frozenset(_BYTE_CHARS.values())


class _Meta:
    """Typed access to the tokenizer metadata; errors name the file and the key."""

    def __init__(self, gguf: GgufFile) -> None:
        self.path = gguf.path
        self.data = gguf.metadata

    def fail(self, key: str, what: str) -> TokenizerError:
        return TokenizerError(f"{self.path}: metadata {key} = {_show(self.data.get(key))} {what}")

    def str_list(self, key: str, required: bool = False) -> list[str] | None:
        value = self.data.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, list) or not set(map(type, value)) <= {str}:
            raise self.fail(key, "must be an array of strings")
        return value

    def num_list(self, key: str) -> list[Any] | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not set(map(type, value)) <= {int, float}:
            raise self.fail(key, "must be an array of numbers")
        return value

    def token_id(self, key: str, n_tokens: int) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n_tokens:
            raise self.fail(key, f"must be a token id below the vocabulary size {n_tokens}")
        return value

    def flag(self, key: str) -> bool | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, bool):
            raise self.fail(key, "must be a boolean")
        return value


def _show(value: Any) -> str:
    if isinstance(value, list):
        return f"[array of {len(value)}]"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _merge_pairs(meta: _Meta, key: str, merges: list[str]) -> list[tuple[str, str]]:
    """Each merge "left right" as (left, right), split on every space as transformers does."""
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if not set(map(len, pairs)) <= {2}:
        i = next(i for i, pair in enumerate(pairs) if len(pair) != 2)
        raise TokenizerError(
            f"{meta.path}: metadata {key}[{i}] = {merges[i]!r} is not two tokens joined by a space"
        )
    return pairs  # type: ignore[return-value]


def _merges_from_scores(tokens: list[str], scores: list[Any]) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies, as transformers' `generate_merges` derives them:
    every split of a token into two vocabulary tokens, pairs of one token ordered by the ids of
    their halves, then all pairs stably sorted by (token score, left length, right length),
    highest first."""
    vocab = {token: index for index, token in enumerate(tokens)}
    score_of = dict(zip(tokens, scores, strict=False))
    found: list[tuple[str, str, Any]] = []
    for token, score in score_of.items():
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _byte_level_backend(meta: _Meta, tokens: list[str]) -> HFTokenizer:
    """transformers' `byte_level_tokenizer` -> `GPT2Tokenizer(vocab, merges)`."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not _ALPHABET.issuperset(token):
            token = "".join(_BYTE_CHARS[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = meta.str_list("tokenizer.ggml.merges")
    if merges is None:
        # transformers would derive merges from scores (keyed by the unrespelled tokens); no
        # byte-level GGUF is written that way, so it is not mirrored here.
        raise meta.fail("tokenizer.ggml.merges", "(missing) is required for a 'gpt2' tokenizer")
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merge_pairs(meta, "tokenizer.ggml.merges", merges),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # GPT2Tokenizer's own unk/bos/eos default, which its constructor adds as a special token
    backend.add_tokens([AddedToken("<|endoftext|>", special=True)])
    return backend


def _sentencepiece_backend(meta: _Meta, tokens: list[str]) -> HFTokenizer:
    """transformers' `sentencepiece_tokenizer` -> `LlamaTokenizer(vocab, merges)`."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.str_list("tokenizer.ggml.merges")
    if merges is not None:
        pairs = _merge_pairs(meta, "tokenizer.ggml.merges", merges)
    else:
        scores = meta.num_list("tokenizer.ggml.scores")
        if scores is None:
            raise meta.fail(
                "tokenizer.ggml.scores", "(missing) is needed to derive merges (no tokenizer.ggml.merges)"
            )
        pairs = _merges_from_scores(tokens, scores)
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    # LlamaTokenizer: add_prefix_space defaults to True and legacy to False -> prepend scheme "first"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    # LlamaTokenizer's bos/eos/unk defaults, which its constructor adds as special tokens
    backend.add_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<unk>")])
    return backend


def _gemma_backend(meta: _Meta, tokens: list[str]) -> HFTokenizer:
    """transformers' `gemma_tokenizer` -> `GemmaTokenizer(vocab, merges)`: a token of only spaces
    is looked up as that many "\u2581"; without merges in the file they are derived with each
    token's position as its score (Gemma's scores do not follow its merge order)."""
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = meta.str_list("tokenizer.ggml.merges")
    if merges is not None:
        pairs = _merge_pairs(meta, "tokenizer.ggml.merges", merges)
    else:
        pairs = _merges_from_scores(tokens, [-i for i in range(len(tokens))])
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=pairs, fuse_unk=True, unk_token="<unk>", byte_fallback=True, dropout=None
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    # GemmaTokenizer's bos/eos/unk/pad/mask defaults, which its constructor adds as special
    # tokens (one the vocabulary lacks gets the next id, as there)
    backend.add_tokens([AddedToken(t, special=True) for t in ("<bos>", "<eos>", "<unk>", "<pad>", "<mask>")])
    return backend


def _content_hash(metadata: dict[str, Any]) -> str:
    """sha256 over every `tokenizer.ggml.*` key and its value (sorted keys, JSON values)."""
    h = hashlib.sha256()
    for key in sorted(k for k in metadata if k.startswith("tokenizer.ggml.")):
        for blob in (key.encode("utf-8"), json.dumps(metadata[key], ensure_ascii=False).encode("utf-8")):
            h.update(len(blob).to_bytes(8, "little"))
            h.update(blob)
    return h.hexdigest()


@contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection meanwhile: building allocates ~100k small objects, and each
    collection they trigger walks the file's large metadata lists (a 50k vocabulary builds ~40%
    faster this way). The collector's previous state is restored."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def tokenizer_from_gguf(gguf: GgufFile) -> Tokenizer:
    """The tokenizer transformers builds from this GGUF file's metadata, as keepwarm's `Tokenizer`."""
    with _gc_paused():
        return _build(gguf)


def _build(gguf: GgufFile) -> Tokenizer:
    meta = _Meta(gguf)
    model = meta.data.get("tokenizer.ggml.model")
    arch = meta.data.get("general.architecture")
    if model not in ("gpt2", "llama"):
        raise TokenizerError(
            f"{meta.path}: metadata tokenizer.ggml.model = {_show(model)} is not supported "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)"
        )
    if model == "llama" and arch in _OTHER_SENTENCEPIECE_ARCHS:
        raise TokenizerError(
            f"{meta.path}: metadata tokenizer.ggml.model = 'llama' with general.architecture = {arch!r} is not "
            f"supported (transformers builds {arch}'s SentencePiece tokenizer its own way)"
        )
    tokens = meta.str_list("tokenizer.ggml.tokens", required=True)
    assert tokens is not None
    if not tokens:
        raise meta.fail("tokenizer.ggml.tokens", "is empty")
    token_types = meta.num_list("tokenizer.ggml.token_type") or []

    try:
        if model == "gpt2":
            backend = _byte_level_backend(meta, tokens)
        elif arch in _GEMMA_ARCHS:
            backend = _gemma_backend(meta, tokens)
        else:
            backend = _sentencepiece_backend(meta, tokens)
    except TokenizerError:
        raise
    except Exception as e:  # tokenizers raises its own exception type (e.g. a merge of unknown tokens)
        raise TokenizerError(f"{meta.path}: the tokenizers library rejects the vocabulary ({e})") from e

    # Control tokens as special tokens; a byte-level vocabulary's control token spelled outside the
    # byte alphabet is a llama.cpp mislabel and is skipped (transformers' add_gguf_special_tokens).
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and (model != "gpt2" or _ALPHABET.issuperset(token))
    ]
    if control:
        backend.add_special_tokens(control)
    candidates = [token for token, kind in zip(tokens, token_types, strict=False) if kind == _USER_DEFINED]
    if candidates:
        known = backend.get_vocab(with_added_tokens=True)
        user_defined = [AddedToken(t, normalized=False, special=False) for t in candidates if t in known]
        if user_defined:
            backend.add_tokens(user_defined)

    pre = meta.data.get("tokenizer.ggml.pre")
    split = PRE_TOKENIZER_SPLITS.get(pre) if isinstance(pre, str) else None
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    # Named special tokens: the text of each id the file gives, made a special added token.
    special: dict[str, str] = {}
    for name, key in _NAMED_IDS:
        token_id = meta.token_id(key, len(tokens))
        if token_id is not None:
            special[name] = tokens[token_id]
    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = list(dict.fromkeys(t for t in special.values() if t not in have))
    if missing:
        backend.add_tokens([AddedToken(t, special=True) for t in missing])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special.values()])

    add_bos = meta.flag("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = model == "llama"  # llama.cpp adds BOS to a SentencePiece vocabulary unless told otherwise
    add_eos = bool(meta.flag("tokenizer.ggml.add_eos_token"))
    add_bos = add_bos and "bos_token" in special
    add_eos = add_eos and "eos_token" in special
    bos, eos = special.get("bos_token"), special.get("eos_token")
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    ends = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    try:
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ends)
    except Exception as e:  # e.g. a BOS text with a space, which transformers' template cannot hold either
        raise TokenizerError(f"{meta.path}: cannot add BOS {bos!r} / EOS {eos!r} to sequences ({e})") from e

    config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,  # transformers never cleans up a BPE tokenizer's output
        **special,
    }
    template = meta.data.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template

    # Generation stops on the file's EOS id (the one transformers' generation config holds for a
    # GGUF), plus llama.cpp's end-of-turn / end-of-message ids when the file names them.
    eos_ids = frozenset(
        token_id
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if (token_id := meta.token_id(key, len(tokens))) is not None
    )
    return Tokenizer(backend, config, special, eos_ids, _content_hash(meta.data), gguf.path)
