"""The Triton kernels the interpreted tests ran (TRITON_INTERPRET=1, dsv4/ops/compile_check.py) compile for Hopper:
the interpreter never compiles a kernel, so one the compiler refuses would otherwise first fail on a GPU."""

import os

import pytest

from dsv4.ops import compile_check


def _needs_interpreter():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernels compile when they run here (no interpreter)")
    pytest.importorskip("triton")


@pytest.mark.after_all_kernels
def test_interpreted_kernels_compile_for_hopper():
    _needs_interpreter()
    records = compile_check.recorded()
    assert not compile_check.unrecorded(), f"launches not written down: {compile_check.unrecorded()}"
    if not records:
        pytest.skip("no dsv4 kernel ran under the interpreter in this session")
    failures = compile_check.compile_recorded(records)
    assert not failures, f"{len(failures)} of {len(records)} interpreted kernel launches do not compile for " \
                         "sm_90a:\n" + "\n".join(failures)


def test_a_kernel_the_compiler_refuses_is_reported(monkeypatch):
    # the sixty-sixth pass's nucleus finisher: a name typed fp32 before a runtime branch and int64 inside it runs
    # under the interpreter, and the compiler refuses it; a correct kernel compiles
    _needs_interpreter()
    recs = [{"module": "tests_compile_probe", "name": name, "signature": {"x_ptr": "*fp32", "n": "i32"},
             "constexprs": {}, "options": {"num_warps": 1}} for name in ("bad", "good")]
    probe = os.path.join(os.path.dirname(__file__), "compile_probe")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (probe, os.environ.get("PYTHONPATH")) if p))
    failures = compile_check.compile_recorded(recs)
    assert len(failures) == 1 and failures[0].startswith("tests_compile_probe.bad{}"), failures
    assert "int64" in failures[0]
