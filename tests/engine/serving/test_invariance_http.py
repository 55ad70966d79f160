"""A cached answer is the uncached answer, through the HTTP service in bfloat16, for every
family the engine serves (dense, qwen3_5, deepseek_v4, laguna, gpt_oss) and the real
SmolLM2-135M-Instruct Q4_1 GGUF: 20 multi-turn
conversations with the prefix cache off and full (restores from the turn boundaries and
continued checkpoints) give identical replies, greedy and seeded at temperature 0.8. The 40
conversations of a round run 16 at a time, so off and full replies also come out of batches
of different compositions; `full` must really restore (cached tokens on every later turn).
Replies are compared with their token logprobs, so equal means equal logits. A control with
invariance off finds differences by the same comparison."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from keepwarm.engine.loading.checkpoint import open_checkpoint
from tests.api.procs import Proc, start_engine

WORDS = "river mill bridge winter miller children lantern harvest orchard market bell ferry".split()
SYSTEM = "You are a patient assistant who answers about a small village and its river. " * 2
CONVERSATIONS = 20
TURNS = 3
WORKERS = 16  # conversations in flight: the engine's default --max-seqs, so none waits in its queue
# family -> (the session fixture that writes its tiny checkpoint, the checkpoint's model_type)
FAMILIES = {
    "dense": ("tiny_dense_model", "qwen3"),
    "qwen3_5": ("tiny_hybrid_model", "qwen3_5_text"),
    "deepseek_v4": ("tiny_deepseek_model", "deepseek_v4"),
    "laguna": ("tiny_laguna_model", "laguna"),
    "gpt_oss": ("tiny_gpt_oss_model", "gpt_oss"),
    "smollm2": ("smollm2_model", "llama"),  # the real model, its Q4_1 GGUF
}


# the real model's 30 layers cost ~10x a tiny model's step: fewer conversations, the same checks
REAL_CONVERSATIONS = 8


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, int]]:
    fixture, model_type = FAMILIES[request.param]
    model: Path = request.getfixturevalue(fixture)
    assert open_checkpoint(model).model_type == model_type
    tmp = tmp_path_factory.mktemp(f"invariance-http-{request.param}")
    proc = start_engine(model, tmp / "cache", tmp / "logs", extra=["--dtype", "bfloat16"])
    yield proc, REAL_CONVERSATIONS if request.param == "smollm2" else CONVERSATIONS
    proc.stop()


Turn = tuple[str, str, str, int]  # content, reasoning, logprobs (JSON), cached prompt tokens


def _conversation(engine: Proc, seed: int, scope: str, temperature: float) -> list[Turn]:
    """Each turn's reply, with the log-probabilities of its tokens and 5 runners-up: equal
    logprobs say the logits were equal too, which a tiny random model's often repeated
    greedy text alone would not show."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": SYSTEM}]
    turns = []
    with httpx.Client(timeout=120) as client:
        for turn in range(TURNS):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 9))) + "?"
            messages.append({"role": "user", "content": question})
            body = {
                "messages": messages,
                "max_tokens": 8,
                "temperature": temperature,
                "seed": seed * 10 + turn,
                "prefix_cache": {"scope": scope},
                "logprobs": True,
                "top_logprobs": 5,
            }
            r = client.post(engine.url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            reply = r.json()
            message = reply["choices"][0]["message"]
            text = message["content"] or ""
            cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
            logprobs = json.dumps(reply["choices"][0]["logprobs"])
            turns.append((text, message.get("reasoning_content") or "", logprobs, cached))
            messages.append({"role": "assistant", "content": text})
    return turns


def _round(
    engine: Proc, temperature: float, conversations: int = CONVERSATIONS
) -> dict[tuple[int, str], list[Turn]]:
    """`conversations` conversations with the cache off and full, WORKERS at a time."""
    runs = [(seed, scope) for seed in range(conversations) for scope in ("off", "full")]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        done = pool.map(lambda run: _conversation(engine, run[0], run[1], temperature), runs)
        return dict(zip(runs, done, strict=True))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cache_full_answers_equal_cache_off_answers(engine: tuple[Proc, int], temperature: float) -> None:
    proc, conversations = engine
    done = _round(proc, temperature, conversations)
    for seed in range(conversations):
        off, full = done[seed, "off"], done[seed, "full"]
        assert [t[:3] for t in full] == [t[:3] for t in off], seed
        assert all(t[3] == 0 for t in off), seed  # off never restores
        assert all(t[3] > 0 for t in full[1:]), (seed, [t[3] for t in full])  # full restored every later turn
    assert len({t[2] for run in done.values() for t in run}) > conversations  # the logits follow the prompt


def test_control_with_invariance_off_the_same_comparison_finds_a_difference(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    """--deterministic false (torch's GEMMs, whose rows change with the row count): the cached
    replies' logprobs no longer equal the uncached ones, so the comparison above can fail."""
    extra = ["--dtype", "bfloat16", "--deterministic", "false"]
    proc = start_engine(tiny_dense_model, tmp_path / "cache", tmp_path / "logs", extra=extra)
    try:
        done = _round(proc, 0.0)
    finally:
        proc.stop()
    replies = {run: [t[:3] for t in turns] for run, turns in done.items()}
    differ = [seed for seed in range(CONVERSATIONS) if replies[seed, "full"] != replies[seed, "off"]]
    assert differ, "invariance off, yet every cached reply's logprobs equal the uncached ones"
