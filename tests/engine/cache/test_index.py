"""The disk cache's index, the same behaviour from both backends (index_protocol.Index):
SQLite (index.py) and Valkey (valkey_index.py, against a real valkey-server). Every test
runs once per backend; two handles on one folder stand for two processes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from keepwarm.engine.cache.index import EVICTING, LIVE, WRITING, CacheIndex, Claim, Row
from keepwarm.engine.cache.index_protocol import Index
from keepwarm.engine.cache.valkey_index import ValkeyIndex
from tests.api.procs import Proc, start_valkey

NS, OTHER = "ns-used-0001", "ns-idle-0002"
HL = 3600.0
NO_FLOOR = -(1 << 62)
Opener = Callable[[str], Index]


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start_valkey(tmp_path_factory.mktemp("valkey"))
    yield proc
    proc.stop()


@pytest.fixture(params=["sqlite", "redis"])
def open_index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Handles on one fresh folder's index: open_index(owner)."""
    opened: list[Index] = []

    def open_one(owner: str) -> Index:
        if request.param == "sqlite":
            idx: Index = CacheIndex(tmp_path, owner=owner)
        else:
            idx = ValkeyIndex(tmp_path, owner=owner, url=request.getfixturevalue("valkey").url)
        opened.append(idx)
        return idx

    yield open_one
    for idx in opened:
        idx.close()


def live(key: str, *, ns: str = NS, tokens: int = 10, nbytes: int = 100, created: float = 1000.0) -> Row:
    return Row(ns, key, tokens, min(tokens, 8), nbytes, created)


def claim(idx: Index, reserve: Row | None, incoming: int, budget: int, **kw: object) -> Claim:
    args: dict[str, object] = dict(
        namespace=NS,
        reserve=reserve,
        incoming=incoming,
        budget=budget,
        floor_deficit=NO_FLOOR,
        protected=frozenset(),
        now=5000.0,
        wall=5000.0,
        half_life=HL,
    )
    args.update(kw)
    return idx.claim(**args)  # type: ignore[arg-type]


def writing(key: str, owner: str, nbytes: int = 100) -> Row:
    return Row(NS, key, 10, 8, nbytes, 4000.0, state=WRITING, owner=owner, since=4000.0)


def test_rows_lengths_and_usage(open_index: Opener) -> None:
    a, b = open_index("a"), open_index("b")
    a.insert([live("key-0001", tokens=10), live("key-0002", tokens=12), live("key-0003", ns=OTHER)])
    a.insert([live("key-0001", tokens=99)])  # a row is there: kept as it was
    assert a.get(NS, "key-0001") == live("key-0001", tokens=10)
    assert a.get(NS, "nope-0000") is None
    assert {r.key for r in b.rows(NS)} == {"key-0001", "key-0002"}
    assert {(r.namespace, r.key) for r in b.rows()} == {
        (NS, "key-0001"),
        (NS, "key-0002"),
        (OTHER, "key-0003"),
    }
    assert b.lengths(NS) == frozenset({10, 12})
    a.insert([live("key-0004", tokens=20)])
    assert b.lengths(NS) == frozenset({10, 12, 20})  # another handle's change is seen
    u = b.usage()
    assert u.by_namespace == {NS: (3, 300), OTHER: (1, 100)} and u.committed_bytes == 400
    row = a.get(NS, "key-0004")
    assert row is not None
    a.remove([dataclasses.replace(row, created=row.created + 1)])  # another publication: kept
    a.remove([dataclasses.replace(row, since=row.since + 1)])
    assert a.get(NS, "key-0004") == row
    a.insert([writing("key-0005", "a")])
    a.remove([writing("key-0005", "a")])  # only LIVE rows are removed
    assert a.get(NS, "key-0005") == writing("key-0005", "a")
    a.release(NS, "key-0005")
    a.remove([row])
    assert a.get(NS, "key-0004") is None and b.lengths(NS) == frozenset({10, 12})
    rows, bad = b.all_rows()
    assert bad == 0 and {r.key for r in rows} == {"key-0001", "key-0002", "key-0003"}


def test_hits_decay_and_adopt(open_index: Opener) -> None:
    idx = open_index("a")
    idx.insert([live("key-0001")])
    assert idx.record_hit(NS, "key-0001", 2000.0, HL)
    assert idx.record_hit(NS, "key-0001", 2000.0 + HL, HL)  # the first hit has halved
    r = idx.get(NS, "key-0001")
    assert r is not None and r.hits == 2 and math.isclose(r.decayed, 1.5) and r.last_used == 2000.0 + HL
    assert not idx.record_hit(NS, "gone-0001", 2000.0, HL)  # no row, nothing to adopt
    assert idx.get(NS, "gone-0001") is None
    assert idx.record_hit(NS, "found-001", 3000.0, HL, adopt=live("found-001", created=3000.0))
    adopted = idx.get(NS, "found-001")
    assert adopted is not None and adopted.hits == 1 and adopted.state == LIVE


def test_a_reservation_counts_against_the_budget_and_is_taken_once(open_index: Opener) -> None:
    a, b = open_index("a"), open_index("b")
    ok = claim(a, writing("new-00001", "a", 300), 300, budget=1000)
    assert ok.status == "ok" and ok.victims == ()
    assert claim(b, writing("new-00001", "b", 300), 300, budget=1000).status == "exists"
    assert a.usage().committed_bytes == 300 and a.usage().by_namespace == {}  # WRITING: committed, not live
    # b needs 800 more: only 700 fit beside a's reservation and nothing LIVE can go
    refused = claim(b, writing("new-00002", "b", 800), 800, budget=1000)
    assert refused.status == "no_room" and refused.need == 100
    assert b.get(NS, "new-00002") is None  # nothing done
    b.release(NS, "new-00001")  # not b's reservation
    b.publish(NS, "new-00001", 999, 4100.0)
    r = a.get(NS, "new-00001")
    assert r is not None and r.state == WRITING and r.owner == "a"
    a.publish(NS, "new-00001", 280, 4100.0)
    r = a.get(NS, "new-00001")
    assert r is not None and (r.state, r.bytes, r.owner) == (LIVE, 280, "")
    assert b.usage().by_namespace == {NS: (1, 280)} and b.usage().committed_bytes == 280
    assert claim(a, writing("new-00003", "a"), 100, budget=1000).status == "ok"
    a.release(NS, "new-00003")
    assert a.get(NS, "new-00003") is None and a.usage().committed_bytes == 280


def test_eviction_order_protection_and_one_evictor_per_file(open_index: Opener) -> None:
    a, b = open_index("a"), open_index("b")
    a.heartbeat(NS, 10_000.0)  # NS is in use (wall 5000 < expiry); OTHER is not
    a.insert(
        [
            live("idle-0002", ns=OTHER, created=900.0),
            live("idle-0001", ns=OTHER, created=800.0),  # oldest of the unused namespace: first
            live("cold-0001", tokens=10),  # score 0.10
            live("warm-0001", tokens=30),  # score 0.30
            live("prot-0001", tokens=5),  # lowest score, but protected
        ]
    )
    a.record_hit(NS, "warm-0001", 4999.0, HL)
    c = claim(a, writing("new-00001", "a"), 100, budget=400, protected=frozenset({"prot-0001"}))
    assert c.status == "ok"
    # committed 500 + 100 - 400: 200 bytes to free: the unused namespace's files, oldest first
    assert [v.key for v in c.victims] == ["idle-0001", "idle-0002"]
    assert {r.key for r in b.rows(states=(EVICTING,))} == {"idle-0001", "idle-0002"}
    assert b.usage().committed_bytes == 400  # EVICTING rows no longer count
    # b frees 100 more: the claimed files are not candidates again, the protected one is skipped
    c2 = claim(b, writing("new-00002", "b"), 100, budget=400, protected=frozenset({"prot-0001"}))
    assert [v.key for v in c2.victims] == ["cold-0001"]
    b.forget_evicted(c.victims)  # a's claims: not b's to forget
    assert {r.key for r in a.rows(states=(EVICTING,))} == {"idle-0001", "idle-0002", "cold-0001"}
    a.forget_evicted(c.victims)
    b.forget_evicted(c2.victims)
    assert a.rows(states=(EVICTING,)) == []
    # without the heartbeat NS's own files are still candidates (the claimer's namespace is in use)
    a.leave()
    c3 = claim(b, None, 0, budget=300)
    assert [v.key for v in c3.victims] == ["prot-0001"]


def test_floor_deficit_frees_bytes_under_the_budget(open_index: Opener) -> None:
    idx = open_index("a")
    idx.insert([live("key-0001", tokens=10), live("key-0002", tokens=20)])
    c = claim(idx, None, 0, budget=10_000, floor_deficit=50)
    assert c.status == "ok" and [v.key for v in c.victims] == ["key-0001"]


def test_claim_keys_and_resolving_a_dead_owners_rows(open_index: Opener) -> None:
    a, b = open_index("a"), open_index("b")
    a.insert([live("key-0001"), live("key-0002")])
    assert claim(a, writing("wrt-00001", "dead"), 100, budget=10_000).status == "ok"
    assert claim(a, writing("wrt-00002", "dead"), 100, budget=10_000).status == "ok"
    claimed = a.claim_keys([(NS, "key-0001"), (NS, "wrt-00001"), (NS, "absent-01")], 5000.0)
    assert [r.key for r in claimed] == ["key-0001"]  # LIVE rows only
    assert b.claim_keys([(NS, "key-0001")], 5000.0) == []  # already a's
    rows, bad = b.all_rows()
    by_key = {r.key: r for r in rows}
    assert bad == 0 and by_key["key-0001"].state == EVICTING and by_key["key-0001"].owner == "a"
    # a reconcile settles them: the published file of a dead writer is LIVE with its real size ...
    b.resolve(by_key["wrt-00001"], exists=True, size=120)
    # ... a reservation without a file and an eviction are gone
    b.resolve(by_key["wrt-00002"], exists=False, size=None)
    b.resolve(by_key["key-0001"], exists=False, size=None)
    stale = Row(NS, "key-0002", 10, 8, 100, 1000.0, state=EVICTING, owner="someone")
    b.resolve(stale, exists=False, size=None)  # the row is not in that state: untouched
    states = {r.key: (r.state, r.bytes) for r in b.all_rows()[0]}
    assert states == {"wrt-00001": (LIVE, 120), "key-0002": (LIVE, 100)}
    assert b.usage().by_namespace == {NS: (2, 220)} and b.usage().committed_bytes == 220
