"""Generated vectors from `dsv4/encoding_vectors/`: encoder prompts and ids, parser results, tokenizer.

Expected values are what the official encoders ("preview" and "v0731") and tokenizer return;
error cases are compared by exception kind only, as the vectors' README prescribes.
"""

import json
import shutil

import pytest

from encoding import encode_messages, load_tokenizer, parse_message_from_completion_text, release_from_config
from encoding.tokenizer import _bundled_tokenizer_dir

ERRORS = {"AssertionError": AssertionError, "ValueError": ValueError, "NotImplementedError": NotImplementedError}


def _expected(case: dict, release: str) -> dict:
    value = case[release]
    return case["preview"] if value == "same_as_preview" else value


@pytest.mark.parametrize("release", ["preview", "v0731"])
def test_encode_case(encode_case, release, tokenizer):
    expected = _expected(encode_case, release)
    if "error" in expected:
        with pytest.raises(ERRORS[expected["error"]["type"]]) as err:
            encode_messages(encode_case["messages"], release=release, **encode_case["kwargs"])
        assert type(err.value) is ERRORS[expected["error"]["type"]]  # not a subclass
        return
    prompt = encode_messages(encode_case["messages"], release=release, **encode_case["kwargs"])
    assert prompt == expected["prompt"]
    assert tokenizer.encode(prompt) == expected["token_ids"]


def test_encode_does_not_mutate_input(encode_case):
    before = json.dumps(encode_case["messages"], sort_keys=True)
    try:
        encode_messages(encode_case["messages"], **encode_case["kwargs"])
    except (AssertionError, NotImplementedError):
        pass
    assert json.dumps(encode_case["messages"], sort_keys=True) == before


def test_release_alias_and_unknown():
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_messages(messages, "thinking", reasoning_effort="max", release="0731") == \
        encode_messages(messages, "thinking", reasoning_effort="max", release="v0731")
    with pytest.raises(ValueError):
        encode_messages(messages, "thinking", release="v4.1")


def test_parse_case(parse_case, tokenizer):
    assert tokenizer.encode(parse_case["completion"]) == parse_case["completion_token_ids"]
    assert tokenizer.decode(parse_case["completion_token_ids"]) == parse_case["completion"]
    if "expected_error" in parse_case:
        kind = ERRORS[parse_case["expected_error"]["type"]]
        with pytest.raises(kind) as err:
            parse_message_from_completion_text(parse_case["completion"], parse_case["thinking_mode"])
        assert type(err.value) is kind
    else:
        got = parse_message_from_completion_text(parse_case["completion"], parse_case["thinking_mode"])
        assert got.pop("unparsed") == []  # our addition: the official parser only accepts clean output
        assert got == parse_case["expected"]


def test_tokenizer_case(tokenizer_case, tokenizer):
    ids = tokenizer.encode(tokenizer_case["text"])
    assert ids == tokenizer_case["ids"]
    assert [tokenizer.id_to_token(i) for i in ids] == tokenizer_case["tokens"]
    assert (tokenizer.decode(ids) == tokenizer_case["text"]) is tokenizer_case["decode_roundtrip"]


def test_special_token_ids_match_shared_table(shared_dsv4, tokenizer):
    table = json.loads((shared_dsv4 / "files" / "special_tokens.json").read_text(encoding="utf-8"))
    assert tokenizer.vocab_size == table["vocab_size_total"] == 129280
    for entry in table["named_tokens"]:
        assert tokenizer.token_id(entry["content"]) == entry["id"]
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    assert tokenizer.token_id("</think>") == 128822 and tokenizer.token_id("｜DSML｜") == 128825
    with pytest.raises(KeyError):
        tokenizer.token_id("<｜DSML｜tool_calls>")  # DSML tags are not single tokens


def test_load_tokenizer_sources(tmp_path, shared_dsv4):
    bundled = _bundled_tokenizer_dir() / "tokenizer.json"
    assert bundled.read_bytes() == (shared_dsv4 / "files" / "tokenizer.json").read_bytes()

    assert load_tokenizer().path == bundled
    assert load_tokenizer(tmp_path).path == bundled  # checkpoint dir without tokenizer.json
    shutil.copy(bundled, tmp_path / "tokenizer.json")
    local = load_tokenizer(tmp_path)
    assert local.path == tmp_path / "tokenizer.json"
    assert local.encode("Hello, world!") == [19923, 14, 2058, 3]
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


def test_release_from_config(shared_dsv4, tmp_path):
    files = shared_dsv4 / "files"
    assert release_from_config(files / "config.json") == "preview"
    assert release_from_config(files / "config.DeepSeek-V4-Flash-0731.json") == "0731"
    config_0731 = json.loads((files / "config.DeepSeek-V4-Flash-0731.json").read_text())
    assert release_from_config(config_0731) == "0731"
    shutil.copy(files / "config.json", tmp_path / "config.json")
    assert release_from_config(tmp_path) == "preview"
