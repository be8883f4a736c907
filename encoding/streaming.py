"""Incremental parsing of a DeepSeek-V4 completion into reasoning, content and DSML tool calls.

API (shared with the engine and the CLI):

    parser = StreamingParser(thinking_mode, tools=None)   # "thinking" | "chat"; tools as declared
    for piece in text_deltas:                 # e.g. IncrementalDecoder.push(token_id)
        d = parser.feed(piece)                # StreamDelta
        d.reasoning, d.content                # text to append
        d.tool_call_deltas                    # [ToolCallDelta(index, name, arguments, dropped)]
        d.tool_calls                          # calls completed in this delta (OpenAI format, no id)
    tail = parser.flush()                     # end of stream: resolves held-back text
    message = parser.finish(strict=False)     # generation: recover, never raise on model text

- `tools`: OpenAI tool schemas (`{"type": "function", "function": {"name": ...}}`) or bare
  `{"name": ...}` dicts; their names enable the drift recovery of ENCODING.md §6.5.
- `message` = {"role", "content", "reasoning_content", "tool_calls", "unparsed"}; `unparsed` lists
  the raw model text that is neither reasoning, content nor a parsed call (malformed DSML, text
  after the tool calls, a marker prefix left at the end); it is [] for well-formed output.
- `ToolCallDelta(index, name="", arguments="", dropped=False)`: `name` arrives once, when the
  invoke header completes; `arguments` fragments arrive per parameter as values stream (string
  values JSON-escaped incrementally) and concatenate to the call's final `arguments` string;
  `dropped=True` retracts a started call that did not complete (the index is then reused).
- `parse_message_from_completion_text(text, thinking_mode, tools=None, strict=True)` is the
  one-shot equivalent: strict=True raises where DeepSeek's official parser does, strict=False
  returns exactly what this parser's `finish(strict=False)` returns for any split of `text`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .encoding_dsv4 import (
    DSML, EOS, INVOKE_END, INVOKE_START, PARAM_END, PARAM_START, THINK_END, TOOL_CALLS_END,
    TOOL_CALLS_START, expect_gap, find_first, make_tool_call, parse_invoke_header,
    parse_message_from_completion_text, parse_parameter,
)

_LOOSE_TOOL_CALLS_START = f"<{DSML}tool_calls"  # block opener without the preceding blank line
_REASONING_STOPS = (THINK_END, TOOL_CALLS_START, EOS)
# Listed longest-first where two stops can start at the same index: ties go to the earlier entry.
_CONTENT_STOPS = (EOS, TOOL_CALLS_START, _LOOSE_TOOL_CALLS_START, f"</{DSML}", f"<{DSML}", DSML)


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed step of tool call `index` (its position in the final `tool_calls` list).

    `name` is set on the call's first delta, when its invoke header completes; `arguments` is
    the next fragment of the arguments JSON text (the fragments of one call concatenate to its
    final `arguments` string); `dropped` says the call started but will not complete (its
    index is reused by the next call, its raw text is reported in `unparsed`).
    """

    index: int
    name: str = ""
    arguments: str = ""
    dropped: bool = False


@dataclass
class StreamDelta:
    """What one `feed` produced; fields are empty when nothing was decided yet.

    `reasoning` / `content`: text to append. `tool_calls`: calls completed in this delta (OpenAI
    format, no id). `tool_call_deltas`: `ToolCallDelta` events in stream order (name when an
    invoke header completes, argument fragments per parameter as values arrive). `bool(delta)`
    is True when any field has something.
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls or self.tool_call_deltas)


def _partial_marker_start(buf: str, stops: tuple[str, ...]) -> int:
    """Smallest index whose suffix is a proper prefix of some stop (len(buf) if none)."""
    longest = max(len(s) for s in stops)
    for i in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[i:]
        if any(len(tail) < len(s) and s.startswith(tail) for s in stops):
            return i
    return len(buf)


class StreamingParser:
    """State machine over the completion: reasoning -> content -> tool block -> after block -> done.

    Only the undecided suffix of the text is buffered; inside the tool block the buffer is the
    current DSML element. The full text is kept to run the official parser in `finish`.
    """

    def __init__(self, thinking_mode: str, tools: list[dict] | None = None):
        if thinking_mode not in ("chat", "thinking"):
            raise AssertionError(f"Invalid thinking_mode `{thinking_mode}`")
        self.thinking_mode = thinking_mode
        self.tools = tools
        # The prompt already opened (<think>) or closed (</think>) reasoning; start on the same side.
        self._state = "reasoning" if thinking_mode == "thinking" else "content"
        self._chunks: list[str] = []
        self._buf = ""
        self._scan_from = 0
        self._flushed = False
        self._invoke_name = ""
        self._invoke_params: dict[str, tuple[str, str]] = {}
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_calls: list[dict] = []

    @property
    def done(self) -> bool:
        """True once EOS ended the turn (later text is ignored)."""
        return self._state == "done"

    def feed(self, delta: str) -> StreamDelta:
        if self._flushed:
            raise RuntimeError("feed() after flush()/finish()")
        self._chunks.append(delta)
        self._buf += delta
        return self._advance()

    def flush(self) -> StreamDelta:
        """End of stream: resolve held-back text (no more markers can complete)."""
        if self._flushed:
            return StreamDelta()
        self._flushed = True
        return self._advance()

    def finish(self, strict: bool = True) -> dict:
        """Final message: exactly `parse_message_from_completion_text` on the full text.

        With strict=False a malformed completion does not raise; the message is assembled from
        what was streamed (reasoning, content, and the tool calls that closed).
        """
        self.flush()
        try:
            message = parse_message_from_completion_text("".join(self._chunks), self.thinking_mode)
            return message
        except (AssertionError, ValueError):
            if strict:
                raise
            return {"role": "assistant", "content": "".join(self._content),
                    "reasoning_content": "".join(self._reasoning), "tool_calls": list(self._tool_calls),
                    "unparsed": []}

    # -- internals --------------------------------------------------------------------------------

    def _advance(self) -> StreamDelta:
        out = StreamDelta()
        while getattr(self, f"_step_{self._state}")(out):
            pass
        self._reasoning.append(out.reasoning)
        self._content.append(out.content)
        self._tool_calls.extend(out.tool_calls)
        return out

    def _scan(self, stops: tuple[str, ...]) -> tuple[int, str | None]:
        """First stop in the buffer if it is certain, else (length of the text safe to release, None).

        A complete match is certain only if no stop could still complete at an earlier index.
        """
        pos, stop = find_first(self._buf, self._scan_from, stops)
        undecided = len(self._buf) if self._flushed else _partial_marker_start(self._buf, stops)
        if stop is not None and pos < undecided:
            return pos, stop
        # No stop can start before this point any more: later scans (same element) resume here,
        # which keeps long tool arguments from being re-searched on every delta.
        self._scan_from = max(0, len(self._buf) - max(len(s) for s in stops) + 1)
        return undecided, None

    def _consume(self, upto: int, stop: str | None) -> str:
        text = self._buf[:upto]
        self._buf = self._buf[upto + len(stop or ""):]
        self._scan_from = 0
        return text

    def _step_reasoning(self, out: StreamDelta) -> bool:
        pos, stop = self._scan(_REASONING_STOPS)
        out.reasoning += self._consume(pos, stop)
        if stop == THINK_END:
            self._state = "content"
        elif stop == TOOL_CALLS_START:
            self._state = "block_gap"  # model skipped </think>: the DSML opener ends reasoning
        elif stop == EOS:
            self._state = "done"
        return stop is not None

    def _step_content(self, out: StreamDelta) -> bool:
        if self._flushed:
            # Truncated output ending in half a control string ("<｜DS"): drop it, it is not content.
            held = _partial_marker_start(self._buf, _CONTENT_STOPS)
            if "｜" in self._buf[held:]:
                self._buf = self._buf[:held]
        pos, stop = self._scan(_CONTENT_STOPS)
        out.content += self._consume(pos, stop)
        if stop == EOS:
            self._state = "done"
        elif stop in (TOOL_CALLS_START, _LOOSE_TOOL_CALLS_START):
            self._state = "block_gap"
        elif stop is not None:
            self._state = "broken"  # stray DSML outside a block: swallow, never show as content
        return stop is not None

    def _read_element(self, stops: tuple[str, ...]) -> tuple[str, str | None] | None:
        """Next DSML element inside the block, or None while its terminating stop is undecided."""
        pos, stop = self._scan(stops)
        if stop is None:
            return None
        return self._consume(pos, stop), stop

    def _fail(self) -> bool:
        self._state = "broken"
        return True

    def _step_block_gap(self, out: StreamDelta) -> bool:
        element = self._read_element((INVOKE_START, TOOL_CALLS_END))
        if element is None:
            return False
        gap, stop = element
        try:
            expect_gap(gap)
        except ValueError:
            return self._fail()
        self._state = "invoke_header" if stop == INVOKE_START else "after_block"
        return True

    def _step_invoke_header(self, out: StreamDelta) -> bool:
        element = self._read_element((PARAM_START, INVOKE_END))
        if element is None:
            return False
        header, stop = element
        try:
            self._invoke_name = parse_invoke_header(header)
        except ValueError:
            return self._fail()
        self._invoke_params = {}
        return self._after_invoke_element(stop, out)

    def _step_param(self, out: StreamDelta) -> bool:
        element = self._read_element((PARAM_END,))
        if element is None:
            return False
        try:
            key, is_str, value = parse_parameter(element[0])
        except ValueError:
            return self._fail()
        if key in self._invoke_params:
            return self._fail()
        self._invoke_params[key] = (value, is_str)
        self._state = "param_gap"
        return True

    def _step_param_gap(self, out: StreamDelta) -> bool:
        element = self._read_element((PARAM_START, INVOKE_END))
        if element is None:
            return False
        gap, stop = element
        try:
            expect_gap(gap)
        except ValueError:
            return self._fail()
        return self._after_invoke_element(stop, out)

    def _after_invoke_element(self, stop: str, out: StreamDelta) -> bool:
        if stop == PARAM_START:
            self._state = "param"
        else:  # INVOKE_END: the call is complete
            out.tool_calls.append(make_tool_call(self._invoke_name, self._invoke_params))
            self._state = "block_gap"
        return True

    def _step_after_block(self, out: StreamDelta) -> bool:
        pos, stop = self._scan((EOS,))
        if stop is not None:
            self._state = "done" if pos == 0 else "broken"
            return True
        if pos > 0:
            self._state = "broken"  # text after </｜DSML｜tool_calls> that is not EOS
        return pos > 0

    def _step_done(self, out: StreamDelta) -> bool:
        self._buf = ""  # nothing may follow EOS; the engine stops there anyway
        return False

    _step_broken = _step_done
