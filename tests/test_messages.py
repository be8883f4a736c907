"""dsv4.messages: OpenAI-shaped messages and tools -> the encoder's message dicts, with one-line errors."""

import json

import pytest

from dsv4.messages import MessageError, load_request, normalize_messages, normalize_tools
from encoding import encode_messages

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_tools_are_wrapped_and_attached_to_the_system_message():
    tools = normalize_tools([WEATHER, {"type": "function", "function": {"name": "now"}}])
    assert tools == [{"type": "function", "function": WEATHER}, {"type": "function", "function": {"name": "now"}}]
    with_system = normalize_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tools)
    assert with_system == [{"role": "system", "content": "S", "tools": tools}, {"role": "user", "content": "U"}]
    without = normalize_messages([{"role": "user", "content": "U"}], tools)
    assert without == [{"role": "system", "content": "", "tools": tools}, {"role": "user", "content": "U"}]
    # rendered as the official tools block after the (empty) system prompt
    prompt = encode_messages(without, "thinking")
    assert prompt.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n") and json.dumps(WEATHER) in prompt


def test_openai_conventions():
    msgs = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "reasoning": "r",
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"x": [1, 2]}}}]},
        {"role": "tool", "tool_call_id": 1, "content": "ok"},
    ])
    assert msgs == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "reasoning_content": "r",
         "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}, "id": "1"}]},
        {"role": "tool", "content": "ok", "tool_call_id": "1"},
    ]


@pytest.mark.parametrize("messages, error", [
    ([], "messages must be a non-empty JSON list of messages"),
    ({"role": "user"}, "messages must be a non-empty JSON list of messages"),
    (["hi"], "messages[0] must be an object with a role, got str"),
    ([{"content": "x"}], "messages[0]: role None is not one of system, developer, user, assistant, tool"),
    ([{"role": "user", "content": 3}], "messages[0].content must be a string or a list of text parts, got int"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "late"}, {"role": "user", "content": "y"}],
     "messages[1]: a system message must come before all other messages"),
    ([{"role": "developer", "content": ""}], "messages[0]: a developer message needs non-empty content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": [{"function": {}}]},
      {"role": "user", "content": "z"}],
     "messages[1].tool_calls[0]: needs function.name (a non-empty string)"),
    ([{"role": "user", "content": "x"},
      {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
      {"role": "tool", "content": "z"}],
     "messages[1].tool_calls[0]: function.arguments must be a JSON object (as a string or an object), got '[1]'"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
     "messages: the last message is an assistant message; the reply is generated after a user or tool message "
     "(add one, or pass the user's text with --prompt)"),
])
def test_message_errors(messages, error):
    with pytest.raises(MessageError) as e:
        normalize_messages(messages)
    assert str(e.value) == error


def test_tool_errors():
    with pytest.raises(MessageError, match=r"^tools\[1\]: a tool needs function.name"):
        normalize_tools([WEATHER, {"description": "x"}])
    with pytest.raises(MessageError, match=r"^tools: tool 'get_weather' is declared twice$"):
        normalize_tools([WEATHER, WEATHER])
    with pytest.raises(MessageError, match=r"^tools\[0\]: only function tools are supported, got type 'web'"):
        normalize_tools([{"type": "web", "name": "x"}])
    with pytest.raises(MessageError, match=r"tools are declared both in the messages and with --tools"):
        normalize_messages([{"role": "system", "content": "", "tools": [WEATHER]}, {"role": "user", "content": "x"}],
                           normalize_tools([WEATHER]))


def test_load_request(tmp_path):
    (tmp_path / "body.json").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}))
    messages, tools = load_request(str(tmp_path / "body.json"), None)
    assert messages == [{"role": "user", "content": "x"}] and tools == [{"type": "function", "function": WEATHER}]
    (tmp_path / "tools.json").write_text(json.dumps({"tools": [WEATHER]}))
    assert load_request(None, str(tmp_path / "tools.json")) == (None, tools)
    with pytest.raises(MessageError, match="declared both in the --messages file and with --tools"):
        load_request(str(tmp_path / "body.json"), str(tmp_path / "tools.json"))
