"""Tool calls the model writes, parsed back into OpenAI `tool_calls`, per its chat
template's convention:

- `hermes`: Qwen2.5 / Qwen3 / Hermes, one `<tool_call>` block per call holding a JSON
  object `{"name": N, "arguments": {...}}`; Qwen3.5's XML body
  `<function=N><parameter=K>V</parameter></function>` in the same block is read too
  (values typed by JSON when they parse, else strings).
- `llama3_json`: Llama 3.x custom tools, the whole reply is `{"name": N, "parameters": {...}}`
  (optionally after `<|python_tag|>`), several calls joined by `;`.
- `dsml`: DeepSeek V3.2 / V4, `<｜DSML｜tool_calls>` (V3.2: `function_calls`) wrapping
  `<｜DSML｜invoke name="N">` blocks of `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`
  (`string="true"`: V is the raw string; `false`: V is a JSON value).

`ToolCallParser` is incremental: `feed(text)` returns the content that is certainly
not part of a call and the calls completed so far; text that may still turn into a
call (a partial opening marker, an open block, a reply that starts like Llama JSON) is
held back. A block that does not parse is given back as content, never dropped.
Whitespace around calls is markup, not content. A call is emitted whole once its
block closes (name and complete arguments in one delta).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3_json", "dsml")

_DSML = "｜DSML｜"
_DSML_OPENERS = (f"<{_DSML}tool_calls>", f"<{_DSML}function_calls>")
_DSML_INVOKE = re.compile(rf'<{_DSML}invoke\s+name="(?P<name>[^"]*)"\s*>(?P<body>.*?)</{_DSML}invoke>', re.S)
_DSML_PARAM = re.compile(
    rf'<{_DSML}parameter\s+name="(?P<key>[^"]*)"(?:\s+string="(?P<string>true|false)")?\s*>'
    rf"(?P<value>.*?)</{_DSML}parameter>",
    re.S,
)
_XML_FUNCTION = re.compile(r"^\s*<function=(?P<name>[^>\n]+)>(?P<body>.*?)</function>\s*$", re.S)
_XML_PARAM = re.compile(r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>", re.S)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


def detect_format(template_source: str) -> str | None:
    """The tool-call convention a chat template teaches its model; None when it has none."""
    if _DSML in template_source:
        return "dsml"
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|python_tag|>" in template_source or (
        "<|start_header_id|>" in template_source and "tool" in template_source
    ):
        return "llama3_json"
    return None


def _args_json(value: Any) -> str | None:
    """Arguments as OpenAI sends them: JSON text of an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _loose_value(text: str) -> Any:
    """An untyped XML parameter value: JSON when it parses as such, else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_from_object(obj: Any) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = _args_json(args)
    return ParsedToolCall(obj["name"], text) if text is not None else None


def _parse_hermes_body(body: str) -> list[ParsedToolCall] | None:
    xml = _XML_FUNCTION.match(body)
    if xml:
        args = {
            m.group("key").strip(): _loose_value(m.group("value"))
            for m in _XML_PARAM.finditer(xml.group("body"))
        }
        return [ParsedToolCall(xml.group("name").strip(), json.dumps(args, ensure_ascii=False))]
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    call = _call_from_object(obj)
    return [call] if call else None


def _parse_dsml_body(body: str) -> list[ParsedToolCall] | None:
    calls = []
    for inv in _DSML_INVOKE.finditer(body):
        args: dict[str, Any] = {}
        for p in _DSML_PARAM.finditer(inv.group("body")):
            raw = p.group("value")
            if p.group("string") == "false":
                try:
                    args[p.group("key")] = json.loads(raw)
                except ValueError:
                    return None
            else:
                args[p.group("key")] = raw
        calls.append(ParsedToolCall(inv.group("name"), json.dumps(args, ensure_ascii=False)))
    leftover = _DSML_INVOKE.sub("", body).strip()
    return calls if calls and not leftover else None


def _parse_llama_json(text: str) -> list[ParsedToolCall] | None:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    i = 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            return None
        call = _call_from_object(obj)
        if call is None:
            return None
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return calls or None


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ToolCallParser:
    """One per choice. `feed` / `finish` return (content, calls) as they become certain."""

    def __init__(self, fmt: str, first_only: bool = False) -> None:
        assert fmt in FORMATS, fmt
        self.fmt = fmt
        self.first_only = first_only  # parallel_tool_calls: false keeps the first call only
        self.calls: list[ParsedToolCall] = []
        self._buf = ""  # text not yet given out
        self._in_block = False
        self._opener = ""
        self._decided = (
            fmt != "llama3_json"
        )  # llama: whether the reply is a call is decided at its first char
        self._capturing = False  # llama: the whole reply is being held as a call

    @property
    def _openers(self) -> tuple[str, ...]:
        return _DSML_OPENERS if self.fmt == "dsml" else ("<tool_call>",)

    def _closer(self) -> str:
        return "</" + self._opener[1:]

    def _emit(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        if self.first_only:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return calls

    def _content(self, text: str) -> str:
        # Whitespace next to a call is markup: content after the first call keeps only real text.
        return "" if self.calls and not text.strip() else text

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._buf += text
        if self.fmt == "llama3_json":
            return self._feed_llama()
        out: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if self._in_block:
                end = self._buf.find(self._closer())
                if end < 0:
                    break
                body = self._buf[:end]
                parsed = _parse_dsml_body(body) if self.fmt == "dsml" else _parse_hermes_body(body)
                if parsed is None:
                    out.append(self._content(self._opener + body + self._closer()))
                else:
                    calls.extend(self._emit(parsed))
                self._buf = self._buf[end + len(self._closer()) :]
                self._in_block = False
                continue
            starts = [(self._buf.find(o), o) for o in self._openers if o in self._buf]
            if starts:
                i, opener = min(starts)
                out.append(self._content(self._buf[:i].rstrip()))  # whitespace before a call is markup
                self._buf = self._buf[i + len(opener) :]
                self._opener = opener
                self._in_block = True
                continue
            # Hold back a partial opener and trailing whitespace (markup if a call follows).
            keep = _partial_suffix(self._buf, self._openers)
            head, tail = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            stripped = head.rstrip()
            out.append(self._content(stripped))
            self._buf = head[len(stripped) :] + tail
            break
        return "".join(out), calls

    def _feed_llama(self) -> tuple[str, list[ParsedToolCall]]:
        if not self._decided:
            s = self._buf.lstrip()
            if not s or _PYTHON_TAG.startswith(s):
                return "", []
            self._decided = True
            self._capturing = s.startswith("{") or s.startswith(_PYTHON_TAG)
        if self._capturing:
            return "", []
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The end of the reply: what is still held back, as calls or as content."""
        buf, self._buf = self._buf, ""
        if self.fmt == "llama3_json":
            if self._capturing:
                parsed = _parse_llama_json(buf)
                if parsed is not None:
                    return "", self._emit(parsed)
            return buf, []
        if self._in_block:  # a call the reply never closed (e.g. cut by max_tokens): give it back as text
            self._in_block = False
            return self._opener + buf, []
        return self._content(buf), []


def parse_tool_calls(text: str, fmt: str, first_only: bool = False) -> tuple[str, list[ParsedToolCall]]:
    """A whole reply: (content, calls)."""
    p = ToolCallParser(fmt, first_only)
    content, calls = p.feed(text)
    more, last = p.finish()
    return content + more, calls + last
