"""Reasoning split out of replies (`<think>…</think>`), alone and together with tool calls,
whole and streamed in pieces cut anywhere: the same message either way."""

from __future__ import annotations

import json

import pytest

from keepwarm.engine.serving.openai_format import ReplyParser, ReplyShape
from keepwarm.engine.serving.reasoning import ReasoningParser, prompt_opens_reasoning, uses_think_tags


def run(text: str, starts: bool, pieces: list[str] | None = None) -> tuple[str, str]:
    p = ReasoningParser(starts)
    r, c = "", ""
    for piece in pieces if pieces is not None else [text]:
        a, b = p.feed(piece)
        r, c = r + a, c + b
    a, b = p.finish()
    return r + a, c + b


@pytest.mark.parametrize(
    "text,starts,reasoning,content",
    [
        (
            "<think>\nThe user wants a river.\n</think>\n\nThe Tagus.",
            False,
            "\nThe user wants a river.\n",
            "The Tagus.",
        ),
        ("The user wants a river.\n</think>\n\nThe Tagus.", True, "The user wants a river.\n", "The Tagus."),
        ("<think>\n\n</think>\n\nThe Tagus.", False, "\n\n", "The Tagus."),
        ("The Tagus, no thinking.", False, "", "The Tagus, no thinking."),
        ("  <thinking> is a word", False, "", "  <thinking> is a word"),
        (
            "<think>still thinking when max_tokens ran out",
            False,
            "still thinking when max_tokens ran out",
            "",
        ),
        ("<think>a</think>b </think> c", False, "a", "b </think> c"),
    ],
)
def test_split_whole_and_streamed(text: str, starts: bool, reasoning: str, content: str) -> None:
    assert run(text, starts) == (reasoning, content)
    for cut in range(len(text) + 1):
        assert run(text, starts, [text[:cut], text[cut:]]) == (reasoning, content), cut
    assert run(text, starts, list(text)) == (reasoning, content)


def test_prompt_tail_and_template_detection() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("user said <think> " + "x" * 100 + "<|im_start|>assistant\n")
    assert uses_think_tags("... '<think>\\n' + reasoning + '\\n</think>' ...")
    assert not uses_think_tags("{{ message.content }}")


def test_reply_with_reasoning_content_and_a_tool_call() -> None:
    text = (
        "<think>\nNeed the weather tool.\n</think>\n\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    shape = ReplyShape(tool_format="hermes", reasoning=True)
    whole = ReplyParser(shape)
    whole.feed(text)
    whole.finish()
    msg = whole.message()
    assert msg.reasoning_content == "\nNeed the weather tool.\n" and msg.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert whole.finish_reason("stop") == "tool_calls" and whole.finish_reason("length") == "length"
    for size in (1, 3, 7):
        p = ReplyParser(shape)
        deltas = [p.feed(text[i : i + size]) for i in range(0, len(text), size)] + [p.finish()]
        sent = [d for d in deltas if d is not None]
        assert (
            "".join(d.reasoning_content for d in sent if isinstance(d.reasoning_content, str))
            == msg.reasoning_content
        )
        assert "".join(d.content for d in sent if isinstance(d.content, str)) == "Checking."
        calls = [c for d in sent if isinstance(d.tool_calls, list) for c in d.tool_calls]
        assert [(c.index, c.type, c.function.name) for c in calls] == [(0, "function", "get_weather")]
        assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}
