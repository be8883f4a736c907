"""Shared fixtures for the encoding tests: the shared data folder, vector parametrization, tokenizer.

The golden files and vectors live in `../shared/dsv4/` beside the repository (CI clones the repo
next to it); every test that needs them is skipped with a clear reason when it is absent. The
engine itself never reads that folder.
"""

import json
from pathlib import Path

import pytest

from encoding import load_tokenizer

SHARED_DSV4 = Path(__file__).resolve().parents[2].parent / "shared" / "dsv4"
MISSING_REASON = f"shared DSV4 test data not found at {SHARED_DSV4} (expected ../shared beside the repo)"

# fixture name -> (file under SHARED_DSV4, key used as test id or None for the index)
_VECTOR_FIXTURES = {
    "encode_case": ("encoding_vectors/encode_cases.json", "id"),
    "parse_case": ("encoding_vectors/parse_cases.json", "id"),
    "tokenizer_case": ("encoding_vectors/tokenizer_cases.json", None),
}


def load_shared_json(relative: str):
    return json.loads((SHARED_DSV4 / relative).read_text(encoding="utf-8"))


def pytest_generate_tests(metafunc):
    for name, (relative, id_key) in _VECTOR_FIXTURES.items():
        if name not in metafunc.fixturenames:
            continue
        if not (SHARED_DSV4 / relative).is_file():
            metafunc.parametrize(name, [pytest.param(None, marks=pytest.mark.skip(reason=MISSING_REASON))])
            continue
        cases = load_shared_json(relative)
        ids = [case[id_key] if id_key else f"{name}{i}" for i, case in enumerate(cases)]
        metafunc.parametrize(name, cases, ids=ids)


@pytest.fixture(scope="session")
def shared_dsv4() -> Path:
    if not SHARED_DSV4.is_dir():
        pytest.skip(MISSING_REASON)
    return SHARED_DSV4


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()
