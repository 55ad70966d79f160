"""The checkpoint's chat template: messages -> prompt text -> token ids, plus the
token positions where each message ends (chat-turn boundaries, the snapshot points
the prefix cache keys on).

Rendering copies transformers' `apply_chat_template` (v5) exactly: the same jinja2
sandbox and options, the same globals and `tojson` filter, the same variables and
message normalization. Boundaries are found through the template itself: render
the first i messages, check that text is a prefix of the full render, and map its
length to a token position with the tokenizer's offsets. Message text is never
searched for marker strings, so a user typing "<|im_end|>" cannot fake a boundary.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from keepwarm.engine.loading.tokenizer import Tokenizer

Message = Mapping[str, Any]

# Names a message's reasoning goes under; the first is the one templates read (as in transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template is missing or cannot render these messages; the message says what to change."""


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat. `boundaries[j]` is the token count up to and including the
    closing markup of some message (ascending, one per message whose prefix render
    is a textual prefix of `text`; messages where that fails are left out)."""

    text: str
    tokens: list[int]
    boundaries: list[int]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike jinja's, it does not HTML-escape, and it takes json.dumps options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict` as templates see it: calling and fromkeys only, no attribute tricks."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's `namespace` without underscore-prefixed attributes (as in transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick for namespace(self=...)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})"
            )


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag)
    and renders its body unchanged; we have no use for the mask."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """Plain JSON-like copy of template inputs (fresh, so templates never see caller objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models (OpenAI SDK messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """transformers' normalization: drop None-valued keys, alias reasoning fields."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise ChatTemplateError(
                f"each chat message must be an object with 'role' and 'content', got {m!r}"
            )
        msg = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if msg.get(k) is not None), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _load_source(root: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (and chat_templates/*.jinja) win over tokenizer_config.json's entry."""
    files: dict[str, str] = {}
    main = root / "chat_template.jinja"
    if main.is_file():
        files["default"] = main.read_text(encoding="utf-8")
    extra_dir = root / "chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            files[f.stem] = f.read_text(encoding="utf-8")
    if files:
        return files["default"] if list(files) == ["default"] else files
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        return {str(t["name"]): str(t["template"]) for t in value}
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    raise ChatTemplateError(
        f"{root / 'tokenizer_config.json'}: 'chat_template' must be a string or a list of templates"
    )


class ChatTemplate:
    """A compiled chat template bound to its tokenizer. Build with `ChatTemplate.from_dir`
    or directly from the template source."""

    def __init__(self, source: str | Mapping[str, str], tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._sources: dict[str, str] = {"default": source} if isinstance(source, str) else dict(source)
        if not self._sources:
            raise ChatTemplateError("no chat template given")
        env = _environment()
        try:
            self._compiled = {name: env.from_string(src) for name, src in self._sources.items()}
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e.message} (line {e.lineno})") from e
        h = hashlib.sha256()
        for name in sorted(self._sources):
            for part in (name.encode(), self._sources[name].encode()):
                h.update(len(part).to_bytes(8, "little"))
                h.update(part)
        self.template_hash = h.hexdigest()

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer: Tokenizer) -> ChatTemplate:
        root = Path(path).expanduser()
        source = _load_source(root, tokenizer.config)
        if source is None:
            raise ChatTemplateError(
                f"{root}: no chat template (add 'chat_template' to tokenizer_config.json or a chat_template.jinja file)"
            )
        return cls(source, tokenizer)

    @property
    def source(self) -> str:
        return self._sources.get("default", next(iter(self._sources.values())))

    def _pick(self, tools: Sequence[Mapping[str, Any]] | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        raise ChatTemplateError(
            f"the checkpoint has several chat templates and no 'default': {sorted(self._compiled)}"
        )

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False) renders it.
        A template that rejects the messages (raise_exception, errors) raises ChatTemplateError."""
        if not messages:
            raise ChatTemplateError("the chat has no messages; send at least one")
        template = self._pick(tools)
        variables: dict[str, Any] = {k: v for k, v in self._tok.special_tokens.items()}
        try:
            return template.render(
                messages=_normalize_messages(messages),
                tools=_plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise ChatTemplateError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})"
            ) from e

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> ChatPrompt:
        text = self.render(messages, add_generation_prompt, tools)
        tokens, offsets = self._tok.encode_with_offsets(text, add_special_tokens=False)
        # ends[t] = character offset where token t ends; non-decreasing along the prompt.
        ends = [end for _, end in offsets]
        boundaries: list[int] = []
        for i in range(1, len(messages) + 1):
            if i == len(messages) and not add_generation_prompt:
                prefix_len = len(text)
            else:
                try:
                    prefix = self.render(messages[:i], add_generation_prompt=False, tools=tools)
                except ChatTemplateError:
                    continue  # e.g. templates that require a user message last
                if not prefix or not text.startswith(prefix):
                    continue  # the template renders earlier turns differently once more follow
                prefix_len = len(prefix)
            # Tokens that end at or before the prefix end; a straddling token is left out (floor).
            pos = bisect.bisect_right(ends, prefix_len)
            if pos > 0 and (not boundaries or pos > boundaries[-1]):
                boundaries.append(pos)
        return ChatPrompt(text=text, tokens=tokens, boundaries=boundaries)
