"""single_shot_inference.py end to end on the embedded demo model (CPU), plus every error path.

The demo checkpoint is generated once per module into a tmp DSV4_CACHE. Real runs go through a
subprocess (both thinking modes, --json, stdin, --prompt-file); the error matrix calls `main()`
in-process (same code, no interpreter start per case), and a few errors run as subprocesses too,
to prove the exit status and the absence of a traceback at the process level.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4.demo import demo_checkpoint
from encoding import encode_messages, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("single_shot_inference", ROOT / "single_shot_inference.py")
cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli)
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
    assert "demo model" in r.stderr and "loading" in r.stderr
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
    assert set(out) == {"role", "reasoning_content", "content", "tool_calls", "usage", "timings", "finish_reason"}
    assert out["role"] == "assistant" and isinstance(out["tool_calls"], list)
    assert isinstance(out["reasoning_content"], str) and isinstance(out["content"], str)
    assert out["finish_reason"] == "length"  # random weights: EOS has a 1-in-129280 chance per token
    assert out["usage"] == {"prompt_tokens": prompt_tokens("Hello", mode), "completion_tokens": 6,
                            "total_tokens": prompt_tokens("Hello", mode) + 6}
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
    (["--max-context", "1"], "error: max-context must be >= 2, got 1"),
    (["--max-context", "0"], "error: max-context must be >= 2, got 0"),
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


def test_bad_prompts(capsys, env, tmp_path, monkeypatch):
    assert call_main(capsys, "--prompt", "  \n")[::2] == (2, "error: the prompt is empty\n")
    code, _, err = call_main(capsys, "--prompt-file", str(tmp_path / "nope.txt"))
    assert code == 2 and err.startswith(f"error: cannot read --prompt-file {tmp_path / 'nope.txt'}: ")
    code, _, err = call_main(capsys, "--prompt", "a", "--prompt-file", "b")
    assert code == 2 and "not allowed with argument" in err

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    assert call_main(capsys)[::2] == (2, "error: no prompt: pass --prompt TEXT, --prompt-file PATH, "
                                         "or pipe text on stdin\n")


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


def test_context_beyond_the_model(capsys, env):
    err = runtime_error(capsys, "--max-context", "100000")
    assert err == "error: max context 100000 exceeds the model's max_position_embeddings 65536"


def test_reasoning_effort_not_in_release(capsys, env):
    err = runtime_error(capsys, "--reasoning-effort", "low")
    assert err.startswith("error: reasoning effort 'low' is not accepted by this checkpoint's encoder (preview)")


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
    for flag in ("--prompt", "--prompt-file", "--system", "--thinking-mode", "--reasoning-effort", "--model",
                 "--device", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                 "--max-context", "--numerics", "--json", "--debug"):
        assert flag in out


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
