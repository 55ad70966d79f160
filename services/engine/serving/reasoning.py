"""Reasoning text (`<think>…</think>`) split from the answer: returned as
`message.reasoning_content` and streamed as `delta.reasoning_content` (the
DeepSeek / llama.cpp / litellm convention).

A reply is in reasoning from its start when the prompt's generation prompt left a
`<think>` open (Qwen3.5-style templates), or when the reply itself opens with
`<think>` (Qwen3); it leaves reasoning at `</think>`. Newlines right after
`</think>` separate the blocks and belong to neither. A reply that never closes its
reasoning (cut by max_tokens) is all reasoning. Markers split across decoded pieces
are held back until they are certain.
"""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def uses_think_tags(template_source: str) -> bool:
    """Whether the chat template knows reasoning blocks at all."""
    return THINK_CLOSE in template_source


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether the generation prompt ends inside a `<think>` block (only its tail is looked at,
    so a user quoting the tag earlier in the chat does not count)."""
    tail = prompt_text[-64:]
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningParser:
    """One per choice. `feed(text)` / `finish()` -> (reasoning, content) pieces now certain."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        # "start": the reply may still open a think block; "think": inside it; "gap": just closed it
        # (leading newlines are dropped); "content": the answer.
        self._state = "think" if starts_in_reasoning else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state == "start":
                s = self._buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self._buf = s[len(THINK_OPEN) :]
                    self._state = "think"
                    continue
                if not s or THINK_OPEN.startswith(s):
                    break  # undecided: whitespace or a partial "<think>"
                self._state = "content"
                continue
            if self._state == "think":
                end = self._buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self._buf[:end])
                    self._buf = self._buf[end + len(THINK_CLOSE) :]
                    self._state = "gap"
                    continue
                keep = _partial(self._buf, THINK_CLOSE)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                break
            if self._state == "gap":
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._state = "content"
                continue
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state == "think":
            return buf, ""
        if self._state == "gap":
            return "", ""
        return "", buf

    @property
    def in_reasoning(self) -> bool:
        return self._state == "think"
