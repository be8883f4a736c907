"""DeepSeek-V4 chat encoding: messages -> prompt string, and completion text -> assistant message.

Owns the text-side contract of DeepSeek's official `encoding/encoding_dsv4.py` as pinned by
`dsv4/ENCODING.md` and its vectors: prompt rendering for the "preview" and "0731" releases (they
differ only in the reasoning-effort prefix), DSML tool-call rendering and parsing, and choosing the
release from a checkpoint's config.json. Outputs are byte-identical to the official encoder and
errors have the same kinds (AssertionError for format checks, ValueError for DSML structure).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

# Control strings. `｜` is U+FF5C and `▁` is U+2581; most of these are single tokens.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# DSML markers as the parser searches for them. The block opener deliberately has no ">" and the
# parameter closer no "<": the official grammar checks those characters separately.
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls"
TOOL_CALLS_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"
INVOKE_END = f"</{DSML}invoke"
PARAM_START = f"<{DSML}parameter"
PARAM_END = f"/{DSML}parameter"
_INVOKE_HEADER_RE = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAM_RE = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)

RELEASES = ("preview", "0731")
_RELEASE_ALIASES = {"v0731": "0731"}

_ABSOLUTE_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve"
    " the root cause, rigorously stress-testing your logic against all potential paths, edge cases,"
    " and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step,"
    " considered alternative, and rejected hypothesis to ensure absolutely no assumption is left"
    " unchecked.\n\n"
)
_BEYOND_MAX_EFFORT = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance:"
    " exhaustively decompose the problem into its most fundamental components, trace every causal"
    " chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles"
    " and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)
# Accepted `reasoning_effort` values per release -> prefix emitted before message 0 (thinking only).
# Preview accepts "high" as a no-op and rejects "low"; 0731 shifts the ladder down one step.
_EFFORT_PREFIX = {
    "preview": {None: "", "high": "", "max": _ABSOLUTE_MAX_EFFORT},
    "0731": {None: "", "low": "", "high": _ABSOLUTE_MAX_EFFORT, "max": _BEYOND_MAX_EFFORT},
}

_DSML_EXAMPLE = "\n".join([
    f"<{DSML}tool_calls>",
    f'<{DSML}invoke name="$TOOL_NAME">',
    f'<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>',
    "...",
    f"</{DSML}invoke>",
    f'<{DSML}invoke name="$TOOL_NAME2">',
    "...",
    f"</{DSML}invoke>",
    f"</{DSML}tool_calls>",
])


def _check(condition: Any, message: str) -> None:
    # The official code uses `assert`; raising explicitly keeps the checks alive under `python -O`.
    if not condition:
        raise AssertionError(message)


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def normalize_release(release: str) -> str:
    """Canonical release name ("preview" or "0731"); accepts the alias "v0731"."""
    release = _RELEASE_ALIASES.get(release, release)
    if release not in RELEASES:
        raise ValueError(f"Unknown DeepSeek-V4 release {release!r}; expected one of {RELEASES}")
    return release


def release_from_config(config: dict | str | Path) -> str:
    """Pick the encoder release from a checkpoint config (dict, config.json path or checkpoint dir).

    The 0731 checkpoints are the only ones carrying the DSpark draft-head keys (`dspark_*`); the
    tokenizer and generation config are identical, so this is the one reliable discriminator.
    """
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
    return "0731" if any(key.startswith("dspark_") for key in config) else "preview"


# ---------------------------------------------------------------------------------------------
# Prompt rendering
# ---------------------------------------------------------------------------------------------

def _tools_block(tools: list[dict]) -> str:
    schemas = "\n".join(_to_json(tool.get("function", tool)) for tool in tools)
    paragraphs = [
        "## Tools",
        "You have access to a set of tools to help answer the user's question. You can invoke tools"
        f' by writing a "<{DSML}tool_calls>" block like the following:',
        _DSML_EXAMPLE,
        'String parameters should be specified as is and set `string="true"`. For all other types'
        ' (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.',
        f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete"
        f" reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.",
        f"Otherwise, output directly after {THINK_END} with tool calls or final response.",
        "### Available Tool Schemas",
        schemas,
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.",
    ]
    return "\n\n".join(paragraphs) + "\n"


def _with_tools_and_format(text: str, msg: dict) -> str:
    """System/developer text plus the optional tools block and response-format schema."""
    if msg.get("tools"):
        text += "\n\n" + _tools_block(msg["tools"])
    if msg.get("response_format"):
        text += ("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
                 + _to_json(msg["response_format"]))
    return text


def _render_arguments(arguments: Any) -> str:
    # Arguments are a JSON string; anything that is not (a dict, broken JSON) becomes a single
    # parameter named "arguments", exactly like the official encoder.
    try:
        parsed = json.loads(arguments)
    except Exception:
        parsed = {"arguments": arguments}
    params = []
    for key, value in parsed.items():
        is_str = isinstance(value, str)
        body = value if is_str else _to_json(value)
        params.append(f'<{DSML}parameter name="{key}" string="{"true" if is_str else "false"}">'
                      f"{body}</{DSML}parameter>")
    return "\n".join(params)


def _render_tool_calls(tool_calls: list[dict]) -> str:
    invokes = []
    for call in tool_calls:
        fn = call.get("function", call)
        invokes.append(f'<{DSML}invoke name="{fn.get("name")}">\n'
                       f"{_render_arguments(fn.get('arguments'))}\n</{DSML}invoke>")
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _render_tool_result(content: Any) -> str:
    if isinstance(content, list):
        content = "\n\n".join(block.get("text", "") if block.get("type") == "text"
                              else f"[Unsupported {block.get('type')}]" for block in content)
    return f"<tool_result>{content}</tool_result>"


def _render_user(msg: dict) -> str:
    blocks = msg.get("content_blocks")
    if not blocks:
        return msg.get("content") or ""
    parts = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(block.get("text") or "")
        elif kind == "tool_result":
            parts.append(_render_tool_result(block.get("content", "")))
        else:
            parts.append(f"[Unsupported {kind}]")
    return "\n\n".join(parts)


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in ("user", "developer"):
            return i
    return -1


class _Renderer:
    """Renders one conversation; holds the per-call settings shared by every message."""

    def __init__(self, messages: list[dict], thinking: bool, drop_thinking: bool, effort_prefix: str):
        self.messages = messages
        self.thinking = thinking
        self.drop_thinking = drop_thinking
        self.effort_prefix = effort_prefix
        self.last_user = _last_user_index(messages)

    def render(self, i: int) -> str:
        msg = self.messages[i]
        role = msg.get("role")
        out = self.effort_prefix if i == 0 and self.thinking else ""
        if role == "system":
            out += _with_tools_and_format(msg.get("content") or "", msg)
        elif role == "developer":
            _check(msg.get("content"), f"Invalid message for role `developer`: {msg}")
            out += USER + _with_tools_and_format(msg["content"], msg)
        elif role == "user":
            out += USER + _render_user(msg)
        elif role == "latest_reminder":
            out += f"{LATEST_REMINDER}{msg.get('content')}"
        elif role == "assistant":
            out += self._render_assistant(i, msg)
        else:
            raise NotImplementedError(f"Unknown role: {role}")  # the official encoder's exception kind (ENCODING.md)
        return out + self._transition(i, msg)

    def _keeps_reasoning(self, i: int) -> bool:
        # Reasoning is rendered for turns after the last user/developer message, or for all turns
        # when dropping is off (explicitly or because tools are present).
        return not self.drop_thinking or i > self.last_user

    def _render_assistant(self, i: int, msg: dict) -> str:
        reasoning = ""
        after_task = i > 0 and self.messages[i - 1].get("task") is not None
        if self.thinking and not after_task and self._keeps_reasoning(i):
            # No "<think>" here: the preceding user turn's transition already opened it.
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = msg.get("tool_calls")
        dsml = "\n\n" + _render_tool_calls(calls) if calls else ""
        eos = "" if msg.get("wo_eos") else EOS
        return reasoning + (msg.get("content") or "") + dsml + eos

    def _transition(self, i: int, msg: dict) -> str:
        """The generation prompt emitted when the next message is the model's (or i is last)."""
        if i + 1 < len(self.messages) and self.messages[i + 1].get("role") not in ("assistant", "latest_reminder"):
            return ""
        task = msg.get("task")
        if task is not None:
            _check(task in TASK_TOKENS, f"Invalid task: {task!r}. Valid tasks are: {list(TASK_TOKENS)}")
            if task != "action":
                return TASK_TOKENS[task]
            return ASSISTANT + (THINK_START if self.thinking else THINK_END) + TASK_TOKENS[task]
        if msg.get("role") in ("user", "developer"):
            opens_thinking = self.thinking and (not self.drop_thinking or i >= self.last_user)
            return ASSISTANT + (THINK_START if opens_thinking else THINK_END)
        return ""


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Fold `tool` messages (and user text following them) into `<｜User｜>` turns of content blocks."""
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        # vLLM-style clients send `reasoning`; the official encoder only knows `reasoning_content`.
        if "reasoning" in msg and "reasoning_content" not in msg:
            msg["reasoning_content"] = msg.pop("reasoning")
        role = msg.get("role")
        prev = merged[-1] if merged else None
        prev_is_blocks = prev is not None and prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": msg.get("content", "")}
            if prev_is_blocks:
                prev["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if prev_is_blocks and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                # Only these keys survive; any other user key (e.g. `tools`) is dropped officially.
                new = {"role": "user", "content": msg.get("content", ""), "content_blocks": [block]}
                new.update({k: msg[k] for k in ("task", "wo_eos", "mask") if k in msg})
                merged.append(new)
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict]) -> None:
    """Reorder tool results in each user turn by the call order of the latest assistant tool calls."""
    call_order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            call_order = {}
            for idx, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    call_order[call_id] = idx
        elif msg.get("role") == "user" and msg.get("content_blocks"):
            blocks = msg["content_blocks"]
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) > 1 and call_order:
                ordered = iter(sorted(results, key=lambda b: call_order.get(b.get("tool_use_id", ""), 0)))
                # Text blocks keep their slots; only the tool_result slots are permuted.
                msg["content_blocks"] = [next(ordered) if b.get("type") == "tool_result" else b for b in blocks]


def _drop_old_reasoning(messages: list[dict]) -> list[dict]:
    """Thinking-mode history compaction: strip reasoning before the last user turn, drop developers."""
    last_user = _last_user_index(messages)
    kept = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in ("user", "system", "tool", "latest_reminder", "direct_search_results") or i >= last_user:
            kept.append(msg)
        elif role == "assistant":
            msg = dict(msg)
            msg.pop("reasoning_content", None)
            kept.append(msg)
        # Developer (and any other) messages before the last user turn are deleted.
    return kept


def encode_messages(
    messages: list[dict],
    thinking_mode: str,
    drop_thinking: bool = True,
    reasoning_effort: str | None = None,
    context: list[dict] | None = None,
    add_default_bos_token: bool = True,
    release: str = "preview",
) -> str:
    """Render OpenAI-style messages to the DeepSeek-V4 prompt string (tokenize without BOS/EOS).

    `thinking_mode` is "chat" or "thinking". `context` holds messages already encoded earlier
    (only `messages` are rendered, and no BOS is added). Tools ride on a system/developer message
    under `tools`; their presence disables `drop_thinking`. `release` selects the effort ladder.
    """
    release = normalize_release(release)
    _check(thinking_mode in ("chat", "thinking"), f"Invalid thinking_mode `{thinking_mode}`")
    efforts = _EFFORT_PREFIX[release]
    _check(reasoning_effort in efforts, f"Invalid reasoning effort: {reasoning_effort}")
    thinking = thinking_mode == "thinking"

    context = _merge_tool_messages(context or [])
    new = _merge_tool_messages(messages)
    full = context + new
    # Sorting over the joined list lets results in `messages` follow calls made in `context`.
    _sort_tool_results(full)

    drop = drop_thinking and not any(m.get("tools") for m in full)
    first_new = len(context)
    if thinking and drop:
        full = _drop_old_reasoning(full)
        # Official quirk kept for prefix-cache compatibility: the rendered range starts after the
        # context as compacted on its own, which can differ from its share of the compacted whole.
        first_new = len(_drop_old_reasoning(context))

    renderer = _Renderer(full, thinking, drop, efforts[reasoning_effort])
    prompt = BOS if add_default_bos_token and not context else ""
    return prompt + "".join(renderer.render(i) for i in range(first_new, len(full)))


# ---------------------------------------------------------------------------------------------
# Completion parsing
# ---------------------------------------------------------------------------------------------

def find_first(text: str, start: int, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """Earliest occurrence of any stop at or after `start`; ties go to the earlier-listed stop."""
    best, best_stop = -1, None
    for stop in stops:
        pos = text.find(stop, start)
        if pos != -1 and (best_stop is None or pos < best):
            best, best_stop = pos, stop
    return best, best_stop


def _read_until(text: str, start: int, stops: tuple[str, ...]) -> tuple[str, int, str | None]:
    """(text before the first stop, index after it, the stop); without a stop: (rest, len, None)."""
    pos, stop = find_first(text, start, stops)
    if stop is None:
        return text[start:], len(text), None
    return text[start:pos], pos + len(stop), stop


def _parse_invoke_header(header: str) -> str:
    match = _INVOKE_HEADER_RE.findall(header)
    if len(match) != 1:
        raise ValueError(f"Tool name format error: {header!r}")
    return match[0]


def _parse_parameter(body: str) -> tuple[str, str, str]:
    """`body` is the text between "<｜DSML｜parameter" and "/｜DSML｜parameter": (name, string, value)."""
    match = _PARAM_RE.findall(body)
    if len(match) != 1:
        raise ValueError(f"Parameter format error: {body!r}")
    return match[0]


def _expect_gap(gap: str) -> None:
    if gap != ">\n":
        raise ValueError(f"Tool call format error: expected '>\\n' but got {gap!r}")


def make_tool_call(name: str, params: dict[str, tuple[str, str]]) -> dict:
    """OpenAI-format call. Arguments JSON is assembled textually: string="false" values stay verbatim."""
    fields = [f"{_to_json(key)}: {_to_json(value) if is_str == 'true' else value}"
              for key, (value, is_str) in params.items()]
    return {"type": "function", "function": {"name": name, "arguments": "{" + ", ".join(fields) + "}"}}


def _parse_tool_block(text: str, pos: int) -> tuple[list[dict], int]:
    """Parse invokes after the block opener up to and including `</｜DSML｜tool_calls>`."""
    calls = []
    while pos < len(text):
        gap, pos, stop = _read_until(text, pos, (INVOKE_START, TOOL_CALLS_END))
        _expect_gap(gap)
        if stop == TOOL_CALLS_END:
            break
        if stop is None:
            raise ValueError("Missing special token in tool calls")
        header, pos, stop = _read_until(text, pos, (PARAM_START, INVOKE_END))
        name = _parse_invoke_header(header)
        params: dict[str, tuple[str, str]] = {}
        while stop == PARAM_START:
            body, pos, stop = _read_until(text, pos, (PARAM_END,))
            key, is_str, value = _parse_parameter(body)
            if key in params:
                raise ValueError(f"Duplicate parameter name: {key!r}")
            params[key] = (value, is_str)
            gap, pos, stop = _read_until(text, pos, (PARAM_START, INVOKE_END))
            _expect_gap(gap)
        calls.append(make_tool_call(name, params))
    return calls, pos


def parse_official_completion(text: str, thinking_mode: str) -> dict:
    """DeepSeek's official parser: one generated assistant turn (INCLUDING the final EOS).

    Returns {"role", "content", "reasoning_content", "tool_calls"} with OpenAI-format calls (no id).
    Accepts well-formed output only: AssertionError for a missing `</think>`/EOS or stray control
    strings, ValueError for malformed DSML (ENCODING.md §4).
    """
    _check(thinking_mode in ("chat", "thinking"), f"Invalid thinking_mode `{thinking_mode}`")
    reasoning, pos = "", 0
    if thinking_mode == "thinking":
        reasoning, pos, stop = _read_until(text, pos, (THINK_END, TOOL_CALLS_START))
        _check(stop == THINK_END, "Invalid thinking format: missing </think>")

    content, pos, stop = _read_until(text, pos, (EOS, TOOL_CALLS_START))
    tool_calls: list[dict] = []
    if stop == TOOL_CALLS_START:
        tool_calls, pos = _parse_tool_block(text, pos)
        trailing, pos, _ = _read_until(text, pos, (EOS,))
        _check(not trailing, "Unexpected content after tool calls")
    else:
        _check(stop == EOS, "Invalid format: missing EOS token")
    _check(pos == len(text), "Unexpected content at end")

    for token in (BOS, EOS, THINK_START, THINK_END, DSML):
        _check(token not in content and token not in reasoning, f"Unexpected special token '{token}' in content")
    return {"role": "assistant", "content": content, "reasoning_content": reasoning, "tool_calls": tool_calls}


def parse_message_from_completion_text(text: str, thinking_mode: str, tools: list[dict] | None = None,
                                       strict: bool = True) -> dict:
    """Parse one generated assistant turn (text after the prompt, including the final EOS).

    Returns {"role", "content", "reasoning_content", "tool_calls", "unparsed"}: what
    `StreamingParser(thinking_mode, tools)` streams for this text, with `unparsed` the raw text
    that is none of the others. strict=True raises exactly where DeepSeek's official parser does
    (without tools the result then equals the official one); strict=False recovers and never raises on model
    text. `tools` (declared tool schemas) enables the drift recovery of ENCODING.md §6.5.
    """
    from .streaming import StreamingParser  # deferred: the streaming parser builds on this module

    parser = StreamingParser(thinking_mode, tools)
    parser.feed(text)
    return parser.finish(strict=strict)
