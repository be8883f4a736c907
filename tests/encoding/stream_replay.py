"""Replaying a completion through `StreamingParser` under many splits and checking what it streams.

The property every parser test builds on: whatever the split (the whole text, each character
alone, every two-delta split, random 1-8 character splits), the deltas add up to the one-shot
`parse_message_from_completion_text(..., strict=False)`, the streamed `ToolCallDelta` events
rebuild exactly the calls that complete, and no reasoning or content carries a control string.
"""

import random

from encoding import StreamingParser, parse_message_from_completion_text

CONTROL_STRINGS = ("｜DSML｜", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                   "<think>", "</think>")


def random_pieces(text: str, seed: int, longest: int = 8) -> list[str]:
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, longest)
        pieces.append(text[i:i + n])
        i += n
    return pieces


def all_splits(text: str, seeds=range(20)):
    """The whole text, one delta per character, every two-delta split, random 1-8 char splits."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for seed in seeds:
        yield random_pieces(text, seed)


def check_tool_call_events(deltas) -> None:
    """Names come first and once per started call, fragments concatenate to the final arguments,
    a dropped call frees its index, and every completed call matches what was streamed for it."""
    started: dict[int, list[str]] = {}
    completed = 0
    for delta in deltas:
        for event in delta.tool_call_deltas:
            if event.dropped:
                assert event.index in started and not (event.name or event.arguments)
                del started[event.index]
            elif event.name:
                assert event.index == completed + len(started) and not event.arguments
                started[event.index] = [event.name, ""]
            else:
                assert event.arguments and event.index in started
                started[event.index][1] += event.arguments
        for call in delta.tool_calls:
            name, arguments = started.pop(completed)
            assert (name, arguments) == (call["function"]["name"], call["function"]["arguments"])
            completed += 1
    assert not started, f"calls started but neither completed nor dropped: {started}"


def replay(pieces: list[str], thinking_mode: str, tools=None) -> dict:
    """Feed `pieces`, check the stream, return `finish(strict=False)`."""
    parser = StreamingParser(thinking_mode, tools)
    deltas = [parser.feed(piece) for piece in pieces] + [parser.flush()]
    message = parser.finish(strict=False)
    streamed = {
        "role": "assistant",
        "content": "".join(d.content for d in deltas),
        "reasoning_content": "".join(d.reasoning for d in deltas),
        "tool_calls": [call for d in deltas for call in d.tool_calls],
        "unparsed": message["unparsed"],
    }
    assert streamed == message
    check_tool_call_events(deltas)
    shown = (message["content"], message["reasoning_content"])
    forbidden = CONTROL_STRINGS + (("<|DSML|",) if parser.tools else ())
    assert not [s for s in forbidden for text in shown if s in text], shown
    assert all(fragment in "".join(pieces) for fragment in message["unparsed"])
    return message


def check_all_splits(text: str, thinking_mode: str, tools=None, expected: dict | None = None) -> dict:
    """The one-shot parse (checked against `expected` fields if given) equals every replay."""
    one_shot = parse_message_from_completion_text(text, thinking_mode, tools, strict=False)
    if expected is not None:
        assert {key: one_shot[key] for key in expected} == expected
    for pieces in all_splits(text):
        assert replay(pieces, thinking_mode, tools) == one_shot, pieces
    return one_shot
