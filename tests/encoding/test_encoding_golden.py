"""DeepSeek's four official golden encoding cases, replayed as their PROVENANCE.md describes.

Each case must render byte-identically with both releases (they differ only in reasoning effort),
and the assistant turns cut out of the rendered prompt must parse back as the official test checks.
"""

import json

import pytest

from encoding import encode_messages, parse_message_from_completion_text

THINK_OPEN = "<｜Assistant｜><think>"
THINKING_MODE = {1: "thinking", 2: "thinking", 3: "thinking", 4: "chat"}


def _golden(shared_dsv4, case: int):
    folder = shared_dsv4 / "official_encoding_tests"
    data = json.loads((folder / f"test_input_{case}.json").read_text(encoding="utf-8"))
    if case == 1:  # the official test attaches the tool list to the system message
        messages = data["messages"]
        messages[0]["tools"] = data["tools"]
    else:
        messages = data
    expected = (folder / f"test_output_{case}.txt").read_bytes().decode("utf-8")
    return messages, expected


@pytest.mark.parametrize("release", ["preview", "0731"])
@pytest.mark.parametrize("case", [1, 2, 3, 4])
def test_golden_prompt_is_byte_identical(shared_dsv4, case, release):
    messages, expected = _golden(shared_dsv4, case)
    prompt = encode_messages(messages, thinking_mode=THINKING_MODE[case], release=release)
    assert prompt.encode("utf-8") == expected.encode("utf-8")


def test_golden_1_turns_parse_back(shared_dsv4):
    messages, _ = _golden(shared_dsv4, 1)
    prompt = encode_messages(messages, thinking_mode="thinking")

    start = prompt.find(THINK_OPEN) + len(THINK_OPEN)
    first_turn = prompt[start:prompt.find("<｜User｜>", start)]
    first = parse_message_from_completion_text(first_turn, thinking_mode="thinking")
    assert first["reasoning_content"] == (
        "The user wants to know the weather in Beijing. I should use the get_weather tool.")
    assert first["content"] == ""
    assert len(first["tool_calls"]) == 1
    call = first["tool_calls"][0]["function"]
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"location": "Beijing", "unit": "celsius"}

    last = parse_message_from_completion_text(prompt[prompt.rfind(THINK_OPEN) + len(THINK_OPEN):], "thinking")
    assert last["reasoning_content"] == "Got the weather data. Let me format a nice response."
    assert "22°C" in last["content"]
    assert last["tool_calls"] == []


def test_golden_2_last_turn_and_dropped_reasoning(shared_dsv4):
    messages, _ = _golden(shared_dsv4, 2)
    prompt = encode_messages(messages, thinking_mode="thinking")
    last = parse_message_from_completion_text(prompt[prompt.rfind(THINK_OPEN) + len(THINK_OPEN):], "thinking")
    assert last["reasoning_content"] == "The user asks about the capital of France. It is Paris."
    assert last["content"] == "The capital of France is Paris."
    assert "The user said hello" not in prompt


def test_golden_1_token_count(shared_dsv4, tokenizer):
    _, expected = _golden(shared_dsv4, 1)
    ids = tokenizer.encode(expected)
    assert len(ids) == 541  # independently published count
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
