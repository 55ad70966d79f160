"""The generation thread: `call` runs work on it (the default model's load, so that torch's
parallel kernels only ever start from the thread that steps), hands back results and errors,
and a model loaded there is stepped there."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from keepwarm.engine.config import EngineConfig
from keepwarm.engine.serving.model_set import ModelSet, served_configs
from keepwarm.engine.serving.worker import Worker


def test_call_runs_on_the_generation_thread_and_passes_errors_back(
    tiny_dense_model: Path, tmp_path: Path
) -> None:
    cfg = EngineConfig(model=tiny_dense_model, dtype="float32", cache_dir=tmp_path).validate()
    models = ModelSet(served_configs(cfg), 0)
    worker = Worker(models)
    try:
        assert worker.call(lambda: threading.current_thread().name) == "keepwarm-generation"
        slot, engine = worker.call(lambda: models.acquire(None))
        models.release(slot)
        assert models.slots[slot.name].engine is engine

        def broken() -> None:
            raise ValueError("no such weight")

        with pytest.raises(ValueError, match="no such weight"):
            worker.call(broken)
        assert worker.thread.is_alive()  # the loop survived the failed call
        assert worker.call(lambda: 6 * 7) == 42
    finally:
        worker.stop()
        models.close()
    assert not worker.thread.is_alive()
