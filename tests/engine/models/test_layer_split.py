"""Layer split (issue 15): a model's layers on several stages, each with its weights and
state on its device, gives the logits and greedy tokens of one stage; its snapshots carry
the canonical global names, so a file written by a 2-stage engine is byte-identical (but
for its creation time) to the 1- and 3-stage ones, and any split adopts it.

Stages run on the `cpu` device (the same code paths: per-stage weights and state, hops at
stage boundaries); with a GPU, splits across the GPU and the CPU run too.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from keepwarm.engine.config import ConfigError
from keepwarm.engine.engine import Engine
from keepwarm.engine.generation.cache_policy import Policy
from keepwarm.engine.loading.checkpoint import open_checkpoint
from keepwarm.engine.models import build_backend
from keepwarm.engine.models.backend import Backend
from keepwarm.engine.models.placement import LayerSplit, Placement, PlacementError
from tests.engine.test_engine import SYSTEM, USER_TURNS, _cfg, _req

FAMILIES = ("dense", "qwen3_5", "deepseek_v4", "laguna", "gpt_oss")
_FIXTURE = {
    "dense": "tiny_dense4_model",
    "qwen3_5": "tiny_hybrid_model",
    "deepseek_v4": "tiny_deepseek_model",
    "laguna": "tiny_laguna_model",
    "gpt_oss": "tiny_gpt_oss_model",
}
LOGITS_ATOL = 1e-5
CPU = torch.device("cpu")
# every split is compared with one stage on its first device; with a GPU, mixed splits too
SPLITS = ["cpu,cpu", "cpu,cpu,cpu"] + (["cuda:0,cpu", "cpu,cuda:0,cpu"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session")
def tiny_dense4_model(tiny_dense_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense demo (tied embeddings) with 4 layers, so that 3 stages fit."""
    from keepwarm.engine.demo.demo_model import dense_init_weights

    path = tmp_path_factory.mktemp("models") / "tiny-dense4"
    shutil.copytree(tiny_dense_model, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=4, max_window_layers=4)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(dense_init_weights(cfg, 1), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, request.getfixturevalue(_FIXTURE[request.param])


# -- parsing -------------------------------------------------------------------------
def test_named_ranges_and_even_splits() -> None:
    p = LayerSplit.parse("cpu:0-1,cpu:2-5").place(6)
    assert [(s.first, s.stop) for s in p.stages] == [(0, 2), (2, 6)]
    assert [p.device_of(i) for i in range(6)] == [CPU] * 6
    assert str(p) == "cpu:0-1,cpu:2-5"
    # stages may be listed in any order; layers stay in order
    assert str(LayerSplit.parse("cpu:3-4,cpu:0-2").place(5)) == "cpu:0-2,cpu:3-4"
    # an even split: the first stages take one more when the layers do not divide
    assert str(LayerSplit.parse("cpu,cpu,cpu").place(4)) == "cpu:0-1,cpu:2-2,cpu:3-3"
    assert str(LayerSplit.parse("cpu, cpu").place(48)) == "cpu:0-23,cpu:24-47"
    assert str(Placement.from_config("", "cpu", 3)) == "cpu:0-2"


@pytest.mark.parametrize(
    "text,layers,message",
    [
        ("cpu:0-1,cpu:3-5", 6, "layers 2-2 belong to no stage"),
        ("cpu:0-3,cpu:3-5", 6, "overlap at layer 3"),
        (
            "cpu:0-2,cpu:3-7",
            6,
            "layer 7 is out of range; this model has 6 layers (0-5): end the last range at 5",
        ),
        ("cpu:0-2,cpu:3-4", 6, "layers 5-5 belong to no stage"),
        ("cpu:1-5", 6, "layers 0-0 belong to no stage"),
        ("cpu:4-2", 6, "backwards"),
        ("tpu:0-2,cpu:3-5", 6, "unknown device 'tpu'"),
        ("cpu:0-2,cpu", 6, "either every stage names its layers"),
        ("cpu,,cpu", 6, "comma-separated stages"),
        ("cpu,cpu,cpu", 2, "names 3 devices but this model has 2 layers"),
    ],
)
def test_bad_splits_say_what_to_change(text: str, layers: int, message: str) -> None:
    with pytest.raises(PlacementError, match="--layer-split") as e:
        LayerSplit.parse(text).place(layers)
    assert message in str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_a_gpu_stage_without_a_gpu_is_refused(tiny_dense_model: Path) -> None:
    with pytest.raises(ConfigError, match="torch sees no GPU here; use cpu stages"):
        _cfg(tiny_dense_model, None, layer_split="cuda:0,cpu")


def test_device_and_split_together_are_refused(tiny_dense_model: Path) -> None:
    with pytest.raises(ConfigError, match="drop --device"):
        _cfg(tiny_dense_model, None, layer_split="cpu,cpu", device="cuda:0")


# -- parity ----------------------------------------------------------------------------
def _placed(model: Path, split: str) -> Backend:
    ckpt = open_checkpoint(model)
    placement = Placement.from_config(split if "," in split else "", split, ckpt.num_layers)
    return build_backend(ckpt, placement, torch.float32, placement.ops())


def _run(b: Backend) -> tuple[torch.Tensor, list[list[int]]]:
    """Two sequences through batched steps: a chunked prefill beside a short one, the rest
    of the long one alone, then greedy decodes of both. Every step's logits, concatenated
    [rows, vocab] on the CPU, and each sequence's tokens."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, b.vocab_size, (45,), generator=g)
    a, c = b.new_state(96), b.new_state(96)
    rows = [b.step([a, c], [prompt[:20], prompt[30:37]])]
    rows.append(b.step([a], [prompt[20:]]))
    last = torch.stack([rows[-1][0], rows[0][1]])
    tokens: list[list[int]] = [[], []]
    for _ in range(6):
        nxt = last.argmax(-1)
        for i in range(2):
            tokens[i].append(int(nxt[i]))
        last = b.step([a, c], [nxt[:1], nxt[1:]])
        rows.append(last)
    return torch.cat([r.float().cpu() for r in rows]), tokens


def test_split_gives_one_stage_logits_and_tokens(family_model: tuple[str, Path]) -> None:
    family, model = family_model
    for split in SPLITS:
        first = split.split(",")[0]
        ref_logits, ref_tokens = _run(_placed(model, first))
        b = _placed(model, split)
        placement = b.placement  # type: ignore[attr-defined]
        assert len(placement.stages) == len(split.split(",")), f"{family}: {placement}"
        state = b.new_state(8)
        for i in range(placement.num_layers):  # each layer's state lives on its stage
            layer = [t for n, t in state.tensors.items() if n.startswith(f"layers.{i}.")]
            assert layer and all(t.device == placement.device_of(i) for t in layer), (family, i)
        logits, tokens = _run(b)
        diff = (logits - ref_logits).abs().max().item()
        assert diff <= LOGITS_ATOL, f"{family} {split}: logits differ by {diff}"
        assert tokens == ref_tokens, f"{family} {split}"


# -- snapshots across topologies ----------------------------------------------------------
TOPOLOGIES = {"1": "", "2": "cpu,cpu", "3": "cpu,cpu,cpu"}


def _turn(engine: Engine, history: list[dict[str, str]], user: str, policy: Policy | None = None) -> str:
    ev = engine.complete(_req([*history, {"role": "user", "content": user}], policy))
    return ev.text


def _write_turn_one(model: Path, split: str, cache: Path) -> tuple[str, str]:
    engine = Engine(_cfg(model, cache, layer_split=split))
    try:
        reply = _turn(engine, [{"role": "system", "content": SYSTEM}], USER_TURNS[0])
        engine.flush()
        return reply, engine.namespace
    finally:
        engine.close()


def _files(cache: Path, namespace: str) -> dict[str, Path]:
    return {str(f.relative_to(cache)): f for f in sorted((cache / namespace).rglob("*.safetensors"))}


def _without_created(path: Path) -> tuple[dict[str, object], bytes]:
    """A safetensors file's header (metadata less `created`, and `header_checksum`, which
    hashes the header with `created` in it) and its payload bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = dict(header.pop("__metadata__"))
    del meta["created"], meta["header_checksum"]
    return {"meta": meta, **header}, raw[8 + n :]


def adopt_and_continue(model: str, cache: str, split: str, reply1: str) -> list[object]:
    """Turn 2 on an engine of `split` with the RAM tier off: [text, cache_source, cached_tokens]."""
    engine = Engine(_cfg(Path(model), Path(cache), layer_split=split, memory_budget=0))
    try:
        history = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER_TURNS[0]},
            {"role": "assistant", "content": reply1},
        ]
        ev = engine.complete(_req([*history, {"role": "user", "content": USER_TURNS[1]}]))
        return [ev.text, ev.timings.cache_source, ev.cached_tokens]
    finally:
        engine.close()


def test_snapshots_do_not_depend_on_the_split(family_model: tuple[str, Path], tmp_path: Path) -> None:
    family, model = family_model
    written: dict[str, tuple[str, str]] = {}
    for name, split in TOPOLOGIES.items():
        written[name] = _write_turn_one(model, split, tmp_path / f"cache{name}")
    reply1, namespace = written["2"]
    assert {ns for _, ns in written.values()} == {namespace}, "the namespace excludes the topology"
    assert {r for r, _ in written.values()} == {reply1}

    # the same files, byte for byte but for their creation time
    files = {name: _files(tmp_path / f"cache{name}", namespace) for name in TOPOLOGIES}
    assert files["2"] and files["1"].keys() == files["2"].keys() == files["3"].keys(), family
    for rel in files["2"]:
        two = _without_created(files["2"][rel])
        assert _without_created(files["1"][rel]) == two, f"{family} {rel}: 1-stage file differs"
        assert _without_created(files["3"][rel]) == two, f"{family} {rel}: 3-stage file differs"

    # turn 2 without any snapshot: the reference
    cold = Engine(_cfg(model, None, memory_budget=0))
    try:
        history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER_TURNS[0]},
                   {"role": "assistant", "content": reply1}]  # fmt: skip
        reference = _turn(cold, history, USER_TURNS[1], Policy("off"))
    finally:
        cold.close()

    # fresh processes: a 1-stage and a 3-stage engine adopt the 2-stage engine's files
    for split in ("", "cpu,cpu,cpu"):
        cache = tmp_path / f"adopt-{len(split.split(','))}"
        shutil.copytree(tmp_path / "cache2", cache)
        code = (
            "import json; from tests.engine.models.test_layer_split import adopt_and_continue;"
            f"print(json.dumps(adopt_and_continue({str(model)!r}, {str(cache)!r}, {split!r}, {reply1!r})))"
        )
        root = Path(__file__).resolve().parents[3]
        res = subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
        )
        assert res.returncode == 0, res.stderr[-3000:]
        text, source, cached = json.loads(res.stdout.strip().splitlines()[-1])
        assert source == "disk" and cached > 0, (family, split, source, cached)
        assert text == reference, f"{family} split {split!r}: turn 2 after adopting differs"
