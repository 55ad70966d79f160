"""Speculative decoding changes nothing but the time (issue 26). For every family's tiny demo
model: replies with speculation on are the replies without it, token for token, at
temperature 0 and seeded 0.8, in float32 and bfloat16; alone, in a mixed batch (prefills, plain decodes, verified
drafts in one step), with rejections forced at every depth by a draft source that proposes
wrong tokens, and through a cache restore from RAM and, in a fresh process, from disk. The
adaptive draft length and the settings' refusals are checked on their own."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from keepwarm.engine.config import ConfigError, EngineConfig
from keepwarm.engine.demo.demo_model import make_demo_model
from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.ngram_draft import NgramDraft
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, RequestError, TokenEvent
from keepwarm.engine.generation.sampling import SamplingParams
from keepwarm.engine.generation.sequence import Status
from keepwarm.engine.generation.speculation import Speculation
from tests.engine.test_engine import _cfg as engine_cfg

FAMILIES = ("dense", "qwen3_5", "deepseek_v4", "laguna", "gpt_oss", "gemma3")
DOC = "The mill by the river grinds wheat. The miller opens the mill at dawn. "
PROMPTS = (
    "Repeat this text exactly: " + DOC * 3,
    "Copy it twice: the bridge, the bridge, the bridge over the river.",
    "Say something about winter in the village.",
)
TEMPS = (0.0, 0.8)


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec") / str(request.param)
    make_demo_model(path, family=str(request.param), seed=5, size="tiny")
    return path


def _cfg(model: Path, cache_dir: Path | None = None, **kw: object) -> EngineConfig:
    """test_engine's engine (float32, one thread), with prompt lookup on down to 1-grams (the
    random-weight model repeats short n-grams: more drafts, more rejections)."""
    cfg = {"max_context": 512, "chunk_size": 32, "speculate": "ngram", "speculate_ngram": "3:1", **kw}
    return engine_cfg(model, cache_dir, **cfg)


def _req(
    prompt: str, temp: float, seed: int, speculate: bool | None = None, max_tokens: int = 40
) -> GenerateRequest:
    return GenerateRequest(
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temp, seed=seed),
        messages=({"role": "user", "content": prompt},),
        speculate=speculate,
    )


def _reply(engine: Engine, req: GenerateRequest) -> tuple[list[int], str]:
    toks, text = [], None
    for ev in engine.generate(req):
        if isinstance(ev, TokenEvent):
            toks.append(ev.token_id)
        elif isinstance(ev, FinishEvent):
            text = ev.text
    assert text is not None
    return toks, text


class WrongDrafts:
    """Drafts from the replies plain decoding gave (so most drafted tokens are accepted), with
    one token made wrong in every other draft, at a place that moves (so rejections happen at
    every depth, first token included)."""

    def __init__(self, texts: Sequence[list[int]], vocab: int) -> None:
        self.texts, self.vocab = texts, vocab
        self.tokens: list[int] = []
        self.calls = 0

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def propose(self, limit: int | None = None) -> list[int]:
        n = len(self.tokens)
        ref = next((t for t in self.texts if t[:n] == self.tokens), None)
        if ref is None:
            return []
        draft = ref[n : n + (limit or 4)]
        self.calls += 1
        if draft and self.calls % 2:
            i = (self.calls // 2) % len(draft)
            draft[i] = (draft[i] + 1) % self.vocab
        return draft


def _plain(model: Path, dtype: str = "float32") -> dict[tuple[int, float], tuple[list[int], str]]:
    """Every prompt at every temperature, decoded plainly, one at a time."""
    engine = Engine(_cfg(model, speculate="off", dtype=dtype))
    try:
        return {(i, t): _reply(engine, _req(p, t, seed=31 + i)) for i, p in enumerate(PROMPTS) for t in TEMPS}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def plain(model: Path) -> dict[tuple[int, float], tuple[list[int], str]]:
    return _plain(model)


def _wrong_drafts(engine: Engine, plain: dict[tuple[int, float], tuple[list[int], str]], temp: float) -> None:
    texts = [
        engine.prepare(_req(PROMPTS[i], t, 0)).tokens + toks
        for (i, t), (toks, _) in plain.items()
        if t == temp
    ]
    engine.new_draft_source = lambda: WrongDrafts(texts, engine.backend.vocab_size)


def test_bfloat16_replies_equal_plain_decoding_with_rejections_forced(model: Path) -> None:
    plain = _plain(model, "bfloat16")
    engine = Engine(_cfg(model, dtype="bfloat16"))
    try:
        for temp in TEMPS:
            _wrong_drafts(engine, plain, temp)
            for i, p in enumerate(PROMPTS):
                assert _reply(engine, _req(p, temp, seed=31 + i)) == plain[(i, temp)]
        assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
    finally:
        engine.close()


@pytest.mark.parametrize("temp", TEMPS)
def test_replies_equal_plain_decoding_with_rejections_forced(model: Path, plain: dict, temp: float) -> None:
    engine = Engine(_cfg(model))
    _wrong_drafts(engine, plain, temp)
    try:
        for i, p in enumerate(PROMPTS):
            assert _reply(engine, _req(p, temp, seed=31 + i)) == plain[(i, temp)]
        s = engine.stats
        assert 0 < s.accepted_tokens < s.drafted_tokens  # drafts were verified, kept and rejected
    finally:
        engine.close()


def test_prompt_lookup_drafts_are_accepted_and_change_nothing(model: Path, plain: dict) -> None:
    engine = Engine(_cfg(model))
    try:
        for i, p in enumerate(PROMPTS):
            for t in TEMPS:
                assert _reply(engine, _req(p, t, seed=31 + i)) == plain[(i, t)]
        assert engine.stats.drafted_tokens > 0
    finally:
        engine.close()


def test_a_mixed_batch_gives_each_request_its_plain_reply(model: Path, plain: dict) -> None:
    """Six requests at once: speculating and not, greedy and sampled, a long prompt's prefill
    chunks in the same steps as other sequences' decodes and verified drafts."""
    engine = Engine(_cfg(model))
    _wrong_drafts(engine, plain, 0.0)
    wrong = engine.new_draft_source
    sources = {0.0: wrong}
    _wrong_drafts(engine, plain, 0.8)
    sources[0.8] = engine.new_draft_source
    try:
        jobs = []
        for i, p in enumerate(PROMPTS):
            for t in TEMPS:
                got: list[int] = []
                engine.new_draft_source = sources[t]
                speculate = None if (i + int(t * 10)) % 3 else False
                seq = engine.submit(
                    _req(p, t, seed=31 + i, speculate=speculate),
                    lambda ev, got=got: got.append(ev.token_id) if isinstance(ev, TokenEvent) else None,
                )
                assert (seq.spec is None) is (speculate is False)
                jobs.append(((i, t), got, seq))
        widest = 0
        while any(seq.status is not Status.FINISHED for _, _, seq in jobs):
            plan_size = engine.step()
            widest = max(widest, plan_size)
        assert widest == len(jobs)
        for key, got, _ in jobs:
            assert got == plain[key][0], key
        assert 0 < engine.stats.accepted_tokens < engine.stats.drafted_tokens
    finally:
        engine.close()


CHILD = """
import json, sys
from pathlib import Path
from tests.engine.generation.test_speculation import _cfg, _conversation
from keepwarm.engine.engine import Engine
engine = Engine(_cfg(Path(sys.argv[1]), Path(sys.argv[2]), memory_budget=0))
print(json.dumps(_conversation(engine)))
engine.close()
"""


def _conversation(engine: Engine) -> list[tuple[str, str, int]]:
    """Two turns over the repeated document, greedy then seeded: each turn's text, where its
    prefix came from, how many tokens were restored."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    out = []
    for turn, temp in enumerate(TEMPS):
        req = GenerateRequest(
            sampling=SamplingParams(max_tokens=30, temperature=temp, seed=3), messages=tuple(messages)
        )
        ev = engine.complete(req)
        out.append((ev.text, ev.timings.cache_source, ev.cached_tokens))
        messages += [
            {"role": "assistant", "content": ev.text},
            {"role": "user", "content": PROMPTS[1 + turn]},
        ]
    engine.flush()
    return out


def test_a_restored_prefix_speculates_with_the_same_replies_in_a_fresh_process(
    model: Path, tmp_path: Path
) -> None:
    cold = Engine(_cfg(model, speculate="off", memory_budget=0))
    try:
        want = [text for text, _, _ in _conversation(cold)]
    finally:
        cold.close()
    warm = Engine(_cfg(model, tmp_path / "cache"))
    try:
        got = _conversation(warm)
        assert [t for t, _, _ in got] == want
        assert got[1][1] == "memory" and got[1][2] > 0  # turn 2 restored turn 1's checkpoint from RAM
        assert warm.stats.drafted_tokens > 0
    finally:
        warm.close()
    root = Path(__file__).resolve().parents[3]
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(tmp_path / "cache")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    after = json.loads(res.stdout.strip().splitlines()[-1])
    assert [t for t, _, _ in after] == want
    assert all(src == "disk" and n > 0 for _, src, n in after)


def test_draft_length_adapts_to_what_is_accepted() -> None:
    spec = Speculation(NgramDraft(k=8), k_max=8)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert spec.propose(text, limit=16) == (3, 4)  # k starts at 2
    spec.adapt(2, 2)
    assert spec.k == 4 and spec.propose(text, limit=16) == (3, 4, 5, 6)
    spec.adapt(4, 4)
    assert spec.k == 8 and spec.propose(text, limit=3) == (3, 4, 5)  # the budget or token limit caps it
    spec.adapt(3, 1)
    assert spec.k == 2
    for rest in (1, 3, 7):  # nothing accepted: the source rests 1, 3, 7 steps
        spec.adapt(2, 0)
        assert spec.k == 1
        assert [spec.propose(text, limit=16) for _ in range(rest)] == [()] * rest
        assert spec.propose(text, limit=16) == (3,)
    spec.adapt(1, 1)
    assert (spec.misses, spec.k) == (0, 2)


def test_settings_and_requests_are_refused_with_what_to_change(model: Path) -> None:
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        _cfg(model, speculate="mtp")
    with pytest.raises(ConfigError, match="--speculate 'fast'"):
        _cfg(model, speculate="fast")
    with pytest.raises(ConfigError, match="--speculate-k 17"):
        _cfg(model, speculate_k=17)
    for bad in ("0:1", "2:3", "9", "x"):
        with pytest.raises(ConfigError, match="LONGEST:SHORTEST"):
            _cfg(model, speculate_ngram=bad)
    assert _cfg(model, speculate_ngram="4").ngram_lengths() == (4, 4)
    engine = Engine(_cfg(model, speculate="off"))
    try:
        with pytest.raises(RequestError, match="--speculate ngram") as e:
            engine.submit(_req("hi", 0.0, 1, speculate=True), lambda ev: None)
        assert e.value.param == "speculate"
        assert engine.submit(_req("hi", 0.0, 1, speculate=False), lambda ev: None).spec is None
    finally:
        engine.close()
