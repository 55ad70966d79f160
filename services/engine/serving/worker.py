"""One generation worker thread behind a bounded queue. Jobs hand events to the
asyncio side through `loop.call_soon_threadsafe`; a cancelled job (client gone)
stops at the next chunk or token."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from keepwarm.engine.engine import Engine, Event, Prompt
from keepwarm.engine.generation.request import GenerateRequest


class QueueFull(Exception):
    """Every queue slot is taken: not now (HTTP 429)."""


@dataclass
class Job:
    request: GenerateRequest
    prompt: Prompt
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Event | BaseException | None] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def push(self, item: Event | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    def __init__(
        self, engine: Engine, queue_size: int, on_event: Callable[[Event], None] | None = None
    ) -> None:
        self.engine = engine
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.on_event = on_event
        self.busy = False
        self.thread = threading.Thread(target=self._run, name="keepwarm-generation", daemon=True)
        self.thread.start()

    @property
    def depth(self) -> int:
        return self.jobs.qsize() + int(self.busy)

    def submit(self, request: GenerateRequest, prompt: Prompt) -> Job:
        job = Job(request, prompt, asyncio.get_running_loop())
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull from None
        return job

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self.busy = True
            try:
                for ev in self.engine.generate(job.request, job.cancelled.is_set, prompt=job.prompt):
                    if self.on_event is not None:
                        self.on_event(ev)
                    job.push(ev)
                job.push(None)
            except BaseException as e:  # delivered to the HTTP side, which maps it to an error
                job.push(e)
            finally:
                self.busy = False
