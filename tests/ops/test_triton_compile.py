"""The Triton kernels the interpreted tests ran (TRITON_INTERPRET=1, dsv4/ops/compile_check.py) compile for Hopper:
the interpreter never compiles a kernel, so one the compiler refuses would otherwise first fail on a GPU."""

import json
import os
import subprocess
import sys

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
    failures = compile_check.compile_recorded()  # (the background compiler's, where the conftest started it)
    assert not failures, f"{len(failures)} of {len(records)} interpreted kernel launches do not compile for " \
                         "sm_90a:\n" + "\n".join(failures)


PROBES = [{"module": "tests_compile_probe", "name": name, "signature": {"x_ptr": "*fp32", "n": "i32"}, "constexprs": {},
           "options": {"num_warps": 1}} for name in ("bad", "good")]


def _probe_path(monkeypatch):
    probe = os.path.join(os.path.dirname(__file__), "compile_probe")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (probe, os.environ.get("PYTHONPATH")) if p))


def test_a_kernel_the_compiler_refuses_is_reported(monkeypatch):
    # the sixty-sixth pass's nucleus finisher: a name typed fp32 before a runtime branch and int64 inside it runs
    # under the interpreter, and the compiler refuses it; a correct kernel compiles
    _needs_interpreter()
    _probe_path(monkeypatch)
    failures = compile_check.compile_recorded(PROBES)
    assert len(failures) == 1 and failures[0].startswith("tests_compile_probe.bad{}"), failures
    assert "int64" in failures[0]


def test_the_background_compiler_reports_after_end_and_drops_its_queue_without_it(monkeypatch):
    # `--stream` (the suite's background compiler): records queued line by line, the failures printed once END
    # arrives; at EOF without END (the test process gone) nothing is printed and it exits 2
    _needs_interpreter()
    _probe_path(monkeypatch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = "".join(json.dumps(r) + "\n" for r in PROBES)
    cmd = [sys.executable, "-m", "dsv4.ops.compile_check", "--stream"]
    done = subprocess.run(cmd, input=lines + compile_check.END + "\n", capture_output=True, text=True, env=env,
                          timeout=300)
    out = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 1 and len(out) == 2 and out[0].startswith("tests_compile_probe.bad{}"), done
    assert out[1] == f"{compile_check.COMPILED} 2"
    gone = subprocess.run(cmd, input=lines, capture_output=True, text=True, env=env, timeout=300)
    assert gone.returncode == 2 and not gone.stdout.strip(), gone
