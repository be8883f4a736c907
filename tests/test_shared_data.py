"""tests/conftest.py: a missing ../shared/dsv4 is one clear error, not silent skips.

Runs pytest in a scratch repository that has this conftest and no ../shared beside it."""

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "dsv4"


def test_uses_the_fixture(shared_dsv4):
    assert shared_dsv4.is_dir()


def test_reads_it_itself():
    if not (SHARED / "files").is_dir():
        pytest.skip(f"not found at {SHARED / 'files'}")


def test_plain():
    pass
'''


def _pytest(repo, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", *args],
                          cwd=repo, capture_output=True, text=True, timeout=300)


def test_missing_shared_data_is_one_error(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(TESTS / "conftest.py", repo / "tests" / "conftest.py")
    (repo / "tests" / "test_sample.py").write_text(SAMPLE)
    shared = tmp_path / "shared" / "dsv4"
    missing = f"the shared test data folder {shared} is missing (../shared/dsv4 beside the clone"

    r = _pytest(repo)
    assert r.returncode == 4, r.stdout + r.stderr
    assert f"1 selected tests need shared data: {missing}" in r.stdout + r.stderr
    assert "passed" not in r.stdout and "skipped" not in r.stdout  # stopped before running anything

    r = _pytest(repo, "-m", "not shared")  # the rest runs; a test that skips on its own fails instead
    assert r.returncode == 1 and "1 failed, 1 passed, 1 deselected" in r.stdout, r.stdout
    assert missing in r.stdout

    (shared / "files").mkdir(parents=True)
    r = _pytest(repo)
    assert r.returncode == 0 and "3 passed" in r.stdout, r.stdout
