"""The dsv4 command (dsv4/cli.py, also single_shot_inference.py and python -m dsv4) end to end on the
embedded demo model (CPU), plus every error path.

The demo checkpoint is generated once per module into a tmp DSV4_CACHE. Real runs go through a
subprocess (both thinking modes, --json, stdin, --prompt-file); the error matrix and the newer
options call `main()` in-process (same code, no interpreter start per case), and a few errors run
as subprocesses too, to prove the exit status and the absence of a traceback at the process level.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4 import cli
from dsv4.demo import demo_checkpoint
from encoding import encode_messages, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# every option of the command; test_help_explains_every_option and test_readme_table_lists_every_option
# check --help and the README against it, test_parser_has_no_other_option the parser
OPTIONS = ("--prompt", "--prompt-file", "--messages", "--tools", "--system", "--interactive", "--raw",
           "--thinking-mode", "--reasoning-effort", "--max-new-tokens", "--temperature", "--top-p", "--top-k",
           "--seed", "--stop", "--model", "--device", "--max-context", "--numerics", "--dtype", "--eager",
           "--no-prefill-graphs", "--kv-fp8", "--keys-fp4", "--kernels",
           "--json", "--logprobs", "--show-special", "--debug", "--version")
FAST = ["--max-new-tokens", "6", "--device", "cpu", "--max-context", "256"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsv4-cache")
    demo_checkpoint(path)  # generated once; every run below reuses it
    return path


@pytest.fixture
def env(cache, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE", str(cache))  # for in-process main()
    return {**os.environ, "DSV4_CACHE": str(cache), "PYTHONIOENCODING": "utf-8"}


def run_cli(env, *args, stdin=None):
    return subprocess.run([sys.executable, "single_shot_inference.py", *args], cwd=ROOT, env=env,
                          input=stdin, capture_output=True, text=True, timeout=300)


def prompt_tokens(text, mode, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return len(load_tokenizer().encode(encode_messages(msgs, mode)))


def assert_stats_line(stderr):
    last = stderr.strip().splitlines()[-1]
    for key in ("prompt ", "generated ", "ttft ", "prefill ", "decode ", "tok/s"):
        assert key in last, last


def test_thinking_mode_streams_reasoning_then_stats(env):
    r = run_cli(env, "--prompt", "Hello", "--thinking-mode", "thinking", "--seed", "1", *FAST)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[reasoning]\n")  # not a TTY: plain labels, no ANSI
    assert "\x1b[" not in r.stdout
    assert "loading" in r.stderr and "demo model" not in r.stderr  # the cache is reused: nothing written
    assert_stats_line(r.stderr)
    assert f"prompt {prompt_tokens('Hello', 'thinking')} tok | generated 6 tok (length)" in r.stderr
    assert "Traceback" not in r.stderr


def test_chat_mode_answers_directly(env):
    r = run_cli(env, "--prompt", "Hello", "--thinking-mode", "chat", "--system", "Be brief.",
                "--temperature", "0", *FAST)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("[answer]\n") and "[reasoning]" not in r.stdout
    assert f"prompt {prompt_tokens('Hello', 'chat', 'Be brief.')} tok" in r.stderr
    assert_stats_line(r.stderr)


@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_json_output(env, mode):
    r = run_cli(env, "--prompt", "Hello", "--thinking-mode", mode, "--json", "--seed", "3", *FAST)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON document on stdout
    assert set(out) == {"role", "reasoning_content", "content", "tool_calls", "usage", "timings", "finish_reason",
                        "unparsed"}
    assert out["unparsed"] == []
    assert out["role"] == "assistant" and isinstance(out["tool_calls"], list)
    assert isinstance(out["reasoning_content"], str) and isinstance(out["content"], str)
    assert out["finish_reason"] == "length"  # random weights: EOS has a 1-in-129280 chance per token
    assert out["usage"] == {"prompt_tokens": prompt_tokens("Hello", mode), "completion_tokens": 6,
                            "total_tokens": prompt_tokens("Hello", mode) + 6,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    for key in ("load_s", "ttft_s", "prefill_tok_s", "decode_tok_s"):
        assert isinstance(out["timings"][key], float) and out["timings"][key] > 0
    # the text landed on the side the mode says (the random model never closes </think>)
    assert bool(out["reasoning_content"]) == (mode == "thinking") and bool(out["content"]) == (mode == "chat")
    # same seed, same text; the human output streams the same text
    human = run_cli(env, "--prompt", "Hello", "--thinking-mode", mode, "--seed", "3", *FAST)
    assert (out["reasoning_content"] or out["content"]) in human.stdout


def test_prompt_from_stdin_and_file(env, tmp_path):
    a = run_cli(env, "--temperature", "0", "--json", *FAST, stdin="What is 2+2?")
    f = tmp_path / "prompt.txt"
    f.write_text("What is 2+2?", encoding="utf-8")
    b = run_cli(env, "--temperature", "0", "--json", "--prompt-file", str(f), *FAST)
    assert a.returncode == b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["reasoning_content"] == json.loads(b.stdout)["reasoning_content"]
    assert json.loads(a.stdout)["usage"]["prompt_tokens"] == prompt_tokens("What is 2+2?", "thinking")


def test_errors_as_processes(env, tmp_path):
    r = run_cli(env, "--prompt", "Hello", "--top-p", "0")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "error: top-p must be in (0, 1], got 0.0\n"
    r = run_cli(env, "--prompt", "Hello", "--model", str(tmp_path / "missing"))
    assert r.returncode == 1 and r.stderr.splitlines()[-1].startswith("error: model path ")
    assert "Traceback" not in r.stderr
    r = run_cli(env, "--prompt", "Hello", "--model", str(tmp_path / "missing"), "--debug")
    assert r.returncode == 1 and "Traceback" in r.stderr


# ---- the error matrix, in-process ------------------------------------------------------------------

def call_main(capsys, *args):
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-0.5"], "error: temperature must be a finite number >= 0, got -0.5"),
    (["--top-p", "1.5"], "error: top-p must be in (0, 1], got 1.5"),
    (["--top-p", "0"], "error: top-p must be in (0, 1], got 0.0"),
    (["--top-k", "-1"], "error: top-k must be an integer >= 0 (0 disables it), got -1"),
    (["--max-new-tokens", "0"], "error: max-new-tokens must be an integer >= 1, got 0"),
    (["--max-context", "1"], "error: --max-context must be >= 2, got 1"),
    (["--max-context", "0"], "error: --max-context must be >= 2, got 0"),
    (["--logprobs", "2"], "error: --logprobs is reported in the --json object: add --json"),
    (["--logprobs", "21", "--json"], "error: --logprobs must be in [0, 20], got 21"),
    (["--stop", ""], "error: --stop needs a non-empty string"),
    (["--kv-fp8", "--numerics", "exact"], "error: --kv-fp8 needs --numerics reference and --dtype bfloat16"),
    (["--kv-fp8", "--keys-fp4", "--dtype", "float32"], "error: --kv-fp8 and --keys-fp4 need --numerics reference"),
    (["--raw", "--system", "x"], "error: --raw feeds the prompt without the chat template; it cannot be combined "
                                 "with --system"),
    (["extra positional"], "error: give the prompt once: PROMPT and --prompt both set it"),
    (["--device", "gpu"], "error: unknown device 'gpu': expected cpu, cuda, cuda:N or a comma-separated list"),
    (["--device", "cuda:0,,cuda:1"], "error: unknown device ''"),
    (["--temperature", "warm"], "error: argument --temperature: invalid float value: 'warm' (see --help)"),
    (["--thinking-mode", "deep"], "error: argument --thinking-mode: invalid choice: 'deep'"),
    (["--reasoning-effort", "medium"], "error: argument --reasoning-effort: invalid choice: 'medium'"),
])
def test_bad_argument_values(capsys, env, args, message):
    code, out, err = call_main(capsys, "--prompt", "Hello", *args)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1, err


HOW = 'pass it as an argument (dsv4 "Hello"), with -p/--prompt TEXT or --prompt-file PATH, or pipe it on stdin'


def test_bad_prompts(capsys, env, tmp_path, monkeypatch):
    assert call_main(capsys, "--prompt", "  \n")[::2] == (2, "error: the prompt is empty\n")
    assert call_main(capsys, "  ")[::2] == (2, "error: the prompt is empty\n")
    code, _, err = call_main(capsys, "--prompt-file", str(tmp_path / "nope.txt"))
    assert code == 2 and err.startswith(f"error: cannot read --prompt-file {tmp_path / 'nope.txt'}: ")
    (tmp_path / "empty.txt").write_text("\n")
    assert call_main(capsys, "--prompt-file", str(tmp_path / "empty.txt"))[::2] == (
        2, f"error: --prompt-file {tmp_path / 'empty.txt'} is empty\n")
    code, _, err = call_main(capsys, "--prompt", "a", "--prompt-file", "b")
    assert (code, err) == (2, "error: give the prompt once: --prompt and --prompt-file both set it\n")

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    assert call_main(capsys)[::2] == (2, f"error: no prompt: {HOW}\n")


def test_empty_stdin_says_how_to_pass_a_prompt(env):
    r = run_cli(env, stdin="")  # e.g. `dsv4 < /dev/null`
    assert (r.returncode, r.stdout, r.stderr) == (2, "", f"error: no prompt: stdin was empty; {HOW}\n")


def runtime_error(capsys, *args):
    """stderr from the error line on (progress lines come before it)."""
    code, out, err = call_main(capsys, "--prompt", "Hello", *FAST, *args)
    assert code == 1 and out == ""
    return err[err.index("error: "):].rstrip("\n")


def test_missing_and_incomplete_model_dirs(capsys, env, tmp_path, cache):
    assert runtime_error(capsys, "--model", str(tmp_path / "nope")) == \
        f"error: model path {tmp_path / 'nope'} does not exist"
    demo = demo_checkpoint(cache)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(demo / "config.json", empty)
    assert runtime_error(capsys, "--model", str(empty)) == \
        f"error: checkpoint {empty}: no *.safetensors files and no model.safetensors.index.json"
    partial = tmp_path / "partial"  # index present, shard missing
    partial.mkdir()
    for name in ("config.json", "model.safetensors.index.json"):
        shutil.copy(demo / name, partial)
    err = runtime_error(capsys, "--model", str(partial))
    assert err.startswith(f"error: checkpoint {partial}: ")
    assert "model-00001-of-00001.safetensors does not exist" in err


def test_unsupported_config(capsys, env, tmp_path, cache):
    demo = demo_checkpoint(cache)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in demo.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    cfg = json.loads((demo / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    assert runtime_error(capsys, "--model", str(bad)) == \
        "error: config.json: 'model_type' is 'llama'; this engine runs DeepSeek-V4 ('deepseek_v4') only"


def test_prompt_longer_than_context(capsys, env):
    n = prompt_tokens("word " * 40, "thinking")
    assert runtime_error(capsys, "--prompt", "word " * 40, "--max-context", "16") == (
        f"error: the prompt is {n} tokens but the context holds 16 (prompt + new tokens); "
        "raise the max context (--max-context) or shorten the prompt")


def test_raw_prompt_longer_than_context_fails_before_the_load(capsys, env):
    n = len(load_tokenizer().encode("word " * 40))
    code, out, err = call_main(capsys, "--raw", "--prompt", "word " * 40, "--max-context", "16")
    assert (code, out) == (1, "") and "loading" not in err
    assert err == (f"error: the prompt is {n} tokens but the context holds 16 (prompt + new tokens); raise the max "
                   "context (--max-context) or shorten the prompt\n")


def test_interactive_turn_longer_than_context_is_dropped(capsys, env, script, monkeypatch):
    import io

    script("Hi!" + EOS)
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 80 + "\nHello\n"))
    code, out, err = call_main(capsys, "-i", "--thinking-mode", "chat", "--json", *FAST, "--max-context", "64")
    assert code == 0, err
    assert [json.loads(line)["content"] for line in out.splitlines()] == ["Hi!"]  # the chat went on
    assert "tokens but the context holds 64" in err
    assert "(that message is dropped; it does not fit a fresh conversation either: shorten it or raise " \
           "--max-context)" in err


def test_closed_stdout_is_one_line(env):
    r = subprocess.run([sys.executable, "single_shot_inference.py", "Hi", *FAST], cwd=ROOT, env=env, stdout=None,
                       stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=lambda: os.close(1))
    assert (r.returncode, r.stderr) == (1, "error: standard output is closed\n")


def test_context_beyond_the_model(capsys, env):
    code, out, err = call_main(capsys, "--prompt", "Hello", "--max-context", "100000")
    assert (code, out) == (2, "") and "loading" not in err  # checked against config.json, before the load
    assert err == "error: --max-context 100000 exceeds the model's max_position_embeddings 65536\n"


def test_reasoning_effort_not_in_release(capsys, env):
    code, out, err = call_main(capsys, "--prompt", "Hello", "--reasoning-effort", "low")
    assert (code, out) == (2, "") and "loading" not in err
    assert err == ("error: --reasoning-effort low is not accepted by this checkpoint's encoder (preview); "
                   "choose one of high, max\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_requested_but_absent(capsys, env):
    code, _, err = call_main(capsys, "--prompt", "Hello", "--device", "cuda")
    assert code == 1
    assert err.startswith("error: device cuda requested but CUDA is not available on this machine")


def test_internal_errors_are_one_line_unless_debug(capsys, env, monkeypatch):
    from dsv4.engine import Engine

    def boom(*a, **k):
        raise KeyError("surprise")

    monkeypatch.setattr(Engine, "generate", boom)
    err = runtime_error(capsys)
    assert err == "error: internal error: KeyError: 'surprise' (rerun with --debug for the traceback)"
    with pytest.raises(KeyError):
        cli.main(["--prompt", "Hello", *FAST, "--debug"])


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for flag in OPTIONS:
        assert flag in out
    assert "PROMPT" in out and "-p TEXT" in out and "-m DIR" in out and "-n N" in out and "-i," in out


def test_stream_printer_sections():
    import io

    from encoding import StreamDelta

    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    deltas = [StreamDelta(reasoning="think"), StreamDelta(reasoning="ing"), StreamDelta(content="Hi"),
              StreamDelta(tool_calls=[call])]
    plain, color = io.StringIO(), io.StringIO()
    for out, tty in ((plain, False), (color, True)):
        printer = cli.StreamPrinter(out, tty)
        for d in deltas:
            printer(d)
        printer.close()
    assert plain.getvalue() == '[reasoning]\nthinking\n\n[answer]\nHi\n\n[tool calls]\nf({"x": 1})\n\n'
    assert color.getvalue().startswith("\x1b[0m\x1b[1m[reasoning]\x1b[0m\x1b[2m\nthinking\x1b[0m\n\n\x1b[1m[answer]")
    assert color.getvalue().endswith("\x1b[0m\n")



def test_parser_has_no_other_option():
    flags = {o for a in cli.build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert flags - {"--help"} == set(OPTIONS)


def test_readme_table_lists_every_option():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| option | meaning |"):]
    table = table[:table.index("\n\n")]
    first_column = "\n".join(row.split(" | ")[0] for row in table.splitlines()[2:])
    for flag in OPTIONS:  # in a code span of the first column, e.g. `-p TEXT`, `--prompt TEXT`
        assert re.search(r"`[^`]*" + re.escape(flag) + r"(?![\w-])[^`]*`", first_column), flag


def test_help_constants_match_the_engine():
    from dsv4 import engine

    assert cli.DEFAULT_CONTEXT == engine.DEFAULT_CONTEXT and cli.MAX_LOGPROBS == engine.MAX_LOGPROBS


def test_entry_points_and_version(env):
    from importlib.metadata import version

    expected = f"dsv4 {version('dsv4')}\n"
    for cmd in ([sys.executable, "-m", "dsv4", "--version"], [sys.executable, "single_shot_inference.py", "--version"]):
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (0, expected), r.stderr
    r = subprocess.run([sys.executable, "-m", "dsv4", "--help"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.stdout.startswith("usage: python -m dsv4 ")
    script = shutil.which("dsv4", path=str(Path(sys.executable).parent))
    if script is None:  # installed before the console script existed: pip install -e . adds it
        pytest.fail("the dsv4 console script is not installed; rerun pip install -e .")
    r = subprocess.run([script, "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, expected)
    assert "[project.scripts]\ndsv4 = \"dsv4.cli:console\"" in (ROOT / "pyproject.toml").read_text()


# ---- scripted outputs: the sampler returns given tokens, so each path has an exact expectation ----------

EOS = "<｜end▁of▁sentence｜>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]
CALL = ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
        "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + EOS)


@pytest.fixture
def script(monkeypatch):
    """script(*texts, interrupt_at=None): the sampler emits the tokens of the texts in order (one text
    per turn); interrupt_at=k raises KeyboardInterrupt instead of the k-th token (0-based)."""
    tok = load_tokenizer()

    def setup(*texts, interrupt_at=None):
        ids = [t for text in texts for t in tok.encode(text)]
        calls = iter(range(10**6))

        def fake_draw(sampler, logits):
            i = next(calls)
            if i == interrupt_at:
                raise KeyboardInterrupt
            return torch.tensor([ids[i]], device=logits.device)

        monkeypatch.setattr("dsv4.sampling.TokenSampler.__call__", fake_draw)
        return ids

    return setup


def test_messages_and_tools_files(capsys, env, tmp_path, script):
    from dsv4.messages import normalize_messages

    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "reasoning_content": "Need the tool.", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 20}"},
        {"role": "assistant", "reasoning": "Done.", "content": "It is 20 degrees."},
        {"role": "user", "content": [{"type": "text", "text": "And in Paris?"}]},
    ]
    (tmp_path / "m.json").write_text(json.dumps(messages))
    (tmp_path / "t.json").write_text(json.dumps(TOOLS))
    script("Let me call it.</think>" + CALL)
    code, out, err = call_main(capsys, "--messages", str(tmp_path / "m.json"), "--tools", str(tmp_path / "t.json"),
                               "--json", *FAST, "--max-new-tokens", "60", "--max-context", "1024")
    assert code == 0, err
    r = json.loads(out)
    assert r["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                  "arguments": "{\"city\": \"Paris\"}"}}]
    assert (r["reasoning_content"], r["content"], r["finish_reason"]) == ("Let me call it.", "", "stop")
    # the prompt is the official encoding: tools on the system message, reasoning kept (tools present)
    expected = normalize_messages(messages, TOOLS)
    assert expected[0]["tools"] == TOOLS
    assert expected[2]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Rome\"}"
    assert expected[4]["reasoning_content"] == "Done." and expected[5]["content"] == "And in Paris?"
    n = len(load_tokenizer().encode(encode_messages(expected, "thinking")))
    assert r["usage"]["prompt_tokens"] == n
    # the text output shows the call under [tool calls]
    script("Let me call it.</think>" + CALL)
    code, out, err = call_main(capsys, "--messages", str(tmp_path / "m.json"), "--tools", str(tmp_path / "t.json"),
                               *FAST, "--max-new-tokens", "60", "--max-context", "1024")
    assert out == "[reasoning]\nLet me call it.\n\n[tool calls]\nget_weather({\"city\": \"Paris\"})\n\n"
    # a request body with "messages" and "tools", plus a prompt appended as the last user turn
    (tmp_path / "body.json").write_text(json.dumps({"messages": messages[:1], "tools": TOOLS}))
    script("Hi" + EOS)
    code, out, err = call_main(capsys, "--messages", str(tmp_path / "body.json"), "-p", "Hello", "--json",
                               "--thinking-mode", "chat", *FAST, "--max-context", "1024")
    body = messages[:1] + [{"role": "user", "content": "Hello"}]
    n = len(load_tokenizer().encode(encode_messages(normalize_messages(body, TOOLS), "chat")))
    assert code == 0 and json.loads(out)["usage"]["prompt_tokens"] == n and json.loads(out)["content"] == "Hi"


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "error: --messages[0] must be an object with a role, got int"),
    ('[{"role": "bot", "content": "x"}]', "error: --messages[0]: role 'bot' is not one of system, developer, user, "
                                          "assistant, tool"),
    ('[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]',
     "error: --messages: the last message is an assistant message; the reply is generated after a user or tool "
     "message (add one, or pass the user's text with --prompt)"),
    ('[{"role": "user", "content": [{"type": "image_url"}]}]',
     "error: --messages[0].content[0]: only text parts are supported, got 'image_url'"),
    ('{"messages": []}', "error: --messages must be a non-empty JSON list of messages"),
    ("not json", "error: --messages M is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_bad_messages_files(capsys, env, tmp_path, content, message):
    (tmp_path / "M").write_text(content)
    code, out, err = call_main(capsys, "--messages", str(tmp_path / "M"))
    assert (code, out) == (2, "")
    assert err == message.replace("M is", f"{tmp_path / 'M'} is") + "\n"


def test_bad_tools_files(capsys, env, tmp_path):
    (tmp_path / "t.json").write_text('[{"type": "function", "function": {"description": "no name"}}]')
    code, _, err = call_main(capsys, "Hello", "--tools", str(tmp_path / "t.json"))
    assert (code, err) == (2, "error: --tools[0]: a tool needs function.name (a non-empty string)\n")
    code, _, err = call_main(capsys, "Hello", "--tools", str(tmp_path / "none.json"))
    assert code == 2 and err.startswith(f"error: cannot read --tools {tmp_path / 'none.json'}: ")


def test_stop_strings(capsys, env, script):
    script("Hello there. STOP here and more" + EOS)
    code, out, err = call_main(capsys, "Hi", "--thinking-mode", "chat", "--stop", "never", "--stop", "STOP",
                               "--json", *FAST, "--max-new-tokens", "30")
    r = json.loads(out)
    assert (code, r["content"], r["finish_reason"]) == (0, "Hello there. ", "stop")
    assert r["usage"]["completion_tokens"] < len(load_tokenizer().encode("Hello there. STOP here and more"))


def test_raw_prompt(capsys, env, script):
    script(" upon a time")
    code, out, err = call_main(capsys, "--raw", "Once", *FAST, "--max-new-tokens", "3")
    assert (code, out) == (0, " upon a time\n")  # no labels, no template
    assert "prompt 1 tok |" in err  # "Once" alone: no BOS, no role tokens
    script(" upon a time")
    code, out, err = call_main(capsys, "--raw", "Once", "--thinking-mode", "chat", "--json", *FAST,
                               "--max-new-tokens", "3")
    r = json.loads(out)
    assert (r["content"], r["reasoning_content"], r["usage"]["prompt_tokens"]) == (" upon a time", "", 1)
    assert "note: --thinking-mode has no effect with --raw (no chat template)" in err


def test_special_tokens_are_hidden_unless_asked(capsys, env, script):
    text = "A<｜User｜>B<｜place▁holder▁no▁7｜>C"
    script(text + EOS)
    code, out, _ = call_main(capsys, "Hi", "--thinking-mode", "chat", *FAST, "--max-new-tokens", "20")
    assert (code, out) == (0, "[answer]\nABC\n")
    script(text + EOS)
    code, out, _ = call_main(capsys, "Hi", "--thinking-mode", "chat", "--show-special", *FAST,
                             "--max-new-tokens", "20")
    assert out == f"[answer]\n{text}\n"
    script(text + EOS)
    code, out, err = call_main(capsys, "Hi", "--thinking-mode", "chat", "--json", "--show-special", *FAST,
                               "--max-new-tokens", "20")
    assert json.loads(out)["content"] == text
    assert "note: --show-special has no effect with --json" in err


def test_special_filter_holds_split_tokens():
    f = cli.SpecialFilter(["<｜User｜>", "<think>"])
    assert f("a<｜Us") == "a" and f("er｜>b<th") == "b" and f("ink>c<") == "c" and f.flush() == "<"


def test_logprobs_in_json(capsys, env):
    code, out, err = call_main(capsys, "Hi", "--json", "--logprobs", "3", "--temperature", "0", *FAST,
                               "--max-new-tokens", "3")
    r = json.loads(out)
    assert code == 0 and len(r["logprobs"]) == 3
    for entry in r["logprobs"]:
        assert set(entry) == {"token", "id", "logprob", "top_logprobs"} and len(entry["top_logprobs"]) == 3
        assert entry["logprob"] == entry["top_logprobs"][0]["logprob"]  # greedy picks the most likely


@pytest.mark.parametrize("as_json", [True, False])
def test_ctrl_c_prints_the_partial_result(capsys, env, script, as_json):
    script("one two three four five six", interrupt_at=3)
    code, out, err = call_main(capsys, "Hi", "--thinking-mode", "chat", *(["--json"] if as_json else []), *FAST)
    assert code == 130
    if as_json:
        r = json.loads(out)
        assert r["finish_reason"] == "interrupted" and r["content"] == "one two three"
        assert r["usage"]["completion_tokens"] == 3
    else:
        assert out == "[answer]\none two three\n"
    assert "generated 3 tok (interrupted)" in err.splitlines()[-1]


def test_interactive_chat_reuses_the_prefix(capsys, env, script, monkeypatch):
    import io

    script("Hi!" + EOS, "Fine." + EOS, "Again." + EOS)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nHow are you?\n\n/reset\nHello\n"))
    code, out, err = call_main(capsys, "-i", "--thinking-mode", "chat", "--system", "Be brief.", "--json", *FAST)
    assert code == 0, err
    turns = [json.loads(line) for line in out.splitlines()]
    assert [t["content"] for t in turns] == ["Hi!", "Fine.", "Again."]
    tok = load_tokenizer()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = len(tok.encode(encode_messages(history, "chat")))
    history += [{"role": "assistant", "content": "Hi!", "reasoning_content": ""},
                {"role": "user", "content": "How are you?"}]
    second = len(tok.encode(encode_messages(history, "chat")))
    assert [t["usage"]["prompt_tokens"] for t in turns] == [first, second, first]
    # turn 2 prefilled only the new tokens; after /reset the conversation starts again
    cached = [t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in turns]
    assert cached == [0, first + len(tok.encode("Hi!" + EOS)) - 1, 0]
    assert "(conversation cleared)" in err
    assert sum("reused" in line for line in err.splitlines()) == 1


def test_interactive_thinking_drops_old_reasoning(capsys, env, script, monkeypatch):
    import io

    script("Think A.</think>Answer A." + EOS, "Think B.</think>Answer B." + EOS)
    monkeypatch.setattr(sys, "stdin", io.StringIO("First\nSecond\n"))
    code, out, err = call_main(capsys, "-i", "--json", *FAST, "--max-new-tokens", "20")
    assert code == 0, err
    turns = [json.loads(line) for line in out.splitlines()]
    assert [(t["reasoning_content"], t["content"]) for t in turns] == [("Think A.", "Answer A."),
                                                                       ("Think B.", "Answer B.")]
    # the official encoder drops the reasoning of earlier turns in thinking mode: turn 2's prompt is
    # the dropped rendering, which leaves turn 1's prompt before its `<think>` (the state cannot be extended: it
    # continues from the state marked there)
    tok = load_tokenizer()
    history = [{"role": "user", "content": "First"},
               {"role": "assistant", "content": "Answer A.", "reasoning_content": "Think A."},
               {"role": "user", "content": "Second"}]
    n = len(tok.encode(encode_messages(history, "thinking")))
    assert "Think A." not in encode_messages(history, "thinking")
    assert turns[1]["usage"]["prompt_tokens"] == n
    first = len(tok.encode(encode_messages(history[:1], "thinking")))
    assert turns[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == first - 1
    assert f"({first - 1} reused)" in err


def test_no_effect_notes(capsys, env):
    code, _, err = call_main(capsys, "Hi", "--thinking-mode", "chat", "--reasoning-effort", "max", "--eager",
                             "--temperature", "0", "--seed", "3", *FAST, "--max-new-tokens", "1")
    assert code == 0
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: --reasoning-effort has no effect with --thinking-mode chat (the effort prefix is part of thinking mode)",
        "note: --eager has no effect on CPU (CUDA graphs are used on CUDA only)",
        "note: --seed has no effect with --temperature 0 (greedy)",
    ]
    code, _, err = call_main(capsys, "Hi", "--no-prefill-graphs", *FAST, "--max-new-tokens", "1")
    assert code == 0
    assert [line for line in err.splitlines() if line.startswith("note: ")] == [
        "note: --no-prefill-graphs has no effect on CPU (CUDA graphs are used on CUDA only)"]
    code, _, err = call_main(capsys, "Hi", "--reasoning-effort", "high", *FAST, "--max-new-tokens", "1")
    assert "note: --reasoning-effort high adds no prefix with this checkpoint's encoder (preview): it is the same " \
           "prompt as no --reasoning-effort" in err


def test_graph_flags_reach_the_engine(capsys, env, monkeypatch):
    # --eager and --no-prefill-graphs become Engine.from_pretrained's graphs / prefill_graphs (the engine decides
    # what each means on the device: tests/test_engine.py on CUDA)
    from dsv4.engine import Engine

    seen = []
    real = Engine.from_pretrained.__func__

    def spy(cls, *a, **k):
        seen.append((k["graphs"], k["prefill_graphs"]))
        return real(cls, *a, **k)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy))
    for flags in ([], ["--no-prefill-graphs"], ["--eager"]):
        code, _, _ = call_main(capsys, "Hi", *flags, *FAST, "--max-new-tokens", "1")
        assert code == 0
    assert seen == [(True, True), (True, False), (False, True)]


def test_packed_state_gives_the_same_output(capsys, env):
    # --kv-fp8 / --keys-fp4 keep the state packed (the same values): greedy decoding past the demo's compressor
    # boundaries writes the same text and the same log-probabilities; the loading line names the packed rows
    args = ("Hi", "--json", "--temperature", "0", "--logprobs", "2", *FAST, "--max-new-tokens", "24")
    code, plain, _ = call_main(capsys, *args)
    assert code == 0
    code, packed, err = call_main(capsys, *args, "--kv-fp8", "--keys-fp4")
    assert code == 0 and "state: K = V rows FP8, indexer keys FP4" in err
    a, b = json.loads(plain), json.loads(packed)
    assert a["usage"]["completion_tokens"] == 24
    for key in ("content", "reasoning_content", "tool_calls", "logprobs"):
        assert a[key] == b[key], key


def test_short_flags(capsys, env, cache):
    code, out, err = call_main(capsys, "-m", str(demo_checkpoint(cache)), "-n", "2", "-p", "Hello", "--json",
                               "--device", "cpu", "--max-context", "64")
    assert code == 0 and json.loads(out)["usage"]["completion_tokens"] == 2


def test_demo_checkpoint_messages(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path))
    args = ("Hi", *FAST, "--max-new-tokens", "1")
    code, _, err = call_main(capsys, *args)
    assert code == 0 and f"demo model (random weights): writing its checkpoint into {tmp_path / 'demo-1'}" in err
    code, _, err = call_main(capsys, *args)  # reused: nothing about preparing it
    assert code == 0 and "demo model" not in err
    shard = tmp_path / "demo-1" / "model-00001-of-00001.safetensors"
    size = shard.stat().st_size
    os.truncate(shard, size - 10)
    code, _, err = call_main(capsys, *args)
    assert code == 0 and (f"demo model: the cached checkpoint in {tmp_path / 'demo-1'} does not verify "
                          f"({shard.name} has {size - 10} bytes, {size} were written); rebuilding it ...") in err
    assert shard.stat().st_size == size


def test_demo_cache_errors_are_one_line(capsys, tmp_path, monkeypatch):
    (tmp_path / "f").write_text("x")
    monkeypatch.setenv("DSV4_CACHE", str(tmp_path / "f"))
    code, out, err = call_main(capsys, "Hi", *FAST)
    assert (code, out) == (1, "") and err.count("\n") == 1
    assert err.startswith(f"error: demo cache {tmp_path / 'f'} ($DSV4_CACHE): a file, not a directory. ")
    assert err.rstrip().endswith("set DSV4_CACHE to another directory")


def test_tiny_checkpoint_with_a_foreign_tokenizer(capsys, env, tmp_path):
    from dsv4.writer import TINY_CONFIG, write_checkpoint

    ckpt = write_checkpoint(TINY_CONFIG, tmp_path / "tiny", "bf16")
    shutil.copy(load_tokenizer().path, ckpt / "tokenizer.json")  # the full 129,280-token tokenizer
    code, out, err = call_main(capsys, "-m", str(ckpt), "Hi", "--device", "cpu")
    assert (code, out) == (1, "") and "loading" not in err  # found before the weights load
    assert err == (f"error: checkpoint {ckpt}: tokenizer.json has 129280 tokens but config.json's vocab_size is 512: "
                   "the tokenizer does not belong to this model (ids >= 512 have no embedding); put the model's own "
                   "tokenizer.json beside config.json\n")


def test_stream_printer_streams_tool_calls():
    import io

    from encoding import StreamDelta, ToolCallDelta

    out = io.StringIO()
    printer = cli.StreamPrinter(out, False)
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    for d in [StreamDelta(content="Hi"), StreamDelta(tool_call_deltas=[ToolCallDelta(0, name="f")]),
              StreamDelta(tool_call_deltas=[ToolCallDelta(0, arguments='{"x": ')]),
              StreamDelta(tool_call_deltas=[ToolCallDelta(0, arguments="1}"), ToolCallDelta(1, name="g"),
                                            ToolCallDelta(1, arguments='{"y')], tool_calls=[call]),
              StreamDelta(tool_call_deltas=[ToolCallDelta(1, dropped=True)])]:
        printer(d)
    printer.close()
    assert out.getvalue() == '[answer]\nHi\n\n[tool calls]\nf({"x": 1})\ng({"y ... [incomplete: not a call]\n\n'


def test_unparsed_output_is_reported(capsys, env, script):
    script("Answer</think>more" + EOS)
    code, out, err = call_main(capsys, "Hi", "--thinking-mode", "chat", "--json", *FAST, "--max-new-tokens", "20")
    r = json.loads(out)
    assert (code, r["content"], r["unparsed"]) == (0, "Answermore", ["</think>"])
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert warnings == ["warning: 1 piece(s) of the output could not be parsed as reasoning, answer or tool call "
                        "(--json lists them under \"unparsed\"): '</think>'"]
    script("Answer" + EOS)
    code, out, err = call_main(capsys, "Hi", "--thinking-mode", "chat", *FAST, "--max-new-tokens", "20")
    assert out == "[answer]\nAnswer\n" and "warning" not in err


def test_tiny_checkpoint_runs_with_the_defaults(capsys, env, tmp_path, script):
    # make_checkpoint's smallest preset: its tokenizer is cut to the 512-token vocabulary, and the
    # default max context (4096 on CPU) is capped at its max_position_embeddings (1024)
    r = subprocess.run([sys.executable, "tools/make_checkpoint.py", "--config", "tiny", "--out", str(tmp_path / "t")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code, out, err = call_main(capsys, "-m", str(tmp_path / "t"), "Hello", "-n", "4", "--json", "--device", "cpu")
    assert code == 0, err
    result = json.loads(out)
    # the defaults sample (temperature 1.0, a fresh seed), so the random model may draw EOS before 4 tokens
    n, finish = result["usage"]["completion_tokens"], result["finish_reason"]
    assert (n, finish) == (4, "length") or (1 <= n <= 4 and finish == "stop"), (n, finish)
    from dsv4.engine import Engine

    assert Engine.from_pretrained(tmp_path / "t", device="cpu", progress=False).max_context == 1024


def test_messages_from_stdin(capsys, env, script, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps([{"role": "user", "content": "Hello"}])))
    script("Hi" + EOS)
    code, out, err = call_main(capsys, "--messages", "-", "--thinking-mode", "chat", "--json", *FAST)
    r = json.loads(out)
    assert (code, r["content"], r["usage"]["prompt_tokens"]) == (0, "Hi", prompt_tokens("Hello", "chat"))


def test_long_problem_lists_are_capped():
    from dsv4.loader import CheckpointError

    lines = cli.describe(CheckpointError("/ckpt", [f"problem {i}" for i in range(30)])).splitlines()
    assert lines[0] == "checkpoint /ckpt: 30 problems" and lines[1:21] == [f"  problem {i}" for i in range(20)]
    assert lines[21:] == ["  ... and 10 more"]
    assert len(cli.describe(CheckpointError("/ckpt", [f"p{i}" for i in range(21)])).splitlines()) == 22


def test_interactive_tool_round_trip(capsys, env, script, monkeypatch, tmp_path):
    import io

    (tmp_path / "t.json").write_text(json.dumps(TOOLS))
    script("Call it.</think>" + CALL, "Done.</think>It is 20 degrees." + EOS)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Weather in Paris?\n/tool {\"temp\": 20}\n"))
    code, out, err = call_main(capsys, "-i", "--tools", str(tmp_path / "t.json"), "--json", *FAST,
                               "--max-new-tokens", "60", "--max-context", "2048")
    assert code == 0, err
    first, second = (json.loads(line) for line in out.splitlines())
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["get_weather"]
    assert (second["reasoning_content"], second["content"]) == ("Done.", "It is 20 degrees.")
    # turn 2 is the official rendering of the call and its result; with tools the reasoning is kept,
    # so the state is extended rather than re-prefilled
    from dsv4.messages import normalize_messages

    history = normalize_messages([{"role": "user", "content": "Weather in Paris?"},
                                  {"role": "assistant", "content": "", "reasoning_content": "Call it.",
                                   "tool_calls": first["tool_calls"]},
                                  {"role": "tool", "content": "{\"temp\": 20}"}], TOOLS)
    prompt = encode_messages(history, "thinking")
    assert "<tool_result>{\"temp\": 20}</tool_result>" in prompt
    assert second["usage"]["prompt_tokens"] == len(load_tokenizer().encode(prompt))
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1)


def test_kernels_option(env):
    r = run_cli(env, "--prompt", "Hi", "--kernels", "fastest", *FAST)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --kernels: expected ref, fast or op=ref|fast items, got 'fastest'")
    r = run_cli(env, "--prompt", "Hi", "--kernels", "fast,nope=ref", *FAST)
    assert r.returncode == 2 and "--kernels: unknown op(s) nope" in r.stderr
    # on a CPU (without the test suite's TRITON_INTERPRET) a requested fast op runs its reference and says why
    plain = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    r = run_cli(plain, "--prompt", "Hi", "--kernels", "ref,linear=fast", "--thinking-mode", "chat", *FAST)
    assert r.returncode == 0, r.stderr
    banner = [line for line in r.stderr.splitlines() if line.startswith("kernels: ")]
    assert len(banner) == 1
    assert "ref (Triton on CPU needs TRITON_INTERPRET=1): linear" in banner[0], banner[0]


def test_prefill_progress_shows_long_prefills_only(monkeypatch, capsys):
    clock = iter([0.0, 0.5, 0.9, 10.0, 10.4, 11.2, 12.0, 20.0, 20.5, 21.6, 30.0, 30.3])
    monkeypatch.setattr(cli.time, "perf_counter", lambda: next(clock))
    p = cli.PrefillProgress(after=1.0)
    for done in (0, 128, 300):  # 0.9 s in all: nothing shown, nothing to erase
        p(done, 300)
    assert capsys.readouterr().err == ""
    for done in (0, 128, 256, 400):  # past 1 s from the start: shown in place, then erased
        p(done, 400)
    assert capsys.readouterr().err == "\rprefill 256/400 tokens\r\033[K"
    for done in (0, 128, 256):  # a request stopped half-way (Ctrl-C): the session clears the line
        p(done, 400)
    p.clear()
    assert capsys.readouterr().err == "\rprefill 256/400 tokens\r\033[K"
    p(0, 100)  # the next request's clock starts afresh
    p(100, 100)
    assert capsys.readouterr().err == ""
