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
from keepwarm.engine.serving.tool_calls import (
    ToolCallParser,
    detect_format,
    encode_chat_with_tools,
    generic_call_text,
    generic_tool_messages,
    generic_tool_prompt,
    parse_tool_calls,
    tool_format_for,
)

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


# --- the generic format: templates that teach no tool convention -----------------------------------

# SmolLM2-Instruct's ChatML template: no tools, a default system message when the chat has none.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's convention: roles must alternate user/model and a system message is refused.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
GENERIC_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city,\n now.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
]  # fmt: skip
GENERIC_PROMPT = (
    "You can call these tools (functions) to help with the user's request:\n"
    "\n"
    "- get_weather: Weather for a city, now.\n"
    '  arguments (JSON Schema): {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}\n'
    "- lookup\n"
    '  arguments (JSON Schema): {"type": "object"}\n'
    "\n"
    'To call a tool, reply with only this JSON object, "name" one of the tools above and "arguments" '
    "matching its schema:\n"
    '{"tool_call":{"name":"<tool name>","arguments":{"<argument>":<value>}}}\n'
    "To call several tools at once, reply with only:\n"
    '{"tool_calls":[{"name":"<tool name>","arguments":{...}},{"name":"<tool name>","arguments":{...}}]}\n'
    'Each result comes back in a user message as "Tool result (<tool name>): <result>". '
    "When no tool is needed, answer in plain text."
)


def test_generic_format_is_chosen_only_for_templates_without_one() -> None:
    assert detect_format(SMOL_TEMPLATE) is None and detect_format(GEMMA_TEMPLATE) is None
    assert tool_format_for(SMOL_TEMPLATE) == "generic" and tool_format_for(SMOL_TEMPLATE, tools=False) is None
    assert tool_format_for(CHATML_TEMPLATE) == "hermes" and tool_format_for(CHATML_TEMPLATE, False) is None
    assert (
        tool_format_for(LLAMA31_TEMPLATE) == "llama3_json" and tool_format_for(DEEPSEEK_V4_TEMPLATE) == "dsml"
    )
    assert generic_tool_prompt(GENERIC_TOOLS) == GENERIC_PROMPT


CALL_1 = '{"tool_call":{"name":"get_weather","arguments":{"city":"Oslo"}}}'
CALL_2 = (
    '{"tool_calls":[{"name":"get_weather","arguments":{"city":"東京"}},{"name":"lookup","arguments":{}}]}'
)


@pytest.mark.parametrize(
    "reply,content,calls",
    [
        (CALL_1, "", [("get_weather", {"city": "Oslo"})]),
        (CALL_2, "", [("get_weather", {"city": "東京"}), ("lookup", {})]),
        # pretty-printed, around whitespace, arguments as a JSON string: still a call
        ('\n {\n  "tool_call" : {"name": "lookup", "arguments": "{\\"q\\": 1}"}\n}\n', "", [("lookup", {"q": 1})]),
        # text first, then the call on a line of its own, then more text
        ("Let me check.\n" + CALL_1 + "\nDone.", "Let me check.\nDone.", [("get_weather", {"city": "Oslo"})]),
        (CALL_1 + "\n" + CALL_1, "", [("get_weather", {"city": "Oslo"})] * 2),
        # not calls: plain text, JSON of another shape, a call object inside a line, bad calls, malformed JSON
        ("Plain words { and braces }.\n\n", "Plain words { and braces }.\n\n", []),
        ('{"answer": 42}\n{"tool": 1}', '{"answer": 42}\n{"tool": 1}', []),
        ("See " + CALL_1, "See " + CALL_1, []),
        ('{"tool_call":{"name":"x","arguments":[1]}}', '{"tool_call":{"name":"x","arguments":[1]}}', []),
        ('{"tool_calls":[]} {"tool_call":{"name":""}}', '{"tool_calls":[]} {"tool_call":{"name":""}}', []),
        ('{"tool_call":{"name":"a","arguments":{}},"x":1}', '{"tool_call":{"name":"a","arguments":{}},"x":1}', []),
        ('Hm.\n{"tool_call": {"name": "a", oops}}\nbye', 'Hm.\n{"tool_call": {"name": "a", oops}}\nbye', []),
        # cut by max_tokens inside the call: given back as text
        ('Hm.\n{"tool_call":{"name":"get_weather","argu', 'Hm.\n{"tool_call":{"name":"get_weather","argu', []),
        ("{", "{", []),
        ('{"tool_c', '{"tool_c', []),
    ],
)  # fmt: skip
def test_generic_replies_parse_whole_and_streamed(
    reply: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    text, parsed = parse_tool_calls(reply, "generic")
    assert text == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    expected = [(c.name, c.arguments) for c in parsed]
    for cut in range(len(reply) + 1):  # two pieces split anywhere
        p = ToolCallParser("generic")
        c1, k1 = p.feed(reply[:cut])
        c2, k2 = p.feed(reply[cut:])
        c3, k3 = p.finish()
        assert c1 + c2 + c3 == content, cut
        assert [(c.name, c.arguments) for c in k1 + k2 + k3] == expected, cut
    p = ToolCallParser("generic")  # one character at a time
    pieces = [p.feed(ch) for ch in reply] + [p.finish()]
    assert "".join(c for c, _ in pieces) == content
    assert [(c.name, c.arguments) for _, k in pieces for c in k] == expected


def test_generic_streaming_gives_text_out_early_and_a_call_once_it_closes() -> None:
    p = ToolCallParser("generic")
    assert p.feed("Checking") == ("Checking", [])
    assert p.feed(" now.\n") == (" now.", [])  # trailing whitespace waits: it is markup if a call follows
    assert p.feed('{"to') == ("", [])  # a `{` at a line start waits until it cannot open a call
    assert p.feed('p": 1}') == ('\n{"top": 1}', [])
    assert p.feed('\n{"tool_call":{"name":"lookup","arguments":{"q":') == ("", [])
    content, calls = p.feed("2}}}")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("lookup", '{"q": 2}')]
    assert p.finish() == ("", [])
    _, first = parse_tool_calls(CALL_2, "generic", first_only=True)
    assert [c.name for c in first] == ["get_weather"]


def generic_chat(tools: list[dict[str, Any]] | None = GENERIC_TOOLS) -> list[list[dict[str, Any]]]:
    """Three turns of a tool loop: the question; + the calls and their results; + the answer
    and a new question."""
    user: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo?"},
    ]
    calls: list[dict[str, Any]] = [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "lookup", "arguments": {"q": "wind"}}},
    ]  # fmt: skip
    after_call = [
        *user,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_2", "content": "calm"},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
    ]
    answer = [
        *after_call,
        {"role": "assistant", "content": "-3 and calm."},
        {"role": "user", "content": "Bergen?"},
    ]
    return [user, after_call, answer]


def test_generic_prompt_merges_the_system_message_and_renders_calls_and_results(tmp_path: Path) -> None:
    tpl = template(tmp_path, SMOL_TEMPLATE)
    first, second, third = generic_chat()
    calls_json = (
        '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Oslo"}},'
        '{"name":"lookup","arguments":{"q":"wind"}}]}'
    )
    assert encode_chat_with_tools(tpl, second, True, GENERIC_TOOLS).text == (
        f"<|im_start|>system\n{GENERIC_PROMPT}\n\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{calls_json}<|im_end|>\n"
        '<|im_start|>user\nTool result (lookup): calm\n\nTool result (get_weather): {"temp": -3}<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    # no system message: the tools' text is a new first one (the template's default one is not added)
    no_system = encode_chat_with_tools(tpl, first[1:], True, GENERIC_TOOLS).text
    assert (
        no_system == f"<|im_start|>system\n{GENERIC_PROMPT}<|im_end|>\n"
        "<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    )
    # one call: the single-call shape, after the assistant's text; results without ids match calls in order
    one = [*first, {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny"}]  # fmt: skip
    assert generic_tool_messages(one, GENERIC_TOOLS)[2:] == [
        {"role": "assistant", "content": "Checking.\n" + CALL_1},
        {"role": "user", "content": "Tool result (get_weather): sunny"},
    ]
    # without tools: earlier calls and results still render as above, with no tools' text
    assert encode_chat_with_tools(tpl, second, True, None).text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWeather in Oslo?<|im_end|>\n"
        f"<|im_start|>assistant\n{calls_json}<|im_end|>\n"
        '<|im_start|>user\nTool result (lookup): calm\n\nTool result (get_weather): {"temp": -3}<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    # a chat without tools and without tool turns, or a template with its own format: as before
    assert encode_chat_with_tools(tpl, first, True, None).text == tpl.render(first, True)
    (tmp_path / "hermes").mkdir()
    hermes = template(tmp_path / "hermes", CHATML_TEMPLATE)
    assert encode_chat_with_tools(hermes, second, True, GENERIC_TOOLS).text == hermes.render(
        second, True, GENERIC_TOOLS
    )
    assert "tool_call" not in tpl.render(second, True, GENERIC_TOOLS)  # the template alone ignores tools


@pytest.mark.parametrize("source", [SMOL_TEMPLATE, GEMMA_TEMPLATE])
def test_generic_prompt_is_deterministic_and_each_turn_extends_the_last(tmp_path: Path, source: str) -> None:
    tpl = template(tmp_path, source)
    turns = generic_chat()
    if source is GEMMA_TEMPLATE:  # no system message there: the tools go to the top of the first user message
        turns = [t[1:] for t in turns]
    prompts = [encode_chat_with_tools(tpl, t, True, GENERIC_TOOLS) for t in turns]
    assert [p.tokens for p in prompts] == [
        encode_chat_with_tools(tpl, t, True, GENERIC_TOOLS).tokens for t in turns
    ]
    for a, b in zip(prompts, prompts[1:], strict=False):
        assert b.tokens[: len(a.tokens)] == a.tokens
    # the reply the grammar lets the model write is exactly how the next turn renders it
    reply = generic_call_text(turns[1][-3]["tool_calls"])
    assert (
        prompts[1]
        .text[len(prompts[0].text) :]
        .startswith(reply + ("<|im_end|>" if source is SMOL_TEMPLATE else "<end_of_turn>"))
    )
    text, calls = parse_tool_calls(reply, "generic")
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("lookup", {"q": "wind"})]  # fmt: skip
    if source is GEMMA_TEMPLATE:
        assert prompts[0].text.startswith(
            f"<|endoftext|><start_of_turn>user\n{GENERIC_PROMPT}\n\nWeather in Oslo?"
        )
        with pytest.raises(ValueError, match="System role not supported"):
            encode_chat_with_tools(tpl, [{"role": "system", "content": "x"}, *turns[0]], True, GENERIC_TOOLS)
