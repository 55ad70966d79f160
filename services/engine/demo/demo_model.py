"""Random-weight demo checkpoints in Hugging Face layout, written deterministically
from a seed, so the stack runs and tests without downloading a model.

    python -m keepwarm.engine.demo.demo_model [--family dense|qwen3_5 (alias hybrid)|deepseek_v4|laguna|gpt_oss|gemma3]
        [--seed N] [--size small|tiny] [--force] DIR

A folder holds config.json, model.safetensors (bf16), generation_config.json and a
byte-level BPE tokenizer (tokenizer.json trained with `tokenizers` on the corpus
shipped in data/corpus.txt, ChatML special tokens) with a ChatML chat template in
tokenizer_config.json. Same arguments -> byte-identical files.

Families: `dense` (model_type qwen3) is built here; the others come from their
demo/<family>.py: `demo_config(size) -> dict` and `init_weights(config, seed) -> dict`.
This module overrides the config's vocab_size (the trained tokenizer's size, so
every id decodes) and its bos/eos/pad token ids before calling `init_weights`.

The folder appears atomically: everything is written and fsynced under
DIR.tmp-<pid>, then renamed to DIR, so an interrupted run never leaves a half
model behind under DIR.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from keepwarm.engine.cache.no_follow import fsync_dir
from keepwarm.engine.demo.draws import Draws, ones
from keepwarm.engine.models import FAMILIES as MODEL_FAMILIES
from keepwarm.engine.models import FAMILY_ALIASES, family_of

CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer uses the same), then byte-level.
QWEN_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Qwen2.5-style ChatML: system/user/assistant, tools, tool calls and tool results.
CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

SIZES = ("small", "tiny")


# --- tokenizer ----------------------------------------------------------------


def train_bpe(vocab_size: int, special_tokens: tuple[str, ...], corpus: Path = CORPUS) -> HFTokenizer:
    """A Qwen2-style byte-level BPE trained on `corpus` with at most `vocab_size` ids in
    total; `special_tokens` get the last ids. Deterministic for the same inputs."""
    n_train = vocab_size - len(special_tokens)
    if n_train < 257:
        raise ValueError(
            f"vocab_size {vocab_size} is too small: byte-level BPE needs > 256 + {len(special_tokens)}"
        )
    tok = HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=n_train,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


def tokenizer_config(
    tok: HFTokenizer,
    chat_template: str,
    eos_token: str,
    pad_token: str | None,
    bos_token: str | None = None,
    extra_special: tuple[str, ...] = (),
    tokenizer_class: str = "Qwen2Tokenizer",
) -> dict[str, Any]:
    """tokenizer_config.json contents in the form real Hugging Face checkpoints use."""
    decoder: dict[str, Any] = {}
    for tid, added in sorted(tok.get_added_tokens_decoder().items()):
        decoder[str(tid)] = {
            "content": added.content,
            "lstrip": added.lstrip,
            "normalized": added.normalized,
            "rstrip": added.rstrip,
            "single_word": added.single_word,
            "special": added.special,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(extra_special),
        "bos_token": bos_token,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos_token,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": pad_token,
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }


# --- dense (qwen3) --------------------------------------------------------------


def dense_demo_config(size: str) -> dict[str, Any]:
    """A Qwen3 config.json. "small" (~210M params with a ~11k vocab; ~1.1 TFLOP for a
    2,048-token prefill, ~3 s at the ~390 GFLOPS bf16 matmul rate of 2 idle AVX512-BF16
    cores) is the stack's default; "tiny" is for tests."""
    if size == "small":
        dims = dict(
            vocab_size=16384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=8, head_dim=64,
        )  # fmt: skip
    elif size == "tiny":
        dims = dict(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        )  # fmt: skip
    else:
        raise ValueError(f"demo size {size!r} is unknown (use one of {', '.join(SIZES)})")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **dims,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 32768,
        "max_window_layers": dims["num_hidden_layers"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": "bfloat16",
    }


def dense_init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights under transformers' Qwen3/Llama names. Matrices N(0, initializer_range);
    the two projections writing into the residual stream (o_proj, down_proj) are scaled
    by 1/sqrt(2 * layers) so the stream's norm stays O(1) through depth and the random
    model's logits stay varied; norm weights are ones."""
    layers = int(config["num_hidden_layers"])
    draws = Draws(config, seed, layers)
    normal, std, out_std = draws.normal, draws.std, draws.out_std
    hid, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    d = int(config.get("head_dim") or hid // heads)
    vocab = int(config["vocab_size"])
    qk_norm = config["model_type"] == "qwen3"

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, hid), std)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal((heads * d, hid), std)
        w[p + "self_attn.k_proj.weight"] = normal((kv_heads * d, hid), std)
        w[p + "self_attn.v_proj.weight"] = normal((kv_heads * d, hid), std)
        w[p + "self_attn.o_proj.weight"] = normal((hid, heads * d), out_std)
        if qk_norm:
            w[p + "self_attn.q_norm.weight"] = ones(d)
            w[p + "self_attn.k_norm.weight"] = ones(d)
        w[p + "mlp.gate_proj.weight"] = normal((inter, hid), std)
        w[p + "mlp.up_proj.weight"] = normal((inter, hid), std)
        w[p + "mlp.down_proj.weight"] = normal((hid, inter), out_std)
        w[p + "input_layernorm.weight"] = ones(hid)
        w[p + "post_attention_layernorm.weight"] = ones(hid)
    w["model.norm.weight"] = ones(hid)
    if not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = normal((vocab, hid), std)
    return w


# --- family table -----------------------------------------------------------------


@dataclass(frozen=True)
class DemoFamily:
    """How to make one family's demo: a config for a size, then weights from config + seed."""

    demo_config: Callable[[str], dict[str, Any]]
    init_weights: Callable[[dict[str, Any], int], dict[str, torch.Tensor]]


def _demo_family(family: str) -> DemoFamily:
    """The family's demo: dense's is written here, every other family's in demo/<family>.py."""
    if family == "dense":
        return DemoFamily(dense_demo_config, dense_init_weights)
    mod = importlib.import_module(f"keepwarm.engine.demo.{family}")
    return DemoFamily(mod.demo_config, mod.init_weights)


# family name (CLI; the registry's names and aliases, models/__init__.py) -> loader; modules are
# imported only when that family is asked for.
FAMILIES: dict[str, Callable[[], DemoFamily]] = {
    name: functools.partial(_demo_family, family_of(name)) for name in (*MODEL_FAMILIES, *FAMILY_ALIASES)
}


# --- writing ------------------------------------------------------------------------


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    _write(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def write_demo_files(out: Path, family: str, seed: int, size: str) -> dict[str, Any]:
    """Write every file of the demo checkpoint into the existing empty folder `out`;
    returns the config written. Not atomic by itself (see `make_demo_model`)."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is unknown (use one of {', '.join(FAMILIES)})")
    if size not in SIZES:
        raise ValueError(f"demo size {size!r} is unknown (use one of {', '.join(SIZES)})")
    fam = FAMILIES[family]()
    config = dict(fam.demo_config(size))

    tok = train_bpe(int(config["vocab_size"]), CHATML_SPECIAL_TOKENS)
    ids = {t: tok.token_to_id(t) for t in CHATML_SPECIAL_TOKENS}
    assert all(v is not None for v in ids.values()), "special tokens were just added"
    # The corpus can saturate BPE below the requested size; the model gets exactly the
    # tokenizer's size so that every id it can emit decodes.
    config["vocab_size"] = int(tok.get_vocab_size(with_added_tokens=True))
    config["bos_token_id"] = ids[ENDOFTEXT]
    config["eos_token_id"] = ids[IM_END]
    config["pad_token_id"] = ids[ENDOFTEXT]

    weights = fam.init_weights(config, seed)
    tensors = {name: t.contiguous() for name, t in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # readable by a container user, like the other files
    with open(out / "model.safetensors", "rb+") as f:
        os.fsync(f.fileno())

    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[ENDOFTEXT],
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.8,
            "top_k": 20,
        },
    )
    _write(out / "tokenizer.json", tok.to_str(pretty=True).encode("utf-8"))
    _write_json(
        out / "tokenizer_config.json",
        tokenizer_config(
            tok, CHATML_TEMPLATE, eos_token=IM_END, pad_token=ENDOFTEXT, extra_special=(IM_START, IM_END)
        ),
    )
    return config


def make_demo_model(
    dest: str | Path, family: str = "dense", seed: int = 0, size: str = "small", force: bool = False
) -> Path:
    """Create the demo checkpoint folder `dest` atomically. An existing `dest` is an error
    unless `force`, which replaces it (the old folder is removed only after the new one is in place)."""
    dest = Path(dest).expanduser().resolve()
    if dest.exists() and not force:
        raise FileExistsError(f"{dest} already exists (pass --force to replace it, or choose another folder)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f"{dest.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write_demo_files(tmp, family, seed, size)
        fsync_dir(tmp)
        old = None
        if dest.exists():
            old = dest.parent / f"{dest.name}.old-{os.getpid()}"
            os.rename(dest, old)
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="make-demo-model", description="Write a random-weight demo checkpoint (HF layout) to DIR."
    )
    ap.add_argument("dir", metavar="DIR", help="folder to create")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", choices=SIZES, default="small")
    ap.add_argument("--force", action="store_true", help="replace DIR if it exists")
    args = ap.parse_args(argv)
    try:
        path = make_demo_model(args.dir, args.family, args.seed, args.size, args.force)
    except (FileExistsError, ValueError) as e:
        print(f"make-demo-model: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((path / "config.json").read_text())
    size_mb = (path / "model.safetensors").stat().st_size / 2**20
    print(
        f"{path}: {args.family} ({cfg['model_type']}), {args.size}, seed {args.seed}, {size_mb:.0f} MiB of weights"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
