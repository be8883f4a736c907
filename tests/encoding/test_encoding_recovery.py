"""Recovering parser (issue #16): reasoning ends at the DSML opener, declared-tool drift, streamed
tool calls, and nothing dropped silently.

Every case runs through `check_all_splits`: one-shot and streamed under every two-delta split,
one character per delta and random 1-8 character splits, with exact expected fields.
"""

import json
import random

import pytest
from stream_replay import check_all_splits, random_pieces, replay

from encoding import StreamDelta, StreamingParser, ToolCallDelta, parse_message_from_completion_text

D = "｜DSML｜"
A = "|DSML|"  # the ASCII drift spelling
EOS = "<｜end▁of▁sentence｜>"
OPENER = f"<{D}tool_calls>"
CLOSER = f"</{D}tool_calls>"
LS_SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
TOOLS = [
    {"type": "function", "function": {"name": "ls", "description": "Run a command", "parameters": LS_SCHEMA}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


def invoke(name: str, params=(("command", "true", "pwd"),), dsml: str = D, sep: str = "\n") -> str:
    """One invoke as the model writes it; `sep` goes between its tags."""
    tags = [f'<{dsml}invoke name="{name}">']
    tags += [f'<{dsml}parameter name="{k}" string="{s}">{v}</{dsml}parameter>' for k, s, v in params]
    return sep.join(tags + [f"</{dsml}invoke>"])


def call(name: str, arguments: dict) -> dict:
    arguments = json.dumps(arguments, ensure_ascii=False)
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def want(**fields) -> dict:
    """Expected message fields; `reasoning` and `calls` stand for the long key names."""
    names = {"reasoning": "reasoning_content", "calls": "tool_calls"}
    return {names.get(key, key): value for key, value in fields.items()}


LS = invoke("ls")
LS_CALL = call("ls", {"command": "pwd"})


# -- 1. the opener ends reasoning however it arrives ---------------------------------------------

@pytest.mark.parametrize("before", ["", "\n", "\n\n"])
@pytest.mark.parametrize("sep", ["\n", ""])
@pytest.mark.parametrize("eos", [EOS, ""])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_opener_ends_reasoning(before, sep, eos, tools):
    text = "reasoning" + before + OPENER + sep + invoke("ls", sep=sep) + sep + CLOSER + eos
    expected = want(reasoning="reasoning", content="", calls=[LS_CALL], unparsed=[])
    check_all_splits(text, "thinking", tools, expected)


def test_opener_without_newlines_between_tags():
    params = (("query", "true", "dsv4 parser"), ("limit", "false", "5"))
    text = "reasoning" + OPENER + invoke("search", params, sep="") + CLOSER
    search = call("search", {"query": "dsv4 parser", "limit": 5})
    check_all_splits(text, "thinking", None, want(reasoning="reasoning", calls=[search], unparsed=[]))


def test_opener_split_across_deltas_then_output_ends():
    parser = StreamingParser("thinking")
    deltas = [parser.feed(p) for p in ["thinking ", f"<{D}tool", "_calls>"]] + [parser.flush()]
    assert [d.reasoning for d in deltas] == ["thinking ", "", "", ""]
    expected = want(role="assistant", reasoning="thinking ", content="", calls=[], unparsed=[OPENER])
    assert parser.finish(strict=False) == expected
    check_all_splits("thinking " + OPENER, "thinking", None, expected)


@pytest.mark.parametrize("before", ["", "\n", "\n\n"])
def test_held_back_opener_prefix_never_reaches_reasoning(before):
    opener = before + OPENER
    for cut in range(1, len(opener) + 1):
        parser = StreamingParser("thinking")
        assert parser.feed("reasoning" + opener[:cut]).reasoning == "reasoning"
        rest = parser.feed(opener[cut:] + "\n" + LS + "\n" + CLOSER + EOS)
        assert rest.reasoning == "" and rest.tool_calls == [LS_CALL]


def test_opener_in_content_owns_one_newline_too():
    text = "Hi\n" + OPENER + "\n" + LS + "\n" + CLOSER + EOS
    check_all_splits(text, "chat", None, want(content="Hi", calls=[LS_CALL], unparsed=[]))


# -- 2. declared-tool drift (ENCODING.md §6.5), and only that -------------------------------------

@pytest.mark.parametrize("mode, shown", [("chat", "content"), ("thinking", "reasoning")])
def test_bare_invoke_of_declared_tool(mode, shown):
    text = "Let me look.\n\n" + LS + EOS
    check_all_splits(text, mode, TOOLS, want(**{shown: "Let me look."}, calls=[LS_CALL], unparsed=[]))


def test_consecutive_bare_invokes():
    text = "Both.\n" + LS + "\n" + invoke("search", (("query", "true", "x"),)) + EOS
    calls = [LS_CALL, call("search", {"query": "x"})]
    check_all_splits(text, "chat", TOOLS, want(content="Both.", calls=calls, unparsed=[]))


@pytest.mark.parametrize("wrapper, closer", [
    ("tool_call", "tool_call"), ("function_calls", "function_calls"), ("tool_calls_begin", "tool_calls")])
def test_corrupted_wrapper_before_declared_invoke(wrapper, closer):
    text = f"Run:\n\n<{D}{wrapper}>\n{LS}\n</{D}{closer}>{EOS}"
    check_all_splits(text, "chat", TOOLS, want(content="Run:", calls=[LS_CALL], unparsed=[]))


@pytest.mark.parametrize("text", [
    f"\n\n<{A}tool_calls>\n{invoke('ls', dsml=A)}\n</{A}tool_calls>{EOS}",
    f"\n\n{invoke('ls', dsml=A)}{EOS}",
    f"\n\n<{A}tool_calls>\n{LS}\n</{D}tool_calls>{EOS}",  # mixed spellings
])
def test_ascii_spelling(text):
    check_all_splits(text, "chat", TOOLS, want(content="", calls=[LS_CALL], unparsed=[]))


def test_ascii_spelling_is_content_without_tools():
    text = f"\n\n<{A}tool_calls>\n{invoke('ls', dsml=A)}\n</{A}tool_calls>{EOS}"
    check_all_splits(text, "chat", None, want(content=text.removesuffix(EOS), calls=[], unparsed=[]))


def test_tools_accept_bare_name_dicts():
    message = parse_message_from_completion_text("\n" + LS + EOS, "chat", [{"name": "ls"}], strict=False)
    assert message["tool_calls"] == [LS_CALL]


def test_text_after_recovered_call_is_reported():
    expected = want(content="", calls=[LS_CALL], unparsed=["\nDone."])
    check_all_splits(LS + "\nDone." + EOS, "chat", TOOLS, expected)


# -- negative cases: not calls, and never shown as text ---------------------------------------------

@pytest.mark.parametrize("mode, shown", [("chat", "content"), ("thinking", "reasoning")])
def test_prose_quoting_an_invoke_is_not_a_call(mode, shown):
    tag = f'<{D}invoke name="ls">'
    text = f"To list files I would write {tag} followed by parameters.{EOS}"
    prose = "To list files I would write  followed by parameters."
    check_all_splits(text, mode, TOOLS, want(**{shown: prose}, calls=[], unparsed=[tag]))


def test_prose_quoting_the_opener_is_not_a_block():
    text = f"A block starts with {OPENER} and ends with {CLOSER}.{EOS}"
    prose = "A block starts with  and ends with ."
    check_all_splits(text, "chat", None, want(content=prose, calls=[], unparsed=[OPENER, CLOSER]))


@pytest.mark.parametrize("tools", [TOOLS, None, []])
def test_bare_invoke_of_undeclared_tool_is_not_a_call(tools):
    rm = invoke("rm", (("path", "true", "/"),))
    text = "Sure.\n" + rm + "\nDone." + EOS
    check_all_splits(text, "chat", tools, want(content="Sure.\nDone.", calls=[], unparsed=["\n" + rm]))


def test_undeclared_invoke_in_drift_wrapper_is_not_a_call():
    block = f"<{D}tool_call>\n{invoke('rm', (('path', 'true', '/'),))}\n</{D}tool_call>"
    check_all_splits(block + EOS, "chat", TOOLS, want(content="", calls=[], unparsed=[block]))


def test_corrupted_wrapper_without_tools_is_not_a_call():
    block = f"\n<{D}tool_call>\n{LS}\n</{D}tool_call>"
    check_all_splits("Run:" + block + EOS, "chat", None, want(content="Run:", calls=[], unparsed=[block]))


def test_recovered_invoke_needs_the_required_arguments():
    bare = invoke("ls", params=())
    expected = want(content="Run:", calls=[], unparsed=["\n" + bare])
    check_all_splits(f"Run:\n{bare}{EOS}", "chat", TOOLS, expected)
    wrapped = f"<{D}tool_call>\n{bare}\n</{D}tool_call>"
    check_all_splits(wrapped + EOS, "chat", TOOLS, want(calls=[], unparsed=[wrapped]))
    # Inside an official block the official grammar decides: the schema is the caller's business.
    official = f"\n\n{OPENER}\n{bare}\n{CLOSER}{EOS}"
    check_all_splits(official, "chat", TOOLS, want(calls=[call("ls", {})], unparsed=[]))


@pytest.mark.parametrize("tail, content", [("", "Run:"), ("\nDone.", "Run:\nDone.")])
def test_unclosed_bare_invoke_is_not_a_call(tail, content):
    header = f'\n<{D}invoke name="ls">\n<{D}parameter name="command" string="true">pwd</{D}parameter>'
    expected = want(content=content, calls=[], unparsed=[header])
    check_all_splits("Run:" + header + tail + EOS, "chat", TOOLS, expected)


def test_unclosed_invoke_streams_then_drops_its_call():
    parser = StreamingParser("chat", TOOLS)
    started = parser.feed(f'Run:\n<{D}invoke name="ls">\n<{D}parameter name="command" string="true">p')
    assert started.content == "Run:"
    assert started.tool_call_deltas == [
        ToolCallDelta(0, name="ls"), ToolCallDelta(0, arguments='{"command": "'),
        ToolCallDelta(0, arguments="p"),
    ]
    end = parser.feed(EOS)
    assert end.tool_call_deltas == [ToolCallDelta(0, dropped=True)] and end.tool_calls == []


def test_dropped_call_index_is_reused():
    broken = f'<{D}invoke name="ls">\n<{D}parameter name="command" string="true">x</{D}parameter>'
    text = f'{broken}\n<{D}invoke name="search">\n</{D}invoke>{EOS}'
    check_all_splits(text, "chat", TOOLS, want(content="", calls=[call("search", {})], unparsed=[broken]))
    events = StreamingParser("chat", TOOLS).feed(text).tool_call_deltas
    assert [(e.index, e.name, e.dropped) for e in events if e.name or e.dropped] == [
        (0, "ls", False), (0, "", True), (0, "search", False)]


# -- 3. nothing disappears silently ---------------------------------------------------------------

@pytest.mark.parametrize("text, mode, expected", [
    # The output ends on a marker prefix: reported, not content.
    ("Answer<｜DS", "chat", want(content="Answer", unparsed=["<｜DS"])),
    (f"r</think>Answer\n\n<{D}tool", "thinking",
     want(reasoning="r", content="Answer", unparsed=[f"\n\n<{D}tool"])),
    ("Answer <", "chat", want(content="Answer <", unparsed=[])),  # not a control-string prefix
    # Stray DSML and control strings in text.
    (f"Hello </{D}parameter> world{EOS}", "chat",
     want(content="Hello  world", unparsed=[f"</{D}parameter>"])),
    (f"abc</think>def{EOS}", "chat", want(content="abcdef", unparsed=["</think>"])),
    (f"r</think>a<think>b{EOS}", "thinking", want(reasoning="r", content="ab", unparsed=["<think>"])),
    (f"a {D} b{EOS}", "chat", want(content="a  b", unparsed=[D])),
    # Text after the block, after EOS; whitespace alone is not worth a report.
    (f"\n\n{OPENER}\n{LS}\n{CLOSER}trailing{EOS}", "chat", want(calls=[LS_CALL], unparsed=["trailing"])),
    (f"\n\n{OPENER}\n{LS}\n{CLOSER}\n{EOS}", "chat", want(calls=[LS_CALL], unparsed=[])),
    (f"Hi{EOS}more", "chat", want(content="Hi", unparsed=["more"])),
    # An empty block is well-formed.
    (f"Hi\n\n{OPENER}\n{CLOSER}{EOS}", "chat", want(content="Hi", calls=[], unparsed=[])),
])
def test_unparsed_text_is_reported(text, mode, expected):
    check_all_splits(text, mode, None, expected)


def test_malformed_block_is_reported_whole():
    block = f"\n\n{OPENER}\n{invoke('calc', (('a', 'true', '1'), ('a', 'true', '2')))}\n{CLOSER}"
    check_all_splits(block + EOS, "chat", None, want(content="", calls=[], unparsed=[block]))


def test_broken_invoke_beside_a_good_one():
    broken = f'<{D}invoke name="calc">\n<{D}parameter name="x">1</{D}parameter>\n</{D}invoke>\n'
    text = f"\n\n{OPENER}\n{LS}\n{broken}{CLOSER}{EOS}"
    check_all_splits(text, "chat", None, want(calls=[LS_CALL], unparsed=[broken]))


def test_prose_inside_a_block_is_reported():
    text = f"\n\n{OPENER}\n{LS}\nI called ls.\n{CLOSER}{EOS}"
    check_all_splits(text, "chat", None, want(calls=[LS_CALL], unparsed=["\nI called ls.\n"]))


def test_block_whose_only_invoke_never_closes_is_reported_whole():
    unclosed = f'<{D}invoke name="ls">\n<{D}parameter name="command" string="true">pwd</{D}parameter>'
    block = f"\n\n{OPENER}\n{unclosed}\n{CLOSER}"
    check_all_splits(block + EOS, "chat", None, want(content="", calls=[], unparsed=[block]))


def test_truncated_block_keeps_closed_calls():
    cut = f'<{D}invoke name="search">\n<{D}parameter name="query" string="true">dee'
    check_all_splits(f"\n\n{OPENER}\n{LS}\n{cut}", "chat", None, want(calls=[LS_CALL], unparsed=[cut]))


# -- 4. streamed tool calls (§6.7) ----------------------------------------------------------------------

def test_name_on_header_then_arguments_per_parameter():
    pieces = [f'\n\n{OPENER}\n<{D}invoke name="l', 's">', f'\n<{D}parameter name="command" string="true">',
              "ls -la ", '"my dir"', f"\n</{D}parameter>\n<{D}parameter name=\"depth\" string=\"false\">[1,",
              f"  2]</{D}parameter>\n</{D}invoke>\n{CLOSER}", EOS]
    parser = StreamingParser("chat")
    deltas = [parser.feed(p) for p in pieces]
    assert [d.tool_call_deltas for d in deltas] == [
        [],
        [ToolCallDelta(0, name="ls")],
        [ToolCallDelta(0, arguments='{"command": "')],
        [ToolCallDelta(0, arguments="ls -la ")],
        [ToolCallDelta(0, arguments='\\"my dir\\"')],
        [ToolCallDelta(0, arguments="\\n"), ToolCallDelta(0, arguments='"'),
         ToolCallDelta(0, arguments=', "depth": '), ToolCallDelta(0, arguments="[1,")],
        [ToolCallDelta(0, arguments="  2]"), ToolCallDelta(0, arguments="}")],
        [],
    ]
    arguments = '{"command": "ls -la \\"my dir\\"\\n", "depth": [1,  2]}'
    assert deltas[6].tool_calls == [{"type": "function", "function": {"name": "ls", "arguments": arguments}}]
    assert json.loads(arguments) == {"command": 'ls -la "my dir"\n', "depth": [1, 2]}
    assert parser.finish() == parse_message_from_completion_text("".join(pieces), "chat")


def test_value_never_streams_a_closer_prefix():
    parser = StreamingParser("chat")
    first = parser.feed(f'\n\n{OPENER}\n<{D}invoke name="ls">\n<{D}parameter name="command" string="true">a<')
    assert first.tool_call_deltas[-1] == ToolCallDelta(0, arguments="a")  # "<" may begin the closer
    assert parser.feed(f"/{D}param").tool_call_deltas == []
    assert parser.feed("eter>").tool_call_deltas == [ToolCallDelta(0, arguments='"')]


def test_parallel_calls_stream_in_order():
    search = invoke("search", (("query", "true", 'say "hi"\\ ok'), ("n", "false", "3")))
    text = f"\n\n{OPENER}\n{LS}\n{search}\n{CLOSER}{EOS}"
    message = check_all_splits(text, "chat", None, want(unparsed=[]))
    assert message["tool_calls"] == [LS_CALL, call("search", {"query": 'say "hi"\\ ok', "n": 3})]
    events = StreamingParser("chat").feed(text).tool_call_deltas
    assert [(e.index, e.name) for e in events if e.name] == [(0, "ls"), (1, "search")]


def test_no_events_for_undeclared_bare_invokes():
    parser = StreamingParser("chat", TOOLS)
    delta = parser.feed("\n" + invoke("rm") + EOS)
    assert delta.tool_call_deltas == [] and delta.tool_calls == [] and not delta


def test_delta_truthiness_counts_call_events():
    assert not StreamDelta()
    assert StreamDelta(tool_call_deltas=[ToolCallDelta(0, name="ls")])


# -- strict parsing stays official -------------------------------------------------------------------

def test_strict_raises_official_errors_strict_false_recovers():
    text = "reasoning" + OPENER + "\n" + LS + "\n" + CLOSER + EOS
    with pytest.raises(AssertionError):
        parse_message_from_completion_text(text, "thinking")
    parser = StreamingParser("thinking", TOOLS)
    parser.feed(text)
    with pytest.raises(AssertionError):
        parser.finish()
    assert parser.finish(strict=False)["tool_calls"] == [LS_CALL]


def test_strict_with_tools_on_well_formed_output():
    text = "r</think>Hi\n\n" + OPENER + "\n" + LS + "\n" + CLOSER + EOS
    assert parse_message_from_completion_text(text, "thinking", TOOLS) == want(
        role="assistant", reasoning="r", content="Hi", calls=[LS_CALL], unparsed=[])


def test_streaming_equals_one_shot_on_random_documents():
    """Random mixes of prose, newlines, DSML tags (well-formed, drifted, broken) and control strings."""
    parts = ["text ", "more prose. ", "\n", "\n\n", "<", "｜", OPENER, CLOSER, f"<{A}tool_calls>",
             f'<{D}invoke name="ls">', f'<{D}invoke name="rm">', f'<{A}invoke name="search">',
             f"</{D}invoke>",
             f'<{D}parameter name="command" string="true">', f'<{D}parameter name="n" string="false">',
             f"</{D}parameter>", f"<{D}tool_call>", f"</{D}tool_call>", D, LS, "</think>", "<think>", EOS,
             'va"lue\\', "[1, 2]"]
    for seed in range(60):
        rng = random.Random(seed)
        text = "".join(rng.choice(parts) for _ in range(rng.randint(3, 25)))
        for mode in ("chat", "thinking"):
            for tools in (None, TOOLS):
                one_shot = parse_message_from_completion_text(text, mode, tools, strict=False)
                for pieces in [list(text)] + [random_pieces(text, s) for s in range(4)]:
                    assert replay(pieces, mode, tools) == one_shot, (text, pieces)
