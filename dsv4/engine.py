"""Generation engine: checkpoint -> chat prompt -> chunked prefill -> sampled decode -> parsed reply.

Owns one request's life cycle on a loaded `Transformer`: checking a checkpoint directory before its
weights load (`inspect_model_dir`: config, tokenizer/vocabulary agreement, encoder release),
encoding the conversation with the checkpoint's encoder release, prefill in chunks of at most
PREFILL_CHUNK tokens (optionally continuing from the prefix already in the state), the decode loop
and its stop conditions (EOS, stop strings, max new tokens, context limit, Ctrl-C), streaming deltas
(IncrementalDecoder -> StreamingParser), log-probabilities and usage/timing accounting. The model,
loader, tokenizer and parser live elsewhere.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from dsv4.config import ModelConfig
from dsv4.sampling import SamplingParams, TokenSampler
from encoding import (
    IncrementalDecoder, StreamDelta, StreamingParser, Tokenizer, encode_messages, load_tokenizer,
    normalize_release, release_from_config,
)

PREFILL_CHUNK = 128  # tokens per prefill forward: bounds activation memory for long prompts
DEFAULT_CONTEXT = {"cpu": 4096, "cuda": 32768}  # max context when none is given (capped by the model)
MAX_LOGPROBS = 20  # most alternatives per token --logprobs reports (OpenAI's limit)

# Accepted `reasoning_effort` per encoder release (ENCODING.md §3.6); None is always accepted.
# tests/test_engine.py checks this table against encode_messages so the two cannot drift.
REASONING_EFFORTS = {"preview": ("high", "max"), "0731": ("low", "high", "max")}
# Efforts a release accepts but renders as no prefix at all (the same prompt as no effort).
NO_OP_EFFORTS = {"preview": ("high",), "0731": ("low",)}

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class EngineError(RuntimeError):
    """A request or setup the engine cannot serve; the message is one line meant for the user."""


class ContextLengthError(EngineError):
    """The prompt leaves no room for a new token within the engine's max context."""


@dataclass
class Completion:
    """Raw result of `Engine.complete`: generated ids (EOS included when it stopped the turn)."""

    token_ids: list[int]
    # "stop" (EOS or a stop string) | "length" (max_new_tokens) | "context" (max context reached)
    # | "interrupted" (KeyboardInterrupt during prefill or decode)
    finish_reason: str
    prompt_tokens: int
    timings: dict[str, float | None]
    cached_tokens: int = 0  # prompt tokens already in the state (prefix reuse), not prefilled again
    logprobs: list[dict] | None = None


@dataclass
class GenerationResult:
    """One assistant turn, OpenAI-style, plus accounting. `to_dict()` is the CLI's --json object.

    `unparsed`: completion text the parser could not place as reasoning, content or a tool call
    (empty for a well-formed turn). `logprobs`: per generated token when requested, else None.
    """

    role: str
    reasoning_content: str
    content: str
    tool_calls: list[dict]
    finish_reason: str
    usage: dict
    timings: dict[str, float | None]
    unparsed: list[str] = field(default_factory=list)
    logprobs: list[dict] | None = None
    token_ids: list[int] = field(default_factory=list)

    def to_dict(self, with_token_ids: bool = False) -> dict:
        d = asdict(self)
        if not with_token_ids:
            d.pop("token_ids")
        if d["logprobs"] is None:
            d.pop("logprobs")
        return d

    def message(self) -> dict:
        """The assistant message to append to the conversation for the next turn."""
        msg = {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning_content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint directory says about itself, read without touching the weights."""

    path: Path
    config: ModelConfig
    release: str  # encoder release: "preview" | "0731"
    tokenizer: Tokenizer

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings


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


def default_max_context(devices: list[str], max_positions: int) -> int:
    """The max context used when none is given: 4096 on CPU, 32768 on CUDA, capped by the model."""
    return min(DEFAULT_CONTEXT["cuda" if devices[0].startswith("cuda") else "cpu"], max_positions)


def inspect_model_dir(path: str | Path) -> CheckpointInfo:
    """Read a checkpoint directory's config.json and tokenizer and check that they agree, before any
    weight is loaded: a tokenizer with ids the model has no embedding for is an EngineError here,
    not a failure at the first prompt. The weights themselves are the loader's to validate."""
    path = Path(path)
    if not path.exists():
        raise EngineError(f"model path {path} does not exist")
    if not path.is_dir():
        raise EngineError(f"model path {path} is not a directory: pass the checkpoint directory")
    cfg = ModelConfig.from_file(path / "config.json")  # ConfigError names the problem
    try:
        tokenizer = load_tokenizer(path)
    except Exception as e:  # a broken tokenizer.json: tokenizers raises plain Exceptions
        raise EngineError(f"checkpoint {path}: cannot load its tokenizer: {str(e).splitlines()[0]}") from None
    source = "tokenizer.json" if (path / "tokenizer.json").is_file() else "the bundled DeepSeek-V4 tokenizer"
    if tokenizer.vocab_size > cfg.vocab_size:
        raise EngineError(
            f"checkpoint {path}: {source} has {tokenizer.vocab_size} tokens but config.json's vocab_size is "
            f"{cfg.vocab_size}: the tokenizer does not belong to this model (ids >= {cfg.vocab_size} have no "
            "embedding); put the model's own tokenizer.json beside config.json")
    for name, tid in (("BOS", tokenizer.bos_id), ("EOS", tokenizer.eos_id)):
        if not 0 <= tid < cfg.vocab_size:
            raise EngineError(f"checkpoint {path}: the tokenizer's {name} id {tid} is outside the model's "
                              f"vocabulary [0, {cfg.vocab_size})")
    try:
        release = release_from_config(path)
    except (OSError, ValueError) as e:
        raise EngineError(f"checkpoint {path}: cannot read config.json: {e}") from None
    return CheckpointInfo(path, cfg, release, tokenizer)


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


def check_reasoning_effort(release: str, effort: str | None) -> None:
    """EngineError unless this encoder release accepts `effort` (None always is)."""
    if effort is not None and effort not in REASONING_EFFORTS[release]:
        raise EngineError(f"reasoning effort {effort!r} is not accepted by this checkpoint's encoder "
                          f"({release}); choose one of {', '.join(REASONING_EFFORTS[release])}")


def render_conversation(release: str, messages: list[dict], thinking_mode: str = "thinking",
                        reasoning_effort: str | None = None) -> str:
    """The prompt text of a conversation, rendered by encoder `release` (special tokens as their strings)."""
    if thinking_mode not in ("thinking", "chat"):
        raise ValueError(f"thinking mode must be 'thinking' or 'chat', got {thinking_mode!r}")
    check_reasoning_effort(release, reasoning_effort)
    try:
        return encode_messages(messages, thinking_mode, reasoning_effort=reasoning_effort, release=release)
    except (AssertionError, AttributeError, TypeError, KeyError) as e:  # the encoder's format checks
        raise EngineError(f"cannot encode the conversation: {e}") from None


def encode_conversation(tokenizer, release: str, messages: list[dict], thinking_mode: str = "thinking",
                        reasoning_effort: str | None = None) -> list[int]:
    """Prompt token ids of a conversation, rendered by encoder `release` (no model needed)."""
    return tokenizer.encode(render_conversation(release, messages, thinking_mode, reasoning_effort))


def reencode(tokenizer, text: str, ids: list[int], new_text: str, window: int = 64) -> list[int] | None:
    """tokenizer.encode(new_text), given ids = tokenizer.encode(text), without encoding what the texts share: `ids` up
    to an added token (`tokenizer.split_ids`: taken out of the text before BPE, so the text before it encodes alike in
    both) at or before the point where the texts part, then the rest of new_text encoded. None where no such token
    lies in the last `window` tokens of ids (encode new_text whole then)."""
    split = getattr(tokenizer, "split_ids", None)
    if not split:
        return None
    c = _common_prefix(text, new_text)
    for k in range(len(ids), max(0, len(ids) - window), -1):
        if ids[k - 1] not in split:
            continue
        tail = tokenizer.decode(ids[k:])
        b = len(text) - len(tail)  # (ids[k:] starts after an added token: at a character)
        if b <= c and text[b:] == tail and tokenizer.encode(tail) == ids[k:]:
            return ids[:k] + tokenizer.encode(new_text[b:])
    return None


def _common_prefix(a, b) -> int:
    """The length of the longest common prefix of two strings or lists (slices compared in C, halving the range)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def declared_tools(messages: list[dict]) -> list[dict]:
    """Every tool schema the conversation declares (tools ride on system/developer messages)."""
    return [t for m in messages for t in (m.get("tools") or [])]


def _make_parser(thinking_mode: str, tools: list[dict]) -> StreamingParser:
    """StreamingParser for the turn; the declared tools enable the recovery of drifted tool calls."""
    return StreamingParser(thinking_mode, tools=tools or None)


class StopStrings:
    """Cuts a text stream at the first of several stop strings.

    `push(text)` returns the text that is certainly before any stop (a suffix that could still
    begin one is held back) and whether a stop was found; the stop string itself and everything
    after it are dropped, as OpenAI's `stop` does.
    """

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        longest = max(len(s) for s in self.stops)
        keep = len(self.buf)
        for i in range(max(0, len(self.buf) - longest + 1), len(self.buf)):
            if any(s.startswith(self.buf[i:]) for s in self.stops):
                keep = i
                break
        out, self.buf = self.buf[:keep], self.buf[keep:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Engine:
    """A loaded model plus everything needed to serve one request at a time.

    The decode state is preallocated once for `max_context` tokens (prompt + completion). Each
    request resets it, unless it asks to reuse the prefix: then a prompt that starts with the
    tokens already in the state only prefills its new suffix (multi-turn chat), and one that starts
    with the tokens of the engine's mark (the state kept after part of an earlier prompt: a thinking
    turn's prompt less its `<think>`, which the next turn renders otherwise) continues from there.
    """

    def __init__(self, model, tokenizer, max_context: int, release: str = "preview", *,
                 defaults: SamplingParams | None = None, eos_ids: frozenset[int] | None = None,
                 load_s: float | None = None, graphs: bool = True, prefill_graphs: bool = True,
                 kv_fp8: bool = False, keys_fp4: bool = False):
        limit = min(model.cfg.max_position_embeddings, getattr(model, "max_pos", None) or 1 << 62)
        if not 2 <= max_context <= limit:
            raise EngineError(f"max context {max_context} must be in [2, {limit}] for this model")
        self.model, self.tokenizer = model, tokenizer
        self.max_context = max_context
        self.release = normalize_release(release)
        self.defaults = defaults or SamplingParams()
        self.eos_ids = eos_ids or frozenset({tokenizer.eos_id})
        self.load_s = load_s
        try:  # kv_fp8 / keys_fp4: packed rows in the state (Transformer.new_state), the same results
            self.state = model.new_state(max_context, kv_fp8=kv_fp8, keys_fp4=keys_fp4)
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.state_ids: list[int] | None = []  # tokens whose KV the state holds; None: unknown (reset)
        # marks, oldest first: (ids, StateMark), the state after a prompt's first len(ids) tokens (complete's `keep`),
        # for a later prompt that starts with them but not with state_ids (thinking mode's next turn drops the reply's
        # reasoning); at most MARKS, and the buffers of dropped ones kept for the next (`_spare`)
        self._marks: list = []
        self._spare: list = []
        self._ids_epoch = self.state.epoch  # the state's epoch (ModelState.reset) when state_ids was set
        self._last_prompt: tuple[str, list[int]] | None = None  # generate's last (prompt text, its ids)
        self.input_device = model.embed.weight.device  # ids enter at the embedding's device
        # On CUDA, decode replays one captured graph per layer (two for a CSA or HCA layer not first on its GPU:
        # dsv4/graphs.py) over the same state the chunked prefill fills; on CPU (or with graphs=False) the model's
        # forward runs the same one-token step eagerly.
        from dsv4 import ops

        self.kernels = ops.active()  # op -> backend bound now (from_pretrained binds them first)
        # a temperature (with or without top-p) is drawn by ops.sample_race where it runs fast (TokenSampler)
        self.fast_race = self.USE_RACE and self.kernels.get("sample_race") == "fast"
        model.prepare()
        self.runner = self.prefill = None
        if graphs and self.input_device.type == "cuda":
            from dsv4.graphs import DecodeRunner, PrefillRunner, prefill_graphs_apply

            self.runner = DecodeRunner(model, self.state, use_graphs=True)
            self._token_host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            self._token_event = torch.cuda.Event()
            self._warm_up()
            # full prefill chunks after the first replay two graphs per layer (the reference MoE syncs with the host,
            # so the reference backend prefills eagerly)
            if prefill_graphs and max_context > 2 * PREFILL_CHUNK and prefill_graphs_apply():
                self.prefill = PrefillRunner(model, self.state, PREFILL_CHUNK)

    # draws through ops.sample_race where its fast backend is bound (70th pass: the engine's step-ahead test of the
    # race passed on a GPU in 6 s, a Flash-vocabulary top-p draw took 47-59 us on an H100); False: torch's sampler
    USE_RACE = True

    # called with (prompt tokens done, prompt tokens to prefill) before the prefill and after each chunk (the CLI's
    # progress line)
    on_prefill: Callable[[int, int], None] | None = None

    # Engine.complete queues each decode step on the last step's sample while it is still on the device. False (a
    # diagnostic, not a second release path): the host reads each token before launching the next step, the loop the
    # GPU test checks this one against and the A/B runs time it against
    step_ahead = True

    # prefill chunk lengths that select every kernel variant a prompt can need (tiles by power-of-two token
    # counts, 16-divisible or not: 9 is the 9-15 class of the 16-row tiles, 80 the 16-divisible one of 65-95; 5
    # leaves one compressed entry, 33 eight, fewer than a small top-k's k; 1 is a one-token chunk, whose index list
    # spans the whole state wherever it runs): compiled here, at load, instead of during the first request
    WARM_UP_CHUNKS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65, 80, 128)
    # and (offset, length) at each of warm_up_positions(): the indexer's kernels take tiles by the power of two of the
    # entries a chunk sees and specialize on whether that count and k are 16-divisible; a full chunk, a tail of 5 and
    # a 16-token chunk 4 positions on meet those classes (kernels compiled during requests took up to ~5 s of their
    # time to first token; sixty-second pass)
    WARM_UP_TAILS = ((0, PREFILL_CHUNK), (0, 5), (0, 1), (4, 16))

    def warm_up_positions(self) -> list[int]:
        """The positions where _warm_up runs the WARM_UP_TAILS that fit: the powers of two from the chunk length
        on, inside the context."""
        out, p = [], PREFILL_CHUNK
        while p < self.max_context:
            out.append(p)
            p *= 2
        return out

    def _warm_up(self) -> None:
        """Run one prefill chunk of each WARM_UP_CHUNKS length at position 0 and the WARM_UP_TAILS at each of
        warm_up_positions() (the graphs' capture already ran the decode step), and one draw of the fast sampler, so
        that no kernel is compiled on a request; the state is reset afterwards."""
        runs = [(0, n) for n in self.WARM_UP_CHUNKS if n < self.max_context]
        runs += [(p + o, n) for p in self.warm_up_positions() for o, n in self.WARM_UP_TAILS
                 if p + o + n <= self.max_context]
        with torch.no_grad():
            for p, n in runs:
                ids = torch.zeros(1, n, dtype=torch.long, device=self.input_device)
                self.state.pos = p
                self.model(ids, self.state, last_only=True)
                self.state.reset()
            if self.fast_race:  # the sampler's kernels: the race, the nucleus' passes and the race within it
                head = self.model.head.weight
                for top_p in (1.0, 0.5):
                    TokenSampler(SamplingParams(seed=0, top_p=top_p), head.device, True)(
                        torch.zeros(1, head.shape[0], dtype=torch.float32, device=head.device))
        self.state_ids = []
        self._ids_epoch = self.state.epoch
        self._drop_marks()

    @classmethod
    def from_pretrained(cls, path: str | Path | CheckpointInfo | None = None, *,
                        device: str | list[str] | None = None, max_context: int | None = None,
                        numerics: str = "reference", dtype: torch.dtype = torch.bfloat16,
                        progress: bool = True, graphs: bool = True, kernels: str | None = None,
                        prefill_graphs: bool = True, kv_fp8: bool = False, keys_fp4: bool = False) -> Engine:
        """Load checkpoint `path` (None: the embedded demo checkpoint, generated on first use; or the
        CheckpointInfo that `inspect_model_dir` returned for it).

        max_context None: 4096 tokens on CPU, 32768 on CUDA, at most the model's
        max_position_embeddings. Defaults for sampling and the stop ids come from the checkpoint's
        generation_config.json; the encoder release ("preview" or "0731") from its config.json.
        graphs: decode through per-layer CUDA graphs when the model is on CUDA (False: eager).
        prefill_graphs: with graphs, also replay the full prefill chunks after the first through two captured graphs
        per layer (False: those chunks run eagerly and the prefill graphs' memory is not taken).
        kernels: the op backends (`--kernels`: "ref", "fast" or "fast,op=ref,..."; None: fast on CUDA, ref on
        CPU), bound once here, before the weights are prepared and the graphs captured.
        kv_fp8 / keys_fp4: keep the state's K = V rows / the indexer's keys as packed FP8 / FP4 rows (reference
        numerics with bf16 activations; the same results in less memory, see Transformer.new_state).
        """
        devices = parse_devices(device)
        check_devices(devices)
        from dsv4 import ops

        try:
            backend, kernel_overrides = ops.parse_kernels(kernels)
            report = ops.configure(backend, torch.device(devices[0]).type, kernel_overrides)
        except ValueError as e:
            raise EngineError(str(e)) from None
        t0 = time.perf_counter()
        if path is None:
            from dsv4.demo import demo_checkpoint

            path = demo_checkpoint()
        info = path if isinstance(path, CheckpointInfo) else inspect_model_dir(path)
        if max_context is None:
            max_context = default_max_context(devices, info.max_positions)
        if max_context > info.max_positions:
            raise EngineError(f"max context {max_context} exceeds the model's max_position_embeddings "
                              f"{info.max_positions}; choose --max-context {info.max_positions} or less")
        from dsv4.loader import load_generation_config, load_model

        generation_config = load_generation_config(info.path)
        model = load_model(info.path, numerics=numerics, dtype=dtype, devices=devices, with_mtp=False,
                           max_pos=max_context, progress=progress)
        engine = cls(model, info.tokenizer, max_context, info.release,
                     defaults=_defaults_from(generation_config), eos_ids=_eos_ids(info.tokenizer, generation_config),
                     load_s=time.perf_counter() - t0, graphs=graphs, prefill_graphs=prefill_graphs, kv_fp8=kv_fp8,
                     keys_fp4=keys_fp4)
        engine.kernels = report
        return engine

    # ---- requests ----------------------------------------------------------------------------

    def encode(self, messages: list[dict], thinking_mode: str = "thinking",
               reasoning_effort: str | None = None) -> list[int]:
        """Prompt token ids of a conversation, rendered by this checkpoint's encoder release."""
        return encode_conversation(self.tokenizer, self.release, messages, thinking_mode, reasoning_effort)

    def generate(self, messages: list[dict], thinking_mode: str = "thinking", reasoning_effort: str | None = None,
                 params: SamplingParams | None = None,
                 on_delta: Callable[[StreamDelta], None] | None = None, *,
                 stop: list[str] | tuple[str, ...] = (), logprobs: int | None = None,
                 reuse_prefix: bool = False) -> GenerationResult:
        """Generate the assistant's reply to `messages`; `on_delta` gets parsed deltas as they form.

        Tools declared in the conversation (`tools` on a system/developer message) go to the output
        parser. `stop`: strings that end the turn (not included in the text). `logprobs`: report
        the chosen token's log-probability and this many alternatives per generated token.
        `reuse_prefix`: keep the state's tokens when the prompt starts with them (multi-turn chat), or
        continue from the mark when it starts with the mark's; and mark the state where the next turn's prompt
        leaves this one (`next_turn_prefix`).
        """
        text = render_conversation(self.release, messages, thinking_mode, reasoning_effort)
        # a chat's prompt extends the last one's rendering, less its end: only the new part is tokenized (reencode)
        last = self._last_prompt
        prompt_ids = reencode(self.tokenizer, *last, text) if last is not None else None
        if prompt_ids is None:
            prompt_ids = self.tokenizer.encode(text)
        self._last_prompt = (text, prompt_ids)
        parser = _make_parser(thinking_mode, declared_tools(messages))
        keep = self.next_turn_prefix(messages, thinking_mode, reasoning_effort, prompt_ids, text) if reuse_prefix \
            else None
        return self._run(prompt_ids, parser.feed, params, on_delta, stop, logprobs, reuse_prefix,
                         finish=lambda: parser.flush(), message=lambda: parser.finish(strict=False),
                         keep=keep or None)

    def next_turn_prefix(self, messages: list[dict], thinking_mode: str, reasoning_effort: str | None,
                         prompt_ids: list[int], text: str | None = None) -> int | None:
        """How many of `prompt_ids` (the rendering of `messages`, `text` as a string) the next turn's prompt starts
        with: all of them where the encoder renders this turn's reply after the prompt as it stands (chat mode, or
        thinking mode with tools), fewer where it re-renders the prompt's end (thinking mode drops the reply's
        reasoning: the prompt's last token, `<think>`, is not in the next turn's). Found by rendering the conversation
        with a placeholder reply and user message; None where the encoder does not take that conversation.

        The next prompt is tokenized from the prompt's last added token before the point where they part (`reencode`:
        ~1 ms), or whole where there is none (~30 ms per 20K tokens)."""
        nxt = messages + [{"role": "assistant", "content": "x", "reasoning_content": "y"},
                          {"role": "user", "content": "z"}]
        try:
            nxt_text = render_conversation(self.release, nxt, thinking_mode, reasoning_effort)
        except EngineError:
            return None
        if text is None:
            text = render_conversation(self.release, messages, thinking_mode, reasoning_effort)
        nxt_ids = reencode(self.tokenizer, text, prompt_ids, nxt_text)
        return _common_prefix(prompt_ids, nxt_ids if nxt_ids is not None else self.tokenizer.encode(nxt_text))

    def generate_raw(self, prompt: str, params: SamplingParams | None = None,
                     on_delta: Callable[[StreamDelta], None] | None = None, *,
                     stop: list[str] | tuple[str, ...] = (), logprobs: int | None = None) -> GenerationResult:
        """Continue `prompt` as plain text: no chat template (the text is tokenized as it is, special
        token strings included) and no output parsing (the whole completion is `content`)."""
        prompt_ids = self.tokenizer.encode(prompt)
        pieces: list[str] = []

        def feed(text: str) -> StreamDelta:
            pieces.append(text)
            return StreamDelta(content=text)

        def message() -> dict:
            return {"role": "assistant", "reasoning_content": "", "content": "".join(pieces), "tool_calls": []}

        return self._run(prompt_ids, feed, params, on_delta, stop, logprobs, False,
                         finish=lambda: StreamDelta(), message=message)

    def _run(self, prompt_ids, feed, params, on_delta, stop, logprobs, reuse_prefix, *, finish, message,
             keep=None):
        decoder = IncrementalDecoder(self.tokenizer)
        stops = StopStrings(stop)

        def emit(delta: StreamDelta) -> None:
            if on_delta is not None and delta:
                on_delta(delta)

        stopped = False

        def on_token(token_id: int) -> bool:
            nonlocal stopped
            text, stopped = stops.push(decoder.push(token_id))
            if text:
                emit(feed(text))
            return stopped

        done = self.complete(prompt_ids, params, on_token=on_token, logprobs=logprobs, reuse_prefix=reuse_prefix,
                             keep=keep)
        if not stopped:  # text after a stop string is dropped; otherwise release what is held back
            tail, stopped = stops.push(decoder.flush())
            tail += "" if stopped else stops.flush()
            if tail:
                emit(feed(tail))
        emit(finish())  # the parser's held-back tail must stream too
        # Non-strict: a truncated turn (no </think> or EOS) and a malformed one from a weak model still
        # return what was streamed; a well-formed turn gives exactly the official parser's result.
        msg = message()
        usage = {"prompt_tokens": done.prompt_tokens, "completion_tokens": len(done.token_ids),
                 "total_tokens": done.prompt_tokens + len(done.token_ids),
                 "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}
        return GenerationResult(
            role=msg["role"], reasoning_content=msg["reasoning_content"], content=msg["content"],
            tool_calls=msg["tool_calls"], finish_reason=done.finish_reason, usage=usage, timings=done.timings,
            unparsed=list(msg.get("unparsed") or []), logprobs=done.logprobs, token_ids=done.token_ids)

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams | None = None) -> list[int]:
        """Generated token ids for raw prompt ids (no chat encoding or parsing)."""
        return self.complete(prompt_ids, params).token_ids

    def reset(self) -> None:
        """Forget the state's contents and its marks (the next request prefills its whole prompt)."""
        self.state_ids = None  # (before the state changes: see complete)
        self._drop_marks()
        self.state.reset()
        self.state_ids, self._ids_epoch = [], self.state.epoch

    def _token_logprobs(self, logits: torch.Tensor, token: torch.Tensor, n: int) -> dict:
        lp = torch.log_softmax(logits.float(), dim=-1)[0]
        entry = {"id": int(token.item()), "logprob": float(lp[token.item()])}
        entry["token"] = self.tokenizer.decode([entry["id"]])
        if n > 0:
            vals, idx = torch.topk(lp, n)
            entry["top_logprobs"] = [{"id": int(i), "token": self.tokenizer.decode([int(i)]), "logprob": float(v)}
                                     for v, i in zip(vals.tolist(), idx.tolist())]
        else:
            entry["top_logprobs"] = []
        return {"token": entry["token"], "id": entry["id"], "logprob": entry["logprob"],
                "top_logprobs": entry["top_logprobs"]}

    @torch.no_grad()
    def complete(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 on_token: Callable[[int], bool | None] | None = None, *, logprobs: int | None = None,
                 reuse_prefix: bool = False, keep: int | None = None) -> Completion:
        """Prefill `prompt_ids`, then sample until EOS, max_new_tokens, the context limit, `on_token`
        returning True (a stop string: finish_reason "stop") or Ctrl-C (finish_reason "interrupted":
        the tokens so far are returned, the KeyboardInterrupt is not re-raised).

        logprobs N: per generated token, its log-probability under the model's distribution (before
        temperature and filters) and the N most likely alternatives. reuse_prefix: when the prompt
        starts with the tokens already in the state, prefill only the rest; else, when it starts with the tokens of
        one of the engine's marks (the longest), go back to the state the mark holds and prefill the rest. keep: take
        a mark after the prompt's first `keep` tokens (1 <= keep <= len(prompt_ids); otherwise none), where they are
        not all in the reused prefix (the prefill then stops there and goes on); a later turn whose prompt starts with
        them but not with the whole state continues from there instead of prefilling all of its prompt. The engine
        keeps the newest MARKS marks; a request drops those past the position it starts writing at.
        """
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
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")

        cached = self.state_ids
        # the longest mark the prompt starts with (a mark stays valid while nothing before its position is rewritten)
        marked = max((m for m in self._marks if 0 < len(m[0]) < P and prompt_ids[:len(m[0])] == m[0]
                      and m[1].epoch == self.state.epoch), key=lambda m: len(m[0]), default=None)
        # state_ids is unknown until this request ends cleanly, and the marks this request's writes invalidate are
        # dropped: both before the state changes (a Ctrl-C during the rewind or the reset leaves nothing that trusts it)
        self.state_ids = None
        if reuse_prefix and cached and len(cached) < P and prompt_ids[:len(cached)] == cached \
                and self.state.pos == len(cached) and self._ids_epoch == self.state.epoch:
            rewind = None  # the prompt extends the state
        elif reuse_prefix and marked is not None:
            rewind, cached = marked[1], marked[0]
        else:
            rewind, cached = "reset", []
        start = len(cached)
        # positions from start on are rewritten; a reset the engine did not make leaves no mark valid
        self._drop_marks(lambda m: rewind == "reset" or m.pos > start or m.epoch != self.state.epoch)
        # the prefill's pieces: chunks from start, or from start to keep and from keep on (the mark is taken between)
        cuts = [start, keep, P] if keep is not None and 0 < keep and start <= keep <= P else [start, P]
        pieces = [(s, min(s + PREFILL_CHUNK, b)) for a, b in zip(cuts, cuts[1:]) for s in range(a, b, PREFILL_CHUNK)]
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.input_device)
        out: list[int] = []
        lps: list[dict] | None = [] if logprobs is not None else None
        finish = "interrupted"
        t0 = time.perf_counter()
        t_first = None
        try:
            if rewind == "reset":
                self.state.reset()
            elif rewind is not None:
                self.state.rewind(rewind)
            # Only the last position's logits are needed: the LM head runs once, after the last chunk.
            if self.on_prefill is not None:
                self.on_prefill(0, P - start)
            if len(cuts) == 3 and keep == start:
                self._take_mark(prompt_ids[:keep])
            for s, e in pieces:
                chunk = ids[:, s:e]
                if self.prefill is not None and self.prefill.applies(e - s, s):
                    x = self.prefill.run(chunk, s)
                    if e == P:
                        logits = self.model.head_logits(x, last_only=True)
                elif e == P and e - s == 1 and s == keep and self.runner is not None:
                    # the prompt's last token after a mark (thinking mode's `<think>`): a decode step of the graphs
                    logits = self.runner.step(prompt_ids[s], s).view(1, 1, -1)
                elif e == P:
                    logits = self.model(chunk, self.state, last_only=True)
                else:
                    self.model.forward_streams(chunk, self.state)
                if len(cuts) == 3 and e == keep:
                    self._take_mark(prompt_ids[:keep])
                if self.on_prefill is not None:
                    self.on_prefill(e - start, P - start)
            sampler = TokenSampler(params, logits.device, self.fast_race)
            # one step ahead (graphs, no log-probabilities, from the second token on: the first is read before any
            # step is launched, so the time to first token holds no launch): the next step is queued on the sampled
            # token while it is still on the device, and the host reads the token (a pinned copy and its event) as
            # that step runs, so the GPU does not wait for the host's loop between steps. No step runs ahead of the
            # last token max_new_tokens or the context allows; one that ran ahead of an EOS or a stop string has fed
            # that token, so the state holds it (a chat's next turn continues after the EOS; after a stop string its
            # re-rendered text may no longer match and is prefilled whole)
            ahead = self.runner is not None and lps is None and self.step_ahead
            fed_last = False
            token = sampler(logits[:, -1])
            while True:
                n = len(out) + 1  # tokens once this one is taken
                if ahead and out and n < params.max_new_tokens and P + n < self.max_context:
                    self._token_host.copy_(token.view(1), non_blocking=True)
                    self._token_event.record(torch.cuda.current_stream(token.device))
                    logits = self.runner.step(token, self.state.pos).view(1, 1, -1)
                    fed_last = True
                    self._token_event.synchronize()
                    token_id = int(self._token_host[0])
                else:
                    fed_last = False
                    token_id = int(token.item())  # the one host sync per step
                if not out:
                    t_first = time.perf_counter()
                if lps is not None:
                    lps.append(self._token_logprobs(logits[:, -1], token, logprobs))
                out.append(token_id)
                stop_text = on_token(token_id) if on_token is not None else False
                if token_id in self.eos_ids or stop_text:
                    finish = "stop"
                    break
                if len(out) >= params.max_new_tokens:
                    finish = "length"
                    break
                if P + len(out) >= self.max_context:
                    finish = "context"
                    break
                if not fed_last:  # feed the token now
                    if self.runner is not None:
                        logits = self.runner.step(token_id, self.state.pos).view(1, 1, -1)
                    else:
                        logits = self.model(token.view(1, 1).to(self.input_device), self.state, last_only=True)
                token = sampler(logits[:, -1])
            # the last token was sampled; it was fed only when its step ran ahead
            self.state_ids = list(prompt_ids) + (out if fed_last else out[:-1])
            self._ids_epoch = self.state.epoch
        except KeyboardInterrupt:
            finish = "interrupted"  # state_ids stays None: a forward may have stopped half-way
        t_end = time.perf_counter()

        if t_first is None:
            t_first = t_end
        ttft, decode_s = t_first - t0, t_end - t_first
        new = P - start
        timings = {
            "load_s": self.load_s,
            "ttft_s": ttft,  # prefill plus the first sample
            "prefill_tok_s": new / ttft if ttft > 0 and out else None,
            "decode_s": decode_s,
            "decode_tok_s": (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else None,
        }
        return Completion(out, finish, P, timings, cached_tokens=start, logprobs=lps)

    # marks an engine keeps: the newest and the one before it (a turn interrupted after its own mark leaves the last
    # turn's, which the chat's next message starts with)
    MARKS = 2

    @property
    def mark_ids(self) -> list[int] | None:
        """The tokens of the newest mark (None: no mark)."""
        return self._marks[-1][0] if self._marks else None

    def _drop_marks(self, which=lambda mark: True) -> None:
        """Drop the marks `which` (StateMark -> bool) picks; their buffers are kept for the next mark."""
        marks, self._marks = self._marks, [m for m in self._marks if not which(m[1])]  # (off the list first)
        self._spare += [m[1] for m in marks if which(m[1])]

    def _take_mark(self, ids: list[int]) -> None:
        """Mark the state (now after `ids`) for a later request (complete's `keep`), in a dropped mark's buffers (the
        oldest mark's once MARKS are kept) where there are some."""
        if any(m[0] == ids for m in self._marks):  # (the mark this request went back to)
            return
        if len(self._marks) >= self.MARKS:
            oldest = self._marks[0][1]
            self._drop_marks(lambda m: m is oldest)
        into = self._spare.pop() if self._spare else None  # (off both lists while the copies are made: an
        self._marks.append((list(ids), self.state.mark(into=into)))  # interrupted copy leaves no mark)

    def with_defaults(self, **overrides) -> SamplingParams:
        """This checkpoint's default SamplingParams with the given (non-None) fields replaced."""
        return replace(self.defaults, **{k: v for k, v in overrides.items() if v is not None})
