"""Generation engine: checkpoint -> chat prompt -> chunked prefill -> sampled decode -> parsed reply.

Owns one request's life cycle on a loaded `Transformer`: encoding the conversation with the
checkpoint's encoder release, prefill in chunks of at most PREFILL_CHUNK tokens, the decode loop and
its stop conditions (EOS, max new tokens, context limit), streaming deltas (IncrementalDecoder ->
StreamingParser) and usage/timing accounting. The model, loader, tokenizer and parser live elsewhere.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dsv4.sampling import SamplingParams, make_generator, sample
from encoding import (
    IncrementalDecoder, StreamDelta, StreamingParser, encode_messages, load_tokenizer, normalize_release,
    release_from_config,
)

PREFILL_CHUNK = 128  # tokens per prefill forward: bounds activation memory for long prompts

# Accepted `reasoning_effort` per encoder release (ENCODING.md §3.6); None is always accepted.
# tests/test_engine.py checks this table against encode_messages so the two cannot drift.
REASONING_EFFORTS = {"preview": ("high", "max"), "0731": ("low", "high", "max")}

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class EngineError(RuntimeError):
    """A request or setup the engine cannot serve; the message is one line meant for the user."""


class ContextLengthError(EngineError):
    """The prompt leaves no room for a new token within the engine's max context."""


@dataclass
class Completion:
    """Raw result of `Engine.complete`: generated ids (EOS included when it stopped the turn)."""

    token_ids: list[int]
    finish_reason: str  # "stop" (EOS) | "length" (max_new_tokens) | "context" (max context reached)
    prompt_tokens: int
    timings: dict[str, float | None]


@dataclass
class GenerationResult:
    """One assistant turn, OpenAI-style, plus accounting. `to_dict()` is the CLI's --json object."""

    role: str
    reasoning_content: str
    content: str
    tool_calls: list[dict]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float | None]
    token_ids: list[int] = field(default_factory=list)

    def to_dict(self, with_token_ids: bool = False) -> dict:
        d = asdict(self)
        if not with_token_ids:
            d.pop("token_ids")
        return d


def parse_devices(spec: str | list[str] | None) -> list[str]:
    """"cpu" | "cuda" | "cuda:N" | "cuda:0,cuda:1" (layers spread in order) -> list of device strings.

    None picks "cuda" when a GPU is visible, else "cpu". Checks syntax only (ValueError); whether the
    devices exist is `check_devices`' job, so a typo and a missing GPU get different errors.
    """
    if spec is None:
        return ["cuda"] if torch.cuda.is_available() else ["cpu"]
    devices = [d.strip() for d in spec.split(",")] if isinstance(spec, str) else [str(d).strip() for d in spec]
    bad = [d for d in devices if not _DEVICE_RE.match(d)]
    if not devices or bad:
        shown = ", ".join(repr(d) for d in bad) if bad else repr(spec)
        raise ValueError(f"unknown device {shown}: expected cpu, cuda, cuda:N or a comma-separated list "
                         "such as cuda:0,cuda:1")
    return devices


def check_devices(devices: list[str]) -> None:
    """EngineError unless every device in `devices` exists on this machine."""
    for d in devices:
        if not d.startswith("cuda"):
            continue
        if not torch.cuda.is_available():
            raise EngineError(f"device {d} requested but CUDA is not available on this machine "
                              f"(torch {torch.__version__}); use --device cpu")
        index = int(d.split(":")[1]) if ":" in d else 0
        if index >= torch.cuda.device_count():
            raise EngineError(f"device {d} requested but this machine has {torch.cuda.device_count()} "
                              "CUDA device(s)")


def _max_positions(path: Path) -> int | None:
    """max_position_embeddings from config.json, read cheaply before the (slow) weight load."""
    try:
        value = json.loads((path / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None  # the loader reports a missing or broken config with all other problems
    return value if isinstance(value, int) else None


def _eos_ids(tokenizer, generation_config: dict) -> frozenset[int]:
    ids = {tokenizer.eos_id}
    extra = generation_config.get("eos_token_id")
    ids.update(extra if isinstance(extra, list) else [extra] if isinstance(extra, int) else [])
    return frozenset(ids)


def _defaults_from(generation_config: dict) -> SamplingParams:
    # HF convention: do_sample false means greedy. An absent top_k means no top-k filter here
    # (transformers would silently apply 50; DeepSeek's file does not set it).
    temperature = float(generation_config.get("temperature", 1.0))
    if generation_config.get("do_sample") is False:
        temperature = 0.0
    return SamplingParams(temperature=temperature, top_p=float(generation_config.get("top_p", 1.0)),
                          top_k=int(generation_config.get("top_k") or 0))


class Engine:
    """A loaded model plus everything needed to serve one request at a time.

    The decode state is preallocated once for `max_context` tokens (prompt + completion) and reset
    per request, so memory use is fixed after construction.
    """

    def __init__(self, model, tokenizer, max_context: int, release: str = "preview", *,
                 defaults: SamplingParams | None = None, eos_ids: frozenset[int] | None = None,
                 load_s: float | None = None, graphs: bool = True):
        limit = min(model.cfg.max_position_embeddings, getattr(model, "max_pos", None) or 1 << 62)
        if not 2 <= max_context <= limit:
            raise EngineError(f"max context {max_context} must be in [2, {limit}] for this model")
        self.model, self.tokenizer = model, tokenizer
        self.max_context = max_context
        self.release = normalize_release(release)
        self.defaults = defaults or SamplingParams()
        self.eos_ids = eos_ids or frozenset({tokenizer.eos_id})
        self.load_s = load_s
        self.state = model.new_state(max_context)
        self.input_device = model.embed.weight.device  # ids enter at the embedding's device
        # On CUDA, decode replays one captured graph per layer over the same state the chunked prefill
        # fills; on CPU (or with graphs=False) the decode step runs the chunked path with one token.
        self.runner = None
        if graphs and self.input_device.type == "cuda":
            from dsv4.graphs import DecodeRunner

            self.runner = DecodeRunner(model, self.state, use_graphs=True)

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, device: str | list[str] | None = None,
                        max_context: int = 4096, numerics: str = "reference", dtype: torch.dtype = torch.bfloat16,
                        progress: bool = True, graphs: bool = True) -> Engine:
        """Load checkpoint `path` (None: the embedded demo checkpoint, generated on first use).

        Defaults for sampling and the stop ids come from the checkpoint's generation_config.json;
        the encoder release ("preview" or "0731") from its config.json. graphs: decode through
        per-layer CUDA graphs when the model is on CUDA (False: eager decode, for debugging).
        """
        devices = parse_devices(device)
        check_devices(devices)
        t0 = time.perf_counter()
        if path is None:
            from dsv4.demo import demo_checkpoint

            path = demo_checkpoint()
        path = Path(path)
        if not path.exists():
            raise EngineError(f"model path {path} does not exist")
        max_pos = _max_positions(path)
        if max_pos is not None and max_context > max_pos:
            raise EngineError(f"max context {max_context} exceeds the model's max_position_embeddings {max_pos}")
        from dsv4.loader import load_generation_config, load_model

        model = load_model(path, numerics=numerics, dtype=dtype, devices=devices, with_mtp=False,
                           max_pos=max_context, progress=progress)
        generation_config = load_generation_config(path)
        tokenizer = load_tokenizer(path)
        return cls(model, tokenizer, max_context, release_from_config(path),
                   defaults=_defaults_from(generation_config), eos_ids=_eos_ids(tokenizer, generation_config),
                   load_s=time.perf_counter() - t0, graphs=graphs)

    # ---- requests ----------------------------------------------------------------------------

    def encode(self, messages: list[dict], thinking_mode: str = "thinking",
               reasoning_effort: str | None = None) -> list[int]:
        """Prompt token ids of a conversation, rendered by this checkpoint's encoder release."""
        if thinking_mode not in ("thinking", "chat"):
            raise ValueError(f"thinking mode must be 'thinking' or 'chat', got {thinking_mode!r}")
        if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS[self.release]:
            raise EngineError(f"reasoning effort {reasoning_effort!r} is not accepted by this checkpoint's "
                              f"encoder ({self.release}); choose one of {', '.join(REASONING_EFFORTS[self.release])}")
        try:
            prompt = encode_messages(messages, thinking_mode, reasoning_effort=reasoning_effort,
                                     release=self.release)
        except AssertionError as e:  # the encoder's format checks (official behaviour) -> user error
            raise EngineError(f"cannot encode the conversation: {e}") from None
        return self.tokenizer.encode(prompt)

    def generate(self, messages: list[dict], thinking_mode: str = "thinking", reasoning_effort: str | None = None,
                 params: SamplingParams | None = None,
                 on_delta: Callable[[StreamDelta], None] | None = None) -> GenerationResult:
        """Generate the assistant's reply to `messages`; `on_delta` gets parsed deltas as they form."""
        prompt_ids = self.encode(messages, thinking_mode, reasoning_effort)
        decoder = IncrementalDecoder(self.tokenizer)
        parser = StreamingParser(thinking_mode)

        def emit(delta: StreamDelta) -> None:
            if on_delta is not None and delta:
                on_delta(delta)

        def on_token(token_id: int) -> None:
            text = decoder.push(token_id)
            if text:
                emit(parser.feed(text))

        done = self.complete(prompt_ids, params, on_token=on_token)
        tail = decoder.flush()
        if tail:
            emit(parser.feed(tail))
        emit(parser.flush())  # finish() would flush too, but silently: the held-back tail must stream
        # Non-strict: a truncated turn (no </think> or EOS) and a malformed one from a weak model still
        # return what was streamed; a well-formed turn gives exactly the official parser's result.
        message = parser.finish(strict=False)
        return GenerationResult(
            role=message["role"], reasoning_content=message["reasoning_content"], content=message["content"],
            tool_calls=message["tool_calls"], finish_reason=done.finish_reason,
            usage={"prompt_tokens": done.prompt_tokens, "completion_tokens": len(done.token_ids),
                   "total_tokens": done.prompt_tokens + len(done.token_ids)},
            timings=done.timings, token_ids=done.token_ids)

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[int]:
        """Generated token ids for raw prompt ids (no chat encoding or parsing)."""
        return self.complete(prompt_ids, params).token_ids

    @torch.no_grad()
    def complete(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 on_token: Callable[[int], None] | None = None) -> Completion:
        """Prefill `prompt_ids`, then sample until EOS, max_new_tokens or the context limit."""
        params = params or self.defaults
        P = len(prompt_ids)
        if P == 0:
            raise ValueError("the prompt has no tokens")
        if P >= self.max_context:
            raise ContextLengthError(
                f"the prompt is {P} tokens but the context holds {self.max_context} (prompt + new tokens); "
                "raise the max context (--max-context) or shorten the prompt")
        vocab = self.model.cfg.vocab_size
        if not all(0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")

        self.state.reset()
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.input_device)
        t0 = time.perf_counter()
        # Only the last position's logits are needed, so every chunk skips the LM head elsewhere.
        for s in range(0, P, PREFILL_CHUNK):
            logits = self.model(ids[:, s:s + PREFILL_CHUNK], self.state, last_only=True)
        generator = make_generator(params, logits.device)

        out: list[int] = []
        t_first = t0
        while True:
            token = sample(logits[:, -1], params, generator)
            token_id = int(token.item())  # the one host sync per step
            if not out:
                t_first = time.perf_counter()
            out.append(token_id)
            if on_token is not None:
                on_token(token_id)
            if token_id in self.eos_ids:
                finish = "stop"
            elif len(out) >= params.max_new_tokens:
                finish = "length"
            elif P + len(out) >= self.max_context:
                finish = "context"
            elif self.runner is not None:
                logits = self.runner.step(token_id, self.state.pos).view(1, 1, -1)
                continue
            else:
                logits = self.model(token.view(1, 1).to(self.input_device), self.state, last_only=True)
                continue
            break
        t_end = time.perf_counter()

        ttft, decode_s = t_first - t0, t_end - t_first
        timings = {
            "load_s": self.load_s,
            "ttft_s": ttft,  # prefill plus the first sample
            "prefill_tok_s": P / ttft if ttft > 0 else None,
            "decode_s": decode_s,
            "decode_tok_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        }
        return Completion(out, finish, P, timings)

    def with_defaults(self, **overrides) -> SamplingParams:
        """This checkpoint's default SamplingParams with the given (non-None) fields replaced."""
        return replace(self.defaults, **{k: v for k, v in overrides.items() if v is not None})
