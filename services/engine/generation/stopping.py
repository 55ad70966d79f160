"""When a sequence stops, and what text it may stream so far.

Stop token ids end a reply without adding text. Stop strings end it where the
earliest one starts; text that might still turn into a stop string (the last
`len(longest stop) - 1` characters) is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class TextStream(Protocol):
    """Incremental detokenizer (Tokenizer.stream_decoder())."""

    def push(self, token: int) -> str: ...

    def flush(self) -> str: ...


class StopChecker:
    def __init__(self, stream: TextStream, stop: Sequence[str], stop_token_ids: set[int]) -> None:
        self.stream = stream
        self.stop = tuple(s for s in stop if s)
        self.stop_token_ids = stop_token_ids
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the whole reply so far (cut at a stop string)
        self.emitted = 0  # characters of `text` already streamed
        self.matched: str | None = None  # the stop string that ended the reply

    def push(self, token: int) -> tuple[str, bool]:
        """Account one sampled token: (text that may be streamed now, stopped?)."""
        if token in self.stop_token_ids:
            return "", True
        self.text += self.stream.push(token)
        found = find_stop(self.text, self.stop, self.emitted)
        if found is not None:
            cut, self.matched = found
            self.text = self.text[:cut]
            out = self.text[self.emitted :] if cut > self.emitted else ""
            self.emitted = max(self.emitted, cut)
            return out, True
        safe = len(self.text) - self.hold if self.stop else len(self.text)
        if safe > self.emitted:
            out = self.text[self.emitted : safe]
            self.emitted = safe
            return out, False
        return "", False

    def finish(self, flush: bool) -> str:
        """The rest of the text once the reply has ended (`flush`: complete a pending
        multi-byte character, for replies cut by length)."""
        if flush:
            self.text += self.stream.flush()
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


def find_stop(text: str, stops: Sequence[str], emitted: int) -> tuple[int, str] | None:
    """Index where the earliest stop string starts in `text`, and that string (the first
    listed of those starting there), searching only where a new match can be (from just
    before `emitted`)."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
