"""keepwarm engine CLI.

  python -m keepwarm.engine generate --model DIR --prompt TEXT [--max-tokens N]
  python -m keepwarm.engine chat --model DIR
  python -m keepwarm.engine serve --model DIR [--port 8100]

Every engine flag also reads KEEPWARM_<FLAG> from the environment.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from keepwarm.engine.config import ConfigError, add_engine_args, config_from
from keepwarm.engine.generation.sampling import SamplingParams


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def _sampling(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed
    )


def _print_timings(ev: object) -> None:
    from keepwarm.engine.generation.request import FinishEvent

    assert isinstance(ev, FinishEvent)
    t = ev.timings
    print(
        f"\n[{ev.prompt_tokens} prompt tokens ({t.restored_tokens} restored from {t.cache_source}), "
        f"{ev.completion_tokens} generated | ttft {t.ttft_ms:.0f} ms, prefill {t.prefill_ms:.0f} ms, "
        f"restore {t.restore_ms:.0f} ms, decode {t.decode_tokens_per_sec:.1f} tok/s, finish {ev.finish_reason}]",
        file=sys.stderr,
    )


def _stream(engine: object, req: object) -> str:
    from keepwarm.engine.engine import Engine
    from keepwarm.engine.generation.request import FinishEvent, GenerateRequest, TokenEvent

    assert isinstance(engine, Engine) and isinstance(req, GenerateRequest)
    text = ""
    for ev in engine.generate(req):
        if isinstance(ev, TokenEvent):
            print(ev.text, end="", flush=True)
        elif isinstance(ev, FinishEvent):
            text = ev.text
            _print_timings(ev)
    return text


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keepwarm.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt (rendered as a user message)")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", default=None)
    gen.add_argument(
        "--raw", action="store_true", help="tokenize the prompt as is, without the chat template"
    )
    chat = sub.add_parser("chat", help="interactive chat; empty line or Ctrl-D quits")
    add_engine_args(chat)
    _sampling_args(chat)
    chat.add_argument("--system", default=None)
    serve = sub.add_parser("serve", help="the engine HTTP service")
    add_engine_args(serve)
    args = parser.parse_args(argv)
    try:
        cfg = config_from(args)
    except ConfigError as e:
        parser.error(str(e))
    if cfg.models and args.command != "serve":
        parser.error(f"{args.command} takes one --model (several, or a models folder, are for serve)")
    if args.command == "serve":
        from keepwarm.engine.serving.server import serve as run_server

        try:
            run_server(cfg)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0

    from keepwarm.engine.engine import Engine
    from keepwarm.engine.generation.request import GenerateRequest

    try:
        engine = Engine(cfg)
    except ValueError as e:  # CheckpointError, TokenizerError, ...: the message says what to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.command == "generate":
            if args.raw:
                req = GenerateRequest(
                    sampling=_sampling(args), prompt_tokens=tuple(engine.tokenizer.encode(args.prompt))
                )
            else:
                msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                    {"role": "user", "content": args.prompt}
                ]
                req = GenerateRequest(sampling=_sampling(args), messages=tuple(msgs))
            _stream(engine, req)
            print()
            return 0
        messages: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
        print(f"keepwarm chat on {cfg.model} ({cfg.dtype}, {cfg.device}); empty line quits.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            reply = _stream(engine, GenerateRequest(sampling=_sampling(args), messages=tuple(messages)))
            print()
            messages.append({"role": "assistant", "content": reply})
        return 0
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
