"""The checkpoint's chat template: messages -> prompt text -> token ids, plus the
token positions where each message ends (chat-turn boundaries, the snapshot points
the prefix cache keys on).

Rendering copies transformers' `apply_chat_template` (v5) exactly: the same jinja2
sandbox and options, the same globals and `tojson` filter, the same variables and
message normalization. Boundaries are found through the template itself, never by
searching message text for marker strings (a user typing "<|im_end|>" cannot fake one).

Boundary i (after the first i messages) is where the render of messages[:i] (no
generation prompt) ends, when that render is a prefix of the full one. Rendering every
prefix costs O(n^2) in the number of messages, so the full chat is rendered once with
`messages` instrumented: every access that could tell messages[:i] apart from the
whole list (fetching or indexing message k >= i, len(), negative indices, reversal) is
logged with the number of characters output so far. Up to the first such access for
boundary i both renders run the same code on the same data, so they have output the
same text; when that access is the main loop fetching message i (not a `loop.last`
peek), the prefix render ends its loop there and the text so far is its output. Other
boundaries (a template that looked ahead first) are checked by rendering the prefix,
deepest first, at most `MAX_PREFIX_RENDERS` of them: the work stays linear in the
number of messages, and a boundary left out only costs a snapshot point.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
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
# Boundaries the access log cannot vouch for are checked by rendering that prefix; at most this many.
MAX_PREFIX_RENDERS = 16
# Variables the engine sets itself; chat_template_kwargs cannot override them.
_RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


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
    # The next turn's prompt (these messages, the reply, one more user message) starts with
    # all of `tokens`: the generation prompt is how the reply's own turn is rendered, so a
    # snapshot at the end of the prompt also serves the next turn (probed with a reply that
    # starts with a letter: one whose first characters merge with the prompt's last token,
    # e.g. a leading newline under byte-level BPE, breaks it for that turn).
    extends_to_next_turn: bool = False


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _AccessLog:
    """What an instrumented render touched. `first[i]` = (characters output so far, the
    id of the iterator whose plain fetch of message i it was, or None for any other kind
    of access) at the first access that could tell messages[:i] apart from the whole list.
    `fetches[it]` = (output position of its first fetch, of its last fetch) per iterator."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0  # characters the render has yielded so far
        self.first: dict[int, tuple[int, int | None]] = {}
        self.fetches: dict[int, tuple[int, int]] = {}
        self._covered = 0  # first[1..covered] are all set (accesses only ever extend coverage)
        self.iterators = 0

    def touch(self, k: int, fetched_by: int | None = None) -> None:
        """Message k was reached: every boundary i <= k is decided from here on."""
        k = min(k, self.n - 1)
        while self._covered < k:
            self._covered += 1
            i = self._covered
            self.first[i] = (self.pos, fetched_by if i == k else None)

    def fetched(self, iterator: int) -> None:
        start, _ = self.fetches.get(iterator, (self.pos, self.pos))
        self.fetches[iterator] = (start, self.pos)

    def whole(self) -> None:
        """An access that depends on the length of the list (len, negative index, reversal)."""
        self.touch(self.n - 1)

    def main_loop(self) -> int | None:
        """The iterator whose fetches spread over the most output: the loop that renders the messages."""
        spans = {it: end - start for it, (start, end) in self.fetches.items()}
        return max(spans, key=lambda it: spans[it]) if spans else None


class _LoggedMessages(list):  # type: ignore[type-arg]
    """`messages` as an instrumented render sees it: a list whose reads are logged.
    `base` maps this view's positions to indices in the whole chat (slices stay logged)."""

    def __init__(self, items: list[Any], log: _AccessLog, base: range | None = None) -> None:
        super().__init__(items)
        self._log = log
        self._base = base if base is not None else range(len(items))

    def __iter__(self) -> Iterator[Any]:
        return _LoggedIterator(self)

    def __len__(self) -> int:
        self._log.whole()
        return list.__len__(self)

    def __bool__(self) -> bool:
        return list.__len__(self) > 0

    def __reversed__(self) -> Iterator[Any]:
        self._log.whole()
        return list.__reversed__(self)

    def __contains__(self, item: object) -> bool:
        self._log.whole()
        return list.__contains__(self, item)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(list.__len__(self))
            if (
                step != 1
                or (key.stop is not None and key.stop < 0)
                or (key.start is not None and key.start < 0)
            ):
                self._log.whole()
                return list.__getitem__(self, key)
            return _LoggedMessages(list.__getitem__(self, key), self._log, self._base[start:stop])
        if isinstance(key, int) and not isinstance(key, bool):
            if key < 0:
                self._log.whole()
            elif key < list.__len__(self):
                self._log.touch(self._base[key])
        return list.__getitem__(self, key)

    def __repr__(self) -> str:
        self._log.whole()
        return list.__repr__(self)

    def logged_items(self) -> list[Any]:
        """The plain items (for filters such as tojson that read the list wholesale)."""
        self._log.whole()
        return list(list.__iter__(self))


class _LoggedIterator:
    def __init__(self, view: _LoggedMessages) -> None:
        self._view = view
        self._i = 0
        view._log.iterators += 1  # noqa: SLF001 - the view's own bookkeeping
        self._serial = view._log.iterators  # noqa: SLF001

    def __iter__(self) -> _LoggedIterator:
        return self

    def __next__(self) -> Any:
        view = self._view
        if self._i >= list.__len__(view):
            end = view._base.stop  # noqa: SLF001 - the view's own bookkeeping
            if end < view._log.n:  # noqa: SLF001
                view._log.touch(end)  # noqa: SLF001 - a slice that stops early knows message `end` is not in it
            raise StopIteration
        k = view._base[self._i]  # noqa: SLF001
        # jinja's `loop.last` / `loop.nextitem` fetch one item ahead through LoopContext._peek_next:
        # that is a look-ahead, not the loop moving on.
        log = view._log  # noqa: SLF001 - the view's own bookkeeping
        if sys._getframe(1).f_code.co_name == "_peek_next":
            log.touch(k)
        else:
            log.touch(k, fetched_by=self._serial)
            log.fetched(self._serial)
        item = list.__getitem__(view, self._i)
        self._i += 1
        return item


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike jinja's, it does not HTML-escape, and it takes json.dumps options.
    if isinstance(x, _LoggedMessages):
        x = x.logged_items()
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
        self.render_work = 0  # messages fed to the template over this object's life (renders x chat length)
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
        # bounded: template kwargs come from requests
        self._extends_to_next_turn = functools.lru_cache(maxsize=32)(self._probe_extends_to_next_turn)
        self._extends_to_next_turn("{}")  # the common case, before any render is counted

    def _probe_extends_to_next_turn(self, kwargs_json: str) -> bool:
        """Whether a one-message chat's prompt (generation prompt included) is a token prefix
        of the prompt after one more exchange, with these template kwargs."""
        kwargs = json.loads(kwargs_json)
        first = [{"role": "user", "content": "Hello."}]
        after = [*first, {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": "Bye."}]
        try:
            a = self._run(_normalize_messages(first), 1, True, None, kwargs)
            b = self._run(_normalize_messages(after), 3, True, None, kwargs)
        except ChatTemplateError:
            return False
        if not b.startswith(a):
            return False
        ta = self._tok.encode_with_offsets(a, add_special_tokens=False)[0]
        tb = self._tok.encode_with_offsets(b, add_special_tokens=False)[0]
        return tb[: len(ta)] == ta

    @classmethod
    def from_dir(cls, path: str | Path, tokenizer: Tokenizer) -> ChatTemplate:
        root = Path(path).expanduser()
        source = _load_source(root, tokenizer.config)
        if source is None:
            raise ChatTemplateError(
                f"{root}: no chat template (add 'chat_template' to tokenizer_config.json or a chat_template.jinja file)"
            )
        return cls(source, tokenizer)

    @classmethod
    def refusing(cls, reason: str, tokenizer: Tokenizer) -> ChatTemplate:
        """The template of a checkpoint that has none: every render raises ChatTemplateError
        with `reason` (the model still serves raw-prompt completions)."""
        return cls("{{ raise_exception(" + json.dumps(reason) + ") }}", tokenizer)

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
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False, **template_kwargs)
        renders it. A template that rejects the messages (raise_exception, errors) raises ChatTemplateError."""
        if not messages:
            raise ChatTemplateError("the chat has no messages; send at least one")
        normalized = _normalize_messages(messages)
        return self._run(normalized, len(normalized), add_generation_prompt, tools, template_kwargs)

    def _run(
        self,
        messages: list[dict[str, Any]],
        num_messages: int,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
        log: _AccessLog | None = None,
    ) -> str:
        """One render of already-normalized messages; `log.pos` follows the output as it is produced."""
        self.render_work += num_messages
        template = self._pick(tools)
        variables: dict[str, Any] = dict(self._tok.special_tokens)
        for name, value in (template_kwargs or {}).items():
            if name in _RESERVED_VARIABLES:
                raise ChatTemplateError(
                    f"chat_template_kwargs cannot set {name!r}: the engine sets it from the request"
                )
            variables[name] = _plain(value)
        parts: list[str] = []
        try:
            for piece in template.generate(
                messages=messages,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            ):
                parts.append(piece)
                if log is not None:
                    log.pos += len(piece)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected these messages: {e}") from e
        except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
            raise ChatTemplateError(
                f"the chat template failed on these messages ({type(e).__name__}: {e})"
            ) from e
        return "".join(parts)

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> ChatPrompt:
        if not messages:
            raise ChatTemplateError("the chat has no messages; send at least one")
        n = len(messages)
        normalized = _normalize_messages(messages)
        log = _AccessLog(n)
        text = self._run(
            _LoggedMessages(normalized, log), n, add_generation_prompt, tools, template_kwargs, log
        )
        tokens, offsets = self._tok.encode_with_offsets(text, add_special_tokens=False)
        # ends[t] = character offset where token t ends; non-decreasing along the prompt.
        ends = [end for _, end in offsets]

        # lengths[i] = characters of `text` the render of messages[:i] (no generation prompt) covers.
        lengths: dict[int, int] = {}
        main = log.main_loop()
        unresolved: list[int] = []
        for i in range(1, n):
            pos, fetched_by = log.first.get(i, (0, None))
            if fetched_by is not None and fetched_by == main:
                lengths[i] = pos
            else:
                unresolved.append(i)
        if not add_generation_prompt:
            lengths[n] = len(text)
        else:
            unresolved.append(n)
        # The shallowest (a shared system prompt) and then the deepest (this turn's history) first.
        order = unresolved[:1] + unresolved[1:][::-1]
        for i in order[:MAX_PREFIX_RENDERS]:
            try:
                prefix = self._run(normalized[:i], i, False, tools, template_kwargs)
            except ChatTemplateError:
                continue  # e.g. templates that require a user message last
            if prefix and text.startswith(prefix):  # else earlier turns render differently once more follow
                lengths[i] = len(prefix)

        boundaries: list[int] = []
        for i in sorted(lengths):
            # Tokens that end at or before the prefix end; a straddling token is left out (floor).
            pos = bisect.bisect_right(ends, lengths[i])
            if pos > 0 and (not boundaries or pos > boundaries[-1]):
                boundaries.append(pos)
        extends = (
            add_generation_prompt
            and tools is None
            and self._extends_to_next_turn(json.dumps(template_kwargs or {}, sort_keys=True, default=repr))
        )
        return ChatPrompt(text=text, tokens=tokens, boundaries=boundaries, extends_to_next_turn=extends)
