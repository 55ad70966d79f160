"""Scale out (issue 17): 3 engines on one cache folder behind 2 gateways sharing one Valkey,
real processes on loopback. 12 multi-turn sessions run concurrently, each turn through the other
gateway than the last; one engine is SIGKILLed while it has sequences running. Every session
continues; the dead engine's sessions restore from the shared disk on their new engine; the only
failures are the streams that were running on the killed engine; the folder holds nothing corrupt,
orphaned or half-written, and its byte budget held while entries were evicted."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis

from keepwarm.engine.cache.index import LIVE, CacheIndex
from keepwarm.engine.cache.snapshot_file import SUFFIX, TMP_SUFFIX, read_snapshot
from tests.api.procs import (
    ENGINE_AUTH,
    ENGINE_TOKEN,
    Proc,
    start_engine,
    start_gateway,
    wait_http,
    wait_snapshot_file,
)

SESSIONS = 12
ROUNDS = 4  # turns per session (plus retries of failed ones)
KILL_ROUND = 2  # the victim is killed while this round's turns run
# Long replies in the kill round (a 160-token reply could end before the kill poll saw it
# running, and under a busy CI machine once a 400-token one did): every turn on the victim is
# still running when the kill comes.
KILL_ROUND_TOKENS = 800
# The run saves ~14 MB of snapshots (tiny model, float32: ~0.5 KiB per token plus 2 KiB of logits,
# several per turn), ~3.6 MB of them by the time the kill round's prompts are in; the dead engine's
# sessions restore right after the kill, and eviction runs from the end of the kill round on.
DISK_BUDGET = 6_000_000
ALPHA = {"Authorization": "Bearer key-alpha"}
TOPICS = ["tides", "glaciers", "comets", "bees", "copper", "lighthouses", "owls", "deserts", "violins",
          "volcanoes", "ferns", "saturn"]  # fmt: skip


@dataclass
class Attempt:
    session: int
    round: int
    gateway: int
    status: int  # HTTP status, or 502 for an error event inside a 200 stream
    cache_source: str | None = None
    cached_tokens: int = 0
    engine: str | None = None  # the session's engine in Redis after a successful turn
    key: str | None = None  # and its last prefix key there
    reply: str = ""
    started: float = 0.0
    ended: float = 0.0


@dataclass
class Session:
    index: int
    stream: bool
    messages: list[dict[str, str]] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    streaming: threading.Event = field(default_factory=threading.Event)  # a reply token arrived

    @property
    def sid(self) -> str:
        return f"scale-{self.index}"


def _post(gateway: Proc, s: Session, max_tokens: int) -> tuple[int, str, dict[str, Any] | None]:
    """(status, reply text, usage) of one turn; an error event inside a stream is a 502."""
    body: dict[str, Any] = {"model": "tiny", "messages": s.messages, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True}  # fmt: skip
    headers = {**ALPHA, "X-Session-Id": s.sid}
    url = gateway.url + "/v1/chat/completions"
    if not s.stream:
        r = httpx.post(url, json=body, headers=headers, timeout=120)
        if r.status_code != 200:
            return r.status_code, "", None
        data = r.json()
        return 200, data["choices"][0]["message"]["content"], data["usage"]
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, "", None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return int(chunk["error"].get("code") or 502), "", None
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                text.append(choice["delta"].get("content") or "")
                s.streaming.set()
    return (200, "".join(text), usage) if usage is not None else (502, "", None)


def _turn(s: Session, rnd: int, gateways: list[Proc], r: redis.Redis, max_tokens: int) -> None:
    """One turn of `s`, retried (through the other gateway) until it succeeds, at most 3 times."""
    s.messages.append({"role": "user", "content": f"Tell me more about {TOPICS[s.index]}, part {rnd}."})
    for retry in range(3):
        g = (s.index + rnd + retry) % 2  # each turn through the other gateway than the last
        a = Attempt(session=s.index, round=rnd, gateway=g, status=0, started=time.monotonic())
        a.status, a.reply, usage = _post(gateways[g], s, max_tokens)
        a.ended = time.monotonic()
        s.attempts.append(a)
        if a.status == 200 and usage is not None:
            a.cache_source = usage["timings"]["cache_source"]
            a.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            a.engine = r.hget(f"keepwarm:session:alpha:{s.sid}", "engine")
            a.key = r.hget(f"keepwarm:session:alpha:{s.sid}", "key")
            s.messages.append({"role": "assistant", "content": a.reply})
            return
    raise AssertionError(f"session {s.index} round {rnd}: 3 attempts failed: {s.attempts[-3:]}")


def _on_disk(cache: Path, key: str) -> bool:
    return bool(list(cache.glob(f"*/{key[:2]}/{key}{SUFFIX}")))


def _wait_writers_idle(engines: list[Proc], timeout: float = 30.0) -> None:
    """Until no engine has a snapshot waiting for its disk writer."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [httpx.get(e.url + "/v1/cache?limit=1", headers=ENGINE_AUTH, timeout=30).json()["stats"]["disk"]
                 for e in engines]  # fmt: skip
        if not any(d["pending"] for d in stats):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def _check_folder(cache: Path) -> tuple[int, int]:
    """(files, bytes): every indexed entry is LIVE, its file exists and loads; every snapshot
    file is indexed; no temp file is left."""
    assert sorted(cache.rglob(f"*{TMP_SUFFIX}")) == []
    index = CacheIndex(cache, owner="scale-out-test")
    try:
        rows, garbage = index.all_rows()
    finally:
        index.close()
    assert garbage == 0 and rows, "the index lists nothing"
    assert collections.Counter(r.state for r in rows) == {LIVE: len(rows)}  # no WRITING / EVICTING left
    files = {p.relative_to(cache) for p in cache.glob(f"*/*/*{SUFFIX}")}
    listed = {Path(r.namespace) / r.key[:2] / f"{r.key}{SUFFIX}" for r in rows}
    assert listed == files  # nothing lost, nothing orphaned
    for row in rows:
        path = cache / row.namespace / row.key[:2] / f"{row.key}{SUFFIX}"
        snapshot, tokens = read_snapshot(path, namespace=row.namespace, key=row.key)  # verifies checksums
        assert (len(tokens), snapshot.position, path.stat().st_size) == (row.tokens, row.position, row.bytes)
    return len(rows), sum(r.bytes for r in rows)


def test_three_engines_two_gateways_one_engine_killed(
    demo_model: Path, tmp_path: Path, logs: Path, valkey: Proc, redis_sync: redis.Redis
) -> None:
    t_start = time.monotonic()
    cache = tmp_path / "cache"
    # --speculate off: the kill must land mid-reply, and the demo model's replies repeat themselves,
    # which prompt lookup would finish in a few steps
    flags = ["--disk-budget", str(DISK_BUDGET), "--min-free-disk", "0", "--writer-queue", "64",
             "--max-context", "1024", "--speculate", "off"]  # fmt: skip
    engines = [start_engine(demo_model, cache, logs, extra=flags, token=ENGINE_TOKEN, wait=False)
               for _ in range(3)]  # fmt: skip
    procs: list[Proc] = list(engines)
    try:
        for e in engines:
            wait_http(e)
        gateways = [start_gateway([e.url for e in engines], valkey.url, logs, engine_token=ENGINE_TOKEN,
                                  extra=["--health-interval", "0.25"], wait=False) for _ in range(2)]  # fmt: skip
        procs += gateways
        for g in gateways:
            wait_http(g)
        t_up = time.monotonic()
        sessions = [Session(i, stream=i % 2 == 1) for i in range(SESSIONS)]
        for s in sessions:
            s.messages.append({"role": "system", "content": f"Topic: {TOPICS[s.index]}. Answer briefly."})
        victim: Proc | None = None
        killed_at = 0.0
        in_flight_at_kill = 0  # the victim's running + waiting sequences just before the kill
        stored: dict[int, bool] = {}  # moved sessions restoring after the kill round: an entry on disk?

        def kill_when_streaming(target: Proc, streams: list[Session]) -> None:
            """SIGKILL as soon as a stream of its sessions has a reply token out and the engine itself
            says it has sequences running."""
            nonlocal killed_at, in_flight_at_kill
            deadline = time.monotonic() + 60
            while not any(s.streaming.is_set() for s in streams):
                assert time.monotonic() < deadline, "no stream of the victim's sessions ever started"
                time.sleep(0.001)
            while not in_flight_at_kill:
                assert time.monotonic() < deadline, "the victim never had a sequence running"
                h = httpx.get(target.url + "/health", headers=ENGINE_AUTH, timeout=10).json()
                in_flight_at_kill = h["running"] + h["waiting"]
            killed_at = time.monotonic()  # the signal goes now; kill() then reaps the process
            target.kill()

        with concurrent.futures.ThreadPoolExecutor(SESSIONS + 1) as pool:
            for rnd in range(ROUNDS):
                killer = None
                if rnd == KILL_ROUND:
                    by_engine = collections.defaultdict(list)
                    for s in sessions:
                        by_engine[s.attempts[-1].engine].append(s)
                    # The engine with the most sessions, among those serving some stream.
                    victim = max((e for e in engines if any(s.stream for s in by_engine[e.url])),
                                 key=lambda e: (len(by_engine[e.url]), e.url))  # fmt: skip
                    # Their last turns' entries are on the shared disk before the crash.
                    for s in by_engine[victim.url]:
                        wait_snapshot_file(cache, redis_sync.hget(f"keepwarm:session:alpha:{s.sid}", "key"))
                    streams = [s for s in by_engine[victim.url] if s.stream]
                    for s in streams:
                        s.streaming.clear()
                    killer = pool.submit(kill_when_streaming, victim, streams)
                max_tokens = KILL_ROUND_TOKENS if rnd == KILL_ROUND else 8
                first = []
                if rnd == KILL_ROUND + 1:
                    # The victim's sessions that it answered in full before the signal have not
                    # restored yet. Their last turn's entry may not have reached the disk (the
                    # writer died with it) and the budget may have evicted the one before: run
                    # them first, one by one on a quiet folder, noting which have an entry there.
                    first = [s for s in sessions if s.attempts[-1].engine == victim.url]
                    for s in first:
                        _wait_writers_idle([e for e in engines if e is not victim])
                        stored[s.index] = any(_on_disk(cache, a.key) for a in s.attempts if a.key)
                        _turn(s, rnd, gateways, redis_sync, max_tokens)
                turns = [pool.submit(_turn, s, rnd, gateways, redis_sync, max_tokens)
                         for s in sessions if s not in first]  # fmt: skip
                for f in turns:
                    f.result()
                if killer is not None:
                    killer.result()
        t_run = time.monotonic()
        assert victim is not None and not victim.alive()

        attempts = [a for s in sessions for a in s.attempts]
        moved = [s for s in sessions if s.attempts[0].engine == victim.url]
        stayed = [s for s in sessions if s not in moved]
        failures = [a for a in attempts if a.status != 200]
        # Every session finished every round; the only failures are streams that were running on
        # the victim when it died (non-streamed requests fail over before any byte reaches the
        # client): its sessions' kill-round turns, in flight across the kill.
        assert in_flight_at_kill >= 1
        assert all(sum(a.status == 200 for a in s.attempts) == ROUNDS for s in sessions)
        in_flight = [a for s in moved for a in s.attempts if a.started < killed_at < a.ended]
        story = [(s.index, s.stream, [(a.round, a.status, a.engine, round(a.started - killed_at, 3),
                  round(a.ended - killed_at, 3)) for a in s.attempts]) for s in moved]  # fmt: skip
        assert len(failures) <= len(in_flight) <= len(moved), (victim.url, story)
        for a in failures:
            assert a.status == 502 and a.round == KILL_ROUND and sessions[a.session] in moved
            assert sessions[a.session].stream and a.started < killed_at < a.ended
        for s in sessions:
            ok = [a for a in s.attempts if a.status == 200]
            assert len({a.engine for a in ok[:KILL_ROUND]}) == 1  # affinity across both gateways
            lost = [a for a in ok if a.round == KILL_ROUND + 1 and stored.get(s.index) is False]
            assert all(a.cached_tokens > 0 for a in ok[1:] if a not in lost), [
                (a.round, a.cache_source, a.engine) for a in ok
            ]
        for s in stayed:
            ok = [a for a in s.attempts if a.status == 200]
            assert {a.engine for a in ok} == {ok[0].engine}  # never moved
            assert [a.cache_source for a in ok[1:]] == ["memory"] * (ROUNDS - 1)
        for s in moved:
            # Nothing sent after the crash was answered by the dead engine (a turn it had answered
            # just before the signal landed may still reach the client after `killed_at`).
            assert not [a for a in s.attempts if a.engine == victim.url and a.started > killed_at]
            after = [
                a for a in s.attempts if a.status == 200 and a.ended > killed_at and a.engine != victim.url
            ]
            # The first turn served after the crash came from another engine, restored from disk
            # wherever the folder held an entry of its prefix.
            assert after, [(a.round, a.status, a.engine) for a in s.attempts]
            if stored.get(s.index, True):
                assert after[0].cache_source == "disk" and after[0].cached_tokens > 0, after[0]
            else:
                assert after[0].cache_source == "none", after[0]
            assert all(a.engine == after[0].engine for a in after)  # and the session stays there
        for g in gateways:
            health = httpx.get(g.url + "/health", timeout=10).json()
            assert {e["url"]: e["healthy"] for e in health["engines"]} == {
                e.url: e is not victim for e in engines
            }
            assert [e["running"] for e in health["engines"] if e["url"] == victim.url] == [None]

        survivors = [e for e in engines if e is not victim]
        evictions = 0
        for e in survivors:
            disk = httpx.get(e.url + "/v1/cache?limit=1", headers=ENGINE_AUTH, timeout=30).json()["stats"][
                "disk"
            ]
            evictions += disk["evictions"]
            assert disk["budget_bytes"] == DISK_BUDGET and disk["num_bytes"] <= DISK_BUDGET
        assert evictions > 0, "the budget never made anyone evict"
        assert sum(not stored.get(s.index, True) for s in moved) < len(moved), "no moved session restored"
        # The crashed engine comes back on the folder (its start settles what it left mid-write),
        # then everything stops cleanly.
        revived = start_engine(demo_model, cache, logs, port=int(victim.url.rsplit(":", 1)[1]), extra=flags,
                               token=ENGINE_TOKEN)  # fmt: skip
        procs.append(revived)
        for p in reversed(procs):
            p.stop()
        files, nbytes = _check_folder(cache)
        assert nbytes <= DISK_BUDGET
        t_end = time.monotonic()
        print(
            f"\nscale-out: up {t_up - t_start:.1f} s, {ROUNDS} rounds x {SESSIONS} sessions "
            f"{t_run - t_up:.1f} s, checks {t_end - t_run:.1f} s; {len(attempts)} requests, "
            f"{len(failures)} failed (streams), of {len(in_flight)} in flight on the victim at the kill "
            f"({in_flight_at_kill} sequences by its /health); "
            f"{len(moved)} sessions moved, restored from disk; {evictions} evictions; "
            f"{files} files, {nbytes} bytes of {DISK_BUDGET}"
        )
    finally:
        for p in reversed(procs):
            p.stop()
