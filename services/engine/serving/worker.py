"""The generation loop thread: steps the engine while any sequence is queued or
running, and sleeps otherwise. Jobs hand events to the asyncio side through
`loop.call_soon_threadsafe`; a cancelled job (client gone) is dropped at the
next step, which frees its state."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from keepwarm.engine.engine import Engine, Event, Prompt, QueueFull
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest
from keepwarm.engine.generation.sequence import Sequence, Status

log = logging.getLogger(__name__)

__all__ = ["Job", "QueueFull", "Worker"]


@dataclass
class Job:
    request: GenerateRequest
    prompt: Prompt
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event | BaseException | None] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    seq: Sequence | None = None

    def push(self, item: Event | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    def __init__(self, engine: Engine, on_event: Callable[[Event], None] | None = None) -> None:
        self.engine = engine
        self.on_event = on_event
        self.jobs: dict[int, Job] = {}  # seq_id -> job, for failing a broken step's sequences
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="keepwarm-generation", daemon=True)
        self.thread.start()

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def depth(self) -> int:
        return self.num_running + self.num_waiting

    def submit(self, request: GenerateRequest, prompt: Prompt) -> Job:
        """Queue a request; raises QueueFull when the waiting queue is full."""
        job = Job(request, prompt, asyncio.get_running_loop())

        finishes = 0

        def deliver(ev: Event) -> None:
            nonlocal finishes
            if self.on_event is not None:
                self.on_event(ev)
            job.push(ev)
            if isinstance(ev, FinishEvent):
                finishes += 1
                if finishes == request.n:  # every choice has ended
                    job.push(None)

        job.seq = self.engine.submit(request, deliver, job.cancelled.is_set, prompt)
        self.jobs[job.seq.seq_id] = job
        self.wake.set()
        return job

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while not self.stopping:
            if not self.engine.has_work():
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                self.engine.step()
            except BaseException as e:  # a broken step: fail what it held, keep serving
                log.exception("engine step failed")
                self._fail_all(e)
            self._forget_finished()

    def _fail_all(self, error: BaseException) -> None:
        for seq_id, job in list(self.jobs.items()):
            seq = job.seq
            assert seq is not None
            self.engine.abandon(seq)
            job.push(error)
            del self.jobs[seq_id]

    def _forget_finished(self) -> None:
        for seq_id in [
            i for i, j in self.jobs.items() if j.seq is not None and j.seq.status is Status.FINISHED
        ]:
            del self.jobs[seq_id]
