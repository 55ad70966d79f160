"""One sequence's speculative decoding: where its drafts come from, how many tokens to draft
next, and what was drafted and accepted.

A step verifies a draft by feeding it after the sequence's last sampled token (k + 1 rows of
the batched step, beside other sequences' decodes and prefills) and sampling every row in
order, each from the logits after the tokens before it; the reply keeps the longest run of
draft tokens the sampler picked, plus the token it picked where the draft went wrong (or after
the last draft token). The kernels give a row the same bits whatever the batch and the
chunking, and a sampled token's draw depends only on (seed, choice, reply position)
(sampling.py), so that reply is bit for bit the one plain decoding gives, at temperature 0
and seeded. The rejected rows are undone by models/rewind.py.

How many tokens to draft adapts to what was accepted: all of a draft accepted doubles k (up
to `k_max`); a partial acceptance sets k to one more than what was accepted; a draft with
nothing accepted also rests the source for 1, 3, 7 ... (at most 31) steps, so a reply the
source cannot predict costs almost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

SPECULATE_MODES = ("off", "ngram", "mtp")  # the engine's --speculate
_REST_CAP = 31


class DraftSource(Protocol):
    """Proposes the tokens that may follow a text it is fed token by token."""

    def extend(self, tokens: Iterable[int]) -> None: ...

    def propose(self, limit: int | None = None) -> list[int]: ...


class Speculation:
    def __init__(self, source: DraftSource, k_max: int) -> None:
        assert k_max >= 1
        self.source = source
        self.k_max = k_max
        self.k = min(2, k_max)
        self.fed = 0  # tokens of the sequence the source has seen
        self.rest = 0  # steps left without drafting
        self.misses = 0  # drafts in a row with nothing accepted
        self.drafted = 0  # tokens drafted and verified for this sequence ...
        self.accepted = 0  # ... and kept

    def propose(self, tokens: Sequence[int], limit: int) -> tuple[int, ...]:
        """Up to min(k, limit) tokens to verify after `tokens` (prompt + reply so far)."""
        self.source.extend(tokens[self.fed :])
        self.fed = len(tokens)
        if self.rest > 0:
            self.rest -= 1
            return ()
        if limit <= 0:
            return ()
        return tuple(self.source.propose(min(self.k, limit)))

    def adapt(self, drafted: int, accepted: int) -> None:
        """A verified draft of `drafted` tokens kept its first `accepted`: the next k (the
        engine counts `drafted` and `accepted` as the reply goes)."""
        assert 0 <= accepted <= drafted
        if accepted == drafted:
            self.k = min(self.k_max, 2 * self.k)
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0:
            self.misses += 1
            self.rest = min(2**self.misses - 1, _REST_CAP)
        else:
            self.misses = 0
