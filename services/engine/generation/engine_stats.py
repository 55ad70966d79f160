"""The engine's counters for /metrics and /v1/cache (the cache tiers keep their own).

Each method is one event of the step loop; the engine calls them and never adds to a
field itself, so what a counter means is written once, here."""

from __future__ import annotations

from dataclasses import dataclass, field

from keepwarm.engine.cache.prefix_cache import Hit


@dataclass
class EngineStats:
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
    steps: int = 0
    step_tokens: int = 0
    step_seconds: float = 0.0
    preemptions: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and verified ...
    accepted_tokens: int = 0  # ... and of those, kept (the reply is the same either way)
    calibration_prefills: int = 0  # warm-up prefills of the prefill cost model (never a request's)

    def admitted(self, prompt_tokens: int, looked_up: bool) -> None:
        """A request's first admission (a preempted one's return is not counted again)."""
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.lookups += int(looked_up)

    def stepped(self, num_tokens: int, seconds: float) -> None:
        """One batched forward."""
        self.steps += 1
        self.step_tokens += num_tokens
        self.step_seconds += seconds

    def prefilled(self, num_tokens: int, seconds: float) -> None:
        """A request's prompt, fed past what its restore covered."""
        self.prefill_tokens += num_tokens
        self.prefill_seconds += seconds

    def restored(self, hit: Hit, num_tokens: int, seconds: float, saved_seconds: float) -> None:
        """A request's restore from the cache, counted once when its reply ends."""
        self.hits_by_tier[hit.source] += 1
        self.hit_tokens_by_tier[hit.source] += num_tokens
        self.restore_seconds += seconds
        self.restore_bytes += hit.num_bytes
        self.prefill_saved_seconds += saved_seconds

    def verified(self, drafted: int, accepted: int) -> None:
        """One speculative step: `drafted` tokens checked, `accepted` of them kept."""
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
