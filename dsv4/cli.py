"""The `dsv4` command (also `python -m dsv4` and `single_shot_inference.py`): DeepSeek-V4 from a shell.

One prompt in, the streamed reply out; or a conversation from an OpenAI-shaped --messages file with
--tools; or --interactive, a multi-turn chat on one loaded model that reuses the prefix already in
the state; or --raw text continuation without the chat template. A thin layer over `dsv4.engine`:
arguments are checked against the checkpoint (config, tokenizer, encoder release) before any
weight loads. Reasoning streams under a "[reasoning]" header (dimmed on a terminal), the reply under
"[answer]", tool calls under "[tool calls]"; progress, notes and a stats line go to stderr.
Without --model it runs the embedded demo model (random weights, real tokenizer).
Exit status: 0 ok, 1 runtime error, 2 usage error, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

DESCRIPTION = """\
Generate DeepSeek-V4 replies: one prompt (an argument, -p, --prompt-file or stdin), a conversation
(--messages, --tools), an interactive chat (-i) or raw text continuation (--raw). Without --model the
built-in demo model runs (random weights: the text is gibberish)."""

EPILOG = """\
examples:
  dsv4 "What is 2+2?"                            # the demo model, thinking mode
  dsv4 -m ~/DeepSeek-V4-Flash -n 512 -p "Hello"    # a real checkpoint
  dsv4 --messages chat.json --tools tools.json --json
  dsv4 -i --thinking-mode chat                    # chat; /reset clears it, /exit or Ctrl-D ends it

Exit status: 0 success, 1 runtime error (model, device, context), 2 bad arguments, 130 interrupted."""


class UsageError(Exception):
    """A bad argument value: exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors, in this tool's one-line format
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("dsv4")
    except Exception:  # running from a checkout that was never installed
        return "unknown"


# dsv4.engine's values, repeated so that --help needs no torch import (tests/test_cli.py checks them)
DEFAULT_CONTEXT = {"cpu": 4096, "cuda": 32768}
MAX_LOGPROBS = 20


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    inp = p.add_argument_group("input")
    inp.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the user message (same as -p)")
    inp.add_argument("-p", "--prompt", metavar="TEXT", help="the user message")
    inp.add_argument("--prompt-file", metavar="PATH", help="read the user message from a UTF-8 file")
    inp.add_argument("--messages", metavar="FILE",
                     help="a JSON list of OpenAI-shaped messages (system, user, assistant with reasoning_content "
                          "and tool_calls, tool results), or a request body with \"messages\" and \"tools\"; "
                          "- reads stdin; a prompt given too is appended as the last user message")
    inp.add_argument("--tools", metavar="FILE",
                     help="a JSON list of OpenAI tool schemas; they ride on the system message and the parsed "
                          "calls come back under [tool calls] and in --json tool_calls")
    inp.add_argument("--system", metavar="TEXT", help="system prompt placed before the user message")
    inp.add_argument("-i", "--interactive", action="store_true",
                     help="multi-turn chat: one user turn per line on stdin; earlier turns are kept as the encoding "
                          "prescribes and the prefix already computed is reused; /reset, /tool TEXT, /exit")
    inp.add_argument("--raw", action="store_true",
                     help="feed the prompt as-is (no chat template, no BOS added) and print the continuation "
                          "unparsed")

    gen = p.add_argument_group("generation")
    gen.add_argument("--thinking-mode", choices=("thinking", "chat"),
                     help="thinking (default): the model reasons first, then answers; chat: it answers directly")
    gen.add_argument("--reasoning-effort", choices=("low", "high", "max"),
                     help="thinking budget; the preview encoder accepts high (no prefix) and max, the 0731 "
                          "encoder low (no prefix), high and max; checked against the checkpoint before loading")
    gen.add_argument("-n", "--max-new-tokens", type=int, default=256, metavar="N",
                     help="stop after this many tokens (default 256)")
    gen.add_argument("--temperature", type=float, metavar="T",
                     help="0 = greedy; default from the checkpoint's generation_config.json (1.0)")
    gen.add_argument("--top-p", type=float, metavar="P",
                     help="nucleus sampling mass in (0, 1]; default from the checkpoint (1.0)")
    gen.add_argument("--top-k", type=int, metavar="K",
                     help="sample among the k most likely tokens; 0 disables (default)")
    gen.add_argument("--seed", type=int, metavar="N",
                     help="random seed, for reproducible sampling (the same seed, the same tokens under the same "
                          "--kernels: the fast and the reference sampler draw from different random streams)")
    gen.add_argument("--stop", action="append", default=[], metavar="STR",
                     help="end the reply where this text appears (not included); repeatable")

    mdl = p.add_argument_group("model")
    mdl.add_argument("-m", "--model", metavar="DIR",
                     help="checkpoint directory (default: the embedded random-weight demo model, "
                          "written once into $DSV4_CACHE or ~/.cache/dsv4)")
    mdl.add_argument("--device", metavar="DEV",
                     help="cpu, cuda, cuda:N, or a list such as cuda:0,cuda:1 to spread the layers "
                          "(default: cuda when available, else cpu)")
    mdl.add_argument("--max-context", type=int, metavar="N",
                     help=f"prompt + generated tokens the state is sized for (default {DEFAULT_CONTEXT['cpu']} "
                          f"on CPU, {DEFAULT_CONTEXT['cuda']} on CUDA, at most the model's "
                          "max_position_embeddings)")
    mdl.add_argument("--numerics", choices=("reference", "exact"), default="reference",
                     help="reference: DeepSeek's quantization simulation (default); exact: plain float math")
    mdl.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                     help="activation dtype (default bfloat16)")
    mdl.add_argument("--eager", action="store_true",
                     help="on CUDA, decode and prefill without CUDA graphs (slower; for debugging)")
    mdl.add_argument("--no-prefill-graphs", action="store_true",
                     help="on CUDA, run prefill chunks eagerly while decode keeps its per-layer CUDA graphs: saves "
                          "the prefill graphs' memory (about 2.4 GB for Flash) at about a third of the prefill speed")
    mdl.add_argument("--kv-fp8", action="store_true",
                     help="keep the state's K = V rows as packed FP8 rows (the reference numerics' own values in "
                          "42%% less memory for them; slower attention reads, and on a GPU the prefill attention sums "
                          "them in another order). Needs --numerics reference and --dtype bfloat16")
    mdl.add_argument("--keys-fp4", action="store_true",
                     help="keep the Lightning Indexer's keys as packed FP4 rows (the same output, 69%% less memory for "
                          "them; faster decode near 128K of context, slower at 1M and in prefill). Needs --numerics "
                          "reference and --dtype bfloat16")
    mdl.add_argument("--kernels", metavar="SPEC",
                     help="op backends: fast (Triton/CUDA kernels; the default on CUDA), ref (the PyTorch "
                          "reference ops; the default on CPU), or per op, e.g. fast,sparse_attn=ref; the run "
                          "banner lists what runs where")

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object with the result at the end (one per turn with -i)")
    out.add_argument("--logprobs", type=int, metavar="N",
                     help=f"with --json: each generated token's log-probability and the N (0..{MAX_LOGPROBS}) "
                          "most likely alternatives")
    out.add_argument("--show-special", action="store_true",
                     help="print special tokens (<｜User｜>, ...) in the streamed text instead of hiding them")
    out.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    out.add_argument("--version", action="version", version=f"dsv4 {version()}")
    return p


# ---- input ---------------------------------------------------------------------------------------

NO_PROMPT = "pass it as an argument (dsv4 \"Hello\"), with -p/--prompt TEXT or --prompt-file PATH, or pipe it on stdin"


def read_prompt(args, required: bool) -> str | None:
    """The user text from the positional argument, -p, --prompt-file or stdin (None if not given and
    not required)."""
    given = [name for name, v in (("PROMPT", args.prompt_arg), ("--prompt", args.prompt),
                                  ("--prompt-file", args.prompt_file)) if v is not None]
    if len(given) > 1:
        raise UsageError(f"give the prompt once: {' and '.join(given)} both set it")
    if args.prompt_arg is not None or args.prompt is not None:
        text = args.prompt_arg if args.prompt_arg is not None else args.prompt
        if not text.strip():
            raise UsageError("the prompt is empty")
        return text
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, "strerror", None) or e
            raise UsageError(f"cannot read --prompt-file {args.prompt_file}: {reason}") from None
        if not text.strip():
            raise UsageError(f"--prompt-file {args.prompt_file} is empty")
        return text
    if not required:
        return None
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(f"no prompt: {NO_PROMPT}")
    text = sys.stdin.read()
    if not text.strip():
        raise UsageError(f"no prompt: stdin was empty; {NO_PROMPT}")
    return text


def build_messages(args) -> tuple[list[dict] | None, str | None]:
    """(conversation, raw prompt): exactly one is set. UsageError for bad files or combinations."""
    from dsv4.messages import MessageError, load_request, normalize_messages

    if args.raw:
        for flag, on in (("--messages", args.messages), ("--tools", args.tools), ("--system", args.system),
                         ("--interactive", args.interactive)):
            if on:
                raise UsageError(f"--raw feeds the prompt without the chat template; it cannot be combined with {flag}")
        return None, read_prompt(args, required=True)
    try:
        raw_messages, tools = load_request(args.messages, args.tools)
        prompt = read_prompt(args, required=raw_messages is None and not args.interactive)
        messages = list(raw_messages or [])
        if args.system is not None:
            if any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
                raise UsageError("--system and a system message in --messages: keep one")
            messages.insert(0, {"role": "system", "content": args.system})
        if prompt is not None:
            messages.append({"role": "user", "content": prompt})
        if args.interactive:
            # the conversation so far may end anywhere (the next line typed continues it); a
            # placeholder user turn lets the checks run, then goes
            if not messages and not tools:
                return [], None
            return normalize_messages(messages + [{"role": "user", "content": "."}], tools)[:-1], None
        where = "--messages" if args.messages else "messages"
        return normalize_messages(messages, tools, where=where), None
    except MessageError as e:
        raise UsageError(str(e)) from None


# ---- output --------------------------------------------------------------------------------------


class SpecialFilter:
    """Removes special-token strings (<｜User｜>, <｜place▁holder▁no▁7｜>, ...) from streamed text.

    Text that may still be the start of one is held until it resolves, so a token split across
    deltas is removed too; `flush()` releases the rest at the end of a section."""

    def __init__(self, specials):
        import re

        self.specials = sorted({s for s in specials if s}, key=len, reverse=True)
        self.regex = re.compile("|".join(re.escape(s) for s in self.specials)) if self.specials else None
        self.prefixes = {s[:i] for s in self.specials for i in range(1, len(s))}
        self.longest = max((len(s) for s in self.specials), default=0)
        self.buf = ""

    def __call__(self, text: str) -> str:
        if self.regex is None:
            return text
        self.buf = self.regex.sub("", self.buf + text)
        keep = len(self.buf)
        for i in range(max(0, len(self.buf) - self.longest + 1), len(self.buf)):
            if self.buf[i:] in self.prefixes:
                keep = i
                break
        out, self.buf = self.buf[:keep], self.buf[keep:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def special_tokens(tokenizer) -> list[str]:
    """The added (control) tokens of a tokenizer, read from its tokenizer.json."""
    try:
        data = json.loads(Path(tokenizer.path).read_text(encoding="utf-8"))
        return [t["content"] for t in data.get("added_tokens", []) if isinstance(t, dict) and t.get("content")]
    except (OSError, ValueError, AttributeError, TypeError):
        return []


class StreamPrinter:
    """Writes deltas as they arrive under section labels; on a terminal the labels are bold and the
    reasoning is dimmed, so it reads apart from the answer. `labels=False` (--raw) writes the text
    only. `hide` filters text (special tokens) per section."""

    STYLE = {"reasoning": "\x1b[2m", "answer": "", "tool calls": ""}

    def __init__(self, out, color: bool, hide: SpecialFilter | None = None, labels: bool = True):
        self.out, self.color, self.section, self.hide, self.labels = out, color, None, hide, labels
        self.open_call: int | None = None  # index of the tool call being streamed
        self.streamed: set[int] = set()  # indices of calls already shown (streamed)
        self.calls_done = 0

    def _enter(self, name: str) -> None:
        if self.section != name:
            self._release()
            gap = "\n\n" if self.section else ""
            if self.labels:
                label = f"\x1b[0m{gap}\x1b[1m[{name}]\x1b[0m{self.STYLE[name]}" if self.color else f"{gap}[{name}]"
                self.out.write(label + "\n")
            self.section = name

    def _release(self) -> None:
        if self.hide is not None:
            self.out.write(self.hide.flush())

    def _text(self, text: str) -> None:
        self.out.write(self.hide(text) if self.hide is not None else text)

    def __call__(self, delta) -> None:
        if delta.reasoning:
            self._enter("reasoning")
            self._text(delta.reasoning)
        if delta.content:
            self._enter("answer")
            self._text(delta.content)
        # Calls stream as name(arguments...) while their DSML arrives: the name when the invoke
        # header completes, argument fragments per parameter, ")" when the call completes.
        for d in getattr(delta, "tool_call_deltas", ()):
            self._enter("tool calls")
            if d.dropped:
                self.out.write(" ... [incomplete: not a call]\n")
                self.open_call = None
                self.streamed.discard(d.index)  # the index is reused by the next call
                continue
            if d.index != self.open_call:
                self._close_call()
                self.open_call = d.index
                self.streamed.add(d.index)
            self.out.write(f"{d.name}(" if d.name else "")
            self.out.write(d.arguments)
        done = range(self.calls_done, self.calls_done + len(delta.tool_calls))
        for index, call in zip(done, delta.tool_calls):
            self._enter("tool calls")
            if self.open_call == index:
                self._close_call()
            elif index not in self.streamed:  # a parser that does not stream calls: the whole call at once
                self.out.write(f"{call['function']['name']}({call['function']['arguments']})\n")
        self.calls_done += len(delta.tool_calls)
        self.out.flush()

    def _close_call(self) -> None:
        if self.open_call is not None:
            self.out.write(")\n")
            self.open_call = None

    def close(self) -> None:
        self._release()
        if self.section:
            self.out.write(("\x1b[0m" if self.color else "") + "\n")
            self.out.flush()
        self.section = None


def stats_line(r) -> str:
    t = r.timings

    def rate(v):
        return f"{v:.1f} tok/s" if v is not None else "n/a"

    cached = r.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    reused = f" ({cached} reused)" if cached else ""
    load = f" | load {t['load_s']:.2f} s" if t.get("load_s") is not None else ""
    return (f"prompt {r.usage['prompt_tokens']} tok{reused} | generated {r.usage['completion_tokens']} tok "
            f"({r.finish_reason}){load} | ttft {t['ttft_s']:.3f} s | prefill {rate(t['prefill_tok_s'])} "
            f"| decode {rate(t['decode_tok_s'])}")


def status(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class PrefillProgress:
    """Engine.on_prefill for a terminal: "prefill N/M tokens" on stderr, rewritten in place, once a prompt's prefill
    has run longer than `after` seconds (short prompts print nothing); erased when the prefill ends, before the reply,
    or by clear() (a request that stopped half-way)."""

    def __init__(self, after: float = 1.0):
        self.after, self.t0, self.shown = after, None, False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.t0 is None or done == 0:  # the prefill starts
            self.t0, self.shown = now, False
        if done < total:
            if done and (self.shown or now - self.t0 >= self.after):
                sys.stderr.write(f"\rprefill {done}/{total} tokens")
                sys.stderr.flush()
                self.shown = True
        else:
            self.clear()

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        self.t0, self.shown = None, False


# ---- run -----------------------------------------------------------------------------------------


def no_effect_notes(args, release: str | None, devices: list[str]) -> list[str]:
    """One line per option that was given but changes nothing here."""
    from dsv4.engine import NO_OP_EFFORTS

    notes = []
    mode = args.thinking_mode or "thinking"
    if args.raw:
        for flag, v in (("--thinking-mode", args.thinking_mode), ("--reasoning-effort", args.reasoning_effort)):
            if v is not None:
                notes.append(f"{flag} has no effect with --raw (no chat template)")
    elif args.reasoning_effort is not None and mode == "chat":
        notes.append("--reasoning-effort has no effect with --thinking-mode chat (the effort prefix is part of "
                     "thinking mode)")
    elif release is not None and args.reasoning_effort in NO_OP_EFFORTS.get(release, ()):
        notes.append(f"--reasoning-effort {args.reasoning_effort} adds no prefix with this checkpoint's encoder "
                     f"({release}): it is the same prompt as no --reasoning-effort")
    on_cuda = any(d.startswith("cuda") for d in devices)
    if args.eager and not on_cuda:
        notes.append("--eager has no effect on CPU (CUDA graphs are used on CUDA only)")
    if args.no_prefill_graphs and not on_cuda:
        notes.append("--no-prefill-graphs has no effect on CPU (CUDA graphs are used on CUDA only)")
    elif args.no_prefill_graphs and args.eager:
        notes.append("--no-prefill-graphs has no effect with --eager (no CUDA graphs at all)")
    if args.temperature == 0:
        moot = [f for f, v in (("--top-p", args.top_p), ("--top-k", args.top_k), ("--seed", args.seed))
                if v is not None]
        if moot:
            notes.append(f"{', '.join(moot)} {'has' if len(moot) == 1 else 'have'} no effect with "
                         "--temperature 0 (greedy)")
    if args.show_special and args.json:
        notes.append("--show-special has no effect with --json (the JSON fields hold the text as generated)")
    return notes


def validate(args) -> tuple[list[str], dict]:
    """Checks that need no checkpoint; -> (devices, sampling overrides)."""
    from dsv4.engine import MAX_LOGPROBS, parse_devices
    from dsv4.sampling import SamplingParams

    try:
        devices = parse_devices(args.device)
        overrides = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                         max_new_tokens=args.max_new_tokens)
        SamplingParams(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.max_context is not None and args.max_context < 2:
        raise UsageError(f"--max-context must be >= 2, got {args.max_context}")
    if args.logprobs is not None:
        if not args.json:
            raise UsageError("--logprobs is reported in the --json object: add --json")
        if not 0 <= args.logprobs <= MAX_LOGPROBS:
            raise UsageError(f"--logprobs must be in [0, {MAX_LOGPROBS}], got {args.logprobs}")
    if any(s == "" for s in args.stop):
        raise UsageError("--stop needs a non-empty string")
    packed = [f for f, on in (("--kv-fp8", args.kv_fp8), ("--keys-fp4", args.keys_fp4)) if on]
    if packed and (args.numerics != "reference" or args.dtype != "bfloat16"):
        raise UsageError(f"{' and '.join(packed)} {'needs' if len(packed) == 1 else 'need'} --numerics reference and "
                         "--dtype bfloat16 (the rows it packs are that simulation's FP8 / FP4 values)")
    try:
        from dsv4 import ops

        _, kernel_overrides = ops.parse_kernels(args.kernels)
        unknown = sorted(set(kernel_overrides) - set(ops.OPS))
        if unknown:
            raise ValueError(f"--kernels: unknown op(s) {', '.join(unknown)}; ops are: {', '.join(ops.OPS)}")
        bad = {k: v for k, v in kernel_overrides.items() if v not in ops.BACKENDS}
        if bad:
            raise ValueError(f"--kernels: a backend is ref or fast, got {', '.join(f'{k}={v}' for k, v in bad.items())}")
    except ValueError as e:
        raise UsageError(str(e)) from None
    return devices, overrides


def resolve_model(args) -> Path:
    if args.model is not None:
        return Path(args.model).expanduser()
    from dsv4.demo import demo_bytes, demo_checkpoint

    def on_build(path: Path, reason: str | None) -> None:
        if reason is None:
            status(f"demo model (random weights): writing its checkpoint into {path} (once, "
                   f"{demo_bytes() / 1e6:.0f} MB) ...")
        else:
            status(f"demo model: the cached checkpoint in {path} does not verify ({reason}); rebuilding it ...")

    try:
        return demo_checkpoint(on_build=on_build)
    except ValueError as e:  # e.g. no tokenizer to bundle: a setup problem, not a bug
        from dsv4.engine import EngineError

        raise EngineError(f"cannot generate the demo checkpoint: {describe(e)}") from e


def run(args) -> int:
    messages, raw_prompt = build_messages(args)
    devices, overrides = validate(args)
    from dsv4.engine import (
        REASONING_EFFORTS, Engine, EngineError, check_devices, default_max_context, encode_conversation,
        inspect_model_dir,
    )

    check_devices(devices)  # before the demo is generated or anything loads
    model_dir = resolve_model(args)
    info = inspect_model_dir(model_dir)  # config, tokenizer and release: no weights yet
    mode = args.thinking_mode or "thinking"
    if not args.raw and args.reasoning_effort not in (None, *REASONING_EFFORTS[info.release]):
        raise UsageError(f"--reasoning-effort {args.reasoning_effort} is not accepted by this checkpoint's encoder "
                         f"({info.release}); choose one of {', '.join(REASONING_EFFORTS[info.release])}")
    max_context = args.max_context or default_max_context(devices, info.max_positions)
    if max_context > info.max_positions:
        raise UsageError(f"--max-context {max_context} exceeds the model's max_position_embeddings "
                         f"{info.max_positions}")
    for note in no_effect_notes(args, info.release, devices):
        status(f"note: {note}")
    if messages or raw_prompt is not None:  # encode before loading: a prompt that cannot fit fails in a second
        effort = args.reasoning_effort if mode == "thinking" else None
        n = len(encode_conversation(info.tokenizer, info.release, messages, mode, effort) if messages
                else info.tokenizer.encode(raw_prompt))
        if n >= max_context:
            raise EngineError(f"the prompt is {n} tokens but the context holds {max_context} (prompt + new "
                              "tokens); raise the max context (--max-context) or shorten the prompt")

    import torch

    packed = ", ".join(n for n, on in (("K = V rows FP8", args.kv_fp8), ("indexer keys FP4", args.keys_fp4)) if on)
    status(f"loading {model_dir} on {','.join(devices)} ({args.numerics} numerics, {args.dtype}"
           f"{', state: ' + packed if packed else ''}) ...")
    engine = Engine.from_pretrained(info, device=devices, max_context=max_context, numerics=args.numerics,
                                    dtype=getattr(torch, args.dtype), graphs=not args.eager, kernels=args.kernels,
                                    prefill_graphs=not args.no_prefill_graphs, kv_fp8=args.kv_fp8,
                                    keys_fp4=args.keys_fp4)
    from dsv4 import ops

    status(ops.banner(engine.kernels))
    if sys.stderr.isatty():
        engine.on_prefill = PrefillProgress()
    session = Session(args, engine, mode, engine.with_defaults(**overrides))
    if args.raw:
        return session.finish(session.raw(raw_prompt))
    if args.interactive:
        return session.chat(messages)
    return session.finish(session.turn(messages))


class Session:
    """Runs turns on one loaded engine and prints them (streamed text or --json)."""

    def __init__(self, args, engine, mode: str, params):
        self.args, self.engine, self.mode, self.params = args, engine, mode, params
        self.effort = args.reasoning_effort if mode == "thinking" else None
        self.hide = None if args.show_special else SpecialFilter(special_tokens(engine.tokenizer))

    def _printer(self, labels: bool = True):
        if self.args.json:
            return None
        return StreamPrinter(sys.stdout, sys.stdout.isatty(), self.hide, labels=labels)

    def _report(self, result, printer) -> None:
        if printer:
            printer.close()
        else:
            print(json.dumps(result.to_dict(), ensure_ascii=False), flush=True)
        if result.unparsed:
            first = result.unparsed[0].strip().replace("\n", " ")
            first = first[:60] + ("..." if len(first) > 60 else "")
            status(f"warning: {len(result.unparsed)} piece(s) of the output could not be parsed as reasoning, answer "
                   f"or tool call (--json lists them under \"unparsed\"): {first!r}")
        status(stats_line(result))

    def _clear_progress(self) -> None:
        """Erase the prefill progress line of a request that stopped half-way (Ctrl-C, an error)."""
        if isinstance(self.engine.on_prefill, PrefillProgress):
            self.engine.on_prefill.clear()

    def turn(self, messages: list[dict], reuse: bool = False):
        printer = self._printer()
        try:
            result = self.engine.generate(messages, self.mode, self.effort, self.params, on_delta=printer,
                                          stop=self.args.stop, logprobs=self.args.logprobs, reuse_prefix=reuse)
        finally:
            self._clear_progress()
        self._report(result, printer)
        return result

    def raw(self, prompt: str):
        printer = self._printer(labels=False)
        try:
            result = self.engine.generate_raw(prompt, self.params, on_delta=printer, stop=self.args.stop,
                                              logprobs=self.args.logprobs)
        finally:
            self._clear_progress()
        self._report(result, printer)
        return result

    @staticmethod
    def finish(result) -> int:
        return 130 if result.finish_reason == "interrupted" else 0

    def chat(self, history: list[dict]) -> int:
        """The --interactive loop: a turn whenever the conversation ends with a user or tool message (one that no
        longer fits the context is dropped with an error line; the chat goes on)."""
        from dsv4.engine import ContextLengthError

        base = [m for m in history if m["role"] == "system"]
        tty = sys.stdin.isatty()
        if tty:
            status("interactive chat: one message per line; /reset clears the conversation, /tool TEXT adds a "
                   "tool result, /exit or Ctrl-D ends it")
        while True:
            if history and history[-1]["role"] in ("user", "tool", "developer"):
                try:
                    result = self.turn(history, reuse=True)
                except ContextLengthError as e:  # raised before any forward: the state is as it was
                    while history and history[-1]["role"] in ("user", "tool"):
                        history.pop()
                    room = ("/reset clears the conversation" if any(m["role"] != "system" for m in history)
                            else "it does not fit a fresh conversation either: shorten it or raise --max-context")
                    status(f"error: {describe(e)} (that message is dropped; {room})")
                else:
                    if result.finish_reason == "interrupted":
                        while history and history[-1]["role"] in ("user", "tool"):
                            history.pop()  # the turn is dropped: the state no longer matches it
                        status("(interrupted: that turn is dropped; Ctrl-C at the prompt or Ctrl-D ends the chat)")
                    else:
                        history.append(result.message())
            try:
                line = input("> ") if tty else (sys.stdin.readline() or None)
            except EOFError:
                line = None
            except KeyboardInterrupt:
                print(file=sys.stderr)
                return 130
            if line is None:  # end of input
                return 0
            text = line.rstrip("\n")
            command = text.strip()
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                history[:] = list(base)
                self.engine.reset()
                status("(conversation cleared)")
                continue
            if command.startswith("/tool"):
                history.append({"role": "tool", "content": command[len("/tool"):].strip()})
                continue
            if not command:
                continue
            history.append({"role": "user", "content": text})


def describe(e: BaseException) -> str:
    """The error's first line; a CheckpointError with several problems adds one indented line each
    (at most 20; a summary line says how many more)."""
    problems = getattr(e, "problems", None)
    if problems:
        lines = [f"checkpoint {e.path}: " + (problems[0] if len(problems) == 1 else f"{len(problems)} problems")]
        if len(problems) > 1:
            shown = 20 if len(problems) > 21 else len(problems)
            lines += [f"  {p}" for p in problems[:shown]]
            if len(problems) > shown:
                lines.append(f"  ... and {len(problems) - shown} more")
        return "\n".join(lines)
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def import_engine() -> None:
    """Import the engine (and torch with it) with SIGINT held back: a Ctrl-C inside `import torch` can be swallowed
    there (the run then goes on to its end) or abort the process; held, it arrives once the imports are done, where
    the caller's handler turns it into "interrupted"."""
    hold = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if hold else None
    try:
        import dsv4.engine  # noqa: F401
    finally:
        if hold:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)  # as it was (SIGINT may have been blocked already)


def main(argv=None, prog: str | None = None) -> int:
    try:
        args = build_parser(prog).parse_args(argv)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if sys.stdout is None:  # started with standard output closed: nowhere to write the reply
        print("error: standard output is closed", file=sys.stderr)
        return 1
    if hasattr(sys.stdout, "reconfigure"):  # never die on a terminal that cannot show a character
        sys.stdout.reconfigure(errors="replace")
    try:
        import_engine()
        return run(args)
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


def console() -> None:
    """Entry point of the `dsv4` console script."""
    sys.exit(main(prog="dsv4"))


if __name__ == "__main__":
    sys.exit(main())
