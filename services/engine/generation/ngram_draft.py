"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the text's
last n tokens (n from `longest` down to `shortest`), the draft speculative decoding verifies.

One `NgramDraft` per sequence, fed every token as it becomes part of the text (prompt, then each
accepted reply token). It keeps, per n-gram length, the position just after the latest
occurrence of each n-gram that something followed, so both feeding a token and proposing a
draft cost O(longest + k): a reply's drafting work is linear in its text, never a rescan."""

from __future__ import annotations

from collections.abc import Iterable


class DraftError(ValueError):
    """A draft setting is out of range; the message names it and what is allowed."""


class NgramDraft:
    def __init__(self, k: int = 4, longest: int = 3, shortest: int = 1) -> None:
        if not 1 <= k <= 16:
            raise DraftError(f"speculate k must be in [1, 16], got {k}")
        if not 1 <= shortest <= longest <= 8:
            raise DraftError(
                f"speculate n-gram lengths must satisfy 1 <= shortest <= longest <= 8, got {shortest}..{longest}"
            )
        self.k, self.longest, self.shortest = k, longest, shortest
        self.tokens: list[int] = []
        # per length n: n-gram -> the position after its latest occurrence that has a successor
        self._after: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(shortest, longest + 1)}

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the text (each one records the n-grams it follows)."""
        for tok in tokens:
            t = len(self.tokens)  # tok's position: it follows the n-grams ending at t - 1
            for n, after in self._after.items():
                if t >= n:
                    after[tuple(self.tokens[t - n : t])] = t
            self.tokens.append(tok)

    def propose(self, limit: int | None = None) -> list[int]:
        """Up to min(k, limit) tokens: what followed the latest earlier occurrence of the text's
        longest matching suffix n-gram ([] when none matches, or limit is 0)."""
        k = self.k if limit is None else min(self.k, limit)
        if k <= 0:
            return []
        size = len(self.tokens)
        for n in range(min(self.longest, size), self.shortest - 1, -1):
            start = self._after[n].get(tuple(self.tokens[size - n :]))
            if start is not None:
                return self.tokens[start : start + k]
        return []
