"""The static decode step (generation/decode_graph.py): bucketed batches, padding rows on a
scratch state, inputs from static buffers, the state addresses and positions read on the
device. On CPU it runs uncaptured under the Triton interpreter with the invariant Triton
kernels; on a GPU (`-m gpu`) it is captured as CUDA graphs and replayed. Either way each
row equals the eager `Backend.step` bitwise, and states advance exactly as eager."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from keepwarm.engine.generation.decode_graph import DecodeGraphs, buckets
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.backend import State, StaticDecode
from keepwarm.kernels.ops import TORCH_OPS
from keepwarm.kernels.triton_invariant import TRITON_INVARIANT_OPS
from tests.engine.test_engine import _cfg

PROMPT_LENS = (5, 17, 40)  # different cache lengths, one past a 32-key tile


def _needs_interpreter(dev: torch.device) -> None:
    # Triton runs on CPU tensors only interpreted: tests/conftest.py sets TRITON_INTERPRET=1 on
    # machines without a GPU (everywhere the CPU cases run by default); on a GPU machine the
    # kernels compile for the GPU and the `cuda` cases run instead.
    if dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1 (set where no GPU is)")


def test_buckets() -> None:
    assert buckets(1) == [1]
    assert buckets(3) == [1, 2, 3]
    assert buckets(4) == [1, 2, 4]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(20) == [1, 2, 4, 8, 16, 24]


def _states(backend: StaticDecode, gen: torch.Generator) -> list[State]:
    states = [backend.new_state(64) for _ in PROMPT_LENS]
    prompts = [torch.randint(3, backend.vocab_size, (n,), generator=gen) for n in PROMPT_LENS]
    backend.step(states, prompts)
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decode_equals_eager_step(tiny_dense_model: Path, device: str, dtype: torch.dtype) -> None:
    dev = torch.device(device)
    _needs_interpreter(dev)
    backend = build_backend(open_checkpoint(tiny_dense_model), dev, dtype, TRITON_INVARIANT_OPS)
    assert isinstance(backend, StaticDecode) and backend.static_decode(64)
    graphs = DecodeGraphs(backend, max_seqs=8, capture=dev.type == "cuda")
    eager = _states(backend, torch.Generator().manual_seed(1))
    static = _states(backend, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    # three sequences (bucket 4: one padding row), then one alone, then the three again
    for rows in ([0, 1, 2], [1], [0, 1, 2]):
        tokens = torch.randint(3, backend.vocab_size, (len(rows),), generator=gen).tolist()
        want = backend.step([eager[j] for j in rows], [torch.tensor([t]) for t in tokens])
        got = graphs.run([static[j] for j in rows], tokens)
        assert got is not None
        assert torch.equal(got, want)
        for j in rows:
            assert static[j].position == eager[j].position
            assert torch.equal(static[j].logits, eager[j].logits)  # type: ignore[arg-type]
    for s, e in zip(static, eager, strict=True):
        p = e.position
        for name, t in e.tensors.items():
            assert torch.equal(s.tensors[name][:p], t[:p]), name
    assert sorted(graphs.graphs) == ([1, 4] if dev.type == "cuda" else [])


def test_a_batch_beyond_the_largest_bucket_steps_eagerly(tiny_dense_model: Path) -> None:
    _needs_interpreter(torch.device("cpu"))
    backend = build_backend(
        open_checkpoint(tiny_dense_model), torch.device("cpu"), torch.float32, TRITON_INVARIANT_OPS
    )
    assert isinstance(backend, StaticDecode) and backend.static_decode(64)
    graphs = DecodeGraphs(backend, max_seqs=2, capture=False)
    states = _states(backend, torch.Generator().manual_seed(3))
    before = [s.position for s in states]
    assert graphs.run(states, [5, 6, 7]) is None  # 3 > bucket 2: "not now", nothing advanced
    assert [s.position for s in states] == before


def test_only_ops_with_address_kernels_run_static(tiny_dense_model: Path) -> None:
    backend = build_backend(open_checkpoint(tiny_dense_model), torch.device("cpu"), torch.float32, TORCH_OPS)
    assert DecodeGraphs.for_backend(backend, 4, 64, enforce_eager=False) is None
    triton = build_backend(
        open_checkpoint(tiny_dense_model), torch.device("cpu"), torch.float32, TRITON_INVARIANT_OPS
    )
    graphs = DecodeGraphs.for_backend(triton, 4, 64, enforce_eager=False)
    assert graphs is not None and not graphs.capture  # CPU: static, never captured


def test_engine_output_with_and_without_the_static_step(tiny_dense_model: Path) -> None:
    from keepwarm.engine.engine import Engine
    from tests.engine.generation.test_batching import _request, _run_together, _tokens

    _needs_interpreter(torch.device("cpu"))

    prompts = [tuple(range(10, 10 + n)) for n in (7, 20, 33)]
    outputs = {}
    for eager in (False, True):
        engine = Engine(_cfg(tiny_dense_model, None, use_triton=True, enforce_eager=eager, max_seqs=4))
        try:
            assert (engine.runner.graphs is None) is eager
            calls = {"n": 0}
            if engine.runner.graphs is not None:
                graphs, inner = engine.runner.graphs, engine.runner.graphs.run

                def counted(
                    states: list[State], tokens: list[int], calls: dict[str, int] = calls, inner: Any = inner
                ) -> torch.Tensor | None:
                    calls["n"] += 1
                    return inner(states, tokens)

                graphs.run = counted  # type: ignore[method-assign]
            events, _, _ = _run_together(engine, [_request(p, 4) for p in prompts], arrive_at=[0, 1, 2])
            outputs[eager] = [_tokens(ev) for _, ev in sorted(events.items())]
            assert (calls["n"] > 0) is not eager  # the decode steps went through the static step
        finally:
            engine.close()
    assert outputs[False] == outputs[True]
    assert all(len(toks) == 4 for toks in outputs[True])
