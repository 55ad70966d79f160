"""The whole request path on each device of tests/conftest.py's `device` (the CPU, and the GPU
where torch sees one: `pytest -m gpu` runs just that case): prefill, a snapshot into RAM and onto
disk, a restore from each tier, decode. Warm answers equal the cold ones on the same device."""

from __future__ import annotations

from pathlib import Path

from keepwarm.engine.config import EngineConfig
from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.request import FinishEvent, GenerateRequest
from keepwarm.engine.generation.sampling import SamplingParams

SYSTEM = "You are a patient assistant who answers about a small village by the river. " * 3
TURNS = ["Tell me about the old mill.", "What did the miller do in winter?"]


def _engine(model: Path, device: str, cache_dir: Path | None, memory_budget: int) -> Engine:
    return Engine(
        EngineConfig(
            model=model,
            device=device,
            dtype="float32",
            cache_dir=cache_dir,
            memory_budget=memory_budget,
            max_context=1024,
            min_tokens=8,
            chunk_size=64,
            num_threads=1,
            fsync=False,
        ).validate()
    )


def _conversation(engine: Engine) -> list[FinishEvent]:
    messages = [{"role": "system", "content": SYSTEM}]
    events = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ev = engine.complete(
            GenerateRequest(sampling=SamplingParams(max_tokens=8, temperature=0.0), messages=tuple(messages))
        )
        events.append(ev)
        messages.append({"role": "assistant", "content": ev.text})
    engine.flush()  # every snapshot on disk before the engine closes
    return events


def test_request_path_cold_ram_and_disk_agree(device: str, tiny_dense_model: Path, tmp_path: Path) -> None:
    cold_engine = _engine(tiny_dense_model, device, None, memory_budget=0)
    try:
        cold = [e.text for e in _conversation(cold_engine)]
    finally:
        cold_engine.close()

    engine = _engine(tiny_dense_model, device, tmp_path / "cache", memory_budget=2**30)
    try:
        ram = _conversation(engine)
    finally:
        engine.close()
    assert [e.text for e in ram] == cold
    assert ram[0].timings.cache_source == "none"
    assert ram[1].timings.cache_source == "memory" and ram[1].cached_tokens > 0

    disk_engine = _engine(tiny_dense_model, device, tmp_path / "cache", memory_budget=0)
    try:
        disk = _conversation(disk_engine)
    finally:
        disk_engine.close()
    assert [e.text for e in disk] == cold
    assert all(e.timings.cache_source == "disk" and e.cached_tokens > 0 for e in disk), [
        e.timings for e in disk
    ]
