from __future__ import annotations

import pytest
import torch

from keepwarm.engine.generation.sampling import Sampler, SamplingError, SamplingParams


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams())(logits) == 1


def test_seed_reproduces_and_top_k_restricts() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=7, top_k=3)
    a = [Sampler(p)(logits) for _ in range(5)]
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1(logits) for _ in range(20)]
    seq2 = [s2(logits) for _ in range(20)]
    assert seq1 == seq2
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert set(seq1) <= top3 and set(a) <= top3


def test_top_p_keeps_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=1))
    seen = {s(logits) for _ in range(200)}
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
