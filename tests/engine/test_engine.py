"""End-to-end engine behaviour on a tiny demo model: cold == warm over a 5-turn
conversation with RAM hits, disk hits and after a real process restart; exact
hits decode with zero prefill; corrupt files are rejected while answers stay right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from array import array
from dataclasses import replace
from pathlib import Path

import pytest
import redis

from keepwarm.engine.cache.prefix_cache import SessionHint
from keepwarm.engine.config import ConfigError, EngineConfig
from keepwarm.engine.engine import Engine, Prompt
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, RequestError
from keepwarm.engine.generation.sampling import SamplingParams
from tests.api.procs import start_valkey

USER_TURNS = [
    "Tell me about the river and the old mill near the village.",
    "What did the miller do in winter?",
    "And the children, where did they play?",
    "Write one more sentence about the bridge.",
    "Thank you. Summarize everything in a line.",
]
SYSTEM = "You are a patient assistant who answers about a small village. " * 3


def _cfg(model: Path, cache_dir: Path | None, **kw: object) -> EngineConfig:
    base = EngineConfig(
        model=model,
        dtype="float32",
        cache_dir=cache_dir,
        max_context=1024,
        min_tokens=8,
        chunk_size=64,
        num_threads=1,
        fsync=False,
    )
    return replace(base, **kw).validate()  # type: ignore[arg-type]


def _req(
    messages: list[dict[str, str]],
    policy: Policy | None = None,
    hint: SessionHint | None = None,
    salt: str = "",
) -> GenerateRequest:
    return GenerateRequest(
        sampling=SamplingParams(max_tokens=12, temperature=0.0),
        messages=tuple(messages),
        policy=policy,
        session_hint=hint,
        cache_salt=salt,
    )


def run_conversation(engine: Engine, policy: Policy | None = None) -> list[FinishEvent]:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    hint = None
    for turn in USER_TURNS:
        messages.append({"role": "user", "content": turn})
        ev = engine.complete(_req(messages, policy, hint))
        out.append(ev)
        messages.append({"role": "assistant", "content": ev.text})
        if ev.prefix_key:
            hint = SessionHint(ev.prefix_key, ev.prefix_tokens)
    engine.flush()
    return out


@pytest.fixture(scope="module")
def cold_replies(tiny_dense_model: Path) -> list[str]:
    engine = Engine(_cfg(tiny_dense_model, None, memory_budget=0))
    try:
        events = run_conversation(engine, Policy("off"))
    finally:
        engine.close()
    assert all(e.timings.cache_source == "none" and e.cached_tokens == 0 for e in events)
    return [e.text for e in events]


def test_cold_equals_warm_memory_disk_and_after_restart(
    tiny_dense_model: Path, tmp_path: Path, cold_replies: list[str]
) -> None:
    cache = tmp_path / "cache"
    engine = Engine(_cfg(tiny_dense_model, cache))
    try:
        first = run_conversation(engine)
        assert [e.text for e in first] == cold_replies
        assert first[0].timings.cache_source == "none"
        for e in first[1:]:
            assert e.cached_tokens > 0 and e.timings.cache_source == "memory", e.timings
            assert e.timings.restored_tokens == e.cached_tokens
        # the same conversation again: every turn is an exact hit from RAM, zero prefill
        again = run_conversation(engine)
        assert [e.text for e in again] == cold_replies
        assert all(e.timings.prefill_tokens == 0 and e.timings.cache_source == "memory" for e in again)
    finally:
        engine.close()

    # a new engine in this process with the RAM tier off: every turn comes from disk
    disk_engine = Engine(_cfg(tiny_dense_model, cache, memory_budget=0))
    try:
        from_disk = run_conversation(disk_engine)
    finally:
        disk_engine.close()
    assert [e.text for e in from_disk] == cold_replies
    assert all(e.timings.cache_source == "disk" and e.cached_tokens > 0 for e in from_disk)

    # a fresh process on the same folder (a restart)
    code = (
        "import json, sys; from pathlib import Path;"
        "from tests.engine.test_engine import Engine, _cfg, run_conversation;"
        f"e = Engine(_cfg(Path({str(tiny_dense_model)!r}), Path({str(cache)!r})));"
        "ev = run_conversation(e); e.close();"
        "print(json.dumps([[x.text, x.timings.cache_source, x.cached_tokens] for x in ev]))"
    )
    assert_restart_replays(code, cold_replies)


def assert_restart_replays(code: str, cold_replies: list[str]) -> None:
    """Run `code` in a fresh interpreter (a restarted engine process); it prints the
    conversation as JSON [[text, cache_source, cached_tokens], ...] on its last line."""
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    after = json.loads(res.stdout.strip().splitlines()[-1])
    assert [t for t, _, _ in after] == cold_replies
    assert all(src == "disk" and n > 0 for _, src, n in after)


def test_continued_checkpoint_covers_the_reply(tiny_dense_model: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, tmp_path / "c"))
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
        ev = engine.complete(_req(msgs))
        assert ev.prefix_key is not None
        assert ev.prefix_tokens == ev.prompt_tokens + ev.completion_tokens
        msgs += [{"role": "assistant", "content": ev.text}, {"role": "user", "content": USER_TURNS[1]}]
        nxt = engine.complete(_req(msgs, hint=SessionHint(ev.prefix_key, ev.prefix_tokens)))
        # turn 2 restores at least the previous prompt; with a reply that re-tokenizes
        # identically it restores prompt + reply (no one-turn lag)
        assert nxt.cached_tokens >= ev.prompt_tokens
    finally:
        engine.close()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_writer_settings_reach_the_disk_tier(tiny_dense_model: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, tmp_path / "c", writer_nice=7, writer_queue_bytes=12345))
    try:
        disk = engine.cache.disk
        assert disk is not None and (disk.writer_nice, disk.queue_bytes) == (7, 12345)
        engine.complete(_req([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]))
        engine.flush()
        (writer,) = [t for t in threading.enumerate() if t.name.startswith("disk-cache-")]
        stat = Path(f"/proc/self/task/{writer.native_id}/stat").read_text()
        assert int(stat[stat.rindex(")") + 2 :].split()[16]) == max(7, os.getpriority(os.PRIO_PROCESS, 0))
        assert disk.stats().saves >= 1
    finally:
        engine.close()


def test_the_cache_index_setting_reaches_the_disk_tier(tiny_dense_model: Path, tmp_path: Path) -> None:
    """--cache-index redis: the engine's disk tier keeps its index in that Valkey (folder-namespaced)."""
    valkey = start_valkey(tmp_path / "valkey")
    try:
        cfg = _cfg(tiny_dense_model, tmp_path / "c", cache_index="redis", cache_index_url=valkey.url)
        engine = Engine(cfg)
        try:
            disk = engine.cache.disk
            assert disk is not None and (disk.index_kind, disk.index_url) == ("redis", valkey.url)
            engine.complete(
                _req([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}])
            )
            engine.flush()
            assert disk.stats().saves >= 1 and disk.stats().errors_by_kind == {}
            folder = (tmp_path / "c" / "index.id").read_text().strip()
            rows = redis.Redis.from_url(valkey.url).hlen(
                f"keepwarm:cache:{{{folder}}}:rows:{engine.namespace}"
            )
            assert rows == disk.stats().num_entries >= 1
            assert not (tmp_path / "c" / "index.sqlite3").exists()
        finally:
            engine.close()
    finally:
        valkey.stop()


def test_writer_nice_is_refused_off_linux(tiny_dense_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="--writer-nice needs Linux .* leave it 0 on darwin"):
        _cfg(tiny_dense_model, None, writer_nice=5)
    cfg = _cfg(tiny_dense_model, None)
    assert cfg.writer_nice is None and cfg.disk_writer_nice == 0  # auto: 0 off Linux, no error


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_the_writer_runs_at_nice_19_by_default_on_linux(tiny_dense_model: Path, tmp_path: Path) -> None:
    """The disk writer's copies and hashes must not take cores from the model's threads mid-step."""
    engine = Engine(_cfg(tiny_dense_model, tmp_path / "c"))
    try:
        disk = engine.cache.disk
        assert disk is not None and disk.writer_nice == 19
        engine.complete(_req([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]))
        engine.flush()
        (writer,) = [t for t in threading.enumerate() if t.name.startswith("disk-cache-")]
        stat = Path(f"/proc/self/task/{writer.native_id}/stat").read_text()
        assert int(stat[stat.rindex(")") + 2 :].split()[16]) == 19
    finally:
        engine.close()


def test_exact_hit_starts_from_stored_logits(tiny_dense_model: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, tmp_path / "c"))
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
        a = engine.complete(_req(msgs))
        b = engine.complete(_req(msgs))
        assert b.timings.prefill_tokens == 0 and b.cached_tokens == b.prompt_tokens
        assert a.text == b.text
    finally:
        engine.close()


def test_tenant_salt_separates_entries(tiny_dense_model: Path, tmp_path: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, tmp_path / "c"))
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
        engine.complete(_req(msgs, salt="tenant-a"))
        other = engine.complete(_req(msgs, salt="tenant-b"))
        same = engine.complete(_req(msgs, salt="tenant-a"))
        assert other.timings.cache_source == "none"
        assert same.timings.cache_source == "memory"
    finally:
        engine.close()


def test_corrupt_file_is_rejected_and_the_answer_is_still_right(
    tiny_dense_model: Path, tmp_path: Path, cold_replies: list[str]
) -> None:
    cache = tmp_path / "c"
    engine = Engine(_cfg(tiny_dense_model, cache))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
    try:
        engine.complete(_req(msgs))
        engine.flush()
        files = sorted(cache.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
        assert files
    finally:
        engine.close()
    for f in files:  # flip one payload byte in every file
        data = bytearray(f.read_bytes())
        data[-3] ^= 0xFF
        f.write_bytes(bytes(data))
    fresh = Engine(_cfg(tiny_dense_model, cache, memory_budget=0))
    try:
        ev = fresh.complete(_req(msgs))
        assert ev.text == cold_replies[0]
        assert ev.timings.cache_source == "none"
        assert fresh.cache.disk is not None
        assert fresh.cache.disk.stats().rejected_by_reason.get("checksum", 0) >= 1
    finally:
        fresh.close()


def test_too_long_prompt_is_413_naming_the_limit(tiny_dense_model: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, None, max_context=64))
    try:
        with pytest.raises(RequestError, match="at most 63") as e:
            engine.complete(_req([{"role": "user", "content": "word " * 200}]))
        assert e.value.status == 413
    finally:
        engine.close()


def test_policies_choose_snapshot_points(tiny_dense_model: Path) -> None:
    engine = Engine(_cfg(tiny_dense_model, None))
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
        prompt = engine.prepare(_req(msgs))
        n = len(prompt.tokens)
        inner = [b for b in prompt.boundaries if 0 < b < n]
        # ChatML: the whole prompt is a prefix of the next turn's, so the history end is not saved
        assert prompt.extends_to_next_turn
        assert engine.snapshots.save_points(Policy("full"), "", prompt, 0) == sorted({inner[0], n})
        forks = Prompt(prompt.tokens, prompt.boundaries, extends_to_next_turn=False)
        assert engine.snapshots.save_points(Policy("full"), "", forks, 0) == sorted({inner[0], inner[-1], n})
        assert engine.snapshots.save_points(Policy("fixed", num_tokens=20), "", prompt, 0) == [20]
        assert engine.snapshots.save_points(Policy("fixed", num_tokens=20), "", prompt, 25) == []
        assert engine.snapshots.save_points(Policy("off"), "", prompt, 0) == []
        # auto: the longest common prefix with recent prompts, floored to a turn boundary
        assert engine.snapshots.save_points(Policy("auto", window=5), "", prompt, 0) == []
        engine.snapshots.recent_prompts.append(("", array("i", prompt.tokens[: inner[0]] + [1, 2, 3])))
        assert engine.snapshots.save_points(Policy("auto", window=5), "", prompt, 0) == [inner[0]]
        assert engine.snapshots.save_points(Policy("auto", window=5), "other-tenant", prompt, 0) == []
    finally:
        engine.close()


@pytest.mark.parametrize("memory_budget", [2 * 1024**3, 0])  # hint explained from RAM, then from disk
def test_a_miss_against_the_session_hint_reports_where_it_diverged(
    tiny_dense_model: Path, tmp_path: Path, memory_budget: int
) -> None:
    cache = tmp_path / "c"
    first = Engine(_cfg(tiny_dense_model, cache))
    try:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]}]
        ev = first.complete(_req(msgs))
        first.flush()
    finally:
        first.close()
    assert ev.prefix_key is not None
    covered = first.prepare(_req(msgs)).tokens  # the prompt part of the hinted entry
    engine = Engine(_cfg(tiny_dense_model, cache, memory_budget=memory_budget))
    try:
        if memory_budget:  # put the hinted entry in RAM: replay the same request
            engine.complete(_req(msgs))
        edited = [{"role": "system", "content": SYSTEM.replace("village", "harbour", 1)}, msgs[1]]
        new_tokens = engine.prepare(_req(edited)).tokens
        want = next(i for i, (a, b) in enumerate(zip(covered, new_tokens, strict=False)) if a != b)
        miss = engine.complete(_req(edited, hint=SessionHint(ev.prefix_key, ev.prefix_tokens)))
        assert miss.timings.diverged_at == want
        assert miss.cached_tokens <= want
    finally:
        engine.close()


def test_deterministic_switch_picks_the_kernels(tiny_dense_model: Path) -> None:
    on = Engine(_cfg(tiny_dense_model, None))
    off = Engine(_cfg(tiny_dense_model, None, deterministic=False))
    try:
        assert on.backend.ops.name == "cpu_invariant"
        assert off.backend.ops.name != "cpu_invariant"
    finally:
        on.close()
        off.close()
