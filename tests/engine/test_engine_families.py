"""The hybrid (qwen3_5) and DeepSeek V4 families through the whole engine and cache,
with no family-specific code on the engine side (issues 6 and 7 acceptance).

- cold == warm over the 5-turn conversation of test_engine.py: RAM hits, disk hits
  from a second engine with its RAM tier off, and a restart in a real subprocess;
  replies byte-identical and each turn's first-token logits within float noise;
- a snapshot file offered to a model of another layer pattern (hybrid) or another
  compression schedule (deepseek_v4) under the same namespace, or whose row counts
  disagree with its position, is rejected as "geometry" and deleted;
- snapshots at turn boundaries are taken by splitting prefill exactly there (recurrent
  and compressed state cannot be cut back), and restore bit-exactly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.demo import deepseek_v4, gpt_oss, laguna, qwen3_5
from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.models.backend import Backend, State
from tests.engine.test_engine import SYSTEM, USER_TURNS, _cfg, _req, assert_restart_replays, run_conversation

FAMILIES = ("hybrid", "deepseek_v4", "laguna", "gpt_oss")
_FIXTURE = {
    "hybrid": "tiny_hybrid_model",
    "deepseek_v4": "tiny_deepseek_model",
    "laguna": "tiny_laguna_model",
    "gpt_oss": "tiny_gpt_oss_model",
}
LOGITS_ATOL = 1e-5  # chunked vs one-shot prefill of the same tokens; observed <= 2e-7 here


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(_FIXTURE[request.param])


# -- instrumentation ---------------------------------------------------------------------
class PrefillTape:
    """Records the logits each request's first token is sampled from (the end of its
    prefill, or a restored state's stored logits: what a restore can break)."""

    def __init__(self, engine: Engine) -> None:
        self.logits: list[torch.Tensor] = []
        inner = engine._sample

        def sample(seq: Any, logits: torch.Tensor) -> None:
            if seq.num_generated == 0:
                self.logits.append(logits.detach().float().cpu().clone())
            inner(seq, logits)

        engine._sample = sample  # type: ignore[method-assign]


def prefill_split(
    backend: Backend,
    state: State,
    tokens: Sequence[int],
    points: Sequence[int] = (),
    on_snapshot: Any = None,
    chunk: int = 2048,
) -> torch.Tensor:
    """Prefill `tokens` in chunks that stop at every absolute position in `points`,
    exporting there (the engine's schedule for one sequence alone)."""
    start = state.position
    pos, end = start, start + len(tokens)
    logits = state.logits
    while pos < end:
        nxt = min([pos + chunk, end, *(p for p in points if p > pos)])
        logits = backend.prefill(state, torch.tensor(tokens[pos - start : nxt - start]))
        pos = nxt
        if on_snapshot is not None and pos in points:
            on_snapshot(pos, backend.export(state))
    assert logits is not None
    return logits


class ChunkRecorder:
    """A backend proxy that records (start, end) of every prefill call the runner makes."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self.chunks: list[tuple[int, int]] = []

    def step(
        self, states: Sequence[State], chunks: Sequence[torch.Tensor], heads: Sequence[int] | None = None
    ) -> torch.Tensor:
        starts = [s.position for s in states]
        out = self._backend.step(states, chunks, heads)
        self.chunks.extend((a, s.position) for a, s in zip(starts, states, strict=True))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _assert_logits_close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        diff = (g - w).abs().max().item()
        assert diff <= LOGITS_ATOL, f"turn {i + 1}: first-token logits differ by {diff}"
        assert int(g.argmax()) == int(w.argmax()), f"turn {i + 1}"


# -- cold == warm --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cold(family_model: tuple[str, Path]) -> tuple[list[str], list[torch.Tensor]]:
    _, model = family_model
    engine = Engine(_cfg(model, None, memory_budget=0))
    tape = PrefillTape(engine)
    try:
        events = run_conversation(engine, Policy("off"))
    finally:
        engine.close()
    assert all(e.timings.cache_source == "none" and e.cached_tokens == 0 for e in events)
    assert len(tape.logits) == len(USER_TURNS)
    return [e.text for e in events], tape.logits


def test_cold_equals_warm_memory_disk_and_after_restart(
    family_model: tuple[str, Path], tmp_path: Path, cold: tuple[list[str], list[torch.Tensor]]
) -> None:
    _, model = family_model
    cold_replies, cold_logits = cold
    cache = tmp_path / "cache"
    engine = Engine(_cfg(model, cache))
    tape = PrefillTape(engine)
    try:
        first = run_conversation(engine)
        assert [e.text for e in first] == cold_replies
        _assert_logits_close(tape.logits, cold_logits)
        assert first[0].timings.cache_source == "none" and first[0].cached_tokens == 0
        for e in first[1:]:
            assert e.cached_tokens > 0 and e.timings.cache_source == "memory", e.timings
            assert e.timings.restored_tokens == e.cached_tokens
            assert e.timings.prefill_tokens == e.prompt_tokens - e.cached_tokens
        # the same conversation again: every turn is an exact hit from RAM, zero prefill
        tape.logits.clear()
        again = run_conversation(engine)
        assert [e.text for e in again] == cold_replies
        _assert_logits_close(tape.logits, cold_logits)
        assert all(e.timings.prefill_tokens == 0 and e.timings.cache_source == "memory" for e in again)
        assert all(e.cached_tokens == e.prompt_tokens for e in again)
    finally:
        engine.close()

    # a new engine in this process with the RAM tier off: every turn comes from disk
    disk_engine = Engine(_cfg(model, cache, memory_budget=0))
    tape = PrefillTape(disk_engine)
    try:
        from_disk = run_conversation(disk_engine)
        assert disk_engine.cache.disk is not None
        assert dict(disk_engine.cache.disk.stats().rejected_by_reason) == {}
    finally:
        disk_engine.close()
    assert [e.text for e in from_disk] == cold_replies
    _assert_logits_close(tape.logits, cold_logits)
    assert all(e.timings.cache_source == "disk" and e.cached_tokens > 0 for e in from_disk)

    # a fresh process on the same folder (a restart)
    logits_file = tmp_path / "restart-logits.pt"
    code = (
        "import json, torch; from pathlib import Path;"
        "from tests.engine.test_engine_families import Engine, PrefillTape, _cfg, run_conversation;"
        f"e = Engine(_cfg(Path({str(model)!r}), Path({str(cache)!r})));"
        "tape = PrefillTape(e); ev = run_conversation(e); e.close();"
        f"torch.save(tape.logits, {str(logits_file)!r});"
        "print(json.dumps([[x.text, x.timings.cache_source, x.cached_tokens] for x in ev]))"
    )
    assert_restart_replays(code, cold_replies)
    _assert_logits_close(torch.load(logits_file), cold_logits)


# -- foreign geometry under the same namespace ---------------------------------------------
def _variant_model(base: Path, dest: Path, family: str, edit: dict[str, Any]) -> Path:
    """A copy of the demo checkpoint `base` (same tokenizer and template) with config
    fields replaced by `edit` and fresh weights for the edited config."""
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(base / name, dest / name)
    config = {**json.loads((base / "config.json").read_text()), **edit}
    module = {"hybrid": qwen3_5, "deepseek_v4": deepseek_v4, "laguna": laguna, "gpt_oss": gpt_oss}[family]
    init = module.init_weights
    weights = {k: v.contiguous() for k, v in init(config, 0).items()}
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


# hybrid: full attention first instead of last (same sizes, other state tensors);
# deepseek_v4: the same layer types with HCA rate 16 instead of 8 (same names, other row counts)
_OTHER: dict[str, dict[str, Any]] = {
    "hybrid": {"layer_types": ["full_attention", "linear_attention", "linear_attention", "linear_attention"]},
    "deepseek_v4": {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}},
    # laguna, gpt_oss: window 8 instead of 16 (same names, other sliding row counts)
    "laguna": {"sliding_window": 8},
    "gpt_oss": {"sliding_window": 8},
}


def _disk(root: Path, namespace: str) -> DiskCache:
    return DiskCache(root, namespace, budget_bytes=1 << 30, min_free_bytes=0, fsync=False).start()


def test_snapshot_of_another_layout_is_rejected_and_deleted(
    family_model: tuple[str, Path], tmp_path: Path
) -> None:
    family, model = family_model
    root = tmp_path / "cache"
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
    writer = Engine(_cfg(model, root, memory_budget=0))
    try:
        prompt = writer.prepare(_req(msgs))
        writer.complete(_req(msgs))
        writer.flush()
        namespace = writer.namespace
        tokens = prompt.tokens
        b = [x for x in prompt.boundaries if 0 < x < len(tokens)][0]
        key_b, key_n = writer.cache.key("", tokens[:b]), writer.cache.key("", tokens)
    finally:
        writer.close()

    other = Engine(
        _cfg(_variant_model(model, tmp_path / "other", family, _OTHER[family]), None, memory_budget=0)
    )
    try:
        if family == "hybrid":
            assert other.backend.geometry.names != writer.backend.geometry.names
        else:  # same tensor names: only the row counts at a position tell them apart
            assert other.backend.geometry.names == writer.backend.geometry.names
        # the namespace alone would keep the files apart; force the same one so that
        # the geometry check is what must catch the mismatch
        assert other.namespace != namespace
        disk = _disk(root, namespace)
        try:
            assert disk.path_for(key_b).is_file() and disk.path_for(key_n).is_file()
            # control: the writer's own model adopts the boundary entry
            good = disk.load(key_b, tokens[:b], writer._validate)
            assert good is not None and good.position == b
            path = disk.path_for(key_n)
            assert disk.load(key_n, tokens, other._validate) is None
            assert not path.exists()
            assert dict(disk.stats().rejected_by_reason) == {"geometry": 1}
            assert not disk.contains(key_n)
        finally:
            disk.close()
    finally:
        other.close()


def test_snapshot_whose_rows_disagree_with_its_position_is_rejected(
    family_model: tuple[str, Path], tmp_path: Path
) -> None:
    _, model = family_model
    engine = Engine(_cfg(model, tmp_path / "cache", memory_budget=0))
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
        tokens = engine.prepare(_req(msgs)).tokens
        m = len(tokens) - 3
        state = engine.backend.new_state(engine.cfg.max_context)
        prefill_split(engine.backend, state, tokens[:m])
        real = engine.backend.export(state)
        engine._validate(real)  # the honest snapshot fits
        lying = Snapshot(m + 1, real.tensors)  # rows of m tokens, claimed to cover m + 1
        with pytest.raises(ValueError):
            engine._validate(lying)
        disk = engine.cache.disk
        assert disk is not None
        key = engine.cache.key("", tokens[: m + 1])
        assert disk.save(key, tokens[: m + 1], lying)
        disk.flush()
        path = disk.path_for(key)
        assert path.is_file()  # the file itself is sound (header, checksums, position <= key)
        assert disk.load(key, tokens[: m + 1], engine._validate) is None
        assert not path.exists()
        assert dict(disk.stats().rejected_by_reason) == {"geometry": 1}
        # and the engine answers a request on that prefix without it
        ev = engine.complete(_req(msgs))
        assert ev.timings.cache_source == "none"
    finally:
        engine.close()


# -- snapshots at boundaries are exact -----------------------------------------------------
def test_boundary_snapshots_split_prefill_and_restore_bit_exactly(
    family_model: tuple[str, Path], tmp_path: Path
) -> None:
    _, model = family_model
    engine = Engine(_cfg(model, tmp_path / "cache", chunk_size=20))
    recorder = ChunkRecorder(engine.backend)
    engine.runner.backend = recorder  # type: ignore[assignment]
    try:
        msgs = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER_TURNS[0]},
            {"role": "assistant", "content": "The mill stood by the river."},
            {"role": "user", "content": USER_TURNS[1]},
        ]
        prompt = engine.prepare(_req(msgs))
        tokens, n = prompt.tokens, len(prompt.tokens)
        points = engine.snapshots.save_points(Policy("full"), "", prompt, 0)
        inner = [b for b in prompt.boundaries if 0 < b < n]
        # ChatML: the whole prompt extends to the next turn, so the history end is not a point
        assert prompt.extends_to_next_turn and points == [inner[0], n]
        assert all(b % 20 for b in points[:-1])  # boundaries fall inside chunks: a split is needed

        ev = engine.complete(_req(msgs))
        assert ev.timings.cache_source == "none"
        # the prefill was split exactly at every snapshot point, chunks no longer than 20
        ends = [e for s, e in recorder.chunks if s < n]
        assert all(0 < e - s <= 20 for s, e in recorder.chunks if s < n)
        assert set(points) <= set(ends) and ends[-1] == n
        engine.flush()
        assert engine.cache.memory is not None and engine.cache.disk is not None

        # an uninterrupted reference run with the same split points, exporting as it goes
        ref_snaps: dict[int, Snapshot] = {}
        ref = engine.backend.new_state(engine.cfg.max_context)
        ref_logits = prefill_split(
            engine.backend,
            ref,
            tokens,
            points,
            lambda pos, snap: ref_snaps.__setitem__(pos, snap.detached()),
            chunk=engine.cfg.chunk_size,
        )
        assert ref_logits is not None
        follow = [int(ref_logits.argmax()), 5, 17, 42, 7]
        ref_decode = [engine.backend.decode(ref, t) for t in follow]

        for b in points:
            key = engine.cache.key("", tokens[:b])
            found = engine.cache.memory.get(key)
            assert found is not None, b
            stored_tokens, in_ram = found
            assert stored_tokens == tokens[:b]
            on_disk = engine.cache.disk.load(key, tokens[:b], engine._validate)
            assert on_disk is not None, b
            for snap in (in_ram, on_disk):
                assert snap.position == b
                # what the engine stored is bit-identical to the reference run's state at b
                assert snap.tensors.keys() == ref_snaps[b].tensors.keys()
                for name, t in snap.tensors.items():
                    assert torch.equal(t, ref_snaps[b].tensors[name]), (b, name)
                # restored and continued, it reproduces the uninterrupted run bit for bit
                state = engine.backend.adopt(snap, engine.cfg.max_context)
                assert state.position == b
                logits = prefill_split(engine.backend, state, tokens[b:], points, chunk=engine.cfg.chunk_size)
                assert logits is not None and torch.equal(logits, ref_logits), b
                for t, want in zip(follow, ref_decode, strict=True):
                    assert torch.equal(engine.backend.decode(state, t), want), b

        # and the split run agrees with a one-shot prefill of the whole prompt
        one = engine.backend.new_state(engine.cfg.max_context)
        one_logits = engine.backend.prefill(one, torch.tensor(tokens))
        assert (one_logits - ref_logits).abs().max().item() <= LOGITS_ATOL
        assert int(one_logits.argmax()) == int(ref_logits.argmax())
    finally:
        engine.close()
