"""The engine: one model, many sequences at once, and the prefix cache.

`step()` is the whole loop body: schedule -> one batched forward -> postprocess.
A request becomes a Sequence; at admission it restores the deepest cached prefix
into its state, then its prefill runs in chunks that stop at save points
(snapshots), then it decodes one token per step, and at the end it leaves a
continued checkpoint covering prompt + reply for the next turn. When the state
memory budget runs out, the newest running sequence is preempted: its snapshot
goes to the RAM tier and it resumes later by adopting it (no recompute).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace as replace_seq
from itertools import count

import torch

from keepwarm.engine.cache.disk_cache import DiskCache
from keepwarm.engine.cache.memory_cache import MemoryCache
from keepwarm.engine.cache.namespace import namespace_id, weights_fingerprint
from keepwarm.engine.cache.prefix_cache import PrefixCache
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.cache.snapshot_file import FORMAT_VERSION
from keepwarm.engine.config import EngineConfig
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.calibration import Calibration
from keepwarm.engine.generation.decode_graph import DecodeGraphs
from keepwarm.engine.generation.engine_stats import EngineStats
from keepwarm.engine.generation.grammar import (
    GrammarError,
    GrammarTokenizer,
    TokenMatcher,
    apply_token_bitmask_,
    matcher_for,
)
from keepwarm.engine.generation.ngram_draft import NgramDraft
from keepwarm.engine.generation.prefill_cost import PrefillCost
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, RequestError, TokenEvent
from keepwarm.engine.generation.runner import Runner, StepOutput
from keepwarm.engine.generation.sampling import LogitsRules, Sampler
from keepwarm.engine.generation.scheduler import Scheduler, SchedulerOutput
from keepwarm.engine.generation.sequence import Decoding, Event, Prompt, Reply, Sequence, Status
from keepwarm.engine.generation.snapshot_pipeline import SnapshotPipeline
from keepwarm.engine.generation.speculation import DraftSource, Speculation
from keepwarm.engine.generation.state_memory import StateMemory
from keepwarm.engine.generation.stopping import StopChecker
from keepwarm.engine.loading.chat_template import ChatTemplate, ChatTemplateError
from keepwarm.engine.loading.checkpoint import Checkpoint, open_checkpoint
from keepwarm.engine.models import build_backend, check_quantize, keeps_blocks
from keepwarm.engine.models.backend import weight_bytes_by_type
from keepwarm.engine.models.placement import Placement
from keepwarm.engine.models.rewind import Rewind
from keepwarm.engine.serving.tool_calls import encode_chat_with_tools, tool_format_for
from keepwarm.kernels.ops import kernels_id

__all__ = ["Engine", "EngineStats", "Event", "Prompt", "QueueFull"]


class QueueFull(Exception):
    """Every waiting slot is taken: not now (HTTP 429)."""


def open_model(cfg: EngineConfig) -> tuple[Checkpoint, Placement]:
    """The checkpoint as `cfg` loads it (a GGUF file's quantized projections in their blocks
    where --weights keeps them: models.keeps_blocks; a Hugging Face folder's made Q8_0 blocks
    with --quantize q8_0) and its placement."""
    ckpt = open_checkpoint(cfg.model)
    placement = Placement.from_config(cfg.layer_split, cfg.device, ckpt.num_layers)
    if cfg.quantize:
        check_quantize(cfg.quantize, ckpt, placement)
        ckpt = open_checkpoint(cfg.model, quantize=cfg.quantize, cache_dir=cfg.cache_dir)
    elif keeps_blocks(cfg.weights, ckpt, placement):
        ckpt = open_checkpoint(cfg.model, keep_blocks=True)  # the header is parsed once
    return ckpt, placement


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.ckpt, self.placement = open_model(cfg)
        self.device = self.placement.first
        self.tokenizer = self.ckpt.open_tokenizer()
        self.template = self._chat_template()
        ops = self.placement.ops(cfg.use_triton, cfg.deterministic)
        self.backend = build_backend(self.ckpt, self.placement, cfg.torch_dtype, ops)
        if self.ckpt.quantized_store is not None:
            self.ckpt.quantized_store.flush()  # --quantize: the next start reads these blocks
        self.weight_bytes_by_type = weight_bytes_by_type(self.backend)  # /metrics
        graphs = DecodeGraphs.for_backend(self.backend, cfg.max_seqs, cfg.max_context, cfg.enforce_eager)
        self.runner = Runner(self.backend, graphs)
        fingerprint_cache = cfg.cache_dir / "fingerprints.json" if cfg.cache_dir else None
        self.namespace = namespace_id(
            format_version=FORMAT_VERSION,
            family=self.backend.family,
            weights_fingerprint=weights_fingerprint(
                list(self.ckpt.weight_files), fingerprint_cache, with_names=self.ckpt.weight_names_matter
            ),
            weights_format=self.ckpt.weights_format,
            tokenizer_hash=self.tokenizer.content_hash,
            chat_template_hash=self.template.template_hash,
            dtype=str(cfg.torch_dtype),
            layout_id=self.backend.geometry.layout_id(),
            kernels=kernels_id(ops),
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
                queue_bytes=cfg.writer_queue_bytes,
                writer_nice=cfg.disk_writer_nice,
                fsync=cfg.fsync,
                index=cfg.cache_index,
                index_url=cfg.cache_index_url or None,
            )
            disk.start()
        self.cache = PrefixCache(self.namespace, memory, disk, self._validate)
        # what prefill costs here (persisted beside the cache): what a restore saved
        self.prefill_cost = (
            PrefillCost.for_namespace(cfg.cache_dir, self.namespace) if cfg.cache_dir else PrefillCost(None)
        )
        # its warm-up when none was persisted: run between requests (`calibrate_step`), never
        # before serving; real prefills are recorded meanwhile
        self.calibration = Calibration(
            self.backend,
            self.prefill_cost,
            cfg.max_context - 1,
            min(cfg.chunk_size, self._max_batch_tokens()),
        )
        self.default_policy: Policy = cfg.policy
        self.stats = EngineStats()
        self.snapshots = SnapshotPipeline(self.cache, self.backend, cfg.min_tokens)
        memory = StateMemory(self.backend, self._kv_budget(), cfg.max_context)
        self.scheduler = Scheduler(
            cfg.max_seqs, self._max_batch_tokens(), cfg.chunk_size, memory, self.snapshots
        )
        self.inbox: queue.SimpleQueue[Sequence] = queue.SimpleQueue()  # from other threads
        self.num_waiting = 0  # submitted, not admitted yet: the bounded queue
        self.waiting_lock = threading.Lock()
        self.lock = threading.Lock()  # one step at a time (loop thread, or a caller's generate())
        self.ids = count()
        self.grammar_tokenizer: GrammarTokenizer | None = None  # built on the first constrained request
        self.tool_format = tool_format_for(self.template.source)  # of requests that send tools
        # speculative decoding's draft source per sequence (--speculate; a test may set its own)
        self.new_draft_source: Callable[[], DraftSource] | None = None
        if cfg.speculate == "ngram":
            longest, shortest = cfg.ngram_lengths()
            self.new_draft_source = lambda: NgramDraft(cfg.speculate_k, longest, shortest)

    @property
    def memory(self) -> StateMemory:
        """The state byte budget (the scheduler's view of memory)."""
        return self.scheduler.memory

    @memory.setter
    def memory(self, memory: StateMemory) -> None:
        self.scheduler.memory = memory

    def _max_batch_tokens(self) -> int:
        if self.cfg.max_batch_tokens > 0:
            return self.cfg.max_batch_tokens
        return max(self.cfg.max_seqs, 128 if self.device.type == "cpu" else 2048)

    def _kv_budget(self) -> int:
        if self.cfg.kv_budget > 0:
            return self.cfg.kv_budget
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.8)
        return 16 * 1024**3

    def _validate(self, snap: Snapshot) -> None:
        self.backend.geometry.validate(snap.tensors, snap.position)

    def _chat_template(self) -> ChatTemplate:
        """--chat-template's file, else the checkpoint's template; a checkpoint without one
        (a base model) still serves raw-prompt completions, and chat is refused naming why."""
        if self.cfg.chat_template is not None:
            return ChatTemplate(self.cfg.chat_template.read_text(encoding="utf-8"), self.tokenizer)
        try:
            return self.ckpt.open_chat_template(self.tokenizer)
        except ChatTemplateError as e:
            return ChatTemplate.refusing(
                f"{e}; this model serves /v1/completions (a raw prompt), or start the engine with "
                "--chat-template FILE",
                self.tokenizer,
            )

    def close(self) -> None:
        """The caller makes sure no step runs now (ModelSet._park holds `self.lock`)."""
        self.calibration.stop()
        self.snapshots.land(wait=True)
        self.prefill_cost.save()
        if self.cache.disk is not None:
            self.cache.disk.close()

    def calibrate_step(self) -> bool:
        """Run one chunk of the prefill cost model's warm-up (between steps: the caller's
        thread, under the step lock); False when none is left."""
        with self.lock:
            before = self.calibration.done
            try:
                return self.calibration.step()
            finally:
                self.stats.calibration_prefills += self.calibration.done - before

    def calibrate(self) -> None:
        """The whole warm-up now (when none was persisted): tests and benchmarks. A server
        runs it in the background (`calibrate_step`)."""
        while self.calibrate_step():
            pass

    # -- request preparation (any thread) -------------------------------------
    def prepare(self, req: GenerateRequest) -> Prompt:
        if req.prompt_tokens is not None:
            tokens, boundaries, extends = list(req.prompt_tokens), [], False
        elif req.messages:
            try:
                chat = encode_chat_with_tools(
                    self.template,
                    list(req.messages),
                    add_generation_prompt=True,
                    tools=list(req.tools) if req.tools else None,
                    template_kwargs=req.chat_template_kwargs,
                )
            except ValueError as e:
                raise RequestError(
                    f"messages could not be rendered by the model's chat template: {e}", param="messages"
                ) from e
            tokens, boundaries = list(chat.tokens), list(chat.boundaries)
            extends = chat.extends_to_next_turn
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
        need = self.memory.bytes_for(self.memory.capacity_for(len(tokens) + 1))
        if need > self.memory.budget_bytes:
            raise RequestError(
                f"the prompt's state needs {need} bytes, more than the engine's whole --kv-budget "
                f"({self.memory.budget_bytes}): shorten the conversation",
                status=413,
                param="messages",
            )
        return Prompt(tokens, boundaries, extends)

    def submit(
        self,
        req: GenerateRequest,
        on_event: Callable[[Event], None],
        should_stop: Callable[[], bool] = lambda: False,
        prompt: Prompt | None = None,
    ) -> Sequence:
        """Queue a request; its events go to `on_event` from the stepping thread.
        Raises QueueFull when `queue_size` sequences are already waiting."""
        prompt = prompt or self.prepare(req)
        params = req.sampling
        stop_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        )
        matcher = self._matcher(req)
        seq = Sequence(
            seq_id=next(self.ids),
            request=req,
            tokens=list(prompt.tokens),
            num_prompt_tokens=len(prompt.tokens),
            boundaries=list(prompt.boundaries),
            prompt_extends_to_next_turn=prompt.extends_to_next_turn,
            policy=req.policy or self.default_policy,
            decoding=Decoding(
                sampler=Sampler(params, _rules(req)),
                stopper=StopChecker(self.tokenizer.stream_decoder(), params.stop, stop_ids),
                max_new_tokens=min(params.max_tokens, self.cfg.max_context - len(prompt.tokens)),
                matcher=matcher,
            ),
            reply=Reply(on_event=on_event, should_stop=should_stop),
            spec=self._speculation(req),
        )
        seq.reply.group.append(seq)
        with self.waiting_lock:
            if self.num_waiting >= self.cfg.queue_size:
                raise QueueFull
            self.num_waiting += 1
        self.inbox.put(seq)
        return seq

    def _speculation(self, req: GenerateRequest) -> Speculation | None:
        """A sequence's speculative decoding: the engine's (--speculate) unless the request
        turns it off; a request that asks for it from an engine without it is a 400."""
        if req.speculate is False:
            return None
        if self.new_draft_source is None:
            if req.speculate:
                raise RequestError(
                    "speculate: true needs an engine started with --speculate ngram; leave speculate out",
                    param="speculate",
                )
            return None
        return Speculation(self.new_draft_source(), self.cfg.speculate_k)

    def _matcher(self, req: GenerateRequest, choice: int = 0) -> TokenMatcher | None:
        """The grammar matcher of a constrained request (compiled per choice); a
        constraint the model's tool-call format cannot express is a 400."""
        if req.constraint is None:
            return None
        if self.grammar_tokenizer is None:
            self.grammar_tokenizer = GrammarTokenizer.from_tokenizer(self.tokenizer, self.backend.vocab_size)
        try:
            return matcher_for(
                req.constraint, self.grammar_tokenizer, self.tool_format, req.parallel_tool_calls
            )
        except GrammarError as e:
            raise RequestError(str(e), param=e.param) from e

    # -- the loop body ------------------------------------------------------------
    def has_work(self) -> bool:
        """Sequences to run, or snapshot copies still to land (a step lands them)."""
        return self.scheduler.has_work() or not self.inbox.empty() or bool(self.snapshots.copies)

    def step(self) -> int:
        """schedule -> run -> postprocess; returns how many sequences took part."""
        with self.lock:
            self._arrivals()
            plan = self.scheduler.schedule()
            self._account(plan)
            out = self.runner.run(plan.scheduled) if plan.scheduled else None
            self.postprocess(plan, out)
            return len(plan.scheduled)

    def _arrivals(self) -> None:
        """Before scheduling: new requests join the line, finished copies land (an admission
        waits for the rest), cancelled sequences end."""
        while not self.inbox.empty():
            self.scheduler.add(self.inbox.get())
        self.snapshots.land(wait=False)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.reply.should_stop():
                self._finish(seq, "cancelled")

    def _account(self, plan: SchedulerOutput) -> None:
        """What scheduling did besides the batch: first admissions leave the bounded queue,
        preemptions are counted, replies memory cannot hold end here."""
        for seq in plan.admitted:
            seq.queued = False
            self._count_waiting(-1)
            self.stats.admitted(seq.num_prompt_tokens, seq.policy.enabled)
        self.stats.preemptions += len(plan.preempted)
        for seq in plan.out_of_memory:
            self._finish(seq, "length")

    def _count_waiting(self, delta: int) -> None:
        with self.waiting_lock:
            self.num_waiting += delta

    def postprocess(self, plan: SchedulerOutput, out: StepOutput | None) -> None:
        """Sample each batch entry that finished feeding its prompt (snapshots at its save
        points on the way), end the replies that stop, then their continued checkpoints.
        No batch (`out` None): the snapshot copies in flight land now."""
        ended = [s for s in plan.out_of_memory if s.reply.checkpoint]
        if out is None:
            self._checkpoint(ended)
            self.snapshots.land(wait=True)  # no forward to overlap with: the copies land now
            return
        self.stats.stepped(out.num_tokens, out.seconds)
        done: list[Sequence] = ended
        for b in plan.scheduled:
            seq = b.seq
            assert seq.state is not None
            rows = b.num_tokens + len(b.draft)
            share = out.seconds * rows / out.num_tokens if out.num_tokens else 0.0
            if b.num_tokens and seq.position <= seq.num_prompt_tokens and not seq.num_generated:
                seq.reply.prefill_s += share
                if seq.position in seq.save_points:
                    self.snapshots.save(seq, seq.position)
                if seq.prefilling:
                    continue
            elif b.num_tokens:
                seq.reply.decode_s += share
            if seq.num_generated == 0 and seq.reply.choice == 0:
                self._prefilled(seq)
            if b.draft:
                self._verify(seq, b.draft, out.logits[seq.seq_id], out.rewinds[seq.seq_id])
            else:
                self._sample(seq, out.logits[seq.seq_id])
            if seq.reply.finish_reason is not None:
                done.append(seq)
        self._checkpoint([s for s in done if s.reply.checkpoint])
        self.stats.snapshots_saved = self.snapshots.num_saved

    def _prefilled(self, seq: Sequence) -> None:
        n = seq.num_prompt_tokens - seq.restored
        self.stats.prefilled(n, seq.reply.prefill_s)
        if seq.num_preemptions == 0 and n > 0:
            self.prefill_cost.record(seq.restored, n, seq.reply.prefill_s)

    def _verify(self, seq: Sequence, draft: tuple[int, ...], rows: torch.Tensor, rewind: Rewind) -> None:
        """Speculative decoding's check (generation/speculation.py): sample each row in order,
        from the logits after the tokens before it, while the sampler picks the draft; the
        state then covers exactly what plain decoding's would (models/rewind.py)."""
        spec = seq.spec
        assert spec is not None
        spec.drafted += len(draft)  # counted before a sample can end the reply (its usage reads them)
        accepted = 0
        for i in range(len(draft) + 1):
            self._sample(seq, rows[i])
            if seq.reply.finish_reason is not None or i == len(draft) or seq.tokens[-1] != draft[i]:
                break
            accepted += 1
            spec.accepted += 1
        self.stats.verified(len(draft), accepted)
        spec.adapt(len(draft), accepted)
        if seq.state is not None:  # released when its reply ended without a checkpoint
            keep = len(seq.tokens) - 1  # the last sampled token is fed next
            first_drafted = rewind.start + rewind.rows - len(draft)  # rows[0] holds the logits after it - 1
            rewind.to(seq.state, keep, rows[keep - first_drafted])

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> None:
        if seq.num_generated == 0 and seq.request.n > 1 and seq.reply.choice == 0:
            self._fork(seq)
        m = seq.decoding.matcher
        allowed = None
        if m is not None:
            mask = m.allowed_tokens()
            allowed = lambda x: apply_token_bitmask_(x, mask)  # noqa: E731
        n = seq.num_prompt_tokens
        pick = seq.decoding.sampler(logits, seq.tokens[:n], seq.tokens[n:], allowed)
        tok = pick.token
        if m is not None:
            m.advance(tok)
        seq.tokens.append(tok)
        if seq.reply.t_first_token is None:
            seq.reply.t_first_token = time.perf_counter()
        text, stopped = seq.decoding.stopper.push(tok)
        if not stopped or text or pick.logprob is not None:
            seq.reply.emit(TokenEvent(tok, text, seq.reply.choice, pick.logprob, pick.top_logprobs))
        if stopped or (m is not None and tok in self.tokenizer.eos_token_ids and m.is_done()):
            self._finish(seq, "stop")
        elif seq.num_generated >= seq.decoding.max_new_tokens:
            self._finish(seq, "length")

    def _fork(self, parent: Sequence) -> None:
        """n > 1: the other choices start from the parent's prefilled state (one prefill),
        parked like preempted sequences, so each is admitted when memory has room."""
        assert parent.state is not None
        snap = self.backend.export(parent.state).detached()  # synchronous: once per n > 1 request
        req, params = parent.request, parent.request.sampling
        for choice in range(1, req.n):
            child = replace_seq(
                parent,
                seq_id=next(self.ids),
                tokens=list(parent.tokens),
                decoding=replace_seq(
                    parent.decoding,
                    sampler=Sampler(params, _rules(req), choice),
                    stopper=StopChecker(
                        self.tokenizer.stream_decoder(), params.stop, parent.decoding.stopper.stop_token_ids
                    ),
                    matcher=self._matcher(req, choice),
                ),
                reply=replace_seq(parent.reply, choice=choice, t_first_token=None, checkpoint=False),
                spec=self._speculation(req),
                status=Status.WAITING,
                state=None,
                parked=snap,
                save_points=[],
                probe=None,
                queued=False,
            )
            parent.reply.group.append(child)
            self.scheduler.requeue(child)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Send the reply's end; free the state unless a continued checkpoint follows
        (this step's `_checkpoint`)."""
        seq.reply.finish_reason = reason
        rest = seq.decoding.stopper.finish(flush=reason == "length")
        if rest:
            seq.reply.emit(TokenEvent(seq.tokens[-1] if seq.num_generated else -1, rest, seq.reply.choice))
        self.stats.completion_tokens += seq.num_generated
        seq.reply.checkpoint = (
            seq.reply.choice == 0
            and seq.policy.mode == "full"
            and reason != "cancelled"
            and seq.num_generated > 0
            and seq.state is not None
            and len(seq.tokens) <= self.cfg.max_context
        )
        key = self.cache.key(seq.salt, seq.tokens) if seq.reply.checkpoint else None
        seq.reply.emit(self._finish_event(seq, key))
        if not seq.reply.checkpoint:
            self._release(seq)

    def _checkpoint(self, seqs: list[Sequence]) -> None:
        """The finished sequences' continued checkpoints (snapshot_pipeline), then their
        states are released."""
        if not seqs:
            return
        self.snapshots.checkpoint(seqs, self.memory, self.runner)
        for seq in seqs:
            self._release(seq)

    def abandon(self, seq: Sequence) -> None:
        """Drop a sequence without a finish event (its step failed); frees its memory."""
        with self.lock:
            if seq.status is not Status.FINISHED:
                self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.queued:
            seq.queued = False
            self._count_waiting(-1)  # never admitted
        self.scheduler.remove(seq)
        if seq.state is not None:
            self.memory.free(seq.state)
        if seq.hit is not None and seq.reply.choice == 0:
            self.cache.promote(seq.hit)  # off the TTFT path; the hit's rows were never rewritten
        seq.state, seq.parked = None, None
        seq.status = Status.FINISHED

    def _finish_event(self, seq: Sequence, key: str | None) -> FinishEvent:
        """The reply's end; the request's restore (choice 0 only) is counted here, once,
        with the prefill it saved by the fitted cost model."""
        saved_s = 0.0
        if seq.hit is not None and seq.reply.choice == 0:
            cold = self.prefill_cost.saved(seq.restored, seq.num_prompt_tokens)
            saved_s = max(0.0, cold - seq.reply.restore_s) if cold is not None else 0.0
            self.stats.restored(seq.hit, seq.restored, seq.reply.restore_s, saved_s)
        return seq.finish_event(key, saved_s)

    # -- conveniences (tests, CLI) -------------------------------------------------
    def generate(
        self,
        req: GenerateRequest,
        should_stop: Callable[[], bool] = lambda: False,
        prompt: Prompt | None = None,
    ) -> Iterator[Event]:
        """Run one request in the caller's thread (stepping the engine, so other queued
        sequences advance too); yields its events. Returns once its state is released
        (after the continued checkpoint)."""
        events: deque[Event] = deque()
        seq = self.submit(req, events.append, should_stop, prompt)
        while any(s.status is not Status.FINISHED for s in seq.reply.group) or len(seq.reply.group) < req.n:
            self.step()
            while events:
                yield events.popleft()
        while events:
            yield events.popleft()

    def complete(self, req: GenerateRequest) -> FinishEvent:
        """Run a request to the end; returns its finish event."""
        final = None
        for ev in self.generate(req):
            if isinstance(ev, FinishEvent):
                final = ev
        assert final is not None
        return final

    def flush(self) -> None:
        with self.lock:
            self.snapshots.land(wait=True)
        if self.cache.disk is not None:
            self.cache.disk.flush()


def _rules(req: GenerateRequest) -> LogitsRules:
    return LogitsRules(
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
    )
