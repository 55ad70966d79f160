"""`ops/bench peer`: keepwarm's engine server and llama.cpp's `llama-server` side by side on the
same GGUF file, same threads, in one run, through the same OpenAI-compatible client.

The peer is built once by `ops/build-peer` (llama.cpp from the llama-cpp-python sdist's
vendored tree) into a cache folder; `--peer-bin DIR` points at another build (or, in the smoke
test, a stand-in that speaks the same API). Rounds are interleaved (keepwarm, llama.cpp,
llama.cpp, keepwarm, ...) and each figure is the median over the rounds, with its spread.

Per round and server, two phases (keepwarm's measured once the prefill cost model it fits
after start on a new cache folder is fitted: `warmup_s`):
  A (one slot): engine start to /health ready; a cold 2,048-token prompt (cache off: TTFT and
    the server's own prefill rate); decode at 256 and 2,048 tokens of context (128 tokens,
    ignore_eos); turn 2 of a conversation over a 1,000-token system prompt (TTFT); the
    follow-up after a restart (keepwarm: its disk cache; llama.cpp: the slot saved to
    `--slot-save-path` before the stop and restored through `/slots/0?action=restore` after
    it, the restore counted in its follow-up time); the restarted server's start.
  B (8 users): 8 conversations x 4 rounds at once over one shared 1,000-token system prompt,
    each user sending its next turn when its reply ends (llama.cpp: `-np 8`,
    `cache_prompt: true`): TTFT p50 / p90 of the later turns; resident memory after.

Every ratio is keepwarm / llama.cpp; `directions` says for each whether higher or lower is
keepwarm ahead, and `targets` whether the issue's target is met.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "services/engine/demo/data/corpus.txt"
QUESTIONS = ("What do these notes describe?", "Say more about that.", "And then?", "Sum it up in a line.")
KEEPWARM, LLAMA = "keepwarm", "llama.cpp"

# key -> (direction, target): "higher" = keepwarm ahead when the ratio is higher
RATIOS: dict[str, tuple[str, float]] = {
    "prefill_ratio": ("higher", 2.0),
    "decode_ratio_256": ("higher", 1.0),
    "decode_ratio_2048": ("higher", 1.0),
    "turn2_ttft_ratio": ("lower", 0.5),
    "restart_ttft_ratio": ("lower", 0.5),
    "chat8_p50_ratio": ("lower", 1.0),
    "chat8_p90_ratio": ("lower", 1.0),
    "start_ratio": ("lower", 2.0),
    "rss_ratio": ("lower", 1.0),
}


@dataclass
class Server:
    kind: str
    argv: list[str]
    url: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    start_s: float = 0.0

    def start(self, timeout: float = 900) -> None:
        with open(self.log, "ab") as out:
            t0 = time.perf_counter()
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.start_s = time.perf_counter() - t0
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.perf_counter() - t0 > timeout:
                self.stop()
                raise RuntimeError(
                    f"{self.kind} did not start (see {self.log}):\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(0.02)

    def settled(self, timeout: float = 1800) -> float:
        """keepwarm on a new cache folder fits its prefill cost model between requests after
        it is ready; the figures are taken once that is done (steady state, as llama.cpp's are).
        Seconds waited; 0 for llama.cpp."""
        if self.kind != KEEPWARM:
            return 0.0
        t0 = time.perf_counter()
        while (httpx.get(self.url + "/health", timeout=30).json().get("prefill_cost") or {}).get(
            "calibration"
        ) not in ("done", "persisted"):
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"keepwarm's prefill cost model was not fitted in {timeout} s")
            time.sleep(0.2)
        return time.perf_counter() - t0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # keepwarm flushes its disk writer on the way out
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def body(self, messages: list[dict[str, str]], max_tokens: int, cache: bool) -> dict[str, Any]:
        """One streamed chat request; the cache switch in each server's own field."""
        body: dict[str, Any] = {
            "model": "default" if self.kind == KEEPWARM else "peer",
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        if self.kind == KEEPWARM:
            body["prefix_cache"] = {"scope": "full" if cache else "off"}
        else:
            body["cache_prompt"] = cache
        return body


@dataclass
class Reply:
    ttft_s: float
    decode_tok_s: float  # client side: tokens after the first over the time they took
    text: str
    prompt_tokens: int
    server_prefill_tok_s: float | None  # the server's own prefill figure
    cached_tokens: int  # prompt tokens the server did not prefill; -1 when it does not say


def chat(server: Server, messages: list[dict[str, str]], max_tokens: int, cache: bool) -> Reply:
    t0 = time.perf_counter()
    first = last = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=server.body(messages, max_tokens, cache),
                      timeout=1800) as r:  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"{server.kind} answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    text.append(piece)
            usage = chunk.get("usage") or usage
            timings = (
                chunk.get("timings") or (usage.get("timings") if isinstance(usage, dict) else None) or timings
            )
    assert first is not None and last is not None, f"{server.kind} streamed no content"
    n = int(usage.get("completion_tokens") or max_tokens)
    return Reply(
        ttft_s=first - t0,
        decode_tok_s=(n - 1) / (last - first) if last > first else float("nan"),
        text="".join(text),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        server_prefill_tok_s=_server_prefill(timings),
        cached_tokens=_cached(usage, timings),
    )


def _cached(usage: dict[str, Any], timings: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    if isinstance(timings.get("cache_n"), int):  # llama-server's timings
        return int(timings["cache_n"])
    return -1


def _server_prefill(t: dict[str, Any]) -> float | None:
    if t.get("prefill_ms"):  # keepwarm's usage.timings
        return float(t["prefill_tokens"]) / (float(t["prefill_ms"]) / 1000)
    if t.get("prompt_ms"):  # llama-server's timings
        return float(t["prompt_n"]) / (float(t["prompt_ms"]) / 1000)
    return None


def _text_of_tokens(server: Server, tokens: int, offset: int = 0) -> str:
    """Corpus text of about `tokens` tokens in the model's tokenizer (asked of keepwarm's
    /tokenize: both servers read the same GGUF's vocabulary)."""
    words = CORPUS.read_text().split()[offset:]
    n = int(tokens * 0.75)
    for _ in range(6):
        text = " ".join(words[:n])
        got = len(
            httpx.post(server.url + "/tokenize", json={"model": "default", "prompt": text}).json()["tokens"]
        )
        if abs(got - tokens) <= max(8, tokens // 100):
            return text
        n = max(1, int(n * tokens / got))
    return text


@dataclass(frozen=True)
class Workload:
    """The sizes of the figures (the issue's by default; the smoke test shrinks them)."""

    long_tokens: int = 2048  # the cold prompt, and the long decode context
    short_tokens: int = 256  # the short decode context
    system_tokens: int = 1000  # the conversations' system prompt
    decode_tokens: int = 128
    reply_tokens: int = 32
    users: int = 8
    user_rounds: int = 4


@dataclass
class Texts:
    long: str
    short: str
    system: str
    work: Workload


def phase_a(server: Server, texts: Texts, restart: Any) -> dict[str, float]:
    w = texts.work
    out: dict[str, float] = {"start_s": server.start_s, "warmup_s": server.settled()}
    cold = chat(server, [{"role": "user", "content": texts.long + "\n\nSummarize."}], 1, cache=False)
    out["prefill_ttft_s"] = cold.ttft_s
    out["prefill_tok_s"] = cold.server_prefill_tok_s or cold.prompt_tokens / cold.ttft_s
    out["prefill_tok_s_client"] = cold.prompt_tokens / cold.ttft_s if cold.prompt_tokens else float("nan")
    for ctx, text in (("short", texts.short), ("long", texts.long)):
        r = chat(server, [{"role": "user", "content": text + "\n\nContinue."}], w.decode_tokens, cache=False)
        out[f"decode_tok_s_{ctx}"] = r.decode_tok_s
    history = [{"role": "system", "content": texts.system}, {"role": "user", "content": QUESTIONS[0]}]
    one = chat(server, history, w.reply_tokens, cache=True)
    history += [{"role": "assistant", "content": one.text}, {"role": "user", "content": QUESTIONS[1]}]
    two = chat(server, history, w.reply_tokens, cache=True)
    out["turn1_ttft_s"], out["turn2_ttft_s"] = one.ttft_s, two.ttft_s
    out["turn2_cached_tokens"] = two.cached_tokens
    history += [{"role": "assistant", "content": two.text}, {"role": "user", "content": QUESTIONS[2]}]
    restored_s, start_s = restart()
    three = chat(server, history, w.reply_tokens, cache=True)
    out["restart_start_s"] = start_s
    out["restart_restore_s"] = restored_s
    out["restart_ttft_s"] = restored_s + three.ttft_s  # the client waits for both
    out["restart_cached_tokens"] = three.cached_tokens
    return out


def phase_b(server: Server, texts: Texts) -> dict[str, float]:
    w = texts.work
    later: list[float] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        history = [{"role": "system", "content": texts.system}]
        for k in range(w.user_rounds):
            history.append({"role": "user", "content": f"(user {u}) {QUESTIONS[k % len(QUESTIONS)]}"})
            r = chat(server, history, w.reply_tokens, cache=True)
            history.append({"role": "assistant", "content": r.text})
            if k:
                with lock:
                    later.append(r.ttft_s)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(w.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(later) == w.users * (w.user_rounds - 1), "a user's conversation failed"
    later.sort()
    return {
        "chat8_p50_s": later[len(later) // 2],
        "chat8_p90_s": later[min(len(later) - 1, int(0.9 * (len(later) - 1) + 0.5))],
        "rss_bytes": float(server.rss_bytes()),
    }


@dataclass
class Setup:
    model: Path
    threads: int
    peer_bin: Path
    work: Path
    dtype: str = "bfloat16"
    context: int = 4096  # tokens per sequence, both servers


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keepwarm_server(setup: Setup, cache_dir: Path, slots: int, log: Path) -> Server:
    port = _port()
    argv = [sys.executable, "-m", "keepwarm.engine", "serve", "--model", str(setup.model), "--dtype", setup.dtype,
            "--num-threads", str(setup.threads), "--cache-dir", str(cache_dir), "--host", "127.0.0.1",
            "--port", str(port), "--max-seqs", str(slots), "--max-context", str(setup.context)]  # fmt: skip
    return Server(KEEPWARM, argv, f"http://127.0.0.1:{port}", log)


def llama_server(setup: Setup, slots: int, slot_dir: Path, log: Path) -> Server:
    port = _port()
    argv = [str(setup.peer_bin / "llama-server"), "-m", str(setup.model), "-t", str(setup.threads),
            "-tb", str(setup.threads), "-c", str(setup.context * slots), "-np", str(slots), "--host", "127.0.0.1",
            "--port", str(port), "--slot-save-path", str(slot_dir), "-a", "peer", "--no-webui"]  # fmt: skip
    return Server(LLAMA, argv, f"http://127.0.0.1:{port}", log)


def run_round(kind: str, setup: Setup, texts: Texts, r: int) -> dict[str, float]:
    base = setup.work / f"{kind}-{r}"
    base.mkdir(parents=True)
    log = base / "server.log"
    if kind == KEEPWARM:
        cache = base / "cache"
        server = keepwarm_server(setup, cache, 1, log)

        def restart() -> tuple[float, float]:
            server.stop()
            server.start()
            return 0.0, server.start_s

    else:
        slot_dir = base / "slots"
        slot_dir.mkdir()
        server = llama_server(setup, 1, slot_dir, log)

        def restart() -> tuple[float, float]:
            save = httpx.post(
                server.url + "/slots/0?action=save", json={"filename": "conversation.bin"}, timeout=600
            )
            assert save.status_code == 200, save.text
            server.stop()
            server.start()
            t0 = time.perf_counter()
            got = httpx.post(server.url + "/slots/0?action=restore", json={"filename": "conversation.bin"},
                             timeout=600)  # fmt: skip
            assert got.status_code == 200, got.text
            return time.perf_counter() - t0, server.start_s

    server.start()
    try:
        out = phase_a(server, texts, restart)
    finally:
        server.stop()
    users = texts.work.users
    busy = (
        keepwarm_server(setup, base / "cache-users", users, base / "server-users.log")
        if kind == KEEPWARM
        else llama_server(setup, users, base, base / "server-users.log")
    )
    busy.start()
    try:
        busy.settled()
        out.update(phase_b(busy, texts))
    finally:
        busy.stop()
    return out


def _idle(max_load: float, timeout_s: float) -> float:
    """Waits (up to timeout_s) for the 1-minute load average to drop under max_load; returns it."""
    t0 = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - t0 < timeout_s:
        time.sleep(5)
    return os.getloadavg()[0]


def bench_peer(
    model: Path, threads: int, peer_bin: Path, rounds: int = 2, idle_wait_s: float = 300,
    work: Workload = Workload(), dtype: str = "bfloat16",
) -> dict[str, Any]:  # fmt: skip
    """Both servers on `model` (llama-server reads only GGUF files: it names the problem in its
    log, shown when it does not start)."""
    version_file = peer_bin.parent / "peer-version.json"
    out: dict[str, Any] = {
        "model": str(model),
        "threads": threads,
        "dtype": dtype,
        "rounds": rounds,
        "workload": work.__dict__,
        "peer": json.loads(version_file.read_text()) if version_file.is_file() else {"bin": str(peer_bin)},
        "load_average_before": _idle(1.0, idle_wait_s),
    }
    with tempfile.TemporaryDirectory(prefix="keepwarm-peer-") as tmp:
        setup = Setup(model, threads, peer_bin, Path(tmp), dtype)
        # The prompts, sized once in the model's tokens (a keepwarm server's /tokenize).
        probe = keepwarm_server(setup, setup.work / "probe-cache", 1, setup.work / "probe.log")
        probe.start()
        try:
            texts = Texts(long=_text_of_tokens(probe, work.long_tokens),
                          short=_text_of_tokens(probe, work.short_tokens, 5000),
                          system=_text_of_tokens(probe, work.system_tokens, 9000), work=work)  # fmt: skip
        finally:
            probe.stop()
        runs: dict[str, list[dict[str, float]]] = {KEEPWARM: [], LLAMA: []}
        for r in range(rounds):  # interleaved: each server goes first in every other round
            for kind in (KEEPWARM, LLAMA) if r % 2 == 0 else (LLAMA, KEEPWARM):
                runs[kind].append(run_round(kind, setup, texts, r))
    out["load_average_after"] = os.getloadavg()[0]
    figures = sorted(runs[KEEPWARM][0])
    for kind, tag in ((KEEPWARM, "keepwarm"), (LLAMA, "llama")):
        for f in figures:
            values = [run[f] for run in runs[kind]]
            out[f"{tag}_{f}"] = statistics.median(values)
            out[f"{tag}_{f}_spread"] = [min(values), max(values)]

    def ratio(f: str) -> float:
        return float(out[f"keepwarm_{f}"] / out[f"llama_{f}"])

    out.update({
        "prefill_ratio": ratio("prefill_tok_s"),
        "decode_ratio_256": ratio("decode_tok_s_short"),
        "decode_ratio_2048": ratio("decode_tok_s_long"),
        "turn2_ttft_ratio": ratio("turn2_ttft_s"),
        "restart_ttft_ratio": ratio("restart_ttft_s"),
        "chat8_p50_ratio": ratio("chat8_p50_s"),
        "chat8_p90_ratio": ratio("chat8_p90_s"),
        "start_ratio": ratio("restart_start_s"),
        "start_new_ratio": ratio("start_s"),
        "rss_ratio": ratio("rss_bytes"),
    })  # fmt: skip
    out["directions"] = {k: f"{d} is keepwarm ahead" for k, (d, _) in RATIOS.items()}
    out["targets"] = {
        k: {
            "target": f"{'>=' if d == 'higher' else '<='} {t}",
            "met": (out[k] >= t) if d == "higher" else (out[k] <= t),
        }
        for k, (d, t) in RATIOS.items()
    }
    return out


def requantized(model: Path, quant: str, peer_bin: Path, folder: Path) -> Path:
    """`model` written again as `quant` (Q8_0, BF16, ...) by llama.cpp's llama-quantize, once,
    into `folder` (from a Q4 file the weights are the Q4 values, re-encoded: the bench compares
    speed on a file of that type, not quality)."""
    out = folder / f"{model.stem}.{quant.upper()}.gguf"
    if not out.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        done = subprocess.run([str(peer_bin / "llama-quantize"), "--allow-requantize", str(model), str(tmp),
                               quant.upper()], capture_output=True, text=True)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize to {quant} failed:\n{done.stderr[-2000:]}")
        tmp.rename(out)
    return out


def default_peer_bin() -> Path:
    """The folder ops/build-peer prints (building llama.cpp the first time: about 20 minutes)."""
    done = subprocess.run([str(ROOT / "ops" / "build-peer")], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ops/build-peer failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1]) / "bin"


README_BEGIN, README_END = "<!-- peer-table -->", "<!-- /peer-table -->"
_ROWS = (  # ratio key, figure, unit, what
    ("prefill_ratio", "prefill_tok_s", "tok/s", "cold prefill, {long_tokens}-token prompt (server's rate)"),
    ("decode_ratio_256", "decode_tok_s_short", "tok/s", "decode at {short_tokens} tokens of context"),
    ("decode_ratio_2048", "decode_tok_s_long", "tok/s", "decode at {long_tokens} tokens of context"),
    ("turn2_ttft_ratio", "turn2_ttft_s", "s", "turn 2 of a conversation, TTFT"),
    ("restart_ttft_ratio", "restart_ttft_s", "s", "follow-up after a restart (restore + TTFT)"),
    ("chat8_p50_ratio", "chat8_p50_s", "s", "{users} users at once, later turns, TTFT p50"),
    ("chat8_p90_ratio", "chat8_p90_s", "s", "{users} users at once, later turns, TTFT p90"),
    ("start_ratio", "restart_start_s", "s", "start to ready (a restart)"),
    ("rss_ratio", "rss_bytes", "MiB", "resident memory after the {users}-user chat"),
)


def readme_table(r: dict[str, Any], machine: str, date: str) -> str:
    """The README's "versus llama.cpp" table from one `ops/bench peer` result."""
    peer = r.get("peer") or {}
    commit = peer.get("llama_cpp_commit") or peer.get("llama_cpp_build")
    built = f"llama.cpp {commit}" if commit else "its vendored llama.cpp; the sdist records no commit"
    lines = [
        f"{machine}, {date}; `{Path(r['model']).name}`, {r['threads']} threads, keepwarm {r['dtype']} with its default --weights (a GGUF's Q8_0 / Q4 projections on their blocks), "
        f"llama-server from llama-cpp-python {peer.get('llama_cpp_python', '?')} ({built}); "
        f"median of {r['rounds']} interleaved rounds; load average {r['load_average_before']:.2f} before, "
        f"{r['load_average_after']:.2f} after.",
        "",
        "| figure | keepwarm | llama.cpp | keepwarm / llama.cpp | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for key, figure, unit, what in _ROWS:
        kw, peer_value = r[f"keepwarm_{figure}"], r[f"llama_{figure}"]
        scale = 1 / 2**20 if unit == "MiB" else 1
        target = r["targets"][key]
        lines.append(
            f"| {what.format(**r['workload'])} ({unit}) | {kw * scale:.2f} | {peer_value * scale:.2f} | "
            f"{r[key]:.2f} ({r['directions'][key]}) | {target['target']} | {'yes' if target['met'] else 'no'} |"
        )
    return "\n".join(lines)


def render_readme(text: str, table: str) -> str:
    """`text` with the part between the peer-table markers replaced by `table`."""
    start, end = text.index(README_BEGIN) + len(README_BEGIN), text.index(README_END)
    return text[:start] + "\n" + table + "\n" + text[end:]


if __name__ == "__main__":
    # python ops/peer.py RESULT.json README.md "MACHINE" DATE: rewrite README's table from a result
    result_path, readme, machine_name, day = sys.argv[1:5]
    doc = Path(readme)
    doc.write_text(render_readme(doc.read_text(), readme_table(json.loads(Path(result_path).read_text()),
                                                               machine_name, day)))  # fmt: skip
