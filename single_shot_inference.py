#!/usr/bin/env python3
"""Single-shot DeepSeek-V4 inference: one prompt in, the streamed reply out.

A thin CLI over `dsv4.engine`: arguments -> Engine.from_pretrained -> Engine.generate -> print.
Reasoning streams under a "[reasoning]" header (dimmed on a terminal), the reply under "[answer]";
progress and a performance line go to stderr. Without --model it runs the embedded demo model
(random weights, real tokenizer). Exit status: 0 ok, 1 runtime error, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_CONTEXT = {"cpu": 4096, "cuda": 32768}


class UsageError(Exception):
    """A bad argument value: exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors, in this tool's one-line format
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description="Generate one DeepSeek-V4 reply to a prompt.",
               epilog="Exit status: 0 success, 1 runtime error (model, device, context), 2 bad arguments.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="the user message")
    src.add_argument("--prompt-file", metavar="PATH", help="read the user message from a UTF-8 file")
    p.add_argument("--system", metavar="TEXT", help="system prompt placed before the user message")
    p.add_argument("--thinking-mode", choices=("thinking", "chat"), default="thinking",
                   help="thinking: the model reasons first, then answers; chat: it answers directly")
    p.add_argument("--reasoning-effort", choices=("low", "high", "max"),
                   help="thinking budget prefix; the preview release accepts high and max, 0731 also low")
    p.add_argument("--model", metavar="DIR",
                   help="checkpoint directory (default: the embedded random-weight demo model, "
                        "generated once into $DSV4_CACHE or ~/.cache/dsv4)")
    p.add_argument("--device", metavar="DEV",
                   help="cpu, cuda, cuda:N, or a list such as cuda:0,cuda:1 to spread the layers "
                        "(default: cuda when available, else cpu)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N",
                   help="stop after this many tokens (default 256)")
    p.add_argument("--temperature", type=float, metavar="T",
                   help="0 = greedy; default from the checkpoint's generation_config.json (1.0)")
    p.add_argument("--top-p", type=float, metavar="P",
                   help="nucleus sampling mass in (0, 1]; default from the checkpoint (1.0)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="sample among the k most likely tokens; 0 disables (default)")
    p.add_argument("--seed", type=int, metavar="N", help="random seed, for reproducible sampling")
    p.add_argument("--max-context", type=int, metavar="N",
                   help=f"prompt + generated tokens the state is sized for (default {DEFAULT_CONTEXT['cpu']} "
                        f"on CPU, {DEFAULT_CONTEXT['cuda']} on CUDA)")
    p.add_argument("--numerics", choices=("reference", "exact"), default="reference",
                   help="reference: DeepSeek's quantization simulation (default); exact: plain float math")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activation dtype")
    p.add_argument("--eager", action="store_true",
                   help="on CUDA, decode without CUDA graphs (slower; for debugging)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result at the end")
    p.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    return p


def read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or e
            raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {reason}") from None
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise UsageError("no prompt: pass --prompt TEXT, --prompt-file PATH, or pipe text on stdin")
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


class StreamPrinter:
    """Writes deltas as they arrive under section labels; on a terminal the labels are bold and the
    reasoning is dimmed, so it reads apart from the answer."""

    STYLE = {"reasoning": "\x1b[2m", "answer": "", "tool calls": ""}

    def __init__(self, out, color: bool):
        self.out, self.color, self.section = out, color, None

    def _enter(self, name: str) -> None:
        if self.section != name:
            gap = "\n\n" if self.section else ""
            label = f"\x1b[0m{gap}\x1b[1m[{name}]\x1b[0m{self.STYLE[name]}" if self.color else f"{gap}[{name}]"
            self.out.write(label + "\n")
            self.section = name

    def __call__(self, delta) -> None:
        if delta.reasoning:
            self._enter("reasoning")
            self.out.write(delta.reasoning)
        if delta.content:
            self._enter("answer")
            self.out.write(delta.content)
        for call in delta.tool_calls:
            self._enter("tool calls")
            self.out.write(f"{call['function']['name']}({call['function']['arguments']})\n")
        self.out.flush()

    def close(self) -> None:
        if self.section:
            self.out.write(("\x1b[0m" if self.color else "") + "\n")
            self.out.flush()


def stats_line(r) -> str:
    t = r.timings

    def rate(v):
        return f"{v:.1f} tok/s" if v is not None else "n/a"

    load = f" | load {t['load_s']:.2f} s" if t.get("load_s") is not None else ""
    return (f"prompt {r.usage['prompt_tokens']} tok | generated {r.usage['completion_tokens']} tok "
            f"({r.finish_reason}){load} | ttft {t['ttft_s']:.3f} s | prefill {rate(t['prefill_tok_s'])} "
            f"| decode {rate(t['decode_tok_s'])}")


def run(args) -> None:
    prompt = read_prompt(args)
    from dsv4.engine import Engine, EngineError, check_devices, parse_devices
    from dsv4.sampling import SamplingParams

    try:  # validate every value before the (slow) model load
        devices = parse_devices(args.device)
        overrides = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                         max_new_tokens=args.max_new_tokens)
        SamplingParams(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise UsageError(str(e)) from None
    max_context = args.max_context
    if max_context is None:
        max_context = DEFAULT_CONTEXT["cuda" if devices[0].startswith("cuda") else "cpu"]
    if max_context < 2:
        raise UsageError(f"max-context must be >= 2, got {max_context}")
    check_devices(devices)  # before the demo is generated or anything loads

    import torch

    def status(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    model_dir = args.model
    if model_dir is None:
        from dsv4.demo import default_cache_dir, demo_checkpoint

        status(f"demo model (random weights): preparing its checkpoint in {default_cache_dir()} ...")
        try:
            model_dir = demo_checkpoint()
        except ValueError as e:  # e.g. no tokenizer to bundle: a setup problem, not a bug
            raise EngineError(f"cannot generate the demo checkpoint: {describe(e)}") from e
    status(f"loading {model_dir} on {','.join(devices)} ({args.numerics} numerics, {args.dtype}) ...")
    engine = Engine.from_pretrained(model_dir, device=devices, max_context=max_context, numerics=args.numerics,
                                    dtype=getattr(torch, args.dtype), graphs=not args.eager)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}]
    printer = None if args.json else StreamPrinter(sys.stdout, sys.stdout.isatty())
    result = engine.generate(messages, args.thinking_mode, args.reasoning_effort,
                             engine.with_defaults(**overrides), on_delta=printer)
    if printer:
        printer.close()
    else:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    status(stats_line(result))


def describe(e: BaseException) -> str:
    """The error's first line; a CheckpointError with several problems adds one indented line each."""
    problems = getattr(e, "problems", None)
    if problems:
        lines = [f"checkpoint {e.path}: " + (problems[0] if len(problems) == 1 else f"{len(problems)} problems")]
        return "\n".join(lines + ([f"  {p}" for p in problems] if len(problems) > 1 else []))
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):  # never die on a terminal that cannot show a character
        sys.stdout.reconfigure(errors="replace")
    try:
        run(args)
        return 0
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # piped into e.g. `head`: stop quietly, also at interpreter exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if args.debug:
            raise
        from dsv4.config import ConfigError
        from dsv4.engine import EngineError
        from dsv4.loader import CheckpointError

        expected = (ConfigError, CheckpointError, EngineError, OSError)
        prefix = "" if isinstance(e, expected) else f"internal error: {type(e).__name__}: "
        hint = "" if isinstance(e, expected) else " (rerun with --debug for the traceback)"
        print(f"error: {prefix}{describe(e)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
