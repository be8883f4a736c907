"""Compile for Hopper, on a machine without a GPU, the Triton kernels the interpreter ran.

Under TRITON_INTERPRET=1 (the CPU tests) Triton runs a kernel's Python with numpy and never compiles it: a kernel can
pass every interpreted test and still be refused by the compiler on the GPU (a name that changes type across a
runtime branch, a cast the frontend rejects, a layout it cannot lower). The sixty-sixth pass lost a GPU call to one.
`record_launches()` wraps the interpreter's launch to note each dsv4 kernel launched (its module, name, argument
types, constexpr values and launch options); `compile_recorded()` compiles each distinct one for sm_90a (the
installed Triton's frontend, LLVM and bundled ptxas; no driver needed) in a subprocess without the interpreter and
returns the failures as one line each. `python -m dsv4.ops.compile_check < records.jsonl` is that subprocess.

Compiling every distinct launch of the CPU suite takes ~5 min of 2 cores (288 launches, sixty-seventh pass), while the
interpreted tests keep about one core busy. `stream_in_background()` (the suite's conftest calls it when the compile
test is selected) hands each launch, as it is first recorded, to that subprocess (`--stream`, at the lowest CPU
priority), which compiles while the tests run; `compile_recorded()` then waits for what is left (CI with an empty
Triton cache: 717 s -> 557 s).
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import subprocess
import sys
import tempfile

_RECORDS: dict[str, dict] = {}  # the launch's JSON, less its scalar types -> the first such launch
_UNRECORDED: set[str] = set()  # kernels launched with an argument _describe cannot write down (the test names them)
_STREAMING = False  # stream_in_background() was called: each new record goes to _STREAM
_STREAM: subprocess.Popen | None = None  # the background compiler (`--stream`), started with the first record sent
_SENT = 0  # records sent to _STREAM
END = "END"  # the line that tells the background compiler every record is sent (EOF without it: the parent is gone)
COMPILED = "# compiled"  # its last line after END: "# compiled N"


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
    if key not in _RECORDS:
        _RECORDS[key] = rec
        if _STREAMING:
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


def stream_in_background() -> None:
    """From now on compile each new record (and those recorded so far) in a background subprocess at the lowest CPU
    priority as it is recorded; compile_recorded() collects its failures."""
    global _STREAMING
    if _STREAMING:
        return
    _STREAMING = True
    for rec in _RECORDS.values():
        _send(rec)


def _send(rec: dict) -> None:
    global _STREAM, _SENT
    if _STREAM is None:
        log = tempfile.TemporaryFile("w+")  # its stderr (Triton's warnings): read only if it fails
        _STREAM = subprocess.Popen([sys.executable, "-m", "dsv4.ops.compile_check", "--stream"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, text=True, env=_compile_env())
        _STREAM.log, _SENT = log, 0
        atexit.register(_stop_stream)
    _STREAM.stdin.write(json.dumps(rec) + "\n")
    _STREAM.stdin.flush()
    _SENT += 1


def _stop_stream() -> None:
    """At exit without compile_recorded(): EOF without END, so the background compiler drops what it has queued."""
    global _STREAM
    proc, _STREAM = _STREAM, None
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.stdin.close()
        proc.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


def _failures(returncode: int, stdout: str, stderr: str) -> list[str]:
    if returncode not in (0, 1):
        return [f"the compile subprocess failed (exit {returncode}): {stderr.strip()[-2000:]}"]
    return [line for line in stdout.splitlines() if line.strip()]


def compile_recorded(records: list[dict] | None = None, timeout: float = 1800) -> list[str]:
    """Compile `records` for sm_90a in a subprocess without the interpreter: one line per kernel that fails. Default:
    those recorded, which the background compiler has been given if stream_in_background() ran (it is then told
    that all are sent and waited for)."""
    global _STREAM, _STREAMING
    if records is None and _STREAM is not None:
        proc, _STREAM, _STREAMING = _STREAM, None, False
        try:
            out, _ = proc.communicate(END + "\n", timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        proc.log.seek(0)
        failures = _failures(proc.returncode, out, proc.log.read())
        # its last line counts what it compiled: all that was sent, or the check did not cover them
        done = failures.pop() if failures and failures[-1].startswith(COMPILED) else None
        if proc.returncode in (0, 1) and done != f"{COMPILED} {_SENT}":
            failures.append(f"the background compiler was sent {_SENT} launches and reported {done!r}")
        return failures
    records = recorded() if records is None else records
    proc = subprocess.run([sys.executable, "-m", "dsv4.ops.compile_check"], input="\n".join(map(json.dumps, records)),
                          capture_output=True, text=True, env=_compile_env(), timeout=timeout)
    return _failures(proc.returncode, proc.stdout, proc.stderr)


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

    what = f"{rec['module']}.{rec['name']}{rec['constexprs']} {rec['options'] or ''}".rstrip()
    try:
        fn = _find_kernel(rec["module"], rec["name"])
        consts = {k: tl.dtype(v["tl_dtype"]) if isinstance(v, dict) else v for k, v in rec["constexprs"].items()}
        triton.compile(ASTSource(fn, rec["signature"], consts), target=GPUTarget("cuda", 90, 32),
                       options=rec["options"])
    except Exception as e:  # noqa: BLE001 (each failure is reported, one line each)
        msg = " ".join(str(e).split())
        return f"{what}: {type(e).__name__}: {msg[-600:]}"
    return None


def main(argv: list[str]) -> int:
    """Compile the records on stdin (one JSON a line) and print the failures, one line each (exit 1 if any). With
    `--stream`, each is queued as its line arrives, until a line END (then the failures are printed and a last line
    "# compiled N"); at EOF without END the parent has gone: the queue is dropped (exit 2)."""
    from concurrent.futures import ProcessPoolExecutor

    if "--stream" in argv and hasattr(os, "nice"):
        os.nice(19)  # beside the tests: the lowest priority, its compile workers too (set here, not by a preexec_fn,
        # which can deadlock a child forked from the threaded test process)
    with ProcessPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        if "--stream" not in argv:
            records = [json.loads(line) for line in sys.stdin if line.strip()]
            failures = [f for f in pool.map(_compile_one, records) if f]
        else:
            futures = []
            for line in sys.stdin:
                if line.strip() == END:
                    break
                if line.strip():
                    futures.append(pool.submit(_compile_one, json.loads(line)))
            else:
                pool.shutdown(cancel_futures=True)
                return 2
            failures = [f for f in (fut.result() for fut in futures) if f]
            print("\n".join(failures + [f"{COMPILED} {len(futures)}"]))
            return 1 if failures else 0
    print("\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
