"""Several models behind one engine process, each an Engine of its own (its namespace,
its cache entries, its scheduler), stepped by the one loop thread: round-robin over the
loaded models that have work.

A model is loaded on its first request. When loading one would take the weights of the
loaded models past `--models-budget` bytes, the least recently used idle model is parked
first: its Engine is closed and dropped (weights, state memory and its RAM tier freed; its
disk writer flushed), so only its disk cache remains, under its namespace. Loading it again
builds the same namespace from the same files, so its earlier snapshots are disk hits.
A model is idle when nothing of it is queued, running or being handed to it (`acquire`
pins it until `release`). Weights are counted from the checkpoint's tensor shapes at the
runtime dtype (before any fused copies), the figure an operator sizes the budget by.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from keepwarm.engine.config import EngineConfig
from keepwarm.engine.engine import Engine, open_model
from keepwarm.engine.generation.engine_stats import EngineStats
from keepwarm.engine.generation.request import RequestError
from keepwarm.engine.loading.checkpoint import CheckpointError, open_checkpoint
from keepwarm.engine.models import MODEL_TYPE_TO_FAMILY
from keepwarm.engine.serving import wire

LOADED, PARKED = "loaded", "parked"


@dataclass
class ModelSlot:
    """One served model: its config, and its Engine while loaded."""

    name: str
    cfg: EngineConfig
    family: str
    weight_bytes: int
    created: int  # when the checkpoint was written (config.json's mtime): OpenAI's `created`
    engine: Engine | None = None
    namespace: str = ""  # known once loaded; kept while parked
    stats: EngineStats = field(default_factory=EngineStats)  # survives parks
    last_used: float = 0.0
    pins: int = 0
    loads: int = 0
    load_seconds: float = 0.0
    parks: int = 0
    park_seconds: float = 0.0

    @property
    def residency(self) -> str:
        return LOADED if self.engine is not None else PARKED

    def card(self) -> wire.ModelCard:
        return wire.ModelCard(
            id=self.name,
            created=self.created,
            owned_by="keepwarm",
            max_model_len=self.cfg.max_context,
            family=self.family,
            residency=self.residency,
        )


def served_configs(cfg: EngineConfig) -> list[EngineConfig]:
    """One EngineConfig per served model: `cfg.models` (several `--model`, or every
    subfolder of a models folder holding a config.json), else `cfg.model` alone."""
    if not cfg.models:
        return [cfg]
    return [replace(cfg, model=p, models=(), model_name="") for p in cfg.models]


def weight_bytes(cfg: EngineConfig) -> int:
    """Bytes of a model's weights as `cfg` loads them (at its dtype, or in their quantized blocks
    where --weights keeps them; integer tensors as stored)."""
    return open_model(cfg)[0].runtime_bytes(cfg.torch_dtype)


class ModelSet:
    def __init__(
        self,
        cfgs: Sequence[EngineConfig],
        budget_bytes: int = 0,
        make_engine: Callable[[EngineConfig], Engine] = Engine,
    ) -> None:
        """`budget_bytes` bounds the loaded models' weights (0: no bound). Checkpoints are
        opened here (bad folders fail at start); nothing is loaded until `acquire`."""
        assert cfgs, "a model set serves at least one model"
        self.budget_bytes = budget_bytes
        self.make_engine = make_engine
        self.slots: dict[str, ModelSlot] = {}
        for c in cfgs:
            ckpt = open_checkpoint(c.model)
            family = MODEL_TYPE_TO_FAMILY.get(ckpt.model_type)
            if family is None:
                raise CheckpointError(
                    f"{ckpt.path}: model_type {ckpt.model_type!r} is not supported "
                    f"(supported: {', '.join(sorted(MODEL_TYPE_TO_FAMILY))})"
                )
            name = c.served_name
            if name in self.slots or name == wire.DEFAULT_MODEL:
                raise CheckpointError(
                    f"two served models would be called {name!r}: give each folder its own name"
                    if name in self.slots
                    else f"a model folder may not be called {wire.DEFAULT_MODEL!r} (that id names the default model)"
                )
            size = weight_bytes(c)
            if budget_bytes and size > budget_bytes:
                raise CheckpointError(
                    f"--models-budget {budget_bytes} bytes cannot hold {name!r} alone ({size} bytes of "
                    "weights at the runtime dtype): raise the budget"
                )
            self.slots[name] = ModelSlot(name, c, family, size, _written_at(c.model))
        self.default = next(iter(self.slots))
        self.lock = threading.Lock()  # loads, parks, pins and the loaded list
        self.changed = threading.Condition(self.lock)
        self._loading = False  # one load at a time
        self._turn = 0  # round-robin position over the loaded models
        self.last_stepped: Engine | None = None

    # -- which model ----------------------------------------------------------------
    def slot(self, name: str | None) -> ModelSlot:
        """The model a request names (None or "default": the first one); a 404 naming the
        served ones otherwise."""
        if name is None or name == wire.DEFAULT_MODEL:
            return self.slots[self.default]
        found = self.slots.get(name)
        if found is None:
            served = ", ".join(repr(n) for n in self.slots)
            raise RequestError(
                f"model {name!r} is not served here; this engine serves {served} "
                f"({wire.DEFAULT_MODEL!r} names {self.default!r})",
                status=404,
                param="model",
            )
        return found

    def acquire(self, name: str | None) -> tuple[ModelSlot, Engine]:
        """The named model's Engine, loaded now if it is parked (parking least recently used
        idle models to stay within the budget; waiting for one to become idle when none is).
        The model stays pinned, so never parked, until `release(slot)`. Blocking: call it
        from a worker thread."""
        slot = self.slot(name)
        with self.lock:
            slot.pins += 1
            slot.last_used = time.monotonic()
        try:
            engine = self._ensure_loaded(slot)
        except BaseException:
            self.release(slot)
            raise
        return slot, engine

    def release(self, slot: ModelSlot) -> None:
        with self.lock:
            slot.pins -= 1
            assert slot.pins >= 0, "released more often than acquired"
            slot.last_used = time.monotonic()
            self.changed.notify_all()

    def _ensure_loaded(self, slot: ModelSlot) -> Engine:
        with self.lock:
            while True:
                if slot.engine is not None:
                    return slot.engine
                if self._loading:
                    self.changed.wait(timeout=0.05)  # one load at a time
                    continue
                if self._make_room(slot):
                    break
                self.changed.wait(timeout=0.05)  # every other loaded model is busy: wait for one
            self._loading = True
        try:
            t0 = time.perf_counter()
            engine = self.make_engine(slot.cfg)
            engine.stats = slot.stats  # counters continue across parks
            # no warm-up here: the prefill cost model is fitted between requests
            # (`background_step`) and from real prefills, never before serving
            seconds = time.perf_counter() - t0
        finally:
            with self.lock:
                self._loading = False
                self.changed.notify_all()
        with self.lock:
            slot.engine = engine
            slot.namespace = engine.namespace
            slot.loads += 1
            slot.load_seconds += seconds
            self.changed.notify_all()
        return engine

    def _make_room(self, slot: ModelSlot) -> bool:
        """Park least recently used idle models until `slot` fits the budget (lock held).
        False: it does not fit and no loaded model is idle now."""
        if not self.budget_bytes:
            return True
        while self.loaded_bytes() + slot.weight_bytes > self.budget_bytes:
            idle = [
                s for s in self.slots.values() if s.engine is not None and s is not slot and self._idle(s)
            ]
            if not idle:
                return False
            self._park(min(idle, key=lambda s: s.last_used))
        return True

    def _idle(self, slot: ModelSlot) -> bool:
        return slot.pins == 0 and slot.engine is not None and not slot.engine.has_work()

    def _park(self, slot: ModelSlot) -> None:
        """Close and drop the model's Engine (lock held; the model is idle)."""
        engine = slot.engine
        assert engine is not None
        t0 = time.perf_counter()
        with engine.lock:  # never in the middle of its step
            slot.engine = None
            if self.last_stepped is not None and self.last_stepped is engine:
                self.last_stepped = None
            engine.close()  # flushes its disk writer: its snapshots are on disk for the next load
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        slot.parks += 1
        slot.park_seconds += time.perf_counter() - t0

    def park(self, name: str) -> bool:
        """Park the named model now if it is loaded and idle (the admin path and tests)."""
        slot = self.slot(name)
        with self.lock:
            if slot.engine is None or not self._idle(slot):
                return False
            self._park(slot)
            return True

    def loaded_bytes(self) -> int:
        return sum(s.weight_bytes for s in self.slots.values() if s.engine is not None)

    def engines(self) -> list[Engine]:
        with self.lock:
            return [s.engine for s in self.slots.values() if s.engine is not None]

    # -- the loop thread --------------------------------------------------------------
    def has_work(self) -> bool:
        return any(e.has_work() for e in self.engines())

    def step(self) -> int:
        """One step of the next loaded model with work (round-robin); how many sequences
        took part."""
        engines = self.engines()
        for k in range(len(engines)):
            e = engines[(self._turn + k) % len(engines)]
            if e.has_work():
                self._turn = (self._turn + k + 1) % len(engines)
                self.last_stepped = e
                return e.step()
        return 0

    def background_step(self) -> tuple[str, Engine, bool] | None:
        """One chunk of a loaded model's background work, its prefill cost model's warm-up
        (the loop thread, when no model has a request); (its name, its engine, whether that
        was its warm-up's first chunk), or None when no model has any left."""
        with self.lock:
            pending = [(s.name, s.engine) for s in self.slots.values() if s.engine is not None]
        for name, engine in pending:
            if engine.calibration.pending:
                first = not engine.calibration.started
                if engine.calibrate_step():
                    return name, engine, first
        return None

    def _loaded_now(self) -> list[Engine]:
        """The loaded engines, read without the lock: /health and the 429 path call this on the
        event loop, which must never wait for a load or a park (a park holds the lock while it
        waits out the model's step and flushes its disk writer). A slot's engine is one
        reference, swapped whole, so the read is a consistent view of each slot."""
        return [e for e in (s.engine for s in list(self.slots.values())) if e is not None]

    @property
    def num_running(self) -> int:
        return sum(len(e.scheduler.running) for e in self._loaded_now())

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self._loaded_now())

    def close(self) -> None:
        with self.lock:
            for s in self.slots.values():
                if s.engine is not None:
                    s.engine.close()
                    s.engine = None

    def describe(self) -> dict[str, dict[str, object]]:
        """Per model: residency, weights, loads and parks with their total seconds."""
        with self.lock:
            return {
                s.name: {
                    "residency": s.residency,
                    "family": s.family,
                    "namespace": s.namespace,
                    "weight_bytes": s.weight_bytes,
                    "loads": s.loads,
                    "load_seconds": s.load_seconds,
                    "parks": s.parks,
                    "park_seconds": s.park_seconds,
                }
                for s in self.slots.values()
            }


def _written_at(model: Path) -> int:
    try:
        return int((model / "config.json").stat().st_mtime)
    except OSError:
        return int(model.stat().st_mtime)


__all__ = ["LOADED", "PARKED", "ModelSet", "ModelSlot", "served_configs", "weight_bytes"]
