"""Suite-wide setup: Triton's interpreter on machines without CUDA, and the shared test data folder,
which is required, never silently skipped.

Triton decides "interpreted or compiled" when it and each @triton.jit function are first imported, so
without CUDA TRITON_INTERPRET=1 is set here, before any test module imports a kernel (the fast ops'
CPU tier, e.g. tests/ops/test_mhc.py, relies on it).

Golden files (official encoder outputs, encoding/parse/tokenizer vectors, the official Flash
config.json) live in `../shared/dsv4/` beside the clone; CI always has it there. Tests that use it
(fixture `shared_dsv4`, or the vector fixtures of tests/encoding) are marked `shared`. When the
folder is missing and any selected test needs it, the run stops before the first test with one
message naming the folder; `-m "not shared"` runs the rest. A test that reads the folder on its own
and skips when it is absent fails with the same message instead.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    try:  # note each kernel the interpreter runs: tests/ops/test_triton_compile.py compiles them for Hopper at the end
        from dsv4.ops.compile_check import record_launches

        record_launches()
    except (ImportError, AttributeError):  # no Triton here, or one whose interpreter is laid out otherwise (the test
        pass  # then skips: nothing recorded)

SHARED_DSV4 = Path(__file__).resolve().parents[1].parent / "shared" / "dsv4"
NEEDS_SHARED = {"shared_dsv4", "encode_case", "parse_case", "tokenizer_case"}  # fixtures that read it
MISSING = (f"the shared test data folder {SHARED_DSV4} is missing (../shared/dsv4 beside the clone: the "
           "official encoder outputs, encoding vectors and the official config.json the tests compare "
           "against); put it there, or run the other tests with -m 'not shared'")


def pytest_configure(config):
    config.addinivalue_line("markers", "shared: needs the shared test data folder ../shared/dsv4")
    config.addinivalue_line("markers", "after_all_kernels: runs after every other test of the session")


@pytest.hookimpl(tryfirst=True)  # before -m selection reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if NEEDS_SHARED & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.shared)
    # the compile check of the kernels the interpreter ran goes last (it compiles what the tests before it launched)
    last = [item for item in items if item.get_closest_marker("after_all_kernels")]
    items[:] = [item for item in items if item not in last] + last


def pytest_collection_finish(session):
    if os.environ.get("TRITON_INTERPRET") == "1" and any(
            item.get_closest_marker("after_all_kernels") for item in session.items):
        try:  # the compile check is selected: compile each launch on the idle cores as the tests record it
            from dsv4.ops.compile_check import stream_in_background

            stream_in_background()
        except ImportError:
            pass
    if SHARED_DSV4.is_dir():
        return
    n = sum(1 for item in session.items if item.get_closest_marker("shared"))
    if n:
        pytest.exit(f"{n} selected tests need shared data: {MISSING}", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and not SHARED_DSV4.is_dir() and str(SHARED_DSV4) in str(report.longrepr):
        report.outcome, report.longrepr = "failed", MISSING


@pytest.fixture(scope="session")
def shared_dsv4() -> Path:
    """The shared test data folder (tests/encoding has its own fixture of the same name)."""
    if not SHARED_DSV4.is_dir():
        pytest.fail(MISSING)
    return SHARED_DSV4


@pytest.fixture(scope="module")
def built_sm90():
    """The CUDA kernels (dsv4/kernels/cuda) built on an sm_90+ device: skip without one, fail if they do not build.
    The CUDA kernel tests use it module-wide (pytestmark)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the CUDA kernels need sm_90+")
    from dsv4.kernels import cuda as cuda_kernels

    if cuda_kernels.load() is None:
        pytest.fail(f"CUDA kernels did not build: {cuda_kernels.status()[1]}")
