"""Streaming parser and incremental detokenizer.

The streaming parser is replayed on every parse vector (and on encoder-rendered assistant turns)
split at random token and character boundaries; the streamed deltas must add up to the
non-streaming result and never show DSML or control-token fragments as content. The incremental
decoder must reproduce the full decode of multi-byte text without ever emitting U+FFFD.
"""

import json
import random

import pytest

from encoding import (
    EOS, IncrementalDecoder, StreamingParser, encode_messages, parse_message_from_completion_text,
)

SEEDS = range(50)
FORBIDDEN_IN_CONTENT = ("｜DSML｜", "<｜")


def _stream(pieces, thinking_mode):
    """Feed `pieces`; return (parser, reasoning deltas, content deltas, streamed tool calls)."""
    parser = StreamingParser(thinking_mode)
    reasoning, content, calls = [], [], []
    for delta in [parser.feed(piece) for piece in pieces] + [parser.flush()]:
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        calls.extend(delta.tool_calls)
    return parser, reasoning, content, calls


def _token_pieces(tokenizer, ids, rng):
    """Decode ids through IncrementalDecoder, grouping 1-4 tokens per delta like a batched server."""
    decoder, pieces, i = IncrementalDecoder(tokenizer), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append("".join(decoder.push(t) for t in ids[i:i + n]))
        i += n
    pieces.append(decoder.flush())
    return pieces


def _char_pieces(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)], strict=True)]


def _check_stream(pieces, thinking_mode, expected=None, error=None):
    parser, reasoning, content, calls = _stream(pieces, thinking_mode)
    streamed = {"role": "assistant", "content": "".join(content),
                "reasoning_content": "".join(reasoning), "tool_calls": calls}
    if error is None:
        assert streamed == expected
        assert parser.finish() == {**expected, "unparsed": []}
        assert parser.done
    else:
        with pytest.raises(error):
            parser.finish()
        assert {k: v for k, v in parser.finish(strict=False).items() if k != "unparsed"} == streamed
    for fragment in FORBIDDEN_IN_CONTENT:
        if expected is None or fragment not in expected["content"]:
            assert all(fragment not in piece for piece in content), (fragment, content)
            assert fragment not in streamed["content"]
    return streamed


def _parse_case_expectation(case):
    if "expected_error" in case:
        return None, {"AssertionError": AssertionError, "ValueError": ValueError}[case["expected_error"]["type"]]
    return case["expected"], None


def test_stream_parse_case_token_splits(parse_case, tokenizer):
    expected, error = _parse_case_expectation(parse_case)
    for seed in SEEDS:
        pieces = _token_pieces(tokenizer, parse_case["completion_token_ids"], random.Random(seed))
        assert "".join(pieces) == parse_case["completion"]
        _check_stream(pieces, parse_case["thinking_mode"], expected, error)


def test_stream_parse_case_char_splits(parse_case):
    expected, error = _parse_case_expectation(parse_case)
    text = parse_case["completion"]
    splits = [list(text), [text]] + [_char_pieces(text, random.Random(seed)) for seed in SEEDS]
    for pieces in splits:
        _check_stream(pieces, parse_case["thinking_mode"], expected, error)


def test_stream_recovers_missing_think_end(shared_dsv4):
    """The DSML opener ends reasoning even without </think> (the official parser raises)."""
    cases = json.loads((shared_dsv4 / "encoding_vectors" / "parse_cases.json").read_text(encoding="utf-8"))
    completion = next(c for c in cases if c["id"] == "err_missing_think_end")["completion"]
    streamed = _check_stream(list(completion), "thinking", error=AssertionError)
    assert streamed["reasoning_content"] == "reasoning..."
    assert streamed["content"] == ""
    assert [c["function"]["name"] for c in streamed["tool_calls"]] == ["now"]


def _assistant_turns(encode_case):
    """(thinking_mode, completion text, assistant message) for assistant turns of an encode vector."""
    for msg in encode_case["messages"]:
        if msg.get("role") != "assistant" or msg.get("wo_eos"):
            continue
        msg = {k: v for k, v in msg.items() if k != "task"}  # a task token would follow the EOS
        for mode in ("chat", "thinking"):
            prompt = encode_messages([{"role": "user", "content": "q"}, msg], mode, drop_thinking=False)
            opener = "<｜Assistant｜>" + ("<think>" if mode == "thinking" else "</think>")
            yield mode, prompt[prompt.index(opener) + len(opener):], msg


def test_stream_encoder_roundtrip(encode_case, tokenizer):
    """Rendered assistant turns parse back to the message, whole and streamed token by token."""
    for mode, completion, msg in _assistant_turns(encode_case):
        expected = parse_message_from_completion_text(completion, mode)
        assert expected.pop("unparsed") == []
        assert expected["content"] == (msg.get("content") or "")
        if mode == "thinking":
            assert expected["reasoning_content"] == (msg.get("reasoning_content") or "")
        for got, sent in zip(expected["tool_calls"], msg.get("tool_calls") or [], strict=True):
            assert got["function"]["name"] == sent["function"]["name"]
            try:
                sent_args = json.loads(sent["function"]["arguments"])
            except json.JSONDecodeError:
                sent_args = {"arguments": sent["function"]["arguments"]}
            assert json.loads(got["function"]["arguments"]) == sent_args
        ids = tokenizer.encode(completion)
        for seed in range(5):
            _check_stream(_token_pieces(tokenizer, ids, random.Random(seed)), mode, expected)


@pytest.mark.parametrize("pieces, mode, content, reasoning, names", [
    # Blank line missing before the block: still a tool call, DSML never shown.
    (["Hi\n<", "｜DSML｜", "tool_calls>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>", EOS],
     "chat", "Hi\n", "", ["now"]),
    # Stray closer in prose is swallowed, not leaked.
    (["Hello </", "｜DSML｜", "parameter> world", EOS], "chat", "Hello ", "", []),
    # Truncated generation ending inside a control string.
    (["r</think>Answer<｜DS"], "thinking", "Answer", "r", []),
    # Text after the tool block is not content.
    (["\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>tail", EOS], "chat", "", "", []),
])
def test_stream_drift_never_leaks(pieces, mode, content, reasoning, names):
    parser, r, c, calls = _stream(pieces, mode)
    assert "".join(c) == content and "".join(r) == reasoning
    assert [call["function"]["name"] for call in calls] == names
    assert all(f not in piece for piece in c for f in FORBIDDEN_IN_CONTENT)
    with pytest.raises(AssertionError):
        parser.finish()


def test_stream_holds_split_markers():
    parser = StreamingParser("thinking")
    assert parser.feed("plan </thi").reasoning == "plan "
    delta = parser.feed("nk>ok\n")
    assert (delta.reasoning, delta.content) == ("", "ok")  # "\n" may start the DSML opener
    delta = parser.feed("\n<｜end▁of▁sen")
    assert delta.content == "\n\n"  # "\n\n<｜e" can no longer become the DSML opener
    assert not parser.feed("tence｜>") and parser.done
    assert parser.finish() == {"role": "assistant", "content": "ok\n\n", "reasoning_content": "plan ",
                               "tool_calls": [], "unparsed": []}


MULTIBYTE_TEXTS = [
    "你好，世界！今天天气怎么样？",
    "龘靐齉齾爩鱻麤龗灪吁",  # rare ideographs split into byte tokens
    "emoji 😀🤖👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 ok",
    "mixed: naïve café — 日本語のテキスト, Привет 🌍!",
    f"reason</think>答案是 42 🎉{EOS}",
]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_incremental_decoder_multibyte(tokenizer, text):
    ids = tokenizer.encode(text)
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_incremental_decoder_actually_holds_back(tokenizer):
    ids = tokenizer.encode("👨‍👩‍👧‍👦龘")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # single tokens split characters
    decoder = IncrementalDecoder(tokenizer)
    assert any(decoder.push(i) == "" for i in ids)


@pytest.mark.parametrize("seed", range(10))
def test_incremental_decoder_random_ids(tokenizer, seed):
    """Arbitrary (possibly invalid UTF-8) id sequences still concatenate to the full decode."""
    rng = random.Random(seed)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    decoder = IncrementalDecoder(tokenizer)
    assert "".join([decoder.push(i) for i in ids] + [decoder.flush()]) == tokenizer.decode(ids)
