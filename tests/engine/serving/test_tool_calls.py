"""Tool-call parsing on what real chat templates render for assistant tool calls: the
rendered assistant turn, fed back as model output, parses into the calls that were rendered —
whole and split into every possible pair of streamed pieces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from keepwarm.engine.demo.demo_model import (
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    tokenizer_config,
    train_bpe,
)
from keepwarm.engine.loading.chat_template import ChatTemplate
from keepwarm.engine.loading.tokenizer import Tokenizer
from keepwarm.engine.serving.tool_calls import ToolCallParser, detect_format, parse_tool_calls

QWEN3_TEMPLATE = (Path(__file__).resolve().parents[1] / "loading" / "qwen3_template.jinja").read_text()

# Llama 3.1's custom-tool convention: the assistant's call is a bare JSON object with "parameters".
LLAMA31_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# DeepSeek V4's DSML encoding of an assistant turn with tool calls (as its encoder writes it).
DSML = "｜DSML｜"
DEEPSEEK_V4_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<｜User｜>{{ message.content }}"
    "{%- elif message.role == 'tool' %}<｜User｜><tool_result>{{ message.content }}</tool_result>"
    "{%- elif message.role == 'assistant' %}<｜Assistant｜></think>{{ message.content or '' }}"
    "{%- if message.tool_calls %}\n\n<" + DSML + "tool_calls>\n"
    "{%- for tc in message.tool_calls %}<" + DSML + 'invoke name="{{ tc.function.name }}">\n'
    "{%- for k, v in tc.function.arguments.items() %}"
    "<" + DSML + "parameter name=\"{{ k }}\" string=\"{{ 'true' if v is string else 'false' }}\">"
    "{{ v if v is string else v | tojson }}</" + DSML + "parameter>\n"
    "{%- endfor %}</" + DSML + "invoke>\n{%- endfor %}</" + DSML + "tool_calls>"
    "{%- endif %}<｜end▁of▁sentence｜>"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<｜Assistant｜></think>{%- endif %}"
)

CALLS = [
    {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3, "units": ["C", "wind"]}},
    {"name": "lookup", "arguments": {"query": "tides «Lisboa» 東京", "exact": False, "limit": None}},
]


def template(tmp_path: Path, source: str) -> ChatTemplate:
    tok = train_bpe(600, CHATML_SPECIAL_TOKENS)
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(tok.to_str())
    cfg = tokenizer_config(tok, source, eos_token="<|im_end|>", pad_token=None, bos_token="<|endoftext|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(d)
    return ChatTemplate(source, t)


def rendered_reply(tpl: ChatTemplate, calls: list[dict[str, Any]], content: str, string_args: bool) -> str:
    """What the template renders for the assistant turn: the model's output convention."""
    tool_calls = [
        {"type": "function", "function": {"name": c["name"],
         "arguments": json.dumps(c["arguments"]) if string_args else c["arguments"]}}
        for c in calls
    ]  # fmt: skip
    user = [{"role": "user", "content": "Weather?"}]
    head = tpl.render(user, add_generation_prompt=True)
    full = tpl.render([*user, {"role": "assistant", "content": content, "tool_calls": tool_calls}], False)
    assert full.startswith(head)
    return full[len(head) :]


def strip_end(text: str) -> str:
    for end in ("<|im_end|>\n", "<|eot_id|>", "<｜end▁of▁sentence｜>"):
        text = text.removesuffix(end)
    return text


@pytest.mark.parametrize(
    "source,fmt,string_args,ncalls,content",
    [
        (CHATML_TEMPLATE, "hermes", False, 2, ""),
        (CHATML_TEMPLATE, "hermes", False, 2, "Let me check."),
        (CHATML_TEMPLATE, "hermes", True, 1, "Let me check."),
        (QWEN3_TEMPLATE, "hermes", True, 2, ""),
        (QWEN3_TEMPLATE, "hermes", False, 1, "Let me check."),
        (LLAMA31_TEMPLATE, "llama3_json", False, 1, ""),  # Llama 3 writes a call as the whole reply
        (DEEPSEEK_V4_TEMPLATE, "dsml", False, 2, ""),
        (DEEPSEEK_V4_TEMPLATE, "dsml", False, 1, "Let me check."),
    ],
)
def test_rendered_calls_parse_back(
    tmp_path: Path, source: str, fmt: str, string_args: bool, ncalls: int, content: str
) -> None:
    tpl = template(tmp_path, source)
    assert detect_format(source) == fmt
    calls = CALLS[:ncalls]
    reply = strip_end(rendered_reply(tpl, calls, content, string_args))
    if source is QWEN3_TEMPLATE:  # the reasoning parser takes the (empty) think block off first
        assert reply.startswith("<think>\n\n</think>\n\n")
        reply = reply.removeprefix("<think>\n\n</think>\n\n")
    text, parsed = parse_tool_calls(reply, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [(c["name"], c["arguments"]) for c in calls]
    assert text == content
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed)
    assert len({c.id for c in parsed}) == len(parsed)

    # Streamed in two pieces split anywhere: the same content and calls, and no content
    # piece ever carries a fragment of the markup.
    for cut in range(len(reply) + 1):
        p = ToolCallParser(fmt)
        c1, k1 = p.feed(reply[:cut])
        c2, k2 = p.feed(reply[cut:])
        c3, k3 = p.finish()
        assert c1 + c2 + c3 == content, cut
        assert [(c.name, c.arguments) for c in k1 + k2 + k3] == [(c.name, c.arguments) for c in parsed], cut


def test_text_without_calls_streams_untouched_and_bad_blocks_come_back_as_text() -> None:
    text = "A <b>bold</b> claim < 3 and <tool_ nothing more.\n"
    p = ToolCallParser("hermes")
    out = "".join(p.feed(ch)[0] for ch in text) + p.finish()[0]
    assert out == text and p.calls == []
    bad = 'Sure.\n<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call>'
    content, calls = parse_tool_calls(bad, "hermes")
    assert calls == [] and content == 'Sure.<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call>'
    cut = 'Sure.\n<tool_call>\n{"name": "x", "argu'  # max_tokens ran out inside the call
    assert parse_tool_calls(cut, "hermes") == ('Sure.<tool_call>\n{"name": "x", "argu', [])


def test_qwen35_xml_body_and_first_call_only() -> None:
    reply = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        '<tool_call>\n{"name": "lookup", "arguments": {"q": 1}}\n</tool_call>'
    )
    content, calls = parse_tool_calls(reply, "hermes")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 3}),
        ("lookup", {"q": 1}),
    ]
    _, first = parse_tool_calls(reply, "hermes", first_only=True)
    assert [c.name for c in first] == ["get_weather"]


def test_llama_json_reply_that_is_not_a_call_is_content() -> None:
    assert parse_tool_calls('{"answer": 42}', "llama3_json") == ('{"answer": 42}', [])
    assert parse_tool_calls("Plain words.", "llama3_json") == ("Plain words.", [])
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', "llama3_json"
    )
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("a", "{}"), ("b", '{"x": 1}')]
