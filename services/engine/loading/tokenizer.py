"""The model's tokenizer: a Hugging Face `tokenizer.json` run by the `tokenizers`
library, plus what `tokenizer_config.json` and `generation_config.json` add to it
(named special tokens, extra added tokens, end-of-turn ids).

Token ids must equal what `transformers` (v5) produces on the same folder, since
snapshots are keyed by token ids and the oracle tests compare against it. So
loading follows transformers' rules: tokens named in the config but missing from
tokenizer.json are added as special tokens; with tokenizer.json present the
config's `add_bos_token` is ignored and tokenizer.json's post-processor decides
what `add_special_tokens=True` adds (unless it has none, then `add_bos_token`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Encoding
from tokenizers import Tokenizer as HFTokenizer

# The named special-token attributes transformers passes to chat templates, in its order.
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

_REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """The tokenizer files are unusable; the message names the file or key to fix."""


@dataclass(frozen=True)
class SpecialToken:
    content: str
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    single_word: bool = False

    def added(self, special: bool = True) -> AddedToken:
        return AddedToken(
            self.content,
            single_word=self.single_word,
            lstrip=self.lstrip,
            rstrip=self.rstrip,
            normalized=self.normalized,
            special=special,
        )


def _special_token(value: Any, where: str) -> SpecialToken | None:
    """A tokenizer_config.json token value: a string, null, or a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return SpecialToken(value)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return SpecialToken(
            value["content"],
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            single_word=bool(value.get("single_word", False)),
        )
    raise TokenizerError(f"{where}: expected a token string or an object with 'content', got {value!r}")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    return []


class Tokenizer:
    """Text <-> token ids for one checkpoint folder. Build with `Tokenizer.from_dir`."""

    def __init__(
        self,
        backend: HFTokenizer,
        config: dict[str, Any],
        special_tokens: dict[str, str],
        eos_token_ids: frozenset[int],
        content_hash: str,
        path: Path | None = None,
    ) -> None:
        self._backend = backend
        self.config = config
        # attribute name ("bos_token", "eos_token", model-specific "*_token") -> token text
        self.special_tokens = special_tokens
        self.eos_token_ids = eos_token_ids
        self.content_hash = content_hash
        self.path = path
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        # tokenizer.json without a post-processor: fall back to the config's add_bos/eos_token
        self._manual_bos = backend.post_processor is None and bool(config.get("add_bos_token", False))
        self._manual_eos = backend.post_processor is None and bool(config.get("add_eos_token", False))
        # Offsets must be untrimmed character spans (chat-turn boundaries depend on them), but a
        # ByteLevel post-processor with trim_offsets shrinks spans around whitespace. Such
        # tokenizers get a second instance without post-processor for offset queries.
        self._offsets_backend = backend
        if _trims_offsets(json.loads(backend.to_str()).get("post_processor")):
            self._offsets_backend = HFTokenizer.from_str(backend.to_str())
            self._offsets_backend.post_processor = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path).expanduser()
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{root}: tokenizer.json is missing (a Hugging Face 'fast' tokenizer file is required)"
            )
        tok_bytes = tok_file.read_bytes()
        try:
            backend = HFTokenizer.from_str(tok_bytes.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own exception type
            raise TokenizerError(f"{tok_file}: the tokenizers library cannot read it ({e})") from e

        cfg_file = root / "tokenizer_config.json"
        cfg_bytes = cfg_file.read_bytes() if cfg_file.is_file() else b""
        config = _read_json(cfg_file) if cfg_bytes else {}

        # Added tokens the config declares that tokenizer.json lacks (transformers adds them too).
        decoder = config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict):
            raise TokenizerError(f"{cfg_file}: 'added_tokens_decoder' must be an object of id -> token")
        missing: list[AddedToken] = []
        for key in sorted(decoder, key=lambda k: int(k)):
            entry = decoder[key]
            tok = _special_token(entry, f"{cfg_file}: added_tokens_decoder[{key}]")
            if tok is not None and backend.token_to_id(tok.content) is None:
                missing.append(tok.added(special=bool(entry.get("special", True))))

        special: dict[str, str] = {}
        named: list[SpecialToken] = []
        for name, value in config.items():
            if not name.endswith("_token"):
                continue
            if name not in NAMED_SPECIAL_TOKENS and not isinstance(value, (str, dict)):
                continue
            tok = _special_token(value, f"{cfg_file}: {name}")
            if tok is not None:
                special[name] = tok.content
                named.append(tok)
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        if isinstance(extra, dict):  # v5 named extras: {"image_token": "<image>"}
            for name, value in extra.items():
                tok = _special_token(value, f"{cfg_file}: extra_special_tokens.{name}")
                if tok is not None:
                    special[name] = tok.content
                    named.append(tok)
        elif isinstance(extra, list):
            for i, value in enumerate(extra):
                tok = _special_token(value, f"{cfg_file}: additional_special_tokens[{i}]")
                if tok is not None:
                    named.append(tok)
        else:
            raise TokenizerError(f"{cfg_file}: 'extra_special_tokens' must be a list or an object")
        have = {t.content for t in missing}
        for tok in named:
            if backend.token_to_id(tok.content) is None and tok.content not in have:
                missing.append(tok.added(special=True))
                have.add(tok.content)
        if missing:
            backend.add_tokens(missing)

        eos: list[int] = []
        if "eos_token" in special:
            eid = backend.token_to_id(special["eos_token"])
            assert eid is not None, "eos_token was added above"
            eos.append(eid)
        for extra_file in ("generation_config.json", "config.json"):
            f = root / extra_file
            if f.is_file():
                eos.extend(_eos_ids(_read_json(f).get("eos_token_id")))

        h = hashlib.sha256()
        for blob in (tok_bytes, cfg_bytes):
            h.update(len(blob).to_bytes(8, "little"))
            h.update(blob)
        return cls(backend, config, special, frozenset(eos), h.hexdigest(), root)

    # --- vocabulary -------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (transformers' len(tokenizer))."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        tid = self._backend.token_to_id(token)
        return None if tid is None else int(tid)

    def id_to_token(self, token_id: int) -> str | None:
        tok = self._backend.id_to_token(token_id)
        return None if tok is None else str(tok)

    def json_text(self) -> str:
        """The tokenizer as `tokenizer.json` text, added tokens included (for grammar libraries)."""
        return str(self._backend.to_str())

    def special_token_id(self, name: str) -> int | None:
        """Id of a named special token ("bos_token", "eos_token", ...); None when the config names none."""
        tok = self.special_tokens.get(name)
        return None if tok is None else self.token_to_id(tok)

    # --- text <-> ids -----------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.encode_with_offsets(text, add_special_tokens)[0])

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's (start, end) character span in `text`.
        Bytes of one character split over several tokens all carry that character's span."""
        backend = self._backend if add_special_tokens else self._offsets_backend
        enc: Encoding = backend.encode(text, add_special_tokens=add_special_tokens)
        ids = list(enc.ids)
        offsets = [(int(a), int(b)) for a, b in enc.offsets]
        if add_special_tokens:
            bos = self.special_token_id("bos_token") if self._manual_bos else None
            eos = self.special_token_id("eos_token") if self._manual_eos else None
            if bos is not None:
                ids.insert(0, bos)
                offsets.insert(0, (0, 0))
            if eos is not None:
                ids.append(eos)
                offsets.append((len(text), len(text)))
        return ids, offsets

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))
        if self._clean_up_spaces:
            text = _clean_up_tokenization(text)
        return text

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


def _trims_offsets(processor: Any) -> bool:
    """Whether a tokenizer.json post_processor (JSON) rewrites offsets (ByteLevel trim_offsets)."""
    if not isinstance(processor, dict):
        return False
    if processor.get("type") == "Sequence":
        return any(_trims_offsets(p) for p in processor.get("processors", []))
    return processor.get("type") in ("ByteLevel", "RobertaProcessing") and bool(
        processor.get("trim_offsets", True)
    )


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization`, applied when the config asks for it."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'")):
        text = text.replace(a, b)
    for a, b in ((" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class StreamDecoder:
    """Incremental detokenizer for streaming: `push` one generated id, get back only
    the text it completed ("" while a multi-byte character is still split across
    byte-level tokens). The concatenation of every `push` plus `flush` equals
    `decode(all ids)` for byte-level tokenizers.

    It decodes a small window: ids[prefix:read] is text already emitted (kept as
    left context, which SentencePiece-style decoders need to place spaces), ids[read:]
    is not yet emitted. Text is emitted once the window decodes to something longer
    that does not end in U+FFFD (an unfinished UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # the window; ids before it are no longer needed
        self._read = 0  # window index where not-yet-emitted ids start

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        emitted = self._tok.decode(self._ids[: self._read], self._skip)
        full = self._tok.decode(self._ids, self._skip)
        if len(full) <= len(emitted) or full.endswith(_REPLACEMENT_CHAR) or not full.startswith(emitted):
            return ""
        new = full[len(emitted) :]
        # The ids just emitted become the left context; older ones are dropped.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return new

    def flush(self) -> str:
        """Whatever is still held back (e.g. a truncated UTF-8 sequence, shown as U+FFFD)."""
        emitted = self._tok.decode(self._ids[: self._read], self._skip)
        full = self._tok.decode(self._ids, self._skip)
        self._ids = []
        self._read = 0
        return full[len(emitted) :] if full.startswith(emitted) else ""
