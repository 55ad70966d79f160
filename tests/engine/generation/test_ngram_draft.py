from __future__ import annotations

import random

import pytest

from keepwarm.engine.generation.ngram_draft import DraftError, NgramDraft


def _draft(tokens: list[int], **kw: int) -> NgramDraft:
    d = NgramDraft(**kw)
    d.extend(tokens)
    return d


def test_the_longest_suffix_proposes_what_followed_its_latest_occurrence() -> None:
    # "1 2 3" occurred at 0 (then 4 5 6) and "2 3" also at 7 (then 9): the 3-gram wins
    d = _draft([1, 2, 3, 4, 5, 6, 8, 2, 3, 9, 7, 1, 2, 3], k=3)
    assert d.propose() == [4, 5, 6]
    # without the 3-gram, the latest "2 3" (followed by 9, 7, 1)
    assert _draft([5, 2, 3, 4, 8, 2, 3, 9, 7, 1, 0, 2, 3], k=3).propose() == [9, 7, 1]
    # the latest occurrence of an n-gram replaces an earlier one
    assert _draft([7, 1, 7, 2, 7], k=1, longest=1).propose() == [2]


def test_shorter_ngrams_are_tried_down_to_the_shortest() -> None:
    tokens = [10, 11, 12, 13, 99, 13]
    assert _draft(tokens, k=2).propose() == [99, 13]  # only the 1-gram "13" occurred before
    assert _draft(tokens, k=2, shortest=2).propose() == []


def test_a_draft_stops_at_the_end_of_the_text_and_at_the_limit() -> None:
    d = _draft([4, 5, 6, 4, 5], k=8)
    assert d.propose() == [6, 4, 5]  # what followed "4 5" up to the end (overlapping is fine)
    assert d.propose(limit=2) == [6, 4]
    assert d.propose(limit=0) == []


def test_no_match_and_the_suffix_itself_is_not_its_own_occurrence() -> None:
    assert _draft([1, 2, 3]).propose() == []
    assert _draft([]).propose() == []
    assert _draft([5]).propose() == []


def test_feeding_in_pieces_equals_feeding_at_once() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    whole = _draft(tokens, k=5)
    pieces = NgramDraft(k=5)
    i = 0
    while i < len(tokens):
        j = i + rng.randrange(1, 9)
        pieces.extend(tokens[i:j])
        i = j
    assert pieces.propose() == whole.propose()
    assert pieces.tokens == tokens


def test_every_draft_is_the_brute_force_search() -> None:
    """Against a rescan: the latest earlier occurrence (with a successor) of the longest suffix."""

    def brute(text: list[int], k: int, longest: int, shortest: int) -> list[int]:
        for n in range(min(longest, len(text)), shortest - 1, -1):
            suffix = text[len(text) - n :]
            for start in range(len(text) - n - 1, -1, -1):
                if text[start : start + n] == suffix:
                    return text[start + n : start + n + k]
        return []

    rng = random.Random(1)
    d = NgramDraft(k=4, longest=3, shortest=1)
    for _ in range(400):
        d.extend([rng.randrange(5)])
        assert d.propose() == brute(d.tokens, 4, 3, 1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"k": 0}, "speculate k must be in \\[1, 16\\], got 0"),
        ({"k": 17}, "got 17"),
        ({"longest": 2, "shortest": 3}, "shortest <= longest <= 8, got 3..2"),
        ({"longest": 9}, "got 1..9"),
        ({"shortest": 0}, "got 0..3"),
    ],
)
def test_settings_out_of_range_are_refused_naming_them(kw: dict[str, int], match: str) -> None:
    with pytest.raises(DraftError, match=match):
        NgramDraft(**kw)
