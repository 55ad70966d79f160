"""What crosses from the scheduler to the runner and the engine's postprocess each step.

`SchedulerOutput` is the one typed answer of `Scheduler.schedule()`: the batch (which
sequences feed how many tokens), and what scheduling did to the others on the way:
sequences admitted for the first time (they left the bounded queue), sequences preempted
to make room, and sequences ended because memory cannot hold them even alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from keepwarm.engine.generation.sequence import Sequence


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens fed this step; 0: sample from the logits the state already has
    draft: tuple[int, ...] = ()  # drafted tokens fed after them and verified (speculation.py)


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[Scheduled, ...]  # this step's batch, every entry with a state that fits
    admitted: tuple[Sequence, ...] = ()  # first admissions (restored from the cache if it held a prefix)
    preempted: tuple[Sequence, ...] = ()  # parked to the RAM tier, back in the waiting line
    out_of_memory: tuple[Sequence, ...] = ()  # cannot fit even alone: their replies end ("length")
