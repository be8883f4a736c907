"""Compile for Hopper, on a machine without a GPU, the Triton kernels the interpreter ran.

Under TRITON_INTERPRET=1 (the CPU tests) Triton runs a kernel's Python with numpy and never compiles it: a kernel can
pass every interpreted test and still be refused by the compiler on the GPU (a name that changes type across a
runtime branch, a cast the frontend rejects, a layout it cannot lower). The sixty-sixth pass lost a GPU call to one.
`record_launches()` wraps the interpreter's launch to note each dsv4 kernel launched (its module, name, argument
types, constexpr values and launch options); `compile_recorded()` compiles each distinct one for sm_90a (the
installed Triton's frontend, LLVM and bundled ptxas; no driver needed) in a subprocess without the interpreter and
returns the failures as one line each. `python -m dsv4.ops.compile_check` is that subprocess: one record a line on
its stdin, then END.

The CPU suite makes 288 distinct launches; compiling them took 311 s at the end of the suite on 2 cores (~240 s of one
core one after another, sixty-seventh pass), while the interpreted tests keep about one core busy.
`stream_in_background()` (the suite's conftest calls it when the compile test is selected) starts that subprocess at
collection, at the lowest CPU priority (`--background`), and hands it each launch as it is first recorded, so that it
compiles while the tests run; `compile_recorded()` then waits for what is left (CI with an empty Triton cache: 717 s ->
557 s). Whatever goes wrong with it (it dies, a compiler crashes its worker, a record is lost) fails the compile test
with its stderr, never the test that launched the kernel.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_RECORDS: dict[str, dict] = {}  # the launch's JSON, less its scalar types -> the first such launch
_UNRECORDED: set[str] = set()  # kernels launched with an argument _describe cannot write down (the test names them)
_LOCK = threading.Lock()  # (kernels launched from two threads at once)
_STREAM: _Compiler | None = None  # stream_in_background()'s compiler: each new record is sent to it
_BROKEN = False  # sending to _STREAM failed: compile_recorded() compiles every record anew instead
_ROOT = Path(__file__).resolve().parents[2]  # the compile subprocess runs here: it imports this dsv4, not another
END = "END"  # the line after the last record: the compiler then prints its failures and "# compiled N"; at EOF
# without it (the parent has gone) it stops its workers and exits 2
COMPILED = "# compiled"


def record_launches() -> None:
    """Note every launch of a dsv4 kernel under the interpreter (idempotent)."""
    from triton.runtime.interpreter import InterpretedFunction

    if getattr(InterpretedFunction.run, "_dsv4_recording", False):
        return
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if getattr(self.fn, "__module__", "").startswith("dsv4."):
            _record(self.fn, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._dsv4_recording = True
    InterpretedFunction.run = recording_run


def _record(fn, args, kwargs) -> None:
    try:
        rec = _describe(fn, args, kwargs)
        json.dumps(rec)
    except Exception:  # noqa: BLE001 (an argument this cannot describe: named by the test, never raised into a test)
        _UNRECORDED.add(f"{fn.__module__}.{fn.__qualname__}")
        return
    # one compile per kernel, options, pointer types and constexprs, where tile sizes (powers of two from 8) count as
    # one: launches that differ only there, or in whether an integer argument fits 32 bits, type-check and lower
    # alike for what this looks for, and compiling each took ~6 min of the CPU suite on 2 cores (sixty-sixth pass)
    rel = dict(rec, signature={k: v for k, v in rec["signature"].items() if v.startswith("*") or v == "constexpr"},
               constexprs={k: "tile" if _is_tile(v) else v for k, v in rec["constexprs"].items()})
    key = json.dumps(rel, sort_keys=True)
    with _LOCK:
        if key not in _RECORDS:
            _RECORDS[key] = rec
            _send(rec)


def _is_tile(v) -> bool:
    return type(v) is int and v >= 8 and v & (v - 1) == 0


def _describe(fn, args, kwargs) -> dict:
    import triton.language as tl
    from triton.runtime.jit import mangle_type

    params = inspect.signature(fn).parameters
    names = list(params)
    given = dict(zip(names, args))
    given.update((k, v) for k, v in kwargs.items() if k in params)
    options = {k: v for k, v in kwargs.items() if k not in params}
    sig, consts = {}, {}
    for name, p in params.items():
        value = given[name] if name in given else p.default
        if "constexpr" in str(p.annotation) or value is None:
            sig[name] = "constexpr"
            consts[name] = {"tl_dtype": str(value)} if isinstance(value, tl.dtype) else value
        else:
            sig[name] = mangle_type(value)
    return {"module": fn.__module__, "name": fn.__qualname__, "signature": sig, "constexprs": consts,
            "options": options}


def recorded() -> list[dict]:
    return list(_RECORDS.values())


def unrecorded() -> list[str]:
    return sorted(_UNRECORDED)


def _compile_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


class _Compiler:
    """A compile subprocess (`python -m dsv4.ops.compile_check`, its own process group) fed one record a line;
    `background`: at the lowest CPU priority."""

    def __init__(self, background: bool = False):
        self.log = tempfile.TemporaryFile("w+", errors="replace")  # its stderr: read only when something went wrong
        # its own process group (stopped as one), in this session: with the kernel's autogroups, a new session would
        # share the CPU evenly with the tests whatever its nice value (CI took 742 s instead of 557)
        self.group = sys.version_info >= (3, 11)
        self.proc = subprocess.Popen([sys.executable, "-m", "dsv4.ops.compile_check"] + ["--background"] * background,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=_compile_env(), cwd=_ROOT, **({"process_group": 0} if self.group else {}))
        self.sent = 0

    def send(self, rec: dict) -> None:
        self.proc.stdin.write(json.dumps(rec) + "\n")
        self.proc.stdin.flush()
        self.sent += 1

    def finish(self, timeout: float) -> list[str]:
        """END, then its failures, one line each; one more where it did not report every record sent compiled."""
        try:
            out, _ = self.proc.communicate(END + "\n", timeout=timeout)
        except BaseException:  # (a timeout, Ctrl-C: no compile left running)
            self.stop()
            raise
        lines = [line for line in out.splitlines() if line.strip()]
        done = lines.pop() if lines and lines[-1].startswith(COMPILED) else None
        if self.proc.returncode not in (0, 1) or done != f"{COMPILED} {self.sent}":
            self.log.seek(0)
            lines.append(f"the compile subprocess (exit {self.proc.returncode}) was sent {self.sent} launches and "
                         f"reported {done!r}: {self.log.read().strip()[-2000:]}")
        return lines

    def stop(self) -> None:
        """EOF (it stops its workers and exits), then the whole process group killed if it has not gone."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            if self.group:
                os.killpg(self.proc.pid, signal.SIGKILL)
            else:  # (Python 3.10: the subprocess alone; it stops its workers at EOF)
                self.proc.kill()
        except (ProcessLookupError, PermissionError):  # (gone)
            pass
        self.proc.wait()


def stream_in_background() -> None:
    """Start a background compiler now (this environment and working directory, the lowest CPU priority) and send
    it each record as it is made, those recorded so far first; compile_recorded() collects its failures."""
    global _STREAM
    with _LOCK:
        if _STREAM is not None or _BROKEN:
            return
        _STREAM = _Compiler(background=True)
        atexit.register(_stop_stream)
        for rec in _RECORDS.values():
            _send(rec)


def _send(rec: dict) -> None:
    global _BROKEN
    if _STREAM is None or _BROKEN:
        return
    try:
        _STREAM.send(rec)
    except OSError:  # it has died: never raised into the test that launched the kernel; the end compiles anew
        _BROKEN = True


def _stop_stream() -> None:
    global _STREAM
    with _LOCK:
        comp, _STREAM = _STREAM, None
    if comp is not None:
        comp.stop()


def compile_recorded(records: list[dict] | None = None, timeout: float = 1800) -> list[str]:
    """Compile `records` for sm_90a in a subprocess without the interpreter: one line per kernel that fails (and one
    where the subprocess did not report them all compiled). Default: those recorded, which the background compiler
    has been sent where stream_in_background() ran (it is then told that all are sent and waited for; if sending to
    it failed, they are compiled anew)."""
    global _STREAM
    if records is None:
        with _LOCK:
            comp, _STREAM = _STREAM, None
            records = recorded()
        if comp is not None and not _BROKEN:
            return comp.finish(timeout)
        if comp is not None:
            comp.stop()
    comp = _Compiler()
    try:
        for rec in records:
            comp.send(rec)
    except OSError:
        pass  # (it died: finish reports what it printed and its stderr)
    return comp.finish(timeout)


def _find_kernel(module: str, name: str):
    import importlib

    from triton.runtime.jit import JITFunction

    mod = importlib.import_module(module)
    for obj in vars(mod).values():
        for cand in (obj, getattr(obj, "fixed", None)):  # a JITFunction, or triton_util.JitTwins' compiled twin
            if isinstance(cand, JITFunction) and cand.fn.__qualname__ == name:
                return cand
    raise LookupError(f"no @triton.jit function {name} in {module}")


def _compile_one(rec: dict) -> str | None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import triton.language as tl

    what = _what(rec)
    try:
        fn = _find_kernel(rec["module"], rec["name"])
        consts = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v for k, v in rec["constexprs"].items()}
        triton.compile(ASTSource(fn, rec["signature"], consts), target=GPUTarget("cuda", 90, 32),
                       options=rec["options"])
    except Exception as e:  # noqa: BLE001 (each failure is reported, one line each)
        msg = " ".join(str(e).split())
        return f"{what}: {type(e).__name__}: {msg[-600:]}"
    return None


def _what(rec: dict) -> str:
    return f"{rec['module']}.{rec['name']}{rec['constexprs']} {rec['options'] or ''}".rstrip()


def main(argv: list[str]) -> int:
    """Compile the records on stdin (one JSON a line), each queued as its line arrives, until a line END; then print
    the failures, one line each, and "# compiled N" (exit 1 if any failed). `--background`: at the lowest CPU
    priority (its workers too). At EOF without END (the parent has gone) the workers are stopped at once (exit 2)."""
    from concurrent.futures import ProcessPoolExecutor

    if "--background" in argv and hasattr(os, "nice"):
        os.nice(19)  # set here, not by a preexec_fn, which can deadlock a child forked from the threaded test process
    pool = ProcessPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)))
    jobs = []
    for line in sys.stdin:
        if line.strip() == END:
            break
        if line.strip():
            rec = json.loads(line)
            try:
                jobs.append((rec, pool.submit(_compile_one, rec)))
            except Exception as e:  # noqa: BLE001 (a worker died: the pool is broken; reported below)
                jobs.append((rec, e))
    else:
        workers = list((getattr(pool, "_processes", None) or {}).values())  # (the executor's own processes)
        for proc in workers:
            proc.kill()
        for proc in workers:
            proc.join(5)
        os._exit(2)
    failures, done = [], 0
    for rec, job in jobs:
        try:
            if isinstance(job, Exception):
                raise job
            failure = job.result()
            done += 1
        except Exception as e:  # noqa: BLE001 (a compiler that crashed its worker: that launch is reported)
            failure = f"{_what(rec)}: its compile worker died: {type(e).__name__}: {e}"
        if failure:
            failures.append(failure)
    pool.shutdown(wait=False, cancel_futures=True)
    print("\n".join(failures + [f"{COMPILED} {done}"]), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001 (exit 3: not "1, failures listed")
        import traceback

        traceback.print_exc()
        code = 3
    sys.exit(code)
