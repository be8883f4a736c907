"""The op seam: every hot op of the model has one entry point here, with a reference and a fast backend.

Each op lives in `dsv4/ops/<op>.py` as `<op>_ref` (pure torch, the spec) and, where one exists, a fast
implementation with the same signature (Triton beside it, CUDA C++ in `dsv4/kernels/cuda/`). Model
modules call `ops.<name>(...)`, never a kernel. The backend is chosen once at start with `configure()`
(`--kernels ref|fast`; default fast on CUDA, ref on CPU), may be overridden per op for A/B runs, and is
described by `banner()`. An op without a fast implementation on the device runs its reference and is
listed as such, never silently. `set_hook()` lets tools/ab_compare.py observe every call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

BACKENDS = ("ref", "fast")


@dataclass
class Op:
    name: str
    ref: Callable
    fast: Callable | None = None  # same signature as ref
    fast_on: tuple[str, ...] = ("cuda",)  # device types the fast path runs on
    interpretable: bool = False  # fast path is Triton: runs on CPU under TRITON_INTERPRET=1
    doc: str = ""
    cuda: str = ""  # the part of the fast path that runs CUDA C++ (dsv4/kernels/cuda); Triton/ref stand in without it
    active: str = "ref"  # the backend bound now
    impl: Callable | None = field(default=None, repr=False)

    def fast_available(self, device_type: str) -> tuple[bool, str]:
        """(available, why not) for the fast path on a device type."""
        if self.fast is None:
            return False, "no fast implementation yet"
        if device_type in self.fast_on:
            return True, ""
        if device_type == "cpu" and self.interpretable:
            if os.environ.get("TRITON_INTERPRET") == "1":
                return True, ""
            return False, "Triton on CPU needs TRITON_INTERPRET=1"
        return False, f"needs {'/'.join(self.fast_on)}"


OPS: dict[str, Op] = {}
_hook: Callable | None = None  # (op, args, kwargs) -> result; set by ab_compare
_SIDE_STREAMS: dict = {}  # device -> its side stream
_FIXED = [0]  # depth of fixed_shapes() contexts


@contextlib.contextmanager
def fixed_shapes():
    """Calls made inside are replayed with the same shapes and strides (a CUDA graph's warm-up and capture): a kernel
    may compile a variant specialized on their integer values. Outside, shapes follow the position (prefill chunks),
    and the kernels whose integer arguments change with it take their unspecialized variant
    (`triton_util.JitTwins`), so that a new value compiles nothing mid-request."""
    _FIXED[0] += 1
    try:
        yield
    finally:
        _FIXED[0] -= 1


def shapes_fixed() -> bool:
    """Whether the calls made now are inside fixed_shapes()."""
    return _FIXED[0] > 0


def side_stream(device):
    """The device's second stream, for work beside the current one (`dsv4.model.layers.SideBranch`), made on first
    use. It comes from torch's high-priority stream pool: the default-priority streams that callers make (graph
    capture and warm-up streams) are drawn round-robin from another pool, so they are never this stream."""
    import torch

    dev = torch.cuda.current_stream(device).device
    if dev not in _SIDE_STREAMS:
        _SIDE_STREAMS[dev] = torch.cuda.Stream(dev, priority=-1)
    return _SIDE_STREAMS[dev]


def stream_role(device) -> str:
    """"side" when the current stream of `device` is its side stream, else "main". Kernels that keep scratch per
    device (the arrival counters of split-K and last-to-arrive reductions) keep one set per role: a launch on the
    side stream may run at the same time as one of the same kernel on the main stream."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return "main"
    dev = torch.cuda.current_stream(device).device
    side = _SIDE_STREAMS.get(dev)
    return "side" if side is not None and torch.cuda.current_stream(dev) == side else "main"


def register(name: str, ref: Callable, fast: Callable | None = None, *, fast_on=("cuda",),
             interpretable: bool = False, doc: str = "", cuda: str = "") -> None:
    op = Op(name, ref, fast, tuple(fast_on), interpretable, doc, cuda)
    op.impl = ref
    OPS[name] = op


def _dispatcher(name: str) -> Callable:
    def call(*args, **kwargs):
        op = OPS[name]
        if _hook is not None:
            return _hook(op, args, kwargs)
        return op.impl(*args, **kwargs)

    call.__name__ = name
    call.__qualname__ = name
    call.__doc__ = f"ops.{name}: dispatches to the backend bound by dsv4.ops.configure()"
    return call


def default_backend(device_type: str) -> str:
    return "fast" if device_type == "cuda" else "ref"


def configure(kernels: str | None = None, device_type: str = "cpu",
              overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Bind every op to a backend once: `kernels` ("ref" | "fast"; None = default for the device),
    per-op `overrides` {op: backend}. A fast op unavailable on the device runs its reference.
    Returns {op: "fast" | "ref" | "ref (reason)"} for the run banner."""
    kernels = kernels or default_backend(device_type)
    if kernels not in BACKENDS:
        raise ValueError(f"kernels must be one of {BACKENDS}, got {kernels!r}")
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(OPS))
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; ops are: {', '.join(sorted(OPS))}")
    bad = {k: v for k, v in overrides.items() if v not in BACKENDS}
    if bad:
        raise ValueError(f"backend must be one of {BACKENDS}, got {bad}")
    report = {}
    for name, op in OPS.items():
        want = overrides.get(name, kernels)
        ok, why = op.fast_available(device_type)
        if want == "fast" and ok:
            op.active, op.impl = "fast", op.fast
            report[name] = "fast"
        else:
            op.active, op.impl = "ref", op.ref
            report[name] = "ref" if want == "ref" else f"ref ({why})"
    if device_type == "cuda" and any(op.cuda and op.active == "fast" for op in OPS.values()):
        from dsv4.kernels import cuda as cuda_kernels

        cuda_kernels.load()  # built (or found in the cache) now, before any weight loads or token runs
    return report


def cuda_line() -> str | None:
    """"CUDA kernels: built (...)" or "CUDA kernels unavailable: <why> (...)" once a configure() on CUDA has asked
    for them; None before."""
    from dsv4.kernels import cuda as cuda_kernels

    if not cuda_kernels.attempted():
        return None
    parts = ", ".join(f"{n}: {op.cuda}" for n, op in OPS.items() if op.cuda)
    ok, why = cuda_kernels.status()
    return f"CUDA kernels: built ({parts})" if ok else f"CUDA kernels unavailable: {why} (Triton runs {parts})"


def parse_kernels(spec: str | None) -> tuple[str | None, dict[str, str]]:
    """`--kernels` value -> (backend, per-op overrides): "ref", "fast", or "fast,sparse_attn=ref,..."
    (None: the device's default). ValueError with a one-line message otherwise."""
    if spec is None or spec == "":
        return None, {}
    backend, overrides = None, {}
    for part in (p.strip() for p in spec.split(",")):
        if "=" in part:
            name, _, value = part.partition("=")
            overrides[name.strip()] = value.strip()
        elif part in BACKENDS and backend is None:
            backend = part
        else:
            raise ValueError(f"--kernels: expected ref, fast or op=ref|fast items, got {part!r}")
    return backend, overrides


def active() -> dict[str, str]:
    return {name: op.active for name, op in OPS.items()}


def banner(report: dict[str, str]) -> str:
    """One line: which ops run fast, which run their reference and why."""
    groups: dict[str, list[str]] = {}
    for n, r in report.items():
        groups.setdefault(r, []).append(n)
    parts = [f"{r}: {', '.join(ns)}" for r, ns in groups.items()]
    line = cuda_line()
    return "kernels: " + "; ".join(parts + ([line] if line else []))


def set_hook(hook: Callable | None) -> None:
    global _hook
    _hook = hook


# ---- the registry (import order = listing order) ----
from dsv4.ops import (  # noqa: E402
    act_quant as _act_quant, head as _head, linear as _linear, mhc as _mhc, moe as _moe, norm as _norm,
    rope as _rope, sparse_attn as _sparse_attn, compressor as _compressor, indexer as _indexer,
    hadamard as _hadamard, plan as _plan, sample as _sample,
)

for _mod in (_act_quant, _linear, _norm, _rope, _mhc, _compressor, _hadamard, _indexer, _sparse_attn, _moe, _head,
             _plan, _sample):
    _mod.register_ops(register)

act_quant = _dispatcher("act_quant")
linear = _dispatcher("linear")
wo_a = _dispatcher("wo_a")
norm_linear = _dispatcher("norm_linear")
rmsnorm = _dispatcher("rmsnorm")
rmsnorm_quant = _dispatcher("rmsnorm_quant")
qkv_norm_rope = _dispatcher("qkv_norm_rope")
rope = _dispatcher("rope")
mhc_pre = _dispatcher("mhc_pre")
mhc_post = _dispatcher("mhc_post")
mhc_head = _dispatcher("mhc_head")
mhc_pre_norm = _dispatcher("mhc_pre_norm")
mhc_post_pre_norm = _dispatcher("mhc_post_pre_norm")
compressor = _dispatcher("compressor")
rotate_fp4 = _dispatcher("rotate_fp4")
indexer_scores = _dispatcher("indexer_scores")
topk_select = _dispatcher("topk_select")
sparse_attn = _dispatcher("sparse_attn")
router = _dispatcher("router")
moe_experts = _dispatcher("moe_experts")
moe_post = _dispatcher("moe_post")
moe_post_pre = _dispatcher("moe_post_pre")
head = _dispatcher("head")
step_plan = _dispatcher("step_plan")
sample_race = _dispatcher("sample_race")
