"""The unit the engine schedules: one prompt being prefilled, then decoded.

A sequence owns what the scheduler needs: its state (or, while preempted, the
snapshot it was parked as), its tokens (prompt then reply), cache policy, save
points and the cache's answer; `Decoding` holds what the sampler needs (sampler,
stop checker, grammar matcher, token limit) and `Reply` what the reply needs (where
its events go, how it ended, the n > 1 group, its timings). Invariants:
  - `tokens[:state.position]` is exactly what the state covers;
  - while decoding, position < len(tokens): the tokens from position on (the last sampled
    one; after a rejected draft on a state that replays, the accepted ones before it) are fed next;
  - `state` is None unless the sequence is RUNNING.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

from msgspec import UNSET

from keepwarm.engine.cache.prefix_cache import Hit, Probe
from keepwarm.engine.cache.snapshot import Snapshot
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.generation.grammar import TokenMatcher
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, Timings, TokenEvent
from keepwarm.engine.generation.sampling import Sampler
from keepwarm.engine.generation.speculation import Speculation
from keepwarm.engine.generation.stopping import StopChecker
from keepwarm.engine.models.backend import State

Event: TypeAlias = TokenEvent | FinishEvent


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    boundaries: list[int]  # token positions where each chat message ends
    extends_to_next_turn: bool = False  # the next turn's prompt starts with all of `tokens`


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (then `parked` holds its snapshot)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Decoding:
    """What the sampler needs: how the next token is picked and when the reply stops."""

    sampler: Sampler
    stopper: StopChecker
    max_new_tokens: int
    matcher: TokenMatcher | None = None  # constrained decoding (response_format, tool_choice)


@dataclass(eq=False)
class Reply:
    """What the reply needs: where its events go, how it ended, and its timings."""

    on_event: Callable[[Event], None]
    should_stop: Callable[[], bool]
    choice: int = 0  # which of the request's n choices this is
    group: list[Sequence] = field(default_factory=list)  # every choice of the request (n > 1)
    finish_reason: str | None = None
    checkpoint: bool = False  # after finishing: feed the last token and save prompt + reply
    diverged_at: int | None = None  # where the prompt left the session's last prefix
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    restore_s: float = 0.0
    prefill_s: float = 0.0  # this sequence's share of the steps that prefilled it
    decode_s: float = 0.0

    def emit(self, ev: Event) -> None:
        self.on_event(ev)


@dataclass(eq=False)
class Sequence:
    """What the scheduler needs (tokens, state, policy, save points, the cache's answer),
    with the sampler's part (`decoding`) and the reply's (`reply`)."""

    seq_id: int
    request: GenerateRequest
    tokens: list[int]  # prompt, then each sampled token
    num_prompt_tokens: int
    boundaries: list[int]  # prompt positions where chat messages end
    policy: Policy
    decoding: Decoding
    reply: Reply
    status: Status = Status.WAITING
    state: State | None = None
    parked: Snapshot | None = None  # the state of a preempted sequence (also in the RAM tier)
    save_points: list[int] = field(default_factory=list)  # absolute prompt positions to snapshot at
    prompt_extends_to_next_turn: bool = False  # the next turn's prompt starts with the whole prompt
    probe: Probe | None = None  # the admission's one cache lookup, until it is admitted
    hit: Hit | None = None  # the cached prefix its state was restored from
    num_preemptions: int = 0
    queued: bool = True  # counted in the engine's bounded waiting queue (until first admitted)
    spec: Speculation | None = None  # speculative decoding's drafts (None: plain decoding)

    @property
    def salt(self) -> str:
        return self.request.cache_salt

    @property
    def position(self) -> int:
        if self.state is not None:
            return self.state.position
        return self.parked.position if self.parked is not None else 0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def prefilling(self) -> bool:
        return self.position < self.num_prompt_tokens

    @property
    def restored(self) -> int:
        return self.hit.snapshot.position if self.hit is not None else 0

    def finish_event(self, key: str | None, prefill_saved_s: float) -> FinishEvent:
        """The reply's last event: how it ended, its text and usage, and its timings;
        `key` is the continued checkpoint's prefix key (None: no checkpoint)."""
        reply, hit, n = self.reply, self.hit, self.num_generated
        first = reply.t_first_token if reply.t_first_token is not None else time.perf_counter()
        timings = Timings(
            cache_source=hit.source if hit else "none",
            restored_tokens=self.restored,
            restore_ms=reply.restore_s * 1000,
            restore_bytes=hit.num_bytes if hit else 0,
            prefill_tokens=self.num_prompt_tokens - self.restored
            if reply.finish_reason != "cancelled" or n
            else 0,
            prefill_ms=reply.prefill_s * 1000,
            decode_ms=reply.decode_s * 1000,
            ttft_ms=(first - reply.t_arrival) * 1000,
            prefill_saved_ms=prefill_saved_s * 1000,
            decode_tokens_per_sec=(n / reply.decode_s) if reply.decode_s > 0 else 0.0,
            drafted_tokens=self.spec.drafted if self.spec else 0,
            accepted_tokens=self.spec.accepted if self.spec else 0,
            diverged_at=UNSET if reply.diverged_at is None else reply.diverged_at,
        )
        return FinishEvent(
            reply.finish_reason or "stop",
            self.decoding.stopper.text,
            self.num_prompt_tokens,
            n,
            self.restored,
            timings,
            key,
            len(self.tokens) if key else 0,
            reply.choice,
            self.decoding.stopper.matched,
        )

    def num_tokens_to_feed(self) -> int:
        """Tokens this sequence still has to feed before it can sample (prefill rest, or
        the last sampled token while decoding); 0 when its logits are ready to sample."""
        return len(self.tokens) - self.position

    def next_save_point(self) -> int | None:
        p = self.position
        return next((s for s in self.save_points if s > p), None)
