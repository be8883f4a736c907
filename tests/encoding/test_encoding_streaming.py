"""Streaming parser and incremental detokenizer.

The streaming parser is replayed on every parse vector (and on encoder-rendered assistant turns)
split at random token and character boundaries; the streamed deltas must add up to the one-shot
result, which equals the official parser on well-formed output and recovers (reporting what it
cannot place in `unparsed`) on the error vectors. The incremental decoder must reproduce the full
decode of multi-byte text without ever emitting U+FFFD.
"""

import json
import random

import pytest
from stream_replay import all_splits, replay

from encoding import (
    EOS, IncrementalDecoder, StreamingParser, encode_messages, parse_message_from_completion_text,
)

SEEDS = range(50)
ERRORS = {"AssertionError": AssertionError, "ValueError": ValueError}


def _now(arguments: str = "{}") -> dict:
    return {"type": "function", "function": {"name": "now", "arguments": arguments}}


# What the recovering parser makes of the official error vectors (the official parser raises).
RECOVERED = {
    "err_missing_think_end": {"reasoning_content": "reasoning...", "content": "", "tool_calls": [_now()],
                              "unparsed": []},
    "err_content_after_calls": {"content": "", "tool_calls": [_now()], "unparsed": ["trailing"]},
    "err_think_end_in_chat": {"content": "abcdef", "tool_calls": [], "unparsed": ["</think>"]},
    "err_duplicate_param": {"content": "", "tool_calls": [], "unparsed": "whole completion before EOS"},
    "err_missing_block_close": {"content": "", "tool_calls": [_now()], "unparsed": []},
}


def _token_pieces(tokenizer, ids, rng):
    """Decode ids through IncrementalDecoder, grouping 1-4 tokens per delta like a batched server."""
    decoder, pieces, i = IncrementalDecoder(tokenizer), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append("".join(decoder.push(t) for t in ids[i:i + n]))
        i += n
    pieces.append(decoder.flush())
    return pieces


def _expected_message(case) -> dict:
    """The recovering parse of a vector: the official result, or the recovery pinned above."""
    if "expected_error" not in case:
        return {**case["expected"], "unparsed": []}
    recovered = dict(RECOVERED[case["id"]])
    if recovered["unparsed"] == "whole completion before EOS":
        recovered["unparsed"] = [case["completion"].removesuffix(EOS)]
    return recovered


def _check_vector(case, pieces):
    expected = _expected_message(case)
    message = replay(pieces, case["thinking_mode"])
    assert {key: message[key] for key in expected} == expected
    parser = StreamingParser(case["thinking_mode"])
    for piece in pieces:
        parser.feed(piece)
    if "expected_error" in case:
        with pytest.raises(ERRORS[case["expected_error"]["type"]]):
            parser.finish()
    else:
        assert parser.finish() == message


def test_stream_parse_case_token_splits(parse_case, tokenizer):
    for seed in SEEDS:
        pieces = _token_pieces(tokenizer, parse_case["completion_token_ids"], random.Random(seed))
        assert "".join(pieces) == parse_case["completion"]
        _check_vector(parse_case, pieces)


def test_stream_parse_case_char_splits(parse_case):
    for pieces in all_splits(parse_case["completion"], SEEDS):
        _check_vector(parse_case, pieces)


def test_one_shot_strict_false_recovers_error_vectors(parse_case):
    completion, mode = parse_case["completion"], parse_case["thinking_mode"]
    got = parse_message_from_completion_text(completion, mode, strict=False)
    expected = _expected_message(parse_case)
    assert {key: got[key] for key in expected} == expected


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
        assert expected["unparsed"] == []
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
            assert replay(_token_pieces(tokenizer, ids, random.Random(seed)), mode) == expected


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
