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
  after the tool calls, a marker prefix left at the end), one entry per contiguous stretch;
  whitespace-only stretches are left out; it is [] for well-formed output.
- `ToolCallDelta(index, name="", arguments="", dropped=False)`: `name` arrives once, when the
  invoke header completes; `arguments` fragments arrive per parameter as values stream (string
  values JSON-escaped incrementally) and concatenate to the call's final `arguments` string;
  `dropped=True` retracts a started call that did not complete (the index is then reused).
- `parse_message_from_completion_text(text, thinking_mode, tools=None, strict=True)` is the
  one-shot equivalent: strict=True raises where DeepSeek's official parser does (and, without
  tools, then returns the official result), strict=False returns exactly what this parser's
  `finish(strict=False)` returns for any split of `text`. `finish(strict=True)` is the same check.

Grammar beyond the official one (deltas and strict=False; ENCODING.md §6.2, §6.5):
- `<｜DSML｜tool_calls>` opens a block wherever it appears, with up to two newlines before it that
  belong to it, once a DSML tag follows it (followed by prose it is a mention, reported); in
  thinking mode it ends reasoning. Whitespace between DSML tags is free.
- With declared tools: a bare `<｜DSML｜invoke name="X">` of a declared X that closes and carries
  X's required parameters is a call; so is such an invoke after a wrapper tag with another name;
  `<|DSML|` counts as `<｜DSML｜`. Without tools none of this applies (official blocks still parse).
- Calls end reasoning and content: text after them is reported, not shown.
- Content and reasoning never carry `｜DSML｜`, BOS, EOS, `<think>` or a `</think>` that does not
  end reasoning: such text, malformed blocks and text after the calls go to `unparsed`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from . import dsml
from .encoding_dsv4 import (
    BOS, DSML, EOS, THINK_END, THINK_START, find_first, make_tool_call, parse_official_completion,
)


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


@dataclass
class _Block:
    """A tool-call block being read. `start` is its absolute offset (leading newlines included)."""

    start: int
    drift: bool  # corrupted wrapper or ASCII spelling: every invoke must name a declared tool
    committed: bool = False  # an invoke (or the closer) followed the opener: it is a block for sure
    calls: int = 0
    failed: bool = False


@dataclass
class _Invoke:
    """An invoke being read; `bare` when it stands outside any block (§6.5 drift)."""

    start: int
    name: str
    bare: bool
    drift: bool  # bare or in a drift block: a call only for a declared tool with its required args
    is_call: bool  # False: an undeclared bare invoke, read only to report it whole
    index: int
    params: dict[str, tuple[str, str]] = field(default_factory=dict)
    key: str = ""
    is_str: str = ""
    value: list[str] = field(default_factory=list)


def _partial_marker_start(buf: str, stops: tuple[str, ...]) -> int:
    """Smallest index whose suffix is a proper prefix of some stop (len(buf) if none)."""
    longest = max(len(s) for s in stops)
    for i in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[i:]
        if any(len(tail) < len(s) and s.startswith(tail) for s in stops):
            return i
    return len(buf)


def _json_fragment(value: str, is_str: str) -> str:
    """A value's share of the arguments JSON: string="true" values are JSON-escaped (per
    character, so fragments escape independently), string="false" values stay verbatim."""
    return json.dumps(value, ensure_ascii=False)[1:-1] if is_str == "true" else value


class StreamingParser:
    """State machine over the completion text; every character ends up in exactly one place.

    States: "text" (reasoning, content, or after the calls, by `_sink`), "tag" (a DSML tag in
    text), "block" / "invoke" / "value" / "value_end" (inside DSML), "skip" (resynchronising a
    broken block), "bare_skip" (the rest of a broken bare invoke) and "done" (after EOS). Only the
    undecided suffix of the text is buffered; `_base` is the absolute offset of its start, and
    unparsed text is recorded as absolute spans of the full text.
    """

    def __init__(self, thinking_mode: str, tools: list[dict] | None = None):
        if thinking_mode not in ("chat", "thinking"):
            raise AssertionError(f"Invalid thinking_mode `{thinking_mode}`")
        self.thinking_mode = thinking_mode
        self.tools = tools
        self._declared = dsml.declared_tools(tools)  # name -> required parameters
        self._spellings = dsml.spellings_for(self._declared)
        self._text_stops = (EOS, BOS, THINK_START, THINK_END, DSML) + tuple(
            f"{newlines}{opener}{sp}" for sp in self._spellings for opener in ("</", "<")
            for newlines in ("\n\n", "\n", ""))
        self._value_stops = (EOS,) + tuple(f"</{sp}parameter" for sp in self._spellings)
        self._skip_stops = (EOS,) + tuple(s for sp in self._spellings for s in (f"<{sp}invoke", f"</{sp}"))
        self._bare_skip_stops = (EOS,) + tuple(
            s for sp in self._spellings for s in (f"</{sp}invoke>", f"<{sp}invoke"))
        # The prompt already opened (<think>) or closed (</think>) reasoning; start on the same side.
        self._sink = "reasoning" if thinking_mode == "thinking" else "content"
        self._state = "text"
        self._chunks: list[str] = []
        self._buf = ""
        self._base = 0
        self._flushed = False
        self._block: _Block | None = None
        self._invoke: _Invoke | None = None
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._tool_calls: list[dict] = []
        self._spans: list[tuple[int, int]] = []

    @property
    def done(self) -> bool:
        """True once EOS ended the turn (later text is reported, never shown)."""
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
        out = self._advance()
        if self._block is not None:  # output ended inside a block (every open element failed)
            self._end_block()
        return out

    def finish(self, strict: bool = True) -> dict:
        """The parsed message: what the deltas streamed, plus `unparsed`.

        strict=True first runs DeepSeek's official parser on the full text and raises its error
        when the completion is not well-formed; strict=False never raises on model text.
        """
        self.flush()
        text = "".join(self._chunks)
        if strict:
            parse_official_completion(text, self.thinking_mode)
        return {"role": "assistant", "content": "".join(self._content),
                "reasoning_content": "".join(self._reasoning), "tool_calls": list(self._tool_calls),
                "unparsed": self._unparsed(text)}

    # -- bookkeeping ------------------------------------------------------------------------------

    def _advance(self) -> StreamDelta:
        out = StreamDelta()
        while getattr(self, f"_step_{self._state}")(out):
            pass
        self._reasoning.append(out.reasoning)
        self._content.append(out.content)
        self._tool_calls.extend(out.tool_calls)
        return out

    def _take(self, n: int) -> str:
        text, self._buf = self._buf[:n], self._buf[n:]
        self._base += n
        return text

    def _report(self, start: int) -> None:
        """Everything consumed from absolute offset `start` up to now is unparsed."""
        if start < self._base:
            self._spans.append((start, self._base))

    def _report_take(self, n: int) -> None:
        start = self._base
        self._take(n)
        self._report(start)

    def _emit(self, text: str, out: StreamDelta) -> None:
        """Text just consumed goes to the current sink; after the calls it is unparsed."""
        if self._sink == "reasoning":
            out.reasoning += text
        elif self._sink == "content":
            out.content += text
        else:
            self._report(self._base - len(text))

    def _unparsed(self, text: str) -> list[str]:
        """Merged unparsed spans as raw text; whitespace-only leftovers are not worth a report."""
        merged: list[list[int]] = []
        for start, end in sorted(self._spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [text[a:b] for a, b in merged if text[a:b].strip()]

    def _scan(self, stops: tuple[str, ...]) -> tuple[int, str | None]:
        """First stop in the buffer if it is certain, else (length of the text safe to release, None).

        A complete match is certain only if no stop could still complete at an earlier index.
        """
        pos, stop = find_first(self._buf, 0, stops)
        undecided = len(self._buf) if self._flushed else _partial_marker_start(self._buf, stops)
        if stop is not None and pos < undecided:
            return pos, stop
        return undecided, None

    def _next_tag(self):
        """(whitespace length, Tag or None) for the next DSML element; None while undecided.

        The Tag is None when something other than a tag follows the whitespace.
        """
        gap = dsml.whitespace_end(self._buf)
        if gap == len(self._buf):
            return (gap, None) if self._flushed else None
        tag = dsml.lex_tag(self._buf, gap, self._spellings, self._flushed)
        return None if tag is dsml.PENDING else (gap, tag)

    # -- text: reasoning, content, after the calls ----------------------------------------------

    def _step_text(self, out: StreamDelta) -> bool:
        pos, stop = self._scan(self._text_stops)
        if stop is None and self._flushed:
            pos = _partial_marker_start(self._buf, self._text_stops)
        self._emit(self._take(pos), out)
        if stop is None:
            if self._flushed and self._buf:
                self._flush_tail(out)
            return False
        if stop == EOS:
            self._take(len(EOS))
            self._state = "done"
        elif stop == THINK_END and self._sink == "reasoning":
            self._take(len(THINK_END))
            self._sink = "content"
        elif stop in (BOS, THINK_START, THINK_END):
            self._report_take(len(stop))
        else:
            self._state = "tag"
        return True

    def _flush_tail(self, out: StreamDelta) -> None:
        """The output ended on what could have begun a marker: a control-string prefix ("<｜DS")
        is reported, anything else ("\\n", "<") is ordinary text."""
        newlines = len(self._buf) - len(self._buf.lstrip("\n"))
        self._emit(self._take(newlines), out)
        if "｜" in self._buf or "|" in self._buf:
            self._report_take(len(self._buf))
        else:
            self._emit(self._take(len(self._buf)), out)

    def _step_tag(self, out: StreamDelta) -> bool:
        newlines = len(self._buf) - len(self._buf.lstrip("\n"))  # they belong to the tag
        tag = dsml.lex_tag(self._buf, newlines, self._spellings, self._flushed)
        if tag is dsml.PENDING:
            return False
        start = self._base
        self._take(newlines + tag.size)
        self._state = "text"
        name = dsml.invoke_name(tag)
        if name is not None:
            self._start_invoke(start, name, bare=True, drift=True, out=out)
        elif tag.bare and not tag.closing and tag.name == "tool_calls":
            self._block = _Block(start, drift=tag.spelling != DSML)
            self._state = "block"
        elif tag.bare and not tag.closing and self._declared and tag.name not in ("", "invoke", "parameter"):
            self._block = _Block(start, drift=True)  # a corrupted wrapper name
            self._state = "block"
        else:
            self._report(start)  # stray DSML: a closer, a mention, a tag that never closed
        return True

    # -- tool-call block ---------------------------------------------------------------------------

    def _step_block(self, out: StreamDelta) -> bool:
        found = self._next_tag()
        if found is None:
            return False
        gap, tag = found
        block = self._block
        name = dsml.invoke_name(tag) if tag is not None else None
        if name is not None and (not block.drift or name in self._declared):
            self._take(gap)
            start = self._base
            self._take(tag.size)
            self._commit_block()
            self._start_invoke(start, name, bare=False, drift=block.drift, out=out)
            return True
        if tag is not None and tag.bare and tag.closing and self._closes_block(tag):
            if block.committed or not block.drift:
                self._take(gap + tag.size)
                self._commit_block()
                self._end_block()
                self._state = "text"
                return True
        if not block.committed:
            # Not a block after all (prose naming the opener): report the opener, resume text.
            self._block = None
            self._report(block.start)
            self._state = "text"
            return True
        block.failed = True
        if tag is not None:
            self._report_take(gap + tag.size)
        self._state = "skip"
        return True

    def _closes_block(self, tag: dsml.Tag) -> bool:
        if tag.name == "tool_calls":
            return True
        return self._block.drift and tag.name not in ("invoke", "parameter")

    def _commit_block(self) -> None:
        """The block holds DSML for sure: reasoning/content are over; later text is reported."""
        self._block.committed = True
        self._sink = "after_calls"

    def _end_block(self) -> None:
        block, self._block = self._block, None
        if block.failed and not block.calls:
            self._report(block.start)  # nothing came of it: report the whole block as written

    def _step_skip(self, out: StreamDelta) -> bool:
        """Broken element in a committed block: report text up to the next invoke, closer or EOS."""
        pos, stop = self._scan(self._skip_stops)
        self._report_take(pos)
        if stop is None:
            return False
        if stop == EOS:
            self._end_block()
            self._state = "text"
        else:
            self._state = "block"
        return True

    # -- invoke --------------------------------------------------------------------------------------

    def _start_invoke(self, start: int, name: str, bare: bool, drift: bool, out: StreamDelta) -> None:
        is_call = not drift or name in self._declared
        index = len(self._tool_calls) + len(out.tool_calls)
        self._invoke = _Invoke(start, name, bare, drift, is_call, index)
        if is_call:
            out.tool_call_deltas.append(ToolCallDelta(self._invoke.index, name=name))
        self._state = "invoke"

    def _step_invoke(self, out: StreamDelta) -> bool:
        found = self._next_tag()
        if found is None:
            return False
        gap, tag = found
        invoke = self._invoke
        param = dsml.parameter_attrs(tag) if tag is not None else None
        if param is not None and param[0] not in invoke.params:
            self._take(gap + tag.size)
            invoke.key, invoke.is_str = param
            invoke.value = []
            opening = "{" if not invoke.params else ", "
            self._arguments(invoke, opening + json.dumps(invoke.key, ensure_ascii=False) + ": "
                            + ('"' if invoke.is_str == "true" else ""), out)
            self._state = "value"
            return True
        if tag is not None and tag.is_close("invoke"):
            self._take(gap + tag.size)
            return self._close_invoke(out)
        return self._fail_invoke(out, gap, tag)

    @staticmethod
    def _arguments(invoke: _Invoke, fragment: str, out: StreamDelta) -> None:
        if invoke.is_call and fragment:
            out.tool_call_deltas.append(ToolCallDelta(invoke.index, arguments=fragment))

    def _step_value(self, out: StreamDelta) -> bool:
        invoke = self._invoke
        pos, stop = self._scan(self._value_stops)
        value = self._take(pos)
        invoke.value.append(value)
        self._arguments(invoke, _json_fragment(value, invoke.is_str), out)
        if stop is None:
            return self._fail_invoke(out, 0, None) if self._flushed else False
        if stop == EOS:
            return self._fail_invoke(out, 0, None)
        self._take(len(stop))
        self._state = "value_end"
        return True

    def _step_value_end(self, out: StreamDelta) -> bool:
        """After `</｜DSML｜parameter` only ">" may come."""
        if not self._buf:
            return self._fail_invoke(out, 0, None) if self._flushed else False
        if self._buf[0] != ">":
            return self._fail_invoke(out, 0, None)
        self._take(1)
        invoke = self._invoke
        invoke.params[invoke.key] = ("".join(invoke.value), invoke.is_str)
        self._arguments(invoke, '"' if invoke.is_str == "true" else "", out)
        self._state = "invoke"
        return True

    def _close_invoke(self, out: StreamDelta) -> bool:
        invoke, self._invoke = self._invoke, None
        if not invoke.is_call or (invoke.drift and self._declared[invoke.name] - invoke.params.keys()):
            # Not a call: an undeclared tool, or a recovered one lacking required arguments.
            if invoke.is_call:
                out.tool_call_deltas.append(ToolCallDelta(invoke.index, dropped=True))
            self._report(invoke.start)
            if invoke.bare:
                self._state = "text"
            else:
                self._block.failed = True
                self._state = "block"
            return True
        self._arguments(invoke, "}" if invoke.params else "{}", out)
        out.tool_calls.append(make_tool_call(invoke.name, invoke.params))
        if invoke.bare:
            self._sink = "after_calls"
            self._state = "text"
        else:
            self._block.calls += 1
            self._state = "block"
        return True

    def _fail_invoke(self, out: StreamDelta, gap: int, tag: dsml.Tag | None) -> bool:
        """The invoke broke at the next element (`tag`, or plain text when None)."""
        invoke, self._invoke = self._invoke, None
        if invoke.is_call:
            out.tool_call_deltas.append(ToolCallDelta(invoke.index, dropped=True))
        self._report(invoke.start)
        if not invoke.bare:
            self._block.failed = True
        if tag is not None and self._starts_next(tag):
            # The invoke never closed but the next one (or the block's end) begins here.
            self._state = "text" if invoke.bare else "block"
        elif not invoke.bare:
            if tag is not None:  # a DSML tag that does not fit belongs to the broken invoke
                self._report_take(gap + tag.size)
            self._state = "skip"
        elif tag is None:
            self._state = "text"  # plain text where DSML should follow: prose quoting a tag
        else:
            self._report_take(gap + tag.size)
            self._state = "bare_skip"  # broken DSML inside: report the invoke up to its end
        return True

    @staticmethod
    def _starts_next(tag: dsml.Tag) -> bool:
        """An invoke opener or a block closer: where parsing resumes after a broken invoke."""
        if dsml.invoke_name(tag) is not None:
            return True
        return tag.bare and tag.closing and tag.name not in ("invoke", "parameter")

    def _step_bare_skip(self, out: StreamDelta) -> bool:
        pos, stop = self._scan(self._bare_skip_stops)
        if stop is not None and stop.startswith("</"):
            pos += len(stop)  # the invoke's own closer is part of it
        self._report_take(pos)
        if stop is None:
            return False
        self._state = "text"
        return True

    def _step_done(self, out: StreamDelta) -> bool:
        self._report_take(len(self._buf))  # nothing may follow EOS; the engine stops there anyway
        return False
