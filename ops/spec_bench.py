"""ops/bench spec: what speculative decoding (--speculate ngram) buys, measured in one run.

Two workloads, each decoded with speculation off and on, alternated, greedy, the prefix cache
off (every run prefills the same prompt cold, so only decoding differs):
  - quote: "repeat and correct this document", a ~1,000-token excerpt of ops/data/gpl-3.0.txt
    (each paragraph one line) with typos, the chat prompt followed by the document's first
    32 tokens as the start of the assistant's reply (what a client that prefills the reply
    sends); prompt lookup drafts from the document and from the reply so far.
    `quote_overlap` says how much of the reply really quotes the document (the share of its
    tokens inside 8-token runs found in the document): a small model may drift into
    repeating itself instead, which prompt lookup drafts just as well;
  - chat: short questions whose replies repeat nothing of the prompt.
The two modes must give the same text (else this fails: speculation changes nothing but
the time). JSON: `spec_speedup_quote` (decode time off / on for the quote),
`spec_cost_chat` (decode time on / off for chat: 1.0 is free), `acceptance_rate` (accepted /
drafted tokens over the quote), with each run's decode time and token counts."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

DOC_TOKENS = 1000
TYPOS = (("software", "sofware"), ("distribute", "distribte"), ("program", "progam"), ("license", "lisense"))
CHAT = (
    "What is a good name for a small grey cat?",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about coffee.",
    "How do I keep basil alive on a windowsill?",
    "Explain what a prime number is to a ten-year-old.",
    "Suggest a name for a bakery by the sea.",
    "What should I pack for a weekend in the mountains?",
)


def _document(engine: Any) -> str:
    """About DOC_TOKENS tokens of the GPL's text from its section 0 on, each paragraph one line
    (its wrapping and indents dropped), with typos to correct."""
    text = (Path(__file__).parent / "data" / "gpl-3.0.txt").read_text()
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    start = paragraphs.index("0. Definitions.")
    doc = ""
    for para in paragraphs[start:]:
        nxt = doc + para + "\n"
        if len(engine.tokenizer.encode(nxt)) > DOC_TOKENS:
            break
        doc = nxt
    for right, wrong in TYPOS:
        doc = doc.replace(right, wrong, 2)
    return doc


def _engine(model: Path, dtype: str, threads: int, speculate: str) -> Any:
    from keepwarm.engine.config import EngineConfig
    from keepwarm.engine.engine import Engine

    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        num_threads=threads,
        cache_dir=None,
        memory_budget=0,
        max_context=4096,
        fsync=False,
        speculate=speculate,
    ).validate()
    return Engine(cfg)


def _request(engine: Any, prompt: str, max_tokens: int, reply_start: list[int] | None = None) -> Any:
    """A greedy request, the cache off; `reply_start`: tokens the assistant's reply begins with."""
    from keepwarm.engine.generation.cache_policy import parse_policy
    from keepwarm.engine.generation.request import GenerateRequest
    from keepwarm.engine.generation.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    req = GenerateRequest(
        sampling=sampling, messages=({"role": "user", "content": prompt},), policy=parse_policy("off")
    )
    if reply_start is None:
        return req
    tokens = engine.prepare(req).tokens + reply_start
    return GenerateRequest(sampling=sampling, prompt_tokens=tuple(tokens), policy=parse_policy("off"))


def _overlap(doc: list[int], reply: list[int], n: int = 8) -> float:
    """The share of `reply`'s tokens inside runs of n tokens that also occur in `doc`."""
    grams = {tuple(doc[i : i + n]) for i in range(len(doc) - n + 1)}
    covered = [False] * len(reply)
    for i in range(len(reply) - n + 1):
        if tuple(reply[i : i + n]) in grams:
            covered[i : i + n] = [True] * n
    return sum(covered) / len(reply) if reply else 0.0


def _decode(engine: Any, req: Any) -> tuple[str, float, int]:
    """One reply: its text, decode seconds, completion tokens."""
    ev = engine.complete(req)
    return ev.text, ev.timings.decode_ms / 1000, ev.completion_tokens


def bench_spec(
    model: Path, dtype: str, threads: int, rounds: int = 2, reply_tokens: int = 1000
) -> dict[str, Any]:
    engines = {mode: _engine(model, dtype, threads, mode) for mode in ("off", "ngram")}
    try:
        off = engines["off"]
        doc = _document(off)
        doc_tokens = off.tokenizer.encode(doc)
        instruction = (
            "Repeat the following document word for word, correcting its spelling mistakes:\n\n" + doc
        )
        quote = _request(off, instruction, reply_tokens, doc_tokens[:32])
        best: dict[tuple[str, str], float] = {}
        texts: dict[tuple[str, str], list[str]] = {}
        tokens: dict[tuple[str, str], int] = {}
        drafted = accepted = 0
        for _ in range(rounds):
            for mode in ("off", "ngram"):  # alternated: the machine's drift hits both
                e = engines[mode]
                d0, a0 = e.stats.drafted_tokens, e.stats.accepted_tokens
                text, secs, n = _decode(e, quote)
                if mode == "ngram":
                    drafted += e.stats.drafted_tokens - d0
                    accepted += e.stats.accepted_tokens - a0
                key = ("quote", mode)
                best[key] = min(best.get(key, float("inf")), secs)
                texts.setdefault(key, []).append(text)
                tokens[key] = n
                chat_s, chat_n, chat_texts = 0.0, 0, []
                for q in CHAT:
                    text, secs, n = _decode(e, _request(e, q, 128))
                    chat_s, chat_n = chat_s + secs, chat_n + n
                    chat_texts.append(text)
                key = ("chat", mode)
                best[key] = min(best.get(key, float("inf")), chat_s)
                texts.setdefault(key, []).append("\x00".join(chat_texts))
                tokens[key] = chat_n
        for work in ("quote", "chat"):
            if (
                set(texts[(work, "off")]) != set(texts[(work, "ngram")])
                or len(set(texts[(work, "off")])) != 1
            ):
                raise SystemExit(f"ops/bench spec: the {work} replies differ with speculation on and off")
        load = os.getloadavg()[0]
        return {
            "model": str(model),
            "dtype": dtype,
            "threads": threads,
            "rounds": rounds,
            "load_average_1m": round(load, 2),
            "quote_prompt_tokens": len(quote.prompt_tokens),
            "quote_reply_tokens": tokens[("quote", "off")],
            "quote_overlap": round(_overlap(doc_tokens, off.tokenizer.encode(texts[("quote", "off")][0])), 3),
            "quote_decode_s_off": round(best[("quote", "off")], 3),
            "quote_decode_s_ngram": round(best[("quote", "ngram")], 3),
            "chat_reply_tokens": tokens[("chat", "off")],
            "chat_decode_s_off": round(best[("chat", "off")], 3),
            "chat_decode_s_ngram": round(best[("chat", "ngram")], 3),
            "spec_speedup_quote": round(best[("quote", "off")] / best[("quote", "ngram")], 3),
            "spec_cost_chat": round(best[("chat", "ngram")] / best[("chat", "off")], 3),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    finally:
        for e in engines.values():
            e.close()
