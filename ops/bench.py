"""keepwarm benchmarks; each writes one JSON object (and prints it).

  ops/bench engine [--model DIR] [--json PATH]   prefill/decode vs transformers, memory roofline,
                                                 engine start to /health ready (new and warm cache folder)
  ops/bench cache  [--model DIR] [--json PATH]   cold vs warm TTFT (RAM, disk), restore bandwidth
  ops/bench serve  [--model DIR] [--json PATH]   concurrent streams: decode scaling, multi-user chat TTFT,
                                                 agents in tool loops over a long system prompt
  ops/bench peer   [--model GGUF] [--json PATH]  keepwarm vs llama.cpp's llama-server on the same file,
                                                 interleaved rounds, ratios keepwarm / llama.cpp (ops/peer.py)
  ops/bench quality [--model GGUF] [--json PATH] perplexity on a fixed English text (ops/data/gpl-3.0.txt)
                                                 with the weights dequantized and on their blocks

Speed lives here, never in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from keepwarm.engine.loading import packaged_model
from keepwarm.engine.loading.packaged_model import model_id


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def mem_read_gbps(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes of a large fp32 reduction over its time: the machine's memory read bandwidth."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return num_bytes / min(times) / 1e9


def _prompt_tokens(vocab: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab - 10, (n,), generator=g).tolist()


def _engine_speed(
    model: Path,
    dtype: torch.dtype,
    toks: list[int],
    decode_tokens: int,
    chunk: int,
    invariant: bool,
    keep_blocks: bool = False,
    contexts: tuple[int, ...] = (256,),
) -> tuple[float, dict[int, float], int, float | None]:
    """(prefill seconds for `toks`, seconds per decode token after each context length in
    `contexts`, weight bytes, seconds of a step's products alone: `_products_s`) with the invariant CPU kernels on or off (kernels/ops.py) and the
    projections on their quantized blocks or dequantized (`keep_blocks`, a GGUF file)."""
    from keepwarm.engine.loading.checkpoint import open_checkpoint
    from keepwarm.engine.models import build_backend
    from keepwarm.kernels.ops import ops_for

    dev = torch.device("cpu")
    ckpt = open_checkpoint(model, keep_blocks=keep_blocks)
    backend = build_backend(ckpt, dev, dtype, ops_for(dev, invariant=invariant))
    n = len(toks)

    def prefill(state: Any, tokens: list[int]) -> torch.Tensor:
        logits = None
        for i in range(0, len(tokens), chunk):
            logits = backend.prefill(state, torch.tensor(tokens[i : i + chunk]))
        assert logits is not None
        return logits

    prefill(backend.new_state(n + 8), toks[:128])  # warm-up
    pre = []
    for _ in range(2):
        st = backend.new_state(n + 8)
        t0 = time.perf_counter()
        prefill(st, toks)
        pre.append(time.perf_counter() - t0)

    decode: dict[int, float] = {}
    for ctx in contexts:
        context = (toks * (ctx // max(1, n) + 1))[:ctx]
        st = backend.new_state(ctx + decode_tokens + 8)
        tok = int(torch.argmax(prefill(st, context)))
        for _ in range(4):  # warm-up
            tok = int(torch.argmax(backend.decode(st, tok)))
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            tok = int(torch.argmax(backend.decode(st, tok)))
        decode[ctx] = (time.perf_counter() - t0) / decode_tokens
    from keepwarm.engine.models.backend import weight_bytes_by_type

    return min(pre), decode, sum(weight_bytes_by_type(backend).values()), _products_s(backend)


def _products_s(backend: Any, rounds: int = 8) -> float | None:
    """Seconds of a decode step's matrix products alone (each layer's projections on one row,
    in the step's order, then the head; best of `rounds`): the weight reading a step cannot
    avoid. None for a family without dense layers."""
    layers = getattr(backend, "layers", None)
    if not layers or not hasattr(layers[0], "w_qkv"):
        return None
    names = ("w_qkv", "w_o", "w_gate_up", "w_down")
    weights = [w for layer in layers for w in (getattr(layer, n) for n in names) if w is not None]
    weights.append(backend.lm_head)
    xs = {k: torch.randn(1, k, dtype=backend.dtype) for k in {w.shape[-1] for w in weights}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds + 1):
            t0 = time.perf_counter()
            for w in weights:
                backend.ops.project(xs[w.shape[-1]], w)
            best = min(best, time.perf_counter() - t0)
    return best


def bench_engine(
    model: Path,
    dtype: torch.dtype,
    prefill_tokens: int,
    decode_tokens: int,
    chunk: int,
    reference: bool = True,
    contexts: tuple[int, ...] = (256, 2048),
) -> dict[str, Any]:
    """Prefill and decode speed with invariance on (the default) and off, back to back (the
    default --weights for the file); for a GGUF file also both weight modes at 256 and 2,048
    tokens of context; the transformers reference unless `reference` is False."""
    from keepwarm.engine.loading.checkpoint import gguf_in
    from keepwarm.kernels.ops import ops_for

    toks = _prompt_tokens(_vocab_size(model), prefill_tokens)
    prefill_s, decoded, weights_bytes, products_s = _engine_speed(
        model, dtype, toks, decode_tokens, chunk, True
    )
    decode_s = decoded[256]
    off_prefill_s, off_decoded, _, _ = _engine_speed(model, dtype, toks, decode_tokens, chunk, False)
    off_decode_s = off_decoded[256]
    gbps = mem_read_gbps()
    out: dict[str, Any] = {
        "model": model_id(model),
        "model_path": str(model),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "ops": ops_for(torch.device("cpu")).name,
        "prefill_tokens": prefill_tokens,
        "prefill_tok_s": prefill_tokens / prefill_s,
        "decode_tok_s": 1 / decode_s,
        "prefill_tok_s_invariance_off": prefill_tokens / off_prefill_s,
        "decode_tok_s_invariance_off": 1 / off_decode_s,
        # the fraction of throughput invariance costs (negative: it is faster)
        "invariance_cost_prefill": 1 - off_prefill_s / prefill_s,
        "invariance_cost_decode": 1 - off_decode_s / decode_s,
        "weights_bytes": weights_bytes,
        "mem_read_gbps": gbps,
        "decode_roofline_fraction": (weights_bytes / decode_s / 1e9) / gbps,
        # the share of a decode step (at 256 tokens) outside its matrix products run alone
        "decode_outside_products_share": None if products_s is None else 1 - products_s / decode_s,
        "load_average": os.getloadavg(),
    }
    if gguf_in(Path(model)) is not None:
        # A GGUF file: its projections on their quantized blocks (--weights as-file) and
        # dequantized to `dtype` (--weights bf16), the same measurements side by side.
        for keep, suffix in ((True, "_as_file"), (False, "_bf16")):
            pre_s, dec, wb, prod_s = _engine_speed(
                model, dtype, toks, decode_tokens, chunk, True, keep, contexts
            )
            out[f"prefill_tok_s{suffix}"] = prefill_tokens / pre_s
            out[f"decode_outside_products_share{suffix}"] = (
                None if prod_s is None else 1 - prod_s / dec[contexts[0]]
            )
            for ctx, s in dec.items():
                out[f"decode_tok_s_{ctx}{suffix}"] = 1 / s
            out[f"weights_bytes{suffix}"] = wb
            out[f"decode_roofline_fraction{suffix}"] = (wb / dec[contexts[0]] / 1e9) / gbps
        first = contexts[0]
        out["weights_ratio_as_file"] = out["weights_bytes_as_file"] / out["weights_bytes_bf16"]
        out["decode_speedup_as_file"] = (
            out[f"decode_tok_s_{first}_as_file"] / out[f"decode_tok_s_{first}_bf16"]
        )
    if reference:
        ref_prefill_s, ref_decode_s = _bench_transformers(model, dtype, toks, decode_tokens)
        out.update(
            ref_prefill_tok_s=prefill_tokens / ref_prefill_s,
            prefill_ratio=ref_prefill_s / prefill_s,
            ref_decode_tok_s=1 / ref_decode_s,
            decode_ratio=ref_decode_s / decode_s,
        )
    return out


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _health(url: str) -> dict[str, Any] | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            doc: dict[str, Any] = json.loads(r.read())
            return doc if r.status == 200 else None
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _start_engine(
    model: Path, dtype: str, threads: int, cache_dir: Path, log: Path, timeout: float = 600
) -> tuple[Any, str, float, dict[str, Any]]:
    """`python -m keepwarm.engine serve` on `cache_dir`: (the process, its URL, seconds from
    spawning it to /health answering 200, that first answer)."""
    import subprocess

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "keepwarm.engine", "serve", "--model", str(model), "--dtype", dtype,
        "--num-threads", str(threads), "--cache-dir", str(cache_dir), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with open(log, "ab") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    while True:
        health = _health(url)
        if health is not None:
            return proc, url, time.perf_counter() - t0, health
        if proc.poll() is not None or time.perf_counter() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"the engine did not start (see {log}):\n{log.read_text()[-3000:]}")
        time.sleep(0.02)


def _stop(proc: Any) -> None:
    import subprocess

    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def kernels_prebuilt() -> bool | None:
    """Whether this CPU's kernels were built at install (`python -m keepwarm.kernels.build`);
    None where the CPU runs none of the builds."""
    from keepwarm.kernels import build, cpu_linear, prebuilt

    isas = build.isas_for("auto", cpu_linear.cpu_flags())
    if not isas:
        return None
    for k in build.KERNELS:
        name, cflags, _ = k.spec(isas[0])
        key = prebuilt.build_key(name, k.source, cflags, cpu_linear.LDFLAGS)
        if not (prebuilt.build_dir(name, key) / prebuilt.MARKER).is_file():
            return False
    return True


def bench_start(model: Path, dtype: str, threads: int, fit_timeout: float = 1800) -> dict[str, Any]:
    """The engine process from spawn to /health ready: on a new cache folder, then (after that
    engine fitted its prefill cost model in the background and stopped) on the same, warm
    folder; and how long the background warm-up took after ready."""
    with tempfile.TemporaryDirectory(prefix="keepwarm-bench-start-") as tmp:
        cache, log = Path(tmp) / "cache", Path(tmp) / "engine.log"
        proc, url, new_s, first = _start_engine(model, dtype, threads, cache, log)
        try:
            t0 = time.perf_counter()
            while True:
                h = _health(url) or {}
                pc = h.get("prefill_cost") or {}
                if pc.get("calibration") in ("done", "persisted"):
                    break
                if time.perf_counter() - t0 > fit_timeout or proc.poll() is not None:
                    raise RuntimeError(f"the prefill cost model was not fitted (see {log})")
                time.sleep(0.1)
            warmup_s = time.perf_counter() - t0
        finally:
            _stop(proc)
        proc, _, warm_s, again = _start_engine(model, dtype, threads, cache, log)
        _stop(proc)
    return {
        "start_s_new_folder": new_s,
        "start_s_warm": warm_s,
        # after ready on the new folder: the prefill cost model's warm-up, run between requests
        "start_warmup_s": warmup_s,
        "start_calibration_at_ready": (first.get("prefill_cost") or {}).get("calibration"),
        "start_calibration_warm": (again.get("prefill_cost") or {}).get("calibration"),
        "kernels_prebuilt": kernels_prebuilt(),
    }


def _vocab_size(model: Path) -> int:
    from keepwarm.engine.loading.checkpoint import open_checkpoint

    return int(open_checkpoint(model).config["vocab_size"])


def _bench_transformers(
    model: Path, dtype: torch.dtype, toks: list[int], decode_tokens: int
) -> tuple[float, float]:
    import transformers

    if model.suffix == ".gguf":  # transformers dequantizes the same file
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            model.parent, gguf_file=model.name, dtype=dtype
        ).eval()
    else:
        ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    ids = torch.tensor([toks])
    with torch.inference_mode():
        ref(ids[:, :128])
        pre = []
        for _ in range(2):
            t0 = time.perf_counter()
            ref(ids, use_cache=True)
            pre.append(time.perf_counter() - t0)
        out = ref(ids[:, :256], use_cache=True)
        pkv = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(4):
            out = ref(tok, past_key_values=pkv, use_cache=True)
            pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            out = ref(tok, past_key_values=pkv, use_cache=True)
            pkv, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = (time.perf_counter() - t0) / decode_tokens
    return min(pre), decode_s


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_read_gbps(path: Path) -> float:
    _drop_page_cache(path)
    size = path.stat().st_size
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return size / (time.perf_counter() - t0) / 1e9


def _long_messages(engine: Any, target: int) -> list[dict[str, str]]:
    """A system prompt of real text sized so the rendered chat is about `target` tokens."""
    corpus = (Path(__file__).resolve().parent.parent / "services/engine/demo/data/corpus.txt").read_text()
    words = corpus.split()
    lo, hi = 1, min(len(words), 2 * target)
    question = {"role": "user", "content": "Summarize the notes above in one sentence."}
    while lo < hi:  # largest word count whose rendering fits the target
        mid = (lo + hi + 1) // 2
        msgs = [{"role": "system", "content": " ".join(words[:mid])}, question]
        if len(engine.template.encode_chat(msgs).tokens) <= target:
            lo = mid
        else:
            hi = mid - 1
    return [{"role": "system", "content": " ".join(words[:lo])}, question]


def _req(msgs: list[dict[str, str]], max_tokens: int = 16) -> Any:
    from keepwarm.engine.generation.request import GenerateRequest
    from keepwarm.engine.generation.sampling import SamplingParams

    return GenerateRequest(
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), messages=tuple(msgs)
    )


def _has_chat_template(engine: Any) -> bool:
    from keepwarm.engine.loading.chat_template import ChatTemplateError

    try:
        engine.template.encode_chat([{"role": "user", "content": "hello"}])
    except ChatTemplateError:
        return False
    return True


def _raw_req(tokens: list[int], max_tokens: int = 16) -> Any:
    """A raw-prompt request (a base model without a chat template)."""
    from keepwarm.engine.generation.request import GenerateRequest
    from keepwarm.engine.generation.sampling import SamplingParams

    return GenerateRequest(
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), prompt_tokens=tuple(tokens)
    )


def _long_request_maker(engine: Any, target: int) -> Callable[[], Any]:
    """Requests of about `target` prompt tokens of real text: a chat (system prompt + question)
    where the model has a chat template, else the corpus' first `target` tokens as a raw prompt."""
    if _has_chat_template(engine):
        msgs = _long_messages(engine, target)
        return lambda: _req(msgs)
    corpus = (Path(__file__).resolve().parent.parent / "services/engine/demo/data/corpus.txt").read_text()
    tokens = engine.tokenizer.encode(corpus, add_special_tokens=True)[:target]
    return lambda: _raw_req(tokens)


QUALITY_TEXT = Path(__file__).with_name("data") / "gpl-3.0.txt"  # FSF: verbatim copies allowed


def bench_quality(model: Path, dtype: torch.dtype, tokens: int) -> dict[str, Any]:
    """Perplexity of the model on the first `tokens` tokens of QUALITY_TEXT (one forward, every
    position's logits), with the weights dequantized to `dtype` (--weights bf16) and on blocks: a
    GGUF file's own (--weights as-file, keys `_as_file`), a folder's made Q8_0 or Q4_K at load
    (--quantize q8_0 / q4_k, keys `_q8_0`, `_q4_k`); the ratios blocks / dequantized."""
    from keepwarm.engine.loading.checkpoint import gguf_in, open_checkpoint
    from keepwarm.engine.models import build_backend
    from keepwarm.kernels.ops import ops_for

    dev = torch.device("cpu")
    out: dict[str, Any] = {"model": model_id(model), "dtype": str(dtype).removeprefix("torch."),
                           "text": QUALITY_TEXT.name}  # fmt: skip
    is_gguf = gguf_in(Path(model)) is not None
    modes: list[tuple[str, dict[str, Any]]] = [("bf16", {})]
    if is_gguf:
        modes.append(("as_file", {"keep_blocks": True}))
    else:
        modes += [("q8_0", {"quantize": "q8_0"}), ("q4_k", {"quantize": "q4_k"})]
    for name, how in modes:
        ckpt = open_checkpoint(model, **how)  # type: ignore[arg-type]
        ids = ckpt.open_tokenizer().encode(QUALITY_TEXT.read_text())[:tokens]
        backend = build_backend(ckpt, dev, dtype, ops_for(dev))
        t0 = time.perf_counter()
        logits = backend.forward(backend.new_state(len(ids)), torch.tensor(ids), all_logits=True).float()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        out[f"ppl_{name}"] = float(torch.exp(nll))
        out[f"seconds_{name}"] = time.perf_counter() - t0
        out["tokens"] = len(ids)
    for blocks, _ in modes[1:]:
        out[f"ppl_ratio_{blocks}"] = out[f"ppl_{blocks}"] / out["ppl_bf16"]
    out["load_average"] = os.getloadavg()
    return out


def bench_cache(
    model: Path, dtype: str, prompt_tokens: int, threads: int, deterministic: bool = True
) -> dict[str, Any]:
    from keepwarm.engine.config import EngineConfig
    from keepwarm.engine.engine import Engine

    with tempfile.TemporaryDirectory(
        prefix="keepwarm-bench-", dir=os.environ.get("KEEPWARM_BENCH_TMP")
    ) as tmp:
        cfg = EngineConfig(
            model=model,
            dtype=dtype,
            num_threads=threads,
            cache_dir=Path(tmp),
            max_context=prompt_tokens + 64,
            min_tokens=16,
            fsync=True,
            deterministic=deterministic,
        ).validate()
        engine = Engine(cfg)
        try:
            long_req = _long_request_maker(engine, prompt_tokens)
            n = len(engine.prepare(long_req()).tokens)
            engine.calibrate()  # the prefill cost model, as a server fits it in the background
            # warm the kernels on a different prompt so "cold" measures prefill, not first-call overhead
            engine.complete(_raw_req(engine.tokenizer.encode("hello there", add_special_tokens=True), 2))
            cold = engine.complete(long_req())
            engine.flush()
            warm_mem = engine.complete(long_req())
            assert engine.cache.memory is not None and engine.cache.disk is not None
            key = engine.cache.key("", engine.prepare(long_req()).tokens)
            path = engine.cache.disk.path_for(key)
            disk_runs, raw_runs = [], []
            for _ in range(3):  # disk and raw reads alternate, so both see the same disk
                engine.cache.memory.clear()
                _drop_page_cache(path)
                disk_runs.append(engine.complete(long_req()))
                raw_runs.append(_raw_read_gbps(path))
            snapshot_bytes = path.stat().st_size
        finally:
            engine.close()
    warm_disk = sorted(disk_runs, key=lambda e: e.timings.ttft_ms)[len(disk_runs) // 2]
    raw = _median(raw_runs)
    restore_s = warm_disk.timings.restore_ms / 1000
    return {
        "model": model_id(model),
        "model_path": str(model),
        "dtype": dtype,
        "deterministic": deterministic,
        "prompt_tokens": n,
        "cold_ttft_s": cold.timings.ttft_ms / 1000,
        "warm_memory_ttft_s": warm_mem.timings.ttft_ms / 1000,
        "warm_disk_ttft_s": warm_disk.timings.ttft_ms / 1000,
        "warm_sources": [warm_mem.timings.cache_source, *(e.timings.cache_source for e in disk_runs)],
        "snapshot_bytes": snapshot_bytes,
        "restore_gbps": snapshot_bytes / restore_s / 1e9 if restore_s > 0 else None,
        "raw_read_gbps": raw,
        "identical_output": all(e.text == cold.text for e in [warm_mem, *disk_runs]),
        # what the engine reports a disk hit saved (cost model minus restore) against what the
        # cold prefill of the same prompt measured: the dashboard's "prefill saved" after a restart
        "cold_prefill_s": cold.timings.prefill_ms / 1000,
        "disk_prefill_saved_s": warm_disk.timings.prefill_saved_ms / 1000,
        "saved_over_cold_prefill": (
            warm_disk.timings.prefill_saved_ms / cold.timings.prefill_ms if cold.timings.prefill_ms else None
        ),
        "disk_runs": len(disk_runs),
    }


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def _serve_engine(
    model: Path,
    dtype: str,
    threads: int,
    cache_dir: Path | None,
    max_seqs: int,
    deterministic: bool = True,
    max_context: int = 4096,
) -> Any:
    from keepwarm.engine.config import EngineConfig
    from keepwarm.engine.engine import Engine

    cfg = EngineConfig(
        model=model,
        dtype=dtype,
        num_threads=threads,
        cache_dir=cache_dir,
        max_context=max_context,
        min_tokens=16,
        max_seqs=max_seqs,
        queue_size=64,
        fsync=False,
        deterministic=deterministic,
    ).validate()
    return Engine(cfg)


def _decode_tok_s(engine: Any, streams: int, prompt_tokens: int, reply_tokens: int) -> float:
    """Aggregate decode tokens/s of `streams` sequences decoding together: from the step
    where every stream has its first token to the end."""
    from keepwarm.engine.generation.cache_policy import parse_policy
    from keepwarm.engine.generation.request import GenerateRequest
    from keepwarm.engine.generation.sampling import SamplingParams
    from keepwarm.engine.generation.sequence import Status

    seqs = []
    for i in range(streams):
        toks = _prompt_tokens(engine.backend.vocab_size, prompt_tokens + i)[i:]
        req = GenerateRequest(
            sampling=SamplingParams(max_tokens=reply_tokens, ignore_eos=True),
            prompt_tokens=tuple(toks),
            policy=parse_policy("off"),
        )
        seqs.append(engine.submit(req, lambda ev: None))
    while any(s.num_generated == 0 for s in seqs):
        engine.step()
    start = sum(s.num_generated for s in seqs)
    t0 = time.perf_counter()
    while any(s.status is not Status.FINISHED for s in seqs):
        engine.step()
    return (sum(s.num_generated for s in seqs) - start) / (time.perf_counter() - t0)


def _chat_ttfts(
    engine: Any, users: int, rounds: int, system: str, policy: str, reply_tokens: int
) -> tuple[list[float], list[float]]:
    """`users` conversations at once over a shared system prompt; each user sends its next
    turn as soon as its reply ends. TTFTs (s) of the first turns, and of every later turn."""
    from keepwarm.engine.generation.cache_policy import parse_policy
    from keepwarm.engine.generation.request import FinishEvent, GenerateRequest
    from keepwarm.engine.generation.sampling import SamplingParams

    questions = [
        "What is the first thing you notice in these notes?",
        "Say more about that, please.",
        "And what happened next?",
        "Sum it up in a sentence.",
        "One more detail?",
    ]
    history = [[{"role": "system", "content": system}] for _ in range(users)]
    finished: list[tuple[int, FinishEvent]] = []
    turn = [0] * users

    def send(u: int) -> None:
        history[u].append({"role": "user", "content": f"(user {u}) {questions[turn[u] % len(questions)]}"})
        req = GenerateRequest(
            sampling=SamplingParams(max_tokens=reply_tokens, ignore_eos=True),
            messages=tuple(history[u]),
            policy=parse_policy(policy),
            cache_salt="bench",
        )
        engine.submit(req, lambda ev: finished.append((u, ev)) if isinstance(ev, FinishEvent) else None)

    for u in range(users):
        send(u)
    first: list[float] = []
    ttfts: list[float] = []
    while engine.has_work():
        engine.step()
        while finished:
            u, ev = finished.pop(0)
            (ttfts if turn[u] > 0 else first).append(ev.timings.ttft_ms / 1000)
            history[u].append({"role": "assistant", "content": ev.text})
            turn[u] += 1
            if turn[u] < rounds:
                send(u)
    return first, ttfts


AGENT_TOOLS = (
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the project's files.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
)  # fmt: skip


def _agent_ttfts(
    engine: Any, agents: int, steps: int, system: str, policy: str, reply_tokens: int, result_words: list[str]
) -> list[list[float]]:
    """`agents` tool loops at once over one long system prompt and the same tools: each step's
    reply is followed by a tool call and its result (about 60 words), then the next step. The
    call appended is a fixed one (a random or small model's own reply would not be a valid
    call); the prompt grows by the call and the result every step, as an agent's does.
    TTFTs (s) per step, per agent."""
    from keepwarm.engine.generation.cache_policy import parse_policy
    from keepwarm.engine.generation.request import FinishEvent, GenerateRequest
    from keepwarm.engine.generation.sampling import SamplingParams

    history: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"(agent {a}) Find the bug."}]
        for a in range(agents)
    ]
    finished: list[tuple[int, FinishEvent]] = []
    ttfts: list[list[float]] = [[] for _ in range(agents)]

    def send(a: int) -> None:
        req = GenerateRequest(
            sampling=SamplingParams(max_tokens=reply_tokens, ignore_eos=True),
            messages=tuple(history[a]),
            tools=AGENT_TOOLS,
            policy=parse_policy(policy),
            cache_salt="bench",
        )
        engine.submit(req, lambda ev: finished.append((a, ev)) if isinstance(ev, FinishEvent) else None)

    for a in range(agents):
        send(a)
    while engine.has_work():
        engine.step()
        while finished:
            a, ev = finished.pop(0)
            k = len(ttfts[a])
            ttfts[a].append(ev.timings.ttft_ms / 1000)
            call = {"id": f"call_{a}_{k}", "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/part_{k}.py"})}}  # fmt: skip
            start = (60 * (a * steps + k)) % max(1, len(result_words) - 60)
            history[a] += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": " ".join(result_words[start : start + 60]),
                },
            ]
            if k + 1 < steps:
                send(a)
    return ttfts


def bench_agents(
    model: Path,
    dtype: str,
    threads: int,
    system_tokens: int,
    agents: int,
    steps: int,
    deterministic: bool = True,
) -> dict[str, Any]:
    """The agent workload: `agents` tool loops of `steps` steps at once, over a system prompt
    of `system_tokens` (cut to what the model's context holds with the loop's growth), cache
    off vs full. TTFT p50 over every step after the first, and of the first steps."""
    from keepwarm.engine.loading.checkpoint import open_checkpoint

    reply = 16
    context = int(open_checkpoint(model).config.get("max_position_embeddings", 8192))
    room = steps * (reply + 400) + 256  # each step adds a call, a result and a reply
    system_tokens = max(256, min(system_tokens, context - room))
    probe = _serve_engine(model, dtype, threads, None, max_seqs=agents, deterministic=deterministic)
    try:
        msgs = _long_messages(probe, system_tokens)
    finally:
        probe.close()
    corpus = (Path(__file__).resolve().parent.parent / "services/engine/demo/data/corpus.txt").read_text()
    words = corpus.split()[-20000:]  # tool results: text other than the system prompt's
    out: dict[str, Any] = {"agents": agents, "agent_steps": steps, "agent_system_tokens": system_tokens}
    for policy in ("full", "off"):
        with tempfile.TemporaryDirectory(prefix="keepwarm-bench-") as tmp:
            engine = _serve_engine(
                model, dtype, threads, Path(tmp), max_seqs=agents, deterministic=deterministic,
                max_context=context,
            )  # fmt: skip
            try:
                ttfts = _agent_ttfts(engine, agents, steps, msgs[0]["content"], policy, reply, words)
                prefilled = engine.stats.prefill_tokens
            finally:
                engine.close()
        later = [t for per in ttfts for t in per[1:]]
        out[f"agent_ttft_p50_{policy}"] = _percentile(later, 0.5)
        out[f"agent_ttft_p90_{policy}"] = _percentile(later, 0.9)
        out[f"agent_first_step_ttft_p50_{policy}"] = _percentile([per[0] for per in ttfts], 0.5)
        out[f"agent_prefill_tokens_{policy}"] = prefilled
    out["agent_ttft_off_over_full_p50"] = out["agent_ttft_p50_off"] / out["agent_ttft_p50_full"]
    return out


def _engine_worker(
    model: str, dtype: str, threads: int, streams: int, reply: int, barrier: Any, out: Any
) -> None:
    """One engine process of the 2-engine figure: waits for its peer, then decodes."""
    torch.set_num_threads(threads)
    engine = _serve_engine(Path(model), dtype, threads, None, max_seqs=streams)
    try:
        _decode_tok_s(engine, 1, 32, 4)  # warm-up
        barrier.wait()
        out.put(_decode_tok_s(engine, streams, 256, reply))
    finally:
        engine.close()


def _two_engines_tok_s(model: Path, dtype: str, streams: int, reply: int) -> float:
    """Aggregate decode tok/s of two engine processes, one thread each, `streams` each,
    decoding at the same time (the 2-engine scale-out figure on a 2-core machine)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_engine_worker, args=(str(model), dtype, 1, streams, reply, barrier, out))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    import queue

    rates: list[float] = []
    while len(rates) < len(procs):
        try:
            rates.append(out.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"an engine process of the 2-engine figure failed (exit {dead})") from None
    for p in procs:
        p.join()
    return float(sum(rates))


def bench_serve(
    model: Path,
    dtype: str,
    threads: int,
    reply_tokens: int,
    system_tokens: int,
    deterministic: bool = True,
    agents: tuple[int, int, int] = (12000, 4, 8),
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model_id(model),
        "model_path": str(model),
        "dtype": dtype,
        "threads": threads,
        "deterministic": deterministic,
    }
    engine = _serve_engine(model, dtype, threads, None, max_seqs=8, deterministic=deterministic)
    try:
        _decode_tok_s(engine, 1, 32, 4)  # warm-up
        for n in (1, 4, 8):
            out[f"decode_tok_s_{n}"] = _decode_tok_s(engine, n, 256, reply_tokens)
        out["decode_scaling_8"] = out["decode_tok_s_8"] / out["decode_tok_s_1"]
        system = _long_messages(engine, system_tokens)[0]["content"]
    finally:
        engine.close()
    for policy in ("full", "off"):
        for users in (1, 8) if policy == "full" else (8,):
            with tempfile.TemporaryDirectory(prefix="keepwarm-bench-") as tmp:
                engine = _serve_engine(
                    model, dtype, threads, Path(tmp), max_seqs=8, deterministic=deterministic
                )
                try:
                    first, ttfts = _chat_ttfts(engine, users, 4, system, policy, 32)
                    prefilled = engine.stats.prefill_tokens
                finally:
                    engine.close()
            suffix = "_1user" if users == 1 else ""
            out[f"ttft_p50_{policy}{suffix}"] = _percentile(ttfts, 0.5)
            if users == 8:
                out[f"ttft_p90_{policy}"] = _percentile(ttfts, 0.9)
                # the first turns arrive together over one uncached system prompt
                out[f"ttft_first_turn_p50_{policy}"] = _percentile(first, 0.5)
                out[f"prefill_tokens_{policy}"] = prefilled
    # scale-out on this machine: 2 engines x 1 thread x 4 streams against 1 engine x 2 threads x 8
    out["two_engines_decode_tok_s_8"] = _two_engines_tok_s(model, dtype, 4, reply_tokens)
    out["two_engines_over_one"] = out["two_engines_decode_tok_s_8"] / out["decode_tok_s_8"]
    out["ttft_off_over_full_p50"] = out["ttft_p50_off"] / out["ttft_p50_full"]
    out["ttft_p90_full_8_over_p50_full_1"] = out["ttft_p90_full"] / out["ttft_p50_full_1user"]
    agent_system, n_agents, steps = agents
    if n_agents > 0:
        out.update(bench_agents(model, dtype, threads, agent_system, n_agents, steps, deterministic))
    out["load_average"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["engine", "cache", "serve", "peer", "quality", "spec"])
    p.add_argument(
        "--model",
        type=packaged_model.resolve,
        default=packaged_model.DEFAULT_MODEL,
        help="a checkpoint folder, a .gguf file or a packaged model's name (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the result here too")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--deterministic",
        choices=["true", "false"],
        default="true",
        help="cache, serve: the invariant kernels on (the default) or off, to measure their cost",
    )
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument(
        "--decode-contexts",
        default="256,2048",
        help="engine, GGUF models: the context lengths decode is timed after, for both --weights modes",
    )
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument(
        "--reply-tokens", type=int, default=128, help="serve: tokens per reply in the decode figures"
    )
    p.add_argument("--system-tokens", type=int, default=1000, help="serve: the shared system prompt")
    p.add_argument(
        "--agent-system-tokens",
        type=int,
        default=12000,
        help="serve: the agents' shared system prompt (cut to the model's context)",
    )
    p.add_argument("--agents", type=int, default=4, help="serve: agents at once (0: no agent workload)")
    p.add_argument("--agent-steps", type=int, default=8, help="serve: tool-loop steps per agent")
    p.add_argument("--no-reference", action="store_true", help="engine: skip the transformers reference")
    p.add_argument("--no-start", action="store_true", help="engine: skip timing the engine's start")
    p.add_argument(
        "--peer-bin",
        type=Path,
        default=None,
        help="peer: the folder holding llama-server (default: built once by ops/build-peer)",
    )
    p.add_argument("--rounds", type=int, default=2, help="peer: interleaved rounds per server")
    p.add_argument(
        "--quant",
        default="",
        help="peer: write --model again as this GGUF type first (q8_0, bf16: llama-quantize) and compare on it",
    )
    p.add_argument(
        "--peer-workload",
        default="",
        help="peer: sizes other than the defaults, e.g. long_tokens=128,users=2 (see ops/peer.py Workload)",
    )
    p.add_argument(
        "--idle-wait", type=float, default=300, help="peer: seconds to wait for a load average under 1"
    )
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from keepwarm.engine.config import DTYPES

    if a.what == "engine":
        contexts = tuple(int(c) for c in a.decode_contexts.split(","))
        result = bench_engine(
            a.model, DTYPES[a.dtype], a.prompt_tokens, a.decode_tokens, a.chunk, not a.no_reference, contexts
        )
        if not a.no_start:
            result.update(bench_start(a.model, a.dtype, a.threads))
    elif a.what == "peer":
        import dataclasses

        import peer

        sizes = dict(kv.split("=", 1) for kv in a.peer_workload.split(",") if kv)
        known = {f.name for f in dataclasses.fields(peer.Workload)}
        if set(sizes) - known:
            p.error(f"--peer-workload: unknown {sorted(set(sizes) - known)}; known: {sorted(known)}")
        work = peer.Workload(**{k: int(v) for k, v in sizes.items()})
        bin_dir = a.peer_bin if a.peer_bin is not None else peer.default_peer_bin()
        model = a.model
        if a.quant:
            model = peer.requantized(a.model, a.quant, bin_dir, bin_dir.parent / "models")
        result = peer.bench_peer(model, a.threads, bin_dir, a.rounds, a.idle_wait, work, a.dtype)
    elif a.what == "spec":
        import spec_bench

        result = spec_bench.bench_spec(a.model, a.dtype, a.threads, a.rounds)
    elif a.what == "quality":
        result = bench_quality(a.model, DTYPES[a.dtype], a.prompt_tokens)
    elif a.what == "cache":
        result = bench_cache(a.model, a.dtype, a.prompt_tokens, a.threads, a.deterministic == "true")
    else:
        result = bench_serve(
            a.model,
            a.dtype,
            a.threads,
            a.reply_tokens,
            a.system_tokens,
            a.deterministic == "true",
            (a.agent_system_tokens, a.agents, a.agent_steps),
        )
    text = json.dumps(result, indent=2)
    print(text)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
