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
- `generic`: for templates that teach no tool convention (llama.cpp's approach): the tools
  are described in plain words in the system message (`generic_tool_messages`) and a call
  is a JSON object `{"tool_call": {"name": N, "arguments": {...}}}`, or
  `{"tool_calls": [{...}, ...]}` for several, written as the whole reply or on a line of
  its own after some text. Any other reply is a plain-text answer. `tool_format_for`
  decides the format of a request (the template's own, else `generic` when tools are sent).

`ToolCallParser` is incremental: `feed(text)` returns the content that is certainly
not part of a call and the calls completed so far; text that may still turn into a
call (a partial opening marker, an open block, a reply that starts like Llama JSON) is
held back (`generic`: a `{` at a line start until it is known not to open a call
object, then the object until it closes). A block that does not parse is given back as
content, never dropped.
Whitespace around calls is markup, not content. A call is emitted whole once its
block closes (name and complete arguments in one delta).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from keepwarm.engine.loading.chat_template import ChatPrompt, ChatTemplate, ChatTemplateError

FORMATS = ("hermes", "llama3_json", "dsml", "generic")

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
# generic: a `{` at a line start (the reply's start, after a newline, right after a call) may open a call
_GENERIC_CANDIDATE = re.compile(r"^[ \t\r\f\v]*\{", re.M)
_GENERIC_HEAD = re.compile(r'\{\s*"tool_calls?"\s*:')
_GENERIC_PARTIAL_KEY = re.compile(r'"tool_calls?"\s*')


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


def tool_format_for(template_source: str, tools: bool = True) -> str | None:
    """The tool-call format of a request: None without tools (`tools`: the request sends
    tools), else the template's own convention (`detect_format`), else `generic`. The one
    decision the prompt rendering, the grammar and the reply parser all follow."""
    if not tools:
        return None
    return detect_format(template_source) or "generic"


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


def _generic_calls(obj: Any) -> list[ParsedToolCall] | None:
    """The calls of a generic reply object, `{"tool_call": C}` or `{"tool_calls": [C, ...]}`
    with C = `{"name": N, "arguments": {...}}`; None when `obj` is anything else."""
    if not isinstance(obj, dict) or len(obj) != 1:
        return None
    if "tool_call" in obj:
        items = [obj["tool_call"]]
    elif isinstance(obj.get("tool_calls"), list) and obj["tool_calls"]:
        items = obj["tool_calls"]
    else:
        return None
    calls = [_call_from_object(item) for item in items]
    return [c for c in calls if c is not None] if all(calls) else None


def _generic_head(text: str) -> bool | None:
    """Whether `text` (starting at a `{`) opens a generic call object: True, False, or
    None while it is too short to tell."""
    if _GENERIC_HEAD.match(text):
        return True
    rest = text[1:].lstrip()
    if not rest or '"tool_calls"'.startswith(rest) or _GENERIC_PARTIAL_KEY.fullmatch(rest):
        return None
    return False


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
        self._capturing = False  # llama: the whole reply is held as a call; generic: a `{"tool_call` object
        self._line_start = True  # generic: the held text starts at a line start (a `{` there may open a call)
        self._ws = ""  # generic: the whitespace before the object being held (markup if it is a call)
        self._tried = 0  # generic: the held object did not decode up to this length

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
        if self.fmt == "generic":
            return self._feed_generic()
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

    def _feed_generic(self) -> tuple[str, list[ParsedToolCall]]:
        out: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if self._capturing:  # the buffer starts with a `{"tool_call...` object
                if "}" not in self._buf[self._tried :]:
                    break
                try:
                    obj, end = json.JSONDecoder().raw_decode(self._buf)
                except ValueError:  # not closed yet (or malformed: given back at finish)
                    self._tried = len(self._buf)
                    break
                parsed = _generic_calls(obj)
                if parsed is None:
                    out.append(self._content(self._ws + self._buf[:end]))
                else:
                    calls.extend(self._emit(parsed))
                self._buf, self._ws, self._tried = self._buf[end:], "", 0
                self._capturing = False
                self._line_start = parsed is not None  # another call may follow a call directly
                continue
            undecided = None
            for m in _GENERIC_CANDIDATE.finditer(self._buf):
                if m.start() == 0 and not self._line_start:
                    continue
                brace = m.end() - 1
                opens = _generic_head(self._buf[brace:])
                if opens is False:
                    continue
                if opens:
                    before = self._buf[:brace]
                    text = before.rstrip()
                    out.append(self._content(text))
                    self._ws = before[len(text) :]  # whitespace before a call is markup
                    self._buf = self._buf[brace:]
                    self._capturing = True
                else:
                    undecided = brace
                break
            if self._capturing:
                continue
            # Hold back an undecided `{` and the whitespace before it, else trailing whitespace.
            head = self._buf if undecided is None else self._buf[:undecided]
            text = head.rstrip()
            if text:
                out.append(self._content(text))
                self._buf = self._buf[len(text) :]
                self._line_start = False
            break
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The end of the reply: what is still held back, as calls or as content."""
        buf, self._buf = self._buf, ""
        if self.fmt == "generic":
            if self._capturing:  # an object that never closed or did not parse: content
                self._capturing = False
                buf, self._ws = self._ws + buf, ""
                return buf, []
            return self._content(buf), []
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


# --- the generic format's prompt ------------------------------------------------------------------

GENERIC_RESULT = "Tool result"


def _compact(value: Any) -> str:
    """JSON as the generic grammar writes it: no spaces, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def generic_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that teaches a model the generic format: each tool's name, description
    and JSON-Schema parameters, the JSON a call is written as, and how results come back."""
    lines = ["You can call these tools (functions) to help with the user's request:", ""]
    for tool in tools:
        fn = tool.get("function", tool)
        description = " ".join(str(fn.get("description") or "").split())
        lines.append(f"- {fn['name']}" + (f": {description}" if description else ""))
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        lines.append(f"  arguments (JSON Schema): {json.dumps(params, ensure_ascii=False)}")
    lines += [
        "",
        'To call a tool, reply with only this JSON object, "name" one of the tools above and '
        '"arguments" matching its schema:',
        '{"tool_call":{"name":"<tool name>","arguments":{"<argument>":<value>}}}',
        "To call several tools at once, reply with only:",
        '{"tool_calls":[{"name":"<tool name>","arguments":{...}},{"name":"<tool name>","arguments":{...}}]}',
        f'Each result comes back in a user message as "{GENERIC_RESULT} (<tool name>): <result>". '
        "When no tool is needed, answer in plain text.",
    ]
    return "\n".join(lines)


def generic_call_text(tool_calls: Sequence[Mapping[str, Any]]) -> str:
    """An assistant turn's `tool_calls` as the generic reply the model would have written
    (exactly what the grammar lets it write, so turn n's reply is a prefix of turn n+1's prompt)."""
    calls = []
    for call in tool_calls:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # kept as a JSON string: the history is the client's to get right
        calls.append({"name": fn.get("name", ""), "arguments": args})
    return _compact({"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls})


def generic_tool_messages(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]], in_system: bool = True
) -> list[dict[str, Any]]:
    """The chat as a template without tool support can render it: the tools' description (if
    any) first in the system message (before the client's own system text; a new first message
    when there is none; `in_system=False`: at the top of the first user message instead),
    assistant `tool_calls` as the JSON text of the call, and each run of `tool` results as one
    user message of `Tool result (<name>): <content>` paragraphs. A function of its arguments alone."""
    out: list[dict[str, Any]] = []
    results: list[str] = []
    names_by_id: dict[str, str] = {}
    last_calls: list[str] = []  # the names of the last assistant turn's calls, for results without ids
    for m in messages:
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            k = len(results)
            name = (
                m.get("name")
                or names_by_id.get(str(call_id))
                or (last_calls[k] if k < len(last_calls) else "")
            )
            label = f"{GENERIC_RESULT} ({name})" if name else GENERIC_RESULT
            results.append(f"{label}: {m.get('content') or ''}")
            continue
        if results:
            out.append({"role": "user", "content": "\n\n".join(results)})
            results = []
        msg = dict(m)
        calls = msg.pop("tool_calls", None)
        if m.get("role") == "assistant" and calls:
            last_calls = [str(c.get("function", c).get("name", "")) for c in calls]
            names_by_id.update(
                {str(c["id"]): n for c, n in zip(calls, last_calls, strict=True) if c.get("id")}
            )
            content = str(msg.get("content") or "")
            msg["content"] = (content + "\n" if content else "") + generic_call_text(calls)
        out.append(msg)
    if results:
        out.append({"role": "user", "content": "\n\n".join(results)})
    if not tools:
        return out
    text = generic_tool_prompt(tools)
    if in_system:
        role, at = "system", 0 if out and out[0].get("role") == "system" else None
    else:
        role, at = "user", next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
    if at is None:
        out.insert(0, {"role": role, "content": text})
    else:
        theirs = str(out[at].get("content") or "")
        out[at] = {**out[at], "content": text + ("\n\n" + theirs if theirs else "")}
    return out


def encode_chat_with_tools(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ChatPrompt:
    """A chat rendered for the model, with its tools: the template renders them itself where it
    has a tool format; for `generic` the chat is first rewritten by `generic_tool_messages`
    (the template then sees no tools), the tools' text in the system message, or, where the
    template refuses system messages, in the first user message. A chat that sends no tools
    but holds earlier calls or results (the answer after a tool loop) is rewritten too."""
    history = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if tool_format_for(template.source, bool(tools) or history) != "generic":
        return template.encode_chat(messages, add_generation_prompt, tools, template_kwargs)
    try:
        chat = generic_tool_messages(messages, tools or ())
        return template.encode_chat(chat, add_generation_prompt, None, template_kwargs)
    except ChatTemplateError:
        if not tools:
            raise
        chat = generic_tool_messages(messages, tools, in_system=False)
        return template.encode_chat(chat, add_generation_prompt, None, template_kwargs)
