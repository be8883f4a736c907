"""OpenAI-shaped chat input -> the message dicts DeepSeek-V4's encoder renders.

Owns reading what clients send (a JSON list of messages, or a request body with "messages" and
"tools"; OpenAI tool schemas) and turning it into what `encoding.encode_messages` expects, with
one-line errors that point at the offending message (`MessageError`). Conventions (ENCODING.md
§3, §5, §6): text content parts are flattened to a string, `reasoning` is accepted as an alias of
`reasoning_content`, tool-call arguments given as objects are serialized to JSON strings, and the
request's tools ride on the first system message (one with empty content is created if there is
none). Rendering and parsing stay in `encoding/`.
"""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system", "developer", "user", "assistant", "tool")


class MessageError(ValueError):
    """Input messages or tools the encoder cannot take; one line naming the place."""


def _text(content, where: str) -> str:
    """A message's content as a string: None -> "", OpenAI text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageError(f"{where}.content[{j}]: only text parts are supported, got {kind!r}")
        return "\n".join(parts)
    raise MessageError(f"{where}.content must be a string or a list of text parts, "
                       f"got {type(content).__name__}")


def _tool_call(call, where: str) -> dict:
    if not isinstance(call, dict):
        raise MessageError(f"{where} must be an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise MessageError(f"{where}: needs function.name (a non-empty string)")
    args = fn.get("arguments", "{}")
    if args is None:
        args = "{}"
    if not isinstance(args, str):  # an object: serialize it, or the encoder wraps it whole (§3.8)
        args = json.dumps(args, ensure_ascii=False)
    try:
        parsed = json.loads(args)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise MessageError(f"{where}: function.arguments must be a JSON object (as a string or an object), "
                           f"got {args[:60]!r}")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def normalize_tools(tools, where: str = "tools") -> list[dict]:
    """OpenAI tool schemas ({"type": "function", "function": {...}}, or bare function objects)."""
    if not isinstance(tools, list):
        raise MessageError(f"{where} must be a JSON list of tool schemas, got {type(tools).__name__}")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise MessageError(f"{where}[{i}]: a tool needs function.name (a non-empty string)")
        if isinstance(tool, dict) and tool.get("type", "function") != "function":
            raise MessageError(f"{where}[{i}]: only function tools are supported, got type {tool['type']!r}")
        out.append({"type": "function", "function": fn})
    names = [t["function"]["name"] for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise MessageError(f"{where}: tool {dup[0]!r} is declared twice")
    return out


def normalize_messages(messages, tools: list[dict] | None = None, *, where: str = "messages") -> list[dict]:
    """Validate OpenAI-shaped `messages` and convert them for the encoder; `tools` (already
    normalized) are attached to the first system message.

    The conversation must end with a user, tool or developer message (the reply is generated
    after it), and system messages must come before every other message (the encoder pastes a
    later one raw into the previous turn).
    """
    if not isinstance(messages, list) or not messages:
        raise MessageError(f"{where} must be a non-empty JSON list of messages")
    out: list[dict] = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise MessageError(f"{at} must be an object with a role, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(f"{at}: role {role!r} is not one of {', '.join(ROLES)}")
        msg: dict = {"role": role, "content": _text(m.get("content"), at)}
        if role == "system":
            if any(p["role"] != "system" for p in out):
                raise MessageError(f"{at}: a system message must come before all other messages")
        if role in ("system", "developer"):
            if m.get("tools"):
                msg["tools"] = normalize_tools(m["tools"], f"{at}.tools")
            if m.get("response_format") is not None:
                msg["response_format"] = m["response_format"]
            if role == "developer" and not msg["content"]:
                raise MessageError(f"{at}: a developer message needs non-empty content")
        elif role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise MessageError(f"{at}.reasoning_content must be a string")
                msg["reasoning_content"] = reasoning
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise MessageError(f"{at}.tool_calls must be a list")
            if calls:
                msg["tool_calls"] = [_tool_call(c, f"{at}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif role == "tool":
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    last = out[-1]["role"]
    if last not in ("user", "tool", "developer"):
        article = "an" if last[0] in "aeiou" else "a"
        raise MessageError(f"{where}: the last message is {article} {last} message; the reply is generated after a "
                           "user or tool message (add one, or pass the user's text with --prompt)")
    if tools:
        if any(m.get("tools") for m in out):
            raise MessageError(f"{where}: tools are declared both in the messages and with --tools; keep one")
        if out[0]["role"] == "system":
            out[0]["tools"] = tools
        else:
            out.insert(0, {"role": "system", "content": "", "tools": tools})
    return out


def read_json_file(path: str, what: str):
    """JSON from `path` ("-" = stdin); MessageError names the flag and the problem."""
    import sys

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MessageError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise MessageError(f"{what} {path} is not valid JSON: {e}") from None


def load_request(messages_path: str | None, tools_path: str | None) -> tuple[list | None, list[dict] | None]:
    """(raw messages or None, normalized tools or None) from the --messages / --tools files.

    A --messages file holds a list of messages, or an object with "messages" (and optionally
    "tools", as in an OpenAI request body); a --tools file a list of tool schemas (or {"tools": [...]})."""
    messages = tools = None
    if messages_path is not None:
        raw = read_json_file(messages_path, "--messages")
        if isinstance(raw, dict) and "messages" in raw:
            messages = raw["messages"]
            if raw.get("tools"):
                tools = normalize_tools(raw["tools"], "--messages tools")
        else:
            messages = raw
    if tools_path is not None:
        raw = read_json_file(tools_path, "--tools")
        if isinstance(raw, dict) and "tools" in raw:
            raw = raw["tools"]
        if tools is not None:
            raise MessageError("tools are declared both in the --messages file and with --tools; keep one")
        tools = normalize_tools(raw, "--tools")
    return messages, tools


__all__ = ["MessageError", "ROLES", "load_request", "normalize_messages", "normalize_tools", "read_json_file"]
