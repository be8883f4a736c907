"""Small Triton helpers shared by the kernels of dsv4/ops.

`ue8m0_scale(amax)`: the FP8 activation scale and its inverse. `e4m3_round(v)`: RNE onto the e4m3 grid.
`round_to(v, dtype)`: fp32 v rounded to nearest-even in `dtype`, returned as fp32 (exact in dtype). For
bf16 the rounding is written out on the bits: the Triton interpreter (CPU tests) truncates fp32 -> bf16,
the GPU's cvt.rn rounds; written out, both give the same bits. `cast(v, dtype)`: the same, in dtype.
`rope_pairs(a, b, cos, sin, inverse)`: one RoPE rotation of interleaved pairs in fp32, as rope_ref.
`arrival_counters(device, name, n)`: the zeroed int32 counters of a "last program to arrive finishes" kernel.
"""

import torch
import triton
import triton.language as tl

from dsv4.ops.act_quant import FP8_AMAX_FLOOR, FP8_MAX_INV

_INV448 = tl.constexpr(FP8_MAX_INV)  # fp32(1/448), as act_quant_ref
_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


@triton.jit
def round_to(v, DT: tl.constexpr):
    if DT == tl.bfloat16:
        b = v.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(v == v, r, v)
    else:
        return v.to(DT).to(tl.float32)


@triton.jit
def rope_pairs(a, b, cos, sin, INVERSE: tl.constexpr):
    """One RoPE rotation of the interleaved pairs (a, b) in fp32, as rope_ref (INVERSE: by the conjugate)."""
    if INVERSE:
        sin = -sin
    return a * cos - b * sin, a * sin + b * cos


@triton.jit
def cast(v, DT: tl.constexpr):
    return round_to(v, DT).to(DT)


@triton.jit
def ue8m0_scale(amax):
    """amax (fp32, any shape) -> (s, 1/s): s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))), read off the
    exponent bits (act_quant_ref's power-of-two scale); both exact."""
    y = tl.maximum(amax, _FLOOR) * _INV448
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    s = (e << 23).to(tl.float32, bitcast=True)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def e4m3_round(v):
    """fp32 v, already clamped to +-448 -> v rounded to the nearest e4m3 value, ties to even, as fp32.

    Adding c = 1.5 * 2^(e + 20), e = max(exponent(v), -6), leaves the sum an ulp of 2^(e - 3) (the e4m3
    spacing at v; 2^-9 on the subnormal grid below 2^-6), so fp32's RNE rounds v onto the e4m3 grid and
    subtracting c is exact. Written out rather than a cast: the GPU's cvt.rn gives the same, and the
    interpreter's fp32 -> fp8 cast mis-rounds a carry into the exponent."""
    e = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
    c = (((e + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + c) - c


_COUNTERS: dict[tuple[torch.device, str, str], torch.Tensor] = {}


def arrival_counters(device: torch.device, name: str, n: int) -> torch.Tensor:
    """n int32 zeros: the arrival counters of the kernels called `name` on `device` (each launch leaves them zero),
    one set per stream role (`ops.stream_role`: a launch on the side stream may overlap one on the main stream).
    Made once, outside graph capture; a launch captured before they exist gets its own (a memset node). A name
    keeps its size (ValueError when asked for more)."""
    from dsv4.ops import stream_role

    key = (device, name, stream_role(device))
    c = _COUNTERS.get(key)
    if c is not None and c.numel() < n:  # never replaced: a captured graph may hold the first buffer
        raise ValueError(f"arrival_counters: {name!r} has {c.numel()} counters on {device}, {n} asked")
    if c is None:
        c = torch.zeros(n, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return c  # in the graph's pool: not kept beyond this launch
        _COUNTERS[key] = c
    return c
