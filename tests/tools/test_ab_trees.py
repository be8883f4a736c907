"""tools/ab_trees.py: variant trees (a checkout's tracked files with a patch), the summary table, the CLI's refusals."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("ab_trees", ROOT / "tools" / "ab_trees.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "k.cu").write_text("constexpr int kRows = 2;\nint f() { return kRows; }\n")
    (src / "README").write_text("hello\n")
    _git(src, "init", "-q")
    _git(src, "add", ".")
    _git(src, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    return src


def _patch(src: Path, path: Path, old: str, new: str) -> Path:
    """A patch of src's k.cu replacing old with new (made with git diff, the working tree restored)."""
    f = src / "pkg" / "k.cu"
    text = f.read_text()
    f.write_text(text.replace(old, new))
    diff = subprocess.run(["git", "diff"], cwd=src, check=True, capture_output=True, text=True).stdout
    f.write_text(text)
    path.write_text(diff)
    return path


def test_make_tree_copies_tracked_files_and_applies_the_patch(repo, tmp_path):
    patch = _patch(repo, tmp_path / "rows4.patch", "kRows = 2", "kRows = 4")
    (repo / "untracked.txt").write_text("not copied\n")
    (repo / "README").write_text("hello, edited\n")  # the working tree's contents are what is copied
    dest = tmp_path / "trees" / "rows4"
    ab.make_tree(repo, dest, patch)
    assert (dest / "pkg" / "k.cu").read_text().startswith("constexpr int kRows = 4;")
    assert (dest / "README").read_text() == "hello, edited\n"
    assert not (dest / "untracked.txt").exists()
    assert (repo / "pkg" / "k.cu").read_text().startswith("constexpr int kRows = 2;")  # the source is untouched
    ab.make_tree(repo, dest, None)  # made again, from scratch: the unpatched copy
    assert (dest / "pkg" / "k.cu").read_text().startswith("constexpr int kRows = 2;")


def test_make_tree_refuses_a_patch_that_does_not_apply(repo, tmp_path):
    patch = _patch(repo, tmp_path / "p.patch", "kRows = 2", "kRows = 4")
    (repo / "pkg" / "k.cu").write_text("constexpr int kRows = 8;\nint f() { return kRows; }\n")
    with pytest.raises(RuntimeError, match="p.patch does not apply"):
        ab.make_tree(repo, tmp_path / "trees" / "p", patch)


def test_parse_variant(tmp_path):
    p = tmp_path / "x.patch"
    p.write_text("")
    assert ab.parse_variant(f"rows4={p}") == ("rows4", p)
    for bad, msg in ((f"rows4{p}", "NAME=PATCH"), (f"head={p}", "'head' is this checkout"),
                     ("r4=/no/such.patch", "no patch file"), (f"a b={p}", "NAME=PATCH")):
        with pytest.raises(ValueError, match=msg):
            ab.parse_variant(bad)


def test_parse_env_variant():
    assert ab.parse_env_variant("nopdl=DSV4_PDL=0") == ("nopdl", {"DSV4_PDL": "0"})
    assert ab.parse_env_variant("two=A_B=1,_C=x=y") == ("two", {"A_B": "1", "_C": "x=y"})
    assert ab.parse_env_variant("empty=K=") == ("empty", {"K": ""})
    for bad, msg in (("nopdl", "NAME=K=V"), ("nopdl=", "NAME=K=V"), ("n=K", "NAME=K=V"), ("n=1K=2", "NAME=K=V"),
                     ("n=K-1=2", "NAME=K=V"), ("n=K=1,", "NAME=K=V"), ("a b=K=1", "NAME=K=V"),
                     ("n=\u00c4=1", "NAME=K=V"), ("n=K\u0663=1", "NAME=K=V"), ("head=K=1", "'head' is this checkout"),
                     ("n=K=1,K=2", "each variable once")):
        with pytest.raises(ValueError, match=msg):
            ab.parse_env_variant(bad)


def test_summary_sums_rounds_and_names_the_bits():
    def run(us, same, diff=0.0):
        return {"1024": {"us1": us, "us2": [u - 1 for u in us], "same": same, "diff": diff}}

    results = {"head": [run([100.0, 110.0], True), run([101.0, 111.0], True)],
               "same": [run([99.0, 109.0], True)],
               "zero": [run([99.0, 109.0], False, 0.0)],  # -0.0 against 0.0: not the same bits, no difference
               "other": [run([98.0, 108.0], True), run([98.5, 108.5], False, 0.25)]}
    lines, summary = ab.summarize(results, ["head", "same", "zero", "other"])
    assert summary["1024/head"]["sum_ctx1"] == [210.0, 212.0] and summary["1024/head"]["sum_ctx2"] == [208.0, 210.0]
    assert summary["1024/same"]["same_bits"] is True and summary["1024/other"]["same_bits"] is False
    assert summary["1024/zero"]["same_bits"] is False
    text = "\n".join(lines)
    assert "context 1024" in text and "100.0 / 110.0 (210.0) | 99.0 / 109.0 (208.0)" in text
    assert "[same bits]" in text and "[logits differ, max 0.25]" in text and "[logits differ, max 0]" in text
    lines, _ = ab.summarize({"head": [run([1.0], True), run([1.0], False, 0.5)]}, ["head"])
    assert "[head: its rounds differ, max 0.5]" in lines[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a CUDA device")
def test_cli_without_cuda_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: ab_trees needs a CUDA device (or --device cpu)"


def test_cli_refuses_bad_arguments(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py"), "--variant", "nothing"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --variant wants NAME=PATCH")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py"), "--contexts", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--contexts must be >= 2" in r.stderr
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py"), "--device", "cpu"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --device cpu runs the tiny test model only")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py"), "--env-variant", "x=K"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --env-variant wants NAME=K=V")
    p = tmp_path / "x.patch"
    p.write_text("")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py"), "--variant", f"x={p}", "--env-variant",
                        "x=K=1"], capture_output=True, text=True)
    assert r.returncode == 2 and "each NAME once" in r.stderr


def test_outside_git_every_file_but_caches(repo, tmp_path):
    plain = tmp_path / "plain"
    subprocess.run(["cp", "-r", str(repo), str(plain)], check=True)
    subprocess.run(["rm", "-rf", str(plain / ".git")], check=True)
    (plain / "__pycache__").mkdir()
    (plain / "__pycache__" / "x.pyc").write_text("")
    (plain / "notes.txt").write_text("kept\n")
    (plain / ".venv").mkdir()
    (plain / ".venv" / "big.bin").write_text("")
    assert ab.tracked_files(plain) == ["README", "notes.txt", "pkg/k.cu"]


def test_a_copy_inside_the_source_checkout_still_gets_its_patch(repo, tmp_path):
    # git would read the patch's paths from the enclosing work tree and skip them, exiting 0
    patch = _patch(repo, tmp_path / "rows4.patch", "kRows = 2", "kRows = 4")
    dest = repo / "ab_work" / "rows4"
    ab.make_tree(repo, dest, patch)
    assert (dest / "pkg" / "k.cu").read_text().startswith("constexpr int kRows = 4;")
    assert (repo / "pkg" / "k.cu").read_text().startswith("constexpr int kRows = 2;")


def test_make_tree_deletes_only_its_own_copies(repo, tmp_path):
    mine = tmp_path / "trees" / "v"
    ab.make_tree(repo, mine, None)
    assert (mine / ab.MARKER).is_file()
    ab.make_tree(repo, mine, None)  # its own copy: made again
    other = tmp_path / "trees" / "precious"
    other.mkdir()
    (other / "data.txt").write_text("keep\n")
    with pytest.raises(RuntimeError, match="is not a copy made by ab_trees"):
        ab.make_tree(repo, other, None)
    assert (other / "data.txt").read_text() == "keep\n"


def test_a_folder_below_a_checkout_is_walked(repo):
    # git answers inside pkg/ too (the enclosing checkout's listing): only the top of a checkout takes it
    assert ab.tracked_files(repo / "pkg") == ["k.cu"]
    with pytest.raises(RuntimeError, match="no files to copy"):
        (repo / "empty").mkdir()
        ab.tracked_files(repo / "empty")


def test_cli_refuses_a_workdir_holding_the_checkout():
    for wd in (str(ROOT), str(ROOT.parent)):
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py"), "--workdir", wd],
                           capture_output=True, text=True)
        assert r.returncode == 2 and "holds this checkout" in r.stderr


def _norm_patch(path: Path, new_line: str | None) -> Path:
    """A patch of this checkout's dsv4/ops/norm.py: its rmsnorm_ref's scaling line replaced by new_line, or (None) a
    comment appended."""
    import difflib

    src = (ROOT / "dsv4" / "ops" / "norm.py").read_text()
    line = "    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)"
    assert line in src
    new = src + "\n# a comment\n" if new_line is None else src.replace(line, new_line)
    path.write_text("".join(difflib.unified_diff(src.splitlines(True), new.splitlines(True), "a/dsv4/ops/norm.py",
                                                 "b/dsv4/ops/norm.py")))
    return path


def test_end_to_end_on_the_cpu_each_variant_runs_its_own_code(tmp_path):
    # a comment gives head's bits; a 1% larger norm output changes the logits: so each copy's dsv4 is what ran; an
    # environment variant runs head's code (head's bits) with its variable set in its worker, and only there
    noop = _norm_patch(tmp_path / "noop.patch", None)
    scale = _norm_patch(tmp_path / "scale.patch",
                        "    xf = 1.01 * xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)")
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_trees.py"), "--device", "cpu", "--tiny", "--layers",
                        "2", "--contexts", "64", "--rounds", "1", "--replays", "1", "--variant", f"noop={noop}",
                        "--variant", f"scale={scale}", "--env-variant", "probe=DSV4_AB_PROBE=42,DSV4_AB_OTHER=x",
                        "--workdir", str(tmp_path / "w"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "DSV4_AB_OTHER": "outer"})  # set in the shell: head sees it, probe its own
    assert r.returncode == 0, r.stderr
    import json

    report = json.loads(out.read_text())
    summary = report["summary"]
    assert summary["64/head"]["same_bits"] is True and summary["64/noop"]["same_bits"] is True
    assert summary["64/scale"]["same_bits"] is False
    assert summary["64/probe"]["same_bits"] is True
    assert report["env"]["probe"] == {"DSV4_AB_OTHER": "x", "DSV4_AB_PROBE": "42"}
    assert report["env"]["head"] == {"DSV4_AB_OTHER": "outer", "DSV4_AB_PROBE": None}
    assert report["env"]["noop"] == report["env"]["head"]
    assert "probe: head's code with DSV4_AB_PROBE=42, DSV4_AB_OTHER=x" in r.stdout
    assert "warning: DSV4_AB_OTHER is set in this shell ('outer')" in r.stderr
    assert report["tree"]["probe"] == report["tree"]["head"] == str((tmp_path / "w" / "head").resolve())
    assert report["tree"]["noop"] == str((tmp_path / "w" / "noop").resolve())
    assert not (tmp_path / "w" / "probe").exists()  # no copy of its own
    assert len(summary["64/scale"]["sum_ctx1"]) == 1 and summary["64/scale"]["sum_ctx1"][0] > 0
    assert "[same bits]" in r.stdout and "[logits differ, max" in r.stdout
    assert (ROOT / "dsv4" / "ops" / "norm.py").read_text().count("1.01 * xf") == 0  # the checkout is untouched
