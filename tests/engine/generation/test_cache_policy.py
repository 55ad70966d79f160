from __future__ import annotations

import pytest

from keepwarm.engine.generation.cache_policy import Policy, PolicyError, parse_policy, policy_for_request


@pytest.mark.parametrize(
    "text,want",
    [
        ("off", Policy("off")),
        ("NONE", Policy("off")),
        ("disabled", Policy("off")),
        ("full", Policy("full")),
        ("Full-Prefix", Policy("full")),
        ("auto", Policy("auto", window=30)),
        ("auto:5", Policy("auto", window=5)),
        ("2048", Policy("fixed", num_tokens=2048)),
        (" 1 ", Policy("fixed", num_tokens=1)),
        ("1000000", Policy("fixed", num_tokens=1_000_000)),
    ],
)
def test_parse(text: str, want: Policy) -> None:
    assert parse_policy(text) == want


@pytest.mark.parametrize("text", ["", "fulll", "auto:", "auto:0", "auto:x", "0", "-5", "1000001", "1.5"])
def test_parse_errors_list_the_accepted_forms(text: str) -> None:
    with pytest.raises(PolicyError, match="accepted: off, full, auto"):
        parse_policy(text)


def test_round_trip_str() -> None:
    for s in ["off", "full", "auto:7", "512"]:
        assert str(parse_policy(s)) == s


def test_request_override() -> None:
    default = Policy("full")
    assert policy_for_request(default) is default
    assert policy_for_request(default, "off") == Policy("off")
    assert policy_for_request(default, "auto", 4) == Policy("auto", window=4)
    assert policy_for_request(default, None, 9) == Policy("full", window=9)
    with pytest.raises(PolicyError, match="window"):
        policy_for_request(default, "auto", "3")
    with pytest.raises(PolicyError, match="out of range"):
        policy_for_request(default, "auto", 0)
