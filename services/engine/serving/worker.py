"""The generation loop thread: steps the engines of a ModelSet (round-robin over the
models with work) while any sequence is queued or running; otherwise, once the server
answers (`start_background`), runs background work one short chunk at a time (the prefill
cost model's warm-up), and sleeps when there is none. Jobs hand events to the asyncio side through
`loop.call_soon_threadsafe`; a cancelled job (client gone) is dropped at the
next step, which frees its state.

The thread is also where the server loads its default model (`call`): torch's OpenMP
thread pools are per calling thread, and once the process's main thread has run a parallel
region, regions started from any other thread run about half as fast for the rest of the
process (measured on a 2-core machine: a 576 x 1536 bf16 linear at batch 1 takes 130 us
from its first thread, 360-450 us from another, and decode fell from 39 to 21 tokens/s).
So the main thread (the HTTP event loop) never runs one, and the steps run on the thread
that ran the first."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from keepwarm.engine.engine import Engine, Event, Prompt, QueueFull
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest
from keepwarm.engine.generation.sequence import Sequence, Status
from keepwarm.engine.serving.model_set import ModelSet

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["Job", "QueueFull", "Worker"]


@dataclass
class Job:
    request: GenerateRequest
    prompt: Prompt
    loop: asyncio.AbstractEventLoop
    engine: Engine
    events: asyncio.Queue[Event | BaseException | None] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    seq: Sequence | None = None

    def push(self, item: Event | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    def __init__(self, models: ModelSet, on_event: Callable[[Event], None] | None = None) -> None:
        self.models = models
        self.on_event = on_event
        self.jobs: dict[int, Job] = {}  # id(job) -> job, for failing a broken step's sequences
        self.wake = threading.Event()
        self.background = threading.Event()  # set once the server answers: background work may run
        self.stopping = False
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._calls_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="keepwarm-generation", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` run on the generation thread (before its next step), its result or its
        exception here; blocking. For work that runs torch's parallel kernels outside a step,
        such as loading the default model (see the module docstring)."""
        assert threading.current_thread() is not self.thread, "call() from the generation thread"
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._calls_lock:
            self._calls.append((fn, done))
        self.wake.set()
        return done.result()

    def _run_calls(self) -> None:
        with self._calls_lock:
            calls, self._calls = self._calls, []
        for fn, done in calls:
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the caller, which raises it
                done.set_exception(e)

    @property
    def num_running(self) -> int:
        return self.models.num_running

    @property
    def num_waiting(self) -> int:
        return self.models.num_waiting

    @property
    def depth(self) -> int:
        return self.num_running + self.num_waiting

    def submit(self, engine: Engine, request: GenerateRequest, prompt: Prompt) -> Job:
        """Queue a request on one model's engine (acquired from the ModelSet); raises
        QueueFull when its waiting queue is full."""
        job = Job(request, prompt, asyncio.get_running_loop(), engine)

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

        job.seq = engine.submit(request, deliver, job.cancelled.is_set, prompt)
        self.jobs[id(job)] = job
        self.wake.set()
        return job

    def start_background(self) -> None:
        """Let background work run between requests (call it once the server answers)."""
        self.background.set()
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while not self.stopping:
            self._run_calls()
            if not self.models.has_work():
                if self.background.is_set() and self._background():
                    continue  # one chunk done: requests that came meanwhile go first
                self.wake.wait(timeout=0.5)
                self.wake.clear()
                continue
            try:
                self.models.step()
            except BaseException as e:  # a broken step: fail what its engine held, keep serving
                log.exception("engine step failed")
                self._fail_all(e, self.models.last_stepped)
            self._forget_finished()

    def _background(self) -> bool:
        """One chunk of background work; False when there is none (or it failed: logged, and
        not retried)."""
        try:
            ran = self.models.background_step()
        except Exception:
            log.exception("background work failed (the prefill cost model is fitted from real prefills)")
            return False
        if ran is None:
            return False
        name, engine, first = ran
        if first:
            print(
                f"keepwarm engine: {name}: fitting the prefill cost model in the background "
                f"({engine.calibration.planned} warm-up prefills, between requests)",
                flush=True,
            )
        if not engine.calibration.pending:
            print(
                f"keepwarm engine: {name}: prefill cost model fitted ({engine.calibration.done} warm-up "
                f"prefills, {engine.calibration.seconds:.1f} s with the requests between)",
                flush=True,
            )
        return True

    def _fail_all(self, error: BaseException, engine: Engine | None) -> None:
        for key, job in list(self.jobs.items()):
            seq = job.seq
            assert seq is not None
            if engine is not None and job.engine is not engine:
                continue
            job.engine.abandon(seq)
            job.push(error)
            del self.jobs[key]

    def _forget_finished(self) -> None:
        for key in [i for i, j in self.jobs.items() if j.seq is not None and j.seq.status is Status.FINISHED]:
            del self.jobs[key]
