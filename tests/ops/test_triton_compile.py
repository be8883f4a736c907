"""The Triton kernels the interpreted tests ran (TRITON_INTERPRET=1, dsv4/ops/compile_check.py) compile for Hopper:
the interpreter never compiles a kernel, so one the compiler refuses would otherwise first fail on a GPU."""

import json
import os
import signal
import subprocess
import sys
import time

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


def test_the_compile_subprocess_reports_after_end_and_stops_its_workers_without_it(monkeypatch):
    # the subprocess queues records line by line and prints the failures and "# compiled N" once END arrives; at EOF
    # without END (the test process gone) it prints nothing, exits 2 and leaves no worker compiling: its process
    # group is gone
    _needs_interpreter()
    _probe_path(monkeypatch)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    lines = "".join(json.dumps(r) + "\n" for r in PROBES)
    cmd = [sys.executable, "-m", "dsv4.ops.compile_check", "--background"]
    done = subprocess.run(cmd, input=lines + compile_check.END + "\n", capture_output=True, text=True, env=env,
                          timeout=300)
    out = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 1 and len(out) == 2 and out[0].startswith("tests_compile_probe.bad{}"), done
    assert out[1] == f"{compile_check.COMPILED} 2"
    slow = "".join(json.dumps(dict(r, module="tests_compile_probe_slow")) + "\n" for r in PROBES)  # (a minute each)
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, **group)
    try:
        out, _ = proc.communicate(slow * 10, timeout=120)  # (its workers' stdout closes when they are gone)
        assert proc.returncode == 2 and not out.strip()
        for _ in range(100):
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("a compile worker outlived the subprocess after EOF")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_compiler_that_crashes_its_worker_fails_the_check(monkeypatch):
    # a worker that dies (here: the kernel's module ends the process as it is imported) is a failure, never a pass
    _needs_interpreter()
    _probe_path(monkeypatch)
    crash = dict(PROBES[1], module="tests_compile_probe_crash")
    failures = compile_check.compile_recorded([crash])
    assert failures and failures[0].startswith("tests_compile_probe_crash.good{}"), failures
    assert "worker died" in failures[0]
    assert "was sent 1 launches and reported '# compiled 0'" in failures[-1]
