"""A cached answer is the uncached answer, through the HTTP service in bfloat16: 20
multi-turn conversations with the prefix cache off and full (restores from the
turn boundaries and continued checkpoints) give identical replies, greedy and
seeded at temperature 0.8."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.procs import Proc, start_engine

WORDS = "river mill bridge winter miller children lantern harvest orchard market bell ferry".split()
SYSTEM = "You are a patient assistant who answers about a small village and its river. " * 2


@pytest.fixture(scope="module")
def engine(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("invariance-http")
    proc = start_engine(tiny_dense_model, tmp / "cache", tmp / "logs", extra=["--dtype", "bfloat16"])
    yield proc
    proc.stop()


def _conversation(engine: Proc, seed: int, scope: str, temperature: float) -> list[str]:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for turn in range(3):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 9))) + "?"
        messages.append({"role": "user", "content": question})
        body = {
            "messages": messages,
            "max_tokens": 8,
            "temperature": temperature,
            "seed": seed * 10 + turn,
            "prefix_cache": {"scope": scope},
        }
        r = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()
        if scope == "full" and turn > 0:  # the cache really was used
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        text = reply["choices"][0]["message"]["content"] or ""
        replies.append(text)
        messages.append({"role": "assistant", "content": text})
    return replies


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cache_full_answers_equal_cache_off_answers(engine: Proc, temperature: float) -> None:
    for seed in range(20):
        off = _conversation(engine, seed, "off", temperature)
        full = _conversation(engine, seed, "full", temperature)
        assert full == off, seed
