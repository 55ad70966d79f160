"""A cached answer is the uncached answer, bitwise: with the invariant CPU kernels (the
default), a token's logits are the same bits computed alone, in batches of random
composition, in prefill chunks of 1, 7, 64 or the default size, and after a snapshot at a
random position restored from RAM or (in a fresh process) from disk; 32 greedy tokens follow
identically. A control with invariance off detects a difference, so these tests can fail.

Every family through its tiny demo model (dense qwen3, hybrid qwen3_5, deepseek_v4: sliding
window with sinks, CSA/HCA compressed rows, mHC; laguna and gpt_oss: full + sliding-window
layers in a ring cache, gpt_oss with sinks, MoE), float32 and bfloat16."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from keepwarm.engine.config import EngineConfig
from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, TokenEvent
from keepwarm.engine.generation.sampling import SamplingParams
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.backend import Backend, State
from keepwarm.kernels import cpu_attention, cpu_delta_rule, cpu_linear, cpu_rowwise
from keepwarm.kernels.ops import ops_for

CPU = torch.device("cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GREEDY = 32
DEFAULT_CHUNK = EngineConfig(model=Path(".")).chunk_size

pytestmark = pytest.mark.skipif(
    not all(m.available() for m in (cpu_linear, cpu_attention, cpu_rowwise, cpu_delta_rule)),
    reason="the invariant CPU kernels need AVX-512 BF16 or AVX2 + FMA + F16C (this CPU lacks both or the build failed)",
)


def _backend(model: Path, dtype: str, invariant: bool = True) -> Backend:
    ops = ops_for(CPU, invariant=invariant)
    assert ops.name == ("cpu_invariant" if invariant else "torch+cpu_linear")
    return build_backend(open_checkpoint(model), CPU, DTYPES[dtype], ops)


def _prompts(vocab: int, lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _one_shot(backend: Backend, tokens: torch.Tensor) -> tuple[torch.Tensor, State]:
    """Logits of every position [n, vocab] from one forward over the whole prompt."""
    state = backend.new_state(len(tokens) + GREEDY + 1)
    return backend.forward(state, tokens, all_logits=True), state  # type: ignore[attr-defined]


def _chunked(backend: Backend, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    state = backend.new_state(len(tokens) + 1)
    parts = [
        backend.forward(state, tokens[i : i + chunk], all_logits=True)  # type: ignore[attr-defined]
        for i in range(0, len(tokens), chunk)
    ]
    return torch.cat(parts)


def _greedy(backend: Backend, state: State, n: int = GREEDY) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens from `state` alone; the logits [n, vocab] that chose them."""
    assert state.logits is not None
    logits, toks = [state.logits], []
    for _ in range(n):
        toks.append(int(torch.argmax(logits[-1])))
        logits.append(backend.decode(state, toks[-1]))
    return toks, torch.stack(logits[:-1])


FAMILIES = {
    "dense": "tiny_dense_model",
    "hybrid": "tiny_hybrid_model",
    "deepseek_v4": "tiny_deepseek_model",
    "laguna": "tiny_laguna_model",
    "gpt_oss": "tiny_gpt_oss_model",
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(FAMILIES[request.param]))


@pytest.fixture(scope="module", params=list(DTYPES))
def dtype(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_every_row_is_the_same_bits_in_any_chunking(model: Path, dtype: str) -> None:
    backend = _backend(model, dtype)
    for tokens in _prompts(backend.vocab_size, (150, 41), seed=1):
        ref, _ = _one_shot(backend, tokens)
        for chunk in (1, 7, 64, DEFAULT_CHUNK):
            got = _chunked(backend, tokens, chunk)
            assert torch.equal(got, ref), (dtype, chunk)


def test_batches_of_random_composition_and_greedy_decode(model: Path, dtype: str) -> None:
    """Several sequences advance together with random chunk lengths (prefill chunks mixed
    with decodes); each row equals the one-shot row, and 32 greedy tokens decoded in random
    batches equal the ones decoded alone."""
    backend = _backend(model, dtype)
    rng = random.Random(7)
    prompts = _prompts(backend.vocab_size, (120, 57, 9, 88), seed=2)
    refs, solo_tokens, solo_logits = [], [], []
    for p in prompts:
        ref, state = _one_shot(backend, p)
        refs.append(ref)
        toks, logits = _greedy(backend, state)
        solo_tokens.append(toks)
        solo_logits.append(logits)
    # full sequences: prompt then its greedy reply, fed through random batches
    seqs = [
        torch.cat([p, torch.tensor(t[:-1], dtype=torch.long)])
        for p, t in zip(prompts, solo_tokens, strict=True)
    ]
    expect = [
        torch.cat([r[:-1], lg]) for r, lg in zip(refs, solo_logits, strict=True)
    ]  # logits after each token
    states = [backend.new_state(len(s) + 1) for s in seqs]
    while any(st.position < len(s) for st, s in zip(states, seqs, strict=True)):
        live = [i for i, (st, s) in enumerate(zip(states, seqs, strict=True)) if st.position < len(s)]
        pick = rng.sample(live, rng.randint(1, len(live)))
        chunks = []
        for i in pick:
            left = len(seqs[i]) - states[i].position
            chunks.append(
                seqs[i][states[i].position : states[i].position + min(left, rng.choice((1, 1, 3, 16, 40)))]
            )
        out = backend.step([states[i] for i in pick], chunks)
        for row, i in zip(out, pick, strict=True):
            assert torch.equal(row, expect[i][states[i].position - 1]), (dtype, i, states[i].position)


def test_snapshot_at_random_positions_restored_from_ram(model: Path, dtype: str) -> None:
    backend = _backend(model, dtype)
    rng = random.Random(11)
    (tokens,) = _prompts(backend.vocab_size, (130,), seed=3)
    ref, state = _one_shot(backend, tokens)
    ref_toks, ref_logits = _greedy(backend, state)
    for split in sorted(rng.sample(range(1, len(tokens)), 6)):
        st = backend.new_state(len(tokens) + GREEDY + 1)
        for i in range(0, split, 64):  # prefill up to the snapshot in default-like chunks
            backend.prefill(st, tokens[i : min(split, i + 64)])
        snap = backend.export(st).detached()
        restored = backend.adopt(snap, len(tokens) + GREEDY + 1)
        tail = backend.forward(restored, tokens[split:], all_logits=True)  # type: ignore[attr-defined]
        assert torch.equal(tail, ref[split:]), (dtype, split)
        toks, logits = _greedy(backend, restored)
        assert toks == ref_toks and torch.equal(logits, ref_logits), (dtype, split)


def test_control_with_invariance_off_detects_a_difference(model: Path, dtype: str) -> None:
    """torch's kernels (the pre-invariance path) give a row different bits with the chunk
    size: the comparison these tests make can fail."""
    backend = _backend(model, dtype, invariant=False)
    (tokens,) = _prompts(backend.vocab_size, (150,), seed=1)
    ref, _ = _one_shot(backend, tokens)
    assert not torch.equal(_chunked(backend, tokens, 1), ref)


# --- through the engine -------------------------------------------------------------------


def _cfg(model: Path, dtype: str, cache_dir: Path | None = None, **kw: object) -> EngineConfig:
    base = EngineConfig(
        model=model,
        dtype=dtype,
        cache_dir=cache_dir,
        max_context=512,
        min_tokens=8,
        num_threads=1,
        fsync=False,
    )
    return replace(base, **kw).validate()  # type: ignore[arg-type]


def _req(tokens: list[int], policy: Policy | None = None) -> GenerateRequest:
    return GenerateRequest(
        sampling=SamplingParams(max_tokens=GREEDY, temperature=0.0, ignore_eos=True),
        prompt_tokens=tuple(tokens),
        policy=policy,
        logprobs=True,
        top_logprobs=3,
    )


Reply = list[tuple[int, float | None, object]]


def _run_together(
    engine: Engine, reqs: list[GenerateRequest], finishes: list[FinishEvent] | None = None
) -> list[Reply]:
    """Submit all, then step the engine until every reply is finished (finish events are
    appended to `finishes`)."""
    replies: list[Reply] = [[] for _ in reqs]
    done = [False] * len(reqs)

    def on_event(i: int):  # noqa: ANN202
        def handle(ev: object) -> None:
            if isinstance(ev, TokenEvent) and ev.logprob is not None:  # not the final text flush
                replies[i].append((ev.token_id, ev.logprob, ev.top_logprobs))
            elif isinstance(ev, FinishEvent):
                done[i] = True
                if finishes is not None:
                    finishes.append(ev)

        return handle

    for i, r in enumerate(reqs):
        engine.submit(r, on_event(i))
    while not all(done):
        engine.step()
    return replies


def _engine_prompts(engine: Engine) -> list[list[int]]:
    return [p.tolist() for p in _prompts(engine.backend.vocab_size, (90, 23, 140, 61), seed=5)]


def test_engine_alone_batched_and_chunk_sizes_agree(model: Path, dtype: str) -> None:
    off = Policy("off")
    alone_engine = Engine(_cfg(model, dtype))
    try:
        prompts = _engine_prompts(alone_engine)
        alone = [_run_together(alone_engine, [_req(p, off)])[0] for p in prompts]
    finally:
        alone_engine.close()
    assert all(len(r) == GREEDY for r in alone)
    for chunk in (1, 7, 64, DEFAULT_CHUNK):
        engine = Engine(_cfg(model, dtype, chunk_size=chunk, max_batch_tokens=max(chunk, 16)))
        try:
            together = _run_together(engine, [_req(p, off) for p in prompts])
        finally:
            engine.close()
        assert together == alone, (dtype, chunk)


def _restart_code(model: Path, dtype: str, cache: Path, prompt: list[int], split: int) -> str:
    return (
        "import json; from pathlib import Path;"
        "from keepwarm.engine.generation.cache_policy import Policy;"
        "from tests.engine.test_invariance import Engine, _cfg, _req, _run_together;"
        f"e = Engine(_cfg(Path({str(model)!r}), {dtype!r}, Path({str(cache)!r}), memory_budget=0));"
        f"f = []; r = _run_together(e, [_req({prompt!r}, Policy('fixed', num_tokens={split}))], f)[0];"
        "e.close(); print(json.dumps([f[0].timings.cache_source, f[0].cached_tokens, [[t, lp] for t, lp, _ in r]]))"
    )


def test_engine_snapshot_splits_restored_from_ram_and_from_disk_in_a_fresh_process(
    model: Path, tmp_path: Path, dtype: str
) -> None:
    """A prompt is snapshotted at a random position (fixed:N), then asked again: the restore
    leaves a tail of prompt tokens to prefill. From RAM in this process, and from disk in a
    fresh process, the 32 greedy tokens and their logprobs equal the uncached answer."""
    rng = random.Random(13)
    cold_engine = Engine(_cfg(model, dtype))
    try:
        prompt = _engine_prompts(cold_engine)[2]
        cold = _run_together(cold_engine, [_req(prompt, Policy("off"))])[0]
    finally:
        cold_engine.close()
    root = Path(__file__).resolve().parents[2]
    for split in sorted(rng.sample(range(8, len(prompt) - 1), 2)):
        cache = tmp_path / f"cache-{split}"
        policy = Policy("fixed", num_tokens=split)
        engine = Engine(_cfg(model, dtype, cache))
        try:
            first = _run_together(engine, [_req(prompt, policy)])[0]
            events: list[object] = []
            engine.submit(_req(prompt, policy), events.append)
            while not any(isinstance(e, FinishEvent) for e in events):
                engine.step()
            engine.flush()
        finally:
            engine.close()
        fin = next(e for e in events if isinstance(e, FinishEvent))
        assert fin.timings.cache_source == "memory" and fin.cached_tokens == split, fin.timings
        again = [
            (e.token_id, e.logprob, e.top_logprobs)
            for e in events
            if isinstance(e, TokenEvent) and e.logprob is not None
        ]
        assert first == cold and again == cold, (dtype, split)
        res = subprocess.run(
            [sys.executable, "-c", _restart_code(model, dtype, cache, prompt, split)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        source, restored, from_disk = json.loads(res.stdout.strip().splitlines()[-1])
        assert (source, restored) == ("disk", split)
        assert from_disk == [[t, lp] for t, lp, _ in cold], (dtype, split)
