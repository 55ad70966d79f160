from __future__ import annotations

import pytest
import torch

from keepwarm.engine.generation.sampling import LogitsRules, Sampler, SamplingError, SamplingParams


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams())(logits).token == 1


def test_seed_reproduces_and_top_k_restricts() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7, top_k=3)
    a = [Sampler(p)(logits).token for _ in range(5)]
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1(logits, reply=range(i)).token for i in range(20)]
    seq2 = [s2(logits, reply=range(i)).token for i in range(20)]
    assert seq1 == seq2
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert set(seq1) <= top3 and set(a) <= top3


def test_top_p_keeps_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=1))
    seen = {s(logits, reply=range(i)).token for i in range(200)}
    assert seen == {0, 1}


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"stop": tuple("x" * 17)}, "stop"),
    ],
)
def test_bad_params_name_the_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(SamplingError, match=field):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_penalties_and_bias_follow_their_definitions() -> None:
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5, 0.0])
    rules = LogitsRules(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias=((4, 3.0),)
    )
    s = Sampler(SamplingParams(), rules)
    got = s._apply_rules(logits.clone(), prompt=[2], reply=[0, 0, 3])
    # token 0: twice in the reply: 2 - 0.25*2 - 0.5 = 1.0, then seen -> 1.0 / 2
    # token 2: in the prompt only: -1 * 2; token 3: once: 0.5 - 0.25 - 0.5 = -0.25, seen -> * 2
    # token 4: +3 bias; token 1 untouched
    assert got.tolist() == [0.5, 1.0, -2.0, -0.5, 3.0]
    assert s(logits, [2], [0, 0, 3]).token == 4


def test_logprobs_come_from_the_unmodified_logits() -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3))
    s = Sampler(SamplingParams(), LogitsRules(logit_bias=((7, 50.0),), logprobs=True, top_logprobs=3))
    pick = s(logits)
    lp = torch.log_softmax(logits.float(), dim=-1)
    assert pick.token == 7 and pick.logprob == float(lp[7])
    top = torch.topk(lp, 3)
    assert pick.top_logprobs == tuple(
        (int(i), float(v)) for i, v in zip(top.indices, top.values, strict=True)
    )


def test_choices_draw_from_their_own_seeded_generators() -> None:
    logits = torch.zeros(1000)
    p = SamplingParams(temperature=1.0, seed=5)
    runs = [[Sampler(p, choice=c)(logits, reply=range(i)).token for i in range(8)] for c in (0, 1, 2, 1)]
    assert runs[1] == runs[3] and runs[0] != runs[1] and runs[1] != runs[2]


def test_a_draw_depends_only_on_seed_choice_and_position() -> None:
    """What makes a seeded reply the same with and without speculative decoding: the token drawn
    for reply position i is a function of (seed, choice, i), whatever was drawn before, in
    whatever order positions are sampled, by whichever sampler object."""
    logits = torch.zeros(1000)
    p = SamplingParams(temperature=1.0, seed=11)
    forward = [Sampler(p)(logits, reply=range(i)).token for i in range(12)]
    s = Sampler(p)
    backward = {i: s(logits, reply=range(i)).token for i in reversed(range(12))}
    assert [backward[i] for i in range(12)] == forward
    again = Sampler(p)
    assert [again(logits, reply=range(5)).token for _ in range(3)] == [forward[5]] * 3  # no hidden state
    assert len(set(forward)) >= 10  # positions draw differently (12 draws over 1,000 tokens)
    other = [
        Sampler(SamplingParams(temperature=1.0, seed=12))(logits, reply=range(i)).token for i in range(12)
    ]
    assert other != forward


@pytest.mark.parametrize("temperature", [6.5e-297, 1e-40, 1e-30, 1e-6])
def test_tiny_temperatures_pick_the_argmax(temperature: float) -> None:
    # x / T overflows float32 for such T; the limit of softmax(x / T) is the argmax.
    logits = torch.tensor([0.1, 30.0, 29.5, -1.0, 29.9])
    p = SamplingParams(temperature=temperature, seed=3)
    assert [Sampler(p)(logits).token for _ in range(5)] == [1] * 5
