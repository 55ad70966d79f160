"""The engine: one model, one generation at a time, and the prefix cache.

A request is: find the deepest cached prefix, adopt it, prefill the rest
(stopping at snapshot points to save them), decode, and leave a continued
checkpoint covering prompt + reply for the next turn.
"""

from __future__ import annotations

import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.memory_cache import MemoryCache
from keepwarm.engine.cache.namespace import namespace_id, weights_fingerprint
from keepwarm.engine.cache.policy import Policy
from keepwarm.engine.cache.prefix_cache import Hit, PrefixCache, candidate_lengths, diverged_at
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_file import FORMAT_VERSION, Alloc
from keepwarm.engine.config import EngineConfig
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, RequestError, Timings, TokenEvent
from keepwarm.engine.generation.runner import Runner
from keepwarm.engine.generation.sampling import Sampler
from keepwarm.engine.loading.chat_template import ChatTemplate
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.loading.tokenizer import Tokenizer
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.backend import State
from keepwarm.kernels.ops import ops_for

Event: TypeAlias = TokenEvent | FinishEvent
MAX_AUTO_WINDOW = 256  # `auto:W` compares with at most this many recent prompts


@dataclass
class EngineStats:
    """Counters for /metrics and /v1/cache (the tiers keep their own)."""

    requests: int = 0
    lookups: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=lambda: {"memory": 0, "disk": 0})
    hit_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"memory": 0, "disk": 0})
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_saved_seconds: float = 0.0
    restore_seconds: float = 0.0
    restore_bytes: int = 0
    completion_tokens: int = 0
    snapshots_saved: int = 0


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    boundaries: list[int]  # token positions where each chat message ends


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.device = torch.device(cfg.device)
        self.ckpt = open_checkpoint(cfg.model)
        self.tokenizer = Tokenizer.from_dir(cfg.model)
        self.template = ChatTemplate.from_dir(cfg.model, self.tokenizer)
        self.backend = build_backend(
            self.ckpt, self.device, cfg.torch_dtype, ops_for(self.device, cfg.use_triton)
        )
        self.runner = Runner(self.backend, cfg.chunk_size)
        fingerprint_cache = cfg.cache_dir / "fingerprints.json" if cfg.cache_dir else None
        self.namespace = namespace_id(
            format_version=FORMAT_VERSION,
            family=self.backend.family,
            weights_fingerprint=weights_fingerprint(list(self.ckpt.weight_files), fingerprint_cache),
            tokenizer_hash=self.tokenizer.content_hash,
            chat_template_hash=self.template.template_hash,
            dtype=str(cfg.torch_dtype),
            layout_id=self.backend.geometry.layout_id(),
        )
        memory = MemoryCache(cfg.memory_budget) if cfg.memory_budget > 0 else None
        disk = None
        if cfg.cache_dir is not None:
            disk = DiskCache(
                cfg.cache_dir,
                self.namespace,
                budget_bytes=cfg.disk_budget,
                min_free_bytes=cfg.min_free_disk,
                queue_size=cfg.writer_queue,
                fsync=cfg.fsync,
            )
            disk.start()
        self.cache = PrefixCache(self.namespace, memory, disk, self._validate)
        self.default_policy: Policy = cfg.policy
        self.stats = EngineStats()
        # (salt, prompt tokens) of recent requests for `auto`; int32 arrays: 4 bytes a token
        self.recent_prompts: deque[tuple[str, array[int]]] = deque(maxlen=MAX_AUTO_WINDOW)
        self.lock = threading.Lock()  # one generation at a time
        self.spare: State | None = None  # the last request's state, reused by the next restore
        # optional backend capability: read disk hits straight into a state's buffers
        self.restore_target: Callable[[State], Alloc] | None = getattr(self.backend, "restore_target", None)

    def _validate(self, snap: Snapshot) -> None:
        self.backend.geometry.validate(snap.tensors, snap.position)

    def close(self) -> None:
        if self.cache.disk is not None:
            self.cache.disk.close()

    # -- request preparation ---------------------------------------------------
    def prepare(self, req: GenerateRequest) -> Prompt:
        if req.prompt_tokens is not None:
            tokens, boundaries = list(req.prompt_tokens), []
        elif req.messages:
            try:
                chat = self.template.encode_chat(
                    list(req.messages),
                    add_generation_prompt=True,
                    tools=list(req.tools) if req.tools else None,
                )
            except ValueError as e:
                raise RequestError(
                    f"messages could not be rendered by the model's chat template: {e}", param="messages"
                ) from e
            tokens, boundaries = list(chat.tokens), list(chat.boundaries)
        else:
            raise RequestError(
                "messages must be a non-empty list of {role, content} objects", param="messages"
            )
        if not tokens:
            raise RequestError("the prompt is empty", param="messages")
        limit = self.cfg.max_context - 1
        if len(tokens) > limit:
            raise RequestError(
                f"the prompt has {len(tokens)} tokens; this engine accepts at most {limit} "
                f"(max_context {self.cfg.max_context}): shorten the conversation",
                status=413,
                param="messages",
            )
        return Prompt(tokens, boundaries)

    def save_points(self, policy: Policy, salt: str, prompt: Prompt, restored: int) -> list[int]:
        """Positions during this prefill where a snapshot is taken (deeper than the
        restored state, at least min_tokens)."""
        n = len(prompt.tokens)
        points: set[int] = set()
        inner = [b for b in prompt.boundaries if 0 < b < n]
        if policy.mode == "full":
            points.add(n)  # exact repeat of this prompt
            if inner:
                points.update((inner[0], inner[-1]))  # shared system prompt; history before this turn's reply
        elif policy.mode == "auto":
            recent = [toks for s, toks in list(self.recent_prompts)[-policy.window :] if s == salt]
            lcp = max((diverged_at(prompt.tokens, toks) for toks in recent), default=0)
            floored = [b for b in inner if b <= lcp]
            if floored:
                points.add(floored[-1])
        elif policy.mode == "fixed":
            points.add(min(policy.num_tokens, n))
        return sorted(p for p in points if p > restored and p >= self.cfg.min_tokens)

    # -- the request -------------------------------------------------------------
    def generate(
        self,
        req: GenerateRequest,
        should_stop: Callable[[], bool] = lambda: False,
        prompt: Prompt | None = None,
    ) -> Iterator[Event]:
        with self.lock:
            yield from self._generate(req, should_stop, prompt)

    def _lookup(self, req: GenerateRequest, prompt: Prompt, policy: Policy) -> tuple[Hit | None, int | None]:
        if not policy.enabled:
            return None, None
        self.stats.lookups += 1
        lengths = candidate_lengths(
            len(prompt.tokens),
            prompt.boundaries,
            self.cache.known_lengths(),
            req.session_hint,
            self.cfg.min_tokens,
        )
        alloc = None
        if self.restore_target is not None:
            if self.spare is None:
                self.spare = self.backend.new_state(self.cfg.max_context)
            alloc = self.restore_target(self.spare)
        hit = self.cache.lookup(req.cache_salt, prompt.tokens, lengths, alloc)
        hint = req.session_hint
        diverged = None
        if hint is not None and (hit is None or hit.num_key_tokens < hint.num_tokens):
            last = self.cache.stored_tokens(hint.key)
            if last is not None:
                d = diverged_at(prompt.tokens, last)
                diverged = d if d < min(len(last), len(prompt.tokens)) else None  # a real difference
        return hit, diverged

    def _generate(
        self, req: GenerateRequest, should_stop: Callable[[], bool], prompt: Prompt | None
    ) -> Iterator[Event]:
        t0 = time.perf_counter()
        prompt = prompt or self.prepare(req)
        tokens = prompt.tokens
        policy = req.policy or self.default_policy
        salt = req.cache_salt
        params = req.sampling
        self.stats.requests += 1
        self.stats.prompt_tokens += len(tokens)

        hit, diverged = self._lookup(req, prompt, policy)
        restore_s = 0.0
        state: State | None = None
        if hit is not None:
            t_r = time.perf_counter()
            try:
                state = self.backend.adopt(hit.snapshot, self.cfg.max_context, into=self.spare)
                restore_s = hit.seconds + (time.perf_counter() - t_r)
            except ValueError:
                state = None  # a mismatch the tier did not catch: treat as a miss
        if state is None:
            hit = None
            state = self.backend.new_state(self.cfg.max_context)
        self.spare = None
        restored = state.position

        t_p = time.perf_counter()
        points = self.save_points(policy, salt, prompt, restored) if policy.enabled else []

        def on_snapshot(pos: int, snap: Snapshot) -> None:
            self.cache.save(salt, tokens[:pos], snap)
            self.stats.snapshots_saved += 1

        logits = self.runner.prefill(state, tokens[restored:], points, on_snapshot, should_stop)
        prefill_s = time.perf_counter() - t_p
        if policy.enabled:
            self.recent_prompts.append((salt, array("i", tokens)))
        if logits is None:
            self.spare = state
            yield self._finish("cancelled", "", prompt, 0, hit, restore_s, prefill_s, 0.0, t0, diverged)
            return
        num_prefill = len(tokens) - restored
        self.stats.prefill_tokens += num_prefill
        self.stats.prefill_seconds += prefill_s

        # -- decode ------------------------------------------------------------
        sampler = Sampler(params)
        stream = self.tokenizer.stream_decoder()
        stop_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        )
        max_new = min(params.max_tokens, self.cfg.max_context - len(tokens))
        generated: list[int] = []
        text = ""
        emitted = 0  # characters of `text` already sent
        hold = max((len(s) for s in params.stop), default=1) - 1
        finish = "length"
        t_d = time.perf_counter()
        ttft = None
        while len(generated) < max_new:
            if generated:
                logits = self.runner.decode(state, generated[-1])
            tok = sampler(logits)
            generated.append(tok)
            if ttft is None:
                ttft = time.perf_counter() - t0
            if tok in stop_ids:
                finish = "stop"
                break
            text += stream.push(tok)
            cut = _find_stop(text, params.stop, emitted)
            if cut is not None:
                text = text[:cut]
                finish = "stop"
                if cut > emitted:
                    yield TokenEvent(tok, text[emitted:cut])
                emitted = cut
                break
            safe = len(text) - hold if params.stop else len(text)
            if safe > emitted:
                yield TokenEvent(tok, text[emitted:safe])
                emitted = safe
            else:
                yield TokenEvent(tok, "")
            if should_stop():
                finish = "cancelled"
                break
        if finish == "length":
            text += stream.flush()
        if emitted < len(text):
            yield TokenEvent(generated[-1] if generated else -1, text[emitted:])
        decode_s = time.perf_counter() - t_d
        self.stats.completion_tokens += len(generated)
        covered = tokens + generated
        continued = policy.mode == "full" and generated and finish != "cancelled"
        key = self.cache.key(salt, covered) if continued else None
        yield self._finish(
            finish,
            text,
            prompt,
            len(generated),
            hit,
            restore_s,
            prefill_s,
            decode_s,
            t0,
            diverged,
            ttft,
            key,
            len(covered) if key else 0,
        )

        # Continued checkpoint, after the reply is out: feed the last token so the
        # state covers prompt + reply, keyed by exactly those tokens.
        if continued and len(covered) <= self.cfg.max_context:
            self.runner.decode(state, generated[-1])
            self.cache.save(salt, covered, self.backend.export(state))
            self.stats.snapshots_saved += 1
        if hit is not None:
            self.cache.promote(hit)  # off the TTFT path; the hit's rows of `state` are unchanged
        self.spare = state

    def _finish(
        self,
        reason: str,
        text: str,
        prompt: Prompt,
        num_generated: int,
        hit: Hit | None,
        restore_s: float,
        prefill_s: float,
        decode_s: float,
        t0: float,
        diverged: int | None,
        ttft: float | None = None,
        key: str | None = None,
        key_tokens: int = 0,
    ) -> FinishEvent:
        restored = hit.snapshot.position if hit else 0
        saved_s = 0.0
        if hit is not None:
            tier = hit.source
            self.stats.hits_by_tier[tier] += 1
            self.stats.hit_tokens_by_tier[tier] += restored
            self.stats.restore_seconds += restore_s
            self.stats.restore_bytes += hit.num_bytes
            cold = self.runner.clock.estimate(restored)
            if cold is not None:
                saved_s = max(0.0, cold - restore_s)
                self.stats.prefill_saved_seconds += saved_s
        ttft_s = ttft if ttft is not None else time.perf_counter() - t0
        timings = Timings(
            cache_source=hit.source if hit else "none",
            restored_tokens=restored,
            restore_ms=restore_s * 1000,
            restore_bytes=hit.num_bytes if hit else 0,
            prefill_tokens=len(prompt.tokens) - restored,
            prefill_ms=prefill_s * 1000,
            decode_ms=decode_s * 1000,
            ttft_ms=ttft_s * 1000,
            prefill_saved_ms=saved_s * 1000,
            decode_tokens_per_sec=(num_generated / decode_s) if decode_s > 0 else 0.0,
            diverged_at=diverged,
        )
        return FinishEvent(
            reason, text, len(prompt.tokens), num_generated, restored, timings, key, key_tokens
        )

    # -- conveniences ------------------------------------------------------------
    def complete(self, req: GenerateRequest) -> FinishEvent:
        """Run a request to the end (tests, CLI); returns its finish event."""
        final = None
        for ev in self.generate(req):
            if isinstance(ev, FinishEvent):
                final = ev
        assert final is not None
        return final

    def flush(self) -> None:
        if self.cache.disk is not None:
            self.cache.disk.flush()


def _find_stop(text: str, stops: Sequence[str], emitted: int) -> int | None:
    """Index where the earliest stop string starts in `text`, searching only where
    a new match can be (from just before `emitted`)."""
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, emitted - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
