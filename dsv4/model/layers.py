"""Building blocks shared by the model modules: numerics context, RMSNorm, Linear, RoPE tables, step plan.

`Numerics` says how a model computes: `exact` (no quantization simulation; what transformers
computes) or `reference` (DeepSeek's numerics, SPEC §2.0), and the activation dtype kept between ops.
`Linear` holds a weight in its stored format under the official names (`weight`, `scale`, ...) and
multiplies through `ops.linear` on the kernel layout made once by `prepare()` (re-made when its
buffers are replaced, e.g. by a reload). `StepPlan` is what one forward step needs to know about
positions, built on the device: the same module code runs prefill chunks and the captured S = 1
decode step.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dsv4 import formats, ops
from dsv4.config import YarnConfig
from dsv4.ops.linear import PreparedLinear, prepare_linear

NUMERICS = ("exact", "reference")


@dataclass(frozen=True)
class Numerics:
    mode: str = "exact"  # "exact" | "reference"
    dtype: torch.dtype = torch.float32  # activation / residual dtype between ops

    def __post_init__(self):
        if self.mode not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.mode!r}")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"activation dtype must be float32 or bfloat16, got {self.dtype}")

    @property
    def reference(self) -> bool:
        return self.mode == "reference"


class RMSNorm(nn.Module):
    """Weighted RMSNorm: statistic and scaling in fp32, result cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, dtype=torch.bfloat16):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)


class Linear(nn.Module):
    """y = x @ W^T with W stored in one of `dsv4.formats` (dense, fp8, mxfp4, nvfp4).

    Reference numerics quantize the activation to FP8 1x128 (power-of-two scales) before a
    quantized weight (W8A8 / W4A8), unless `act_quant=False`; exact numerics never do. The GEMM
    accumulates in fp32 and the result is returned in `out_dtype` (default: x's dtype).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, numerics: Numerics, *,
                 act_quant: bool = True, **fmt_opts):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fmt = fmt
        self.numerics = numerics
        self.act_quant = act_quant and numerics.reference and fmt != "dense"
        self.cls = formats.FORMATS[fmt]
        for name, (shape, dtype) in self.cls.layout(out_features, in_features, **fmt_opts).items():
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))
        self._prepared: PreparedLinear | None = None
        self._prepared_from: tuple = ()

    def stored(self) -> formats.LinearWeight:
        """The weight as its explicit format container (data + scale tensors, no copy)."""
        return self.cls(**dict(self._buffers))

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """[N, K] in dtype from the stored bytes (tests and tools; the forward never does this)."""
        return self.stored().dequantize(dtype)

    def prepared(self) -> PreparedLinear:
        """The kernel layout of the current buffers, made once (again only if a buffer was replaced or
        written in place: the key holds each buffer's storage address and version counter)."""
        key = tuple((b.data_ptr(), b._version) for b in self._buffers.values())
        if self._prepared is None or key != self._prepared_from:
            self._prepared = prepare_linear(self.stored())
            self._prepared_from = key
        return self._prepared

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return ops.linear(x, self.prepared(), self.act_quant, out_dtype or x.dtype)

    def normed(self, x: torch.Tensor, norm: "RMSNorm", out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """self(norm(x)) as one op (ops.norm_linear: a decode step norms x inside the linear's launch)."""
        return ops.norm_linear(x, norm.weight, norm.eps, self.prepared(), self.act_quant, out_dtype or x.dtype)


class FusedLinear:
    """Linears that read the same input, run as one GEMM over their concatenated rows (one launch, one
    activation quantization). The members keep their official buffers, re-pointed as views into the
    concatenated tensors, so no weight is stored twice; a member whose buffers are replaced (reload,
    placement) or written is re-fused at the next call. Members that cannot share one GEMM (different
    formats or dtypes, FP8 rows not a multiple of the 128-row scale block) run one by one."""

    def __init__(self, members: list[Linear]):
        self.members = members
        self._fused: tuple | None = None

    def _key(self) -> tuple:
        return tuple((b.data_ptr(), b._version) for m in self.members for b in m._buffers.values())

    def _fusable(self) -> bool:
        m0 = self.members[0]
        names = list(m0._buffers)
        same = all(m.fmt == m0.fmt and m.in_features == m0.in_features and m.act_quant == m0.act_quant
                   and list(m._buffers) == names
                   and all(m._buffers[n].dtype == m0._buffers[n].dtype and m._buffers[n].device == m0._buffers[n].device
                           for n in names) for m in self.members)
        blocks = m0.fmt != "fp8" or all(m.out_features % 128 == 0 for m in self.members)
        return same and blocks and m0.fmt in ("dense", "fp8") and m0._buffers["weight"].device.type != "meta"

    def prepared(self) -> PreparedLinear | None:
        key = self._key()
        if self._fused is None or self._fused[0] != key:
            fused = None
            if self._fusable():
                names = list(self.members[0]._buffers)
                cat = {n: torch.cat([m._buffers[n] for m in self.members], 0) for n in names}
                offset = dict.fromkeys(names, 0)
                for m in self.members:  # re-point the members' buffers into the fused tensors
                    for n in names:
                        rows = m._buffers[n].shape[0]
                        m._buffers[n] = cat[n][offset[n]:offset[n] + rows]
                        offset[n] += rows
                fused = prepare_linear(self.members[0].cls(**cat))
            self._fused = (self._key(), fused)
        return self._fused[1]

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """x [..., K] -> one output per member, in member order (views of one GEMM's output)."""
        p = self.prepared()
        if p is None:
            return tuple(m(x, out_dtype) for m in self.members)
        y = ops.linear(x, p, self.members[0].act_quant, out_dtype or x.dtype)
        return y.split([m.out_features for m in self.members], -1)

    def normed(self, x: torch.Tensor, norm: "RMSNorm",
               out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """self(norm(x)): one ops.norm_linear over the fused rows (members one by one after one norm otherwise)."""
        p = self.prepared()
        if p is None:
            y = norm(x)
            return tuple(m(y, out_dtype) for m in self.members)
        y = ops.norm_linear(x, norm.weight, norm.eps, p, self.members[0].act_quant, out_dtype or x.dtype)
        return y.split([m.out_features for m in self.members], -1)


# --------------------------------------------------------------------------------------------------
# RoPE tables: interleaved pairs (x[2i], x[2i+1]) on the LAST `rope_dim` dims of a head (SPEC §2.3.3)


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnConfig | None) -> torch.Tensor:
    """[rope_dim/2] fp32 angular frequencies; YaRN blends in omega/factor above the ramp (no mscale),
    with DeepSeek's expression and evaluation order: f/factor*(1-smooth) + f*smooth, smooth = 1-ramp."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return freqs

    def corr_dim(n_rot: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(corr_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / yarn.factor * (1 - smooth) + freqs * smooth


class Rope:
    """cos/sin tables [max_pos, rope_dim/2] (fp32) for one RoPE kind, computed once per model and device."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnConfig | None, max_pos: int, device=None):
        self.rope_dim = rope_dim
        inv = rope_inv_freq(rope_dim, theta, yarn).to(device)
        ang = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos(), ang.sin()

    def at(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, rope_dim/2] at positions pos [S]."""
        return self.cos[pos], self.sin[pos]


# --------------------------------------------------------------------------------------------------
# The step plan


@dataclass
class StepPlan:
    """Positions and index lists of one forward step on one device (all tensors on that device).

    start: [1] int64, the first token's position; pos: [S]. Window index lists (SPEC §2.3.5, the
    official layout): query t lists positions max(0, t-W+1)..t ascending, then -1 up to `win_len`
    slots, as rows of cat(ring, chunk kv) (ring slot p % W for p < start, W + p - start for the
    chunk); a one-token step (decode) lists ring slots only, p % W, as its kv goes to its slot
    first (`ring_first`: the slot held position p - W, which its window no longer covers). win_len is
    W, except for a first chunk (start 0, S > 1), where DeepSeek's prefill uses min(S, W). A decode
    step (S = 1) has static sizes: `end` is None and every compressed-entry list covers the whole
    entries buffer; a prefill chunk knows its end position on the host.
    """

    start: torch.Tensor
    pos: torch.Tensor
    S: int
    window: int
    win_len: int
    win_idx: torch.Tensor  # [S, win_len] int32
    ring_slots: torch.Tensor  # [min(S, W)] int64: ring slots of the chunk's last min(S, W) tokens
    end: int | None
    ropes: dict = field(default_factory=dict)  # kind -> (cos, sin) [S, rd/2]
    visible: dict = field(default_factory=dict)  # ratio -> n_vis [S]; (ratio, n) -> the HCA index list
    windows: dict = field(default_factory=dict)  # a decode step's: ratio -> (p mod ratio [1], its window's start [1])
    pending: SideBranch | None = None  # the side branch still making this plan's tensors (see ready())

    @staticmethod
    def build(start: torch.Tensor, S: int, window: int, host_start: int | None) -> "StepPlan":
        dev = start.device
        pos = start + torch.arange(S, device=dev)
        win_len = min(S, window) if (host_start == 0 and S > 1) else window
        first = (pos - window + 1).clamp_min(0)
        p = first[:, None] + torch.arange(win_len, device=dev)[None, :]  # [S, win_len]
        row = p % window if S == 1 else torch.where(p >= start, window + p - start, p % window)
        win_idx = torch.where(p <= pos[:, None], row, -1).to(torch.int32)
        keep = min(S, window)
        end = None if (S == 1 or host_start is None) else host_start + S
        return StepPlan(start, pos, S, window, win_len, win_idx, pos[S - keep:] % window, end)

    @staticmethod
    def decode(start: torch.Tensor, window: int, tables: list, ratios: list, prefix: list) -> "StepPlan":
        """A one-token step's plan (as `build(start, 1, window, None)`) with the RoPE rows of every table, the visible
        counts of `ratios` and the HCA lists of `prefix` ((ratio, n) pairs) made at once by `ops.step_plan`: the
        tensors `rope`, `n_visible` and `prefix_idx` would make one by one."""
        win_idx, ring, ropes, n_vis, lists = ops.step_plan(start, window, [(t.cos, t.sin) for t in tables],
                                                           list(ratios), list(prefix))
        plan = StepPlan(start, start[:1], 1, window, window, win_idx, ring, None)
        plan.ropes.update({id(t): r for t, r in zip(tables, ropes)})
        plan.visible.update((r, v[0:1]) for r, v in zip(ratios, n_vis))
        plan.windows.update((r, (v[1:2], v[2:3])) for r, v in zip(ratios, n_vis))
        plan.visible.update(zip(prefix, lists))
        return plan

    def ready(self) -> None:
        """Makes the current stream wait for the side branch that builds this plan (the decode step's plan is made
        beside the first layer's mHC and query projections); call before the first kernel that reads it."""
        if self.pending is not None:
            self.pending.join()
            self.pending = None

    def rope(self, table: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(table)
        if key not in self.ropes:
            self.ropes[key] = table.at(self.pos)
        return self.ropes[key]

    @property
    def ring_first(self) -> bool:
        """The step's kv is inserted into the ring before the attention, which reads the ring alone."""
        return self.S == 1

    def n_visible(self, ratio: int) -> torch.Tensor:
        """[S] int64: compressed entries visible to each query, w with (w + 1) * ratio <= pos + 1."""
        if ratio not in self.visible:
            self.visible[ratio] = (self.pos + 1) // ratio
        return self.visible[ratio]

    def window_slots(self, ratio: int) -> torch.Tensor:
        """[S] int64: each token's slot in its compressor window, p mod ratio (a decode step's from the plan's one
        launch; otherwise made at each call, never cached: a layer with two captured schedules must not read a tensor
        that only one of them makes)."""
        w = self.windows.get(ratio)
        return w[0] if w is not None else self.pos % ratio

    def window_start(self, ratio: int) -> torch.Tensor:
        """[1] int64: the first position of the first token's compressor window, start - start mod ratio (as
        window_slots)."""
        w = self.windows.get(ratio)
        return w[1] if w is not None else self.start - self.start % ratio

    def prefix_idx(self, ratio: int, n: int) -> torch.Tensor:
        """[S, n] int32: an HCA query's compressed index list, its visible entries ascending, then -1."""
        key = (ratio, n)
        if key not in self.visible:
            ar = torch.arange(n, device=self.pos.device)
            self.visible[key] = torch.where(ar[None, :] < self.n_visible(ratio)[:, None], ar, -1).to(torch.int32)
        return self.visible[key]

    def n_entries(self, ratio: int, capacity: int) -> int:
        """Compressed entries a step's index lists cover: all that can be visible by the end of the chunk
        (prefill), or the whole buffer (decode: static shapes)."""
        return capacity if self.end is None else min(self.end // ratio, capacity)


# --------------------------------------------------------------------------------------------------
# A second stream inside one forward

_OVERLAP = [True]


def set_overlap(enabled: bool) -> bool:
    """Whether `SideBranch` runs its work on a second stream (the default) or in line on the current one, for A/B
    runs and per-op timing; returns the previous setting."""
    prev = _OVERLAP[0]
    _OVERLAP[0] = bool(enabled)
    return prev


def on_device(device: torch.device):
    """A context that makes `device` the current CUDA device (nothing on other device types). Triton launches a kernel
    on the current device's stream whatever device its tensors are on, so every layer (and the head) of a model spread
    over GPUs runs inside the context of its own device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class SideBranch:
    """Work that needs only what the current stream has queued so far, run on a second stream of the device so
    that its kernels overlap the current stream's next ones; `join()` makes the current stream wait for it before
    anything reads the branch's results. At batch 1 many decode kernels leave most of the GPU idle (a small grid,
    a serial tail), so independent chains fill those gaps. Inside a CUDA-graph capture the fork and the join are
    graph edges and the branch's kernels parallel nodes. One side stream per device (`ops.side_stream`); ops that
    keep per-device scratch keep a second set for it (`ops.stream_role`).
    Memory: tensors the branch allocates belong to the side stream's pool, and the main stream may still be reading
    one when Python frees it. That is safe because the side stream allocates only inside branches, and every
    branch starts by waiting for the main stream (the fork, when the SideBranch is made): a freed block is handed out
    again only to work queued after every main-stream read that came before. So: allocate on the side stream only
    inside a branch, and keep the branch's results referenced until after `join()`. A branch may be entered later
    than its fork (its work then queued after more main-stream work) only if the main stream reads no side-stream
    tensor between the fork and the branch's first allocation.
    In line (no second stream) on the CPU and after `set_overlap(False)`; the results are the same bits."""

    def __init__(self, device: torch.device):
        # branches of one device share its side stream, so a branch's work follows every earlier branch's
        self.main = self.side = self._ctx = None
        if _OVERLAP[0] and device.type == "cuda":
            self.main = torch.cuda.current_stream(device)
            self.side = ops.side_stream(device)
            self.side.wait_stream(self.main)

    def __enter__(self) -> "SideBranch":
        if self.side is not None:
            self._ctx = torch.cuda.stream(self.side)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)
