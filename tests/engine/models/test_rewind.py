"""Rewind (models/rewind.py) takes a state back exactly: for every family, a state that fed
k drafted rows and was rewound to an accepted position holds the same bits as a state that
never fed the rejected rows, and continues with the same logits bit for bit. Dense and the
sliding families (ring slots put back) move the position back; the hybrid recurrent and
DeepSeek V4 compressor states go back to the step's start and feed the accepted tokens again.
With the invariant CPU kernels, float32 and bfloat16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from keepwarm.engine.demo.demo_model import make_demo_model
from keepwarm.engine.models.backend import Backend, State
from keepwarm.engine.models.rewind import Rewind
from tests.engine.test_invariance import _backend
from tests.engine.test_invariance import pytestmark as needs_invariant_kernels

REPLAYS = {
    "dense": False,
    "qwen3_5": True,
    "deepseek_v4": True,
    "laguna": False,
    "gpt_oss": False,
    "gemma3": False,
}
PROMPT = 45  # past every tiny sliding window: the rings have wrapped

pytestmark = needs_invariant_kernels


@pytest.fixture(scope="module", params=sorted(REPLAYS))
def family_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("rewind") / request.param
    make_demo_model(path, family=request.param, seed=3, size="tiny")
    return request.param, path


def _feed(backend: Backend, state: State, tokens: list[int]) -> torch.Tensor:
    return backend.step([state], [torch.tensor(tokens, dtype=torch.long)])[0]


def _same_state(backend: Backend, a: State, b: State) -> None:
    assert a.position == b.position
    sa, sb = backend.export(a), backend.export(b)
    assert sa.tensors.keys() == sb.tensors.keys()
    for name, t in sa.tensors.items():
        assert torch.equal(t, sb.tensors[name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("accepted", [0, 2, 5])
def test_a_rewound_state_is_the_state_that_never_fed_the_rejected_rows(
    family_model: tuple[str, Path], dtype: str, accepted: int
) -> None:
    family, path = family_model
    backend = _backend(path, dtype)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, backend.vocab_size, (PROMPT + 12,), generator=g).tolist()
    prompt, last, truth = tokens[:PROMPT], tokens[PROMPT], tokens[PROMPT + 1 :]
    k = 5
    draft = truth[:accepted] + [(t + 1) % backend.vocab_size for t in truth[accepted:k]]

    plain = backend.new_state(80)
    _feed(backend, plain, prompt)
    for t in [last, *truth[:accepted]]:
        _feed(backend, plain, [t])

    spec = backend.new_state(80)
    _feed(backend, spec, prompt)
    rewind = Rewind.before(backend.geometry, spec, 1 + k)
    rows = backend.step([spec], [torch.tensor([last, *draft], dtype=torch.long)], [1 + k])
    assert rows.shape == (1 + k, backend.vocab_size) and spec.position == PROMPT + 1 + k
    keep = PROMPT + 1 + accepted
    rewind.to(spec, keep, rows[accepted])
    assert rewind.replay is REPLAYS[family]
    if rewind.replay and accepted < k:  # back at the step's start: the accepted tokens are fed again
        assert spec.position == PROMPT
        _feed(backend, spec, [last, *truth[:accepted]])
    else:
        assert torch.equal(rows[accepted], plain.logits)
    _same_state(backend, spec, plain)
    assert spec.logits is not None and plain.logits is not None
    assert torch.equal(spec.logits, plain.logits)
    for t in truth[accepted : accepted + 4]:  # and the continuation is the same, bit for bit
        assert torch.equal(_feed(backend, spec, [t]), _feed(backend, plain, [t]))


def test_a_step_gives_the_logits_of_each_requested_row(family_model: tuple[str, Path]) -> None:
    """`heads`: the last heads[b] rows of each chunk, in order; each row's logits are the ones
    that chunk's prefix alone gives (the invariant kernels: whatever the batch and chunking)."""
    _, path = family_model
    backend = _backend(path, "float32")
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(0, backend.vocab_size, (n,), generator=g) for n in (9, 4))
    sa, sb = backend.new_state(16), backend.new_state(16)
    out = backend.step([sa, sb], [a, b], [3, 1])
    assert out.shape == (4, backend.vocab_size)
    for i, n in enumerate((7, 8, 9)):
        alone = backend.new_state(16)
        assert torch.equal(out[i], _feed(backend, alone, a[:n].tolist()))
    assert torch.equal(out[3], _feed(backend, backend.new_state(16), b.tolist()))
    assert sa.logits is not None and torch.equal(sa.logits, out[2]) and sa.position == 9
    with pytest.raises(ValueError, match="cannot give logits for its last 5"):
        backend.step([backend.new_state(16)], [b], [5])
