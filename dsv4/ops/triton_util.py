"""Small Triton helpers shared by the kernels of dsv4/ops.

`ue8m0_scale(amax)`: the FP8 activation scale and its inverse. `e4m3_round(v)`: RNE onto the e4m3 grid.
`round_to(v, dtype)`: fp32 v rounded to nearest-even in `dtype`, returned as fp32 (exact in dtype). For
bf16 the rounding is written out on the bits: the Triton interpreter (CPU tests) truncates fp32 -> bf16,
the GPU's cvt.rn rounds; written out, both give the same bits. `cast(v, dtype)`: the same, in dtype.
`rope_pairs(a, b, cos, sin, inverse)`: one RoPE rotation of interleaved pairs in fp32, as rope_ref.
`arrival_counters(device, name, n)`: the zeroed int32 counters of a "last program to arrive finishes" kernel.
`e4m3_bits(q)`: a value on the e4m3 grid -> its byte; `packed_kv_chunk(...)`: a column chunk of
packed FP8 K = V rows (dsv4/ops/kv_pack.py) as their exact values; `store_packed_kv(...)`: one row stored in that form;
`e2m1_f16(n)` / `packed_key_tile(...)`: FP4 codes as exact values, a tile of packed FP4 indexer keys.
`JitTwins`: a kernel specialized on its integer arguments for fixed shapes (graphs) and not for varying ones.
`PDL`, `gdc_launch_dependents`, `gdc_wait`, `pdl_launch(on)`: programmatic dependent launch from Triton (where the
installed Triton has it; DSV4_PDL=0 turns it off, as for the CUDA kernels): a kernel compiled with PDL=True starts
early, lets its own dependents start, and waits for the kernel before it before reading anything.
"""

import os

import torch
import triton
import triton.language as tl

from dsv4 import ops

try:  # programmatic dependent launch from Triton (griddepcontrol)
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__ and os.environ.get("DSV4_PDL", "1") != "0"
except ImportError:  # an older Triton: plain launches
    PDL = False

    def gdc_launch_dependents():  # never traced: PDL is False
        pass

    def gdc_wait():
        pass


class JitTwins:
    """One Triton kernel compiled two ways. Triton compiles a kernel per combination of its integer arguments' value
    classes (1, divisible by 16, other). Where those follow the position (a prefill chunk's entry count, length and
    strides), a request meeting a new combination compiled a kernel in the middle of its prefill (the indexer's
    top-k and scores: ~1 s each, up to ~5 s of a request's time to first token; sixty-second pass). `fixed` is the
    specialized kernel, for calls inside `dsv4.ops.fixed_shapes()` (the decode graphs, whose shapes are fixed at
    capture); `any` does not specialize on the integer arguments named in `varying`, so one compile per constexpr
    configuration serves every value, and the engine's warm-up (Engine._warm_up) meets each configuration at load."""

    def __init__(self, fn, varying: list[str]):
        self.fixed = triton.jit(fn)
        self.any = triton.jit(do_not_specialize=varying)(fn)

    def __getitem__(self, grid):
        return (self.fixed if ops.shapes_fixed() else self.any)[grid]


def pdl_launch(on: bool) -> dict:
    """The launch options of a kernel compiled with PDL=on."""
    return {"launch_pdl": True} if on else {}


from dsv4.ops.act_quant import FP8_AMAX_FLOOR, FP8_MAX_INV

_INV448 = tl.constexpr(FP8_MAX_INV)  # fp32(1/448), as act_quant_ref
_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


@triton.jit
def rne_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), still fp32; NaN kept. Written with integer ops: the Triton
    interpreter's fp32 -> bf16 cast truncates (the GPU's cvt.rn rounds the same way as this)."""
    b = v.to(tl.int32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(v == v, r, v)


@triton.jit
def round_to(v, DT: tl.constexpr):
    """fp32 -> the nearest value of DT (ties to even), still fp32."""
    if DT == tl.bfloat16:
        return rne_bf16(v)
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


@triton.jit
def store_act_quant(y, q_ptr, s_ptr, row, D, BLOCK: tl.constexpr):
    """The FP8 1x128 quantization of one row y (fp32 [BLOCK], its values already rounded to the activation dtype,
    zeros past D; D % 128 == 0): act_quant_ref's e4m3 codes into q_ptr[row * D + ..] and power-of-two scales into
    s_ptr[row * D / 128 + ..]; blocks past D are not stored. A negative value that rounds to zero is stored as -0, as
    the reference's cast gives it."""
    NB: tl.constexpr = BLOCK // 128
    v = tl.reshape(y, (NB, 128))
    sc, inv = ue8m0_scale(tl.max(tl.abs(v), axis=1))
    u = tl.clamp(v * inv[:, None], -448.0, 448.0)  # v * (1/s) = v / s exactly (a power of two)
    q = e4m3_round(u)
    q = tl.where(q == 0.0, u * 0.0, q)
    b = tl.arange(0, NB)
    bm = b < D // 128
    j = b[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(q_ptr + row * D + j, q.to(q_ptr.dtype.element_ty), mask=bm[:, None])
    tl.store(s_ptr + row * (D // 128) + b, sc, mask=bm)


@triton.jit
def e4m3_bits(q):
    """q (fp32 on the e4m3 grid, |q| <= 448) -> its e4m3 byte as int32 (sign bit 0x80, so -0.0 -> 0x80)."""
    b = q.to(tl.int32, bitcast=True)
    e = (b >> 23) & 0xFF
    nrm = ((e - 120) << 3) | ((b >> 20) & 7)  # exponent bias 127 -> 7, the top 3 mantissa bits
    sub = (tl.abs(q) * 512.0).to(tl.int32)  # below 2^-6: m * 2^-9
    return ((b >> 24) & 0x80) | tl.where(e >= 121, nrm, sub)


@triton.jit
def packed_kv_chunk(u8_ptr, b16_ptr, rows, ok, R: tl.constexpr, C0: tl.constexpr, DC: tl.constexpr,
                    NOPE: tl.constexpr):
    """Columns C0 .. C0 + DC of packed K = V rows (byte offsets `rows` [R] from u8_ptr; b16_ptr is the same memory as
    bf16) -> their values [R, DC] in fp32, exact (0 where not ok). The chunk is cut into pieces of SUB = min(DC, 64)
    columns (C0 a multiple of SUB; NOPE of 64): a piece is either e4m3 codes, converted by the hardware's cvt and
    times its block's scale byte (loaded once a piece), or bf16 RoPE dims, or (past the row's NOPE + 64 dims, where
    a power-of-two tile overhangs it) zeros."""
    SUB: tl.constexpr = DC if DC < 64 else 64
    NB: tl.constexpr = DC // SUB
    piece = C0 // SUB + tl.arange(0, NB)
    isn = piece * SUB < NOPE  # [NB]: a piece of codes
    col = piece[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [NB, SUB]
    m_n = ok[:, None, None] & isn[None, :, None]
    code = tl.load(u8_ptr + rows[:, None, None] + col[None, :, :], mask=m_n, other=0)
    sb = tl.load(u8_ptr + rows[:, None] + (NOPE + 128 + piece * SUB // 64)[None, :], mask=ok[:, None] & isn[None, :],
                 other=0).to(tl.int32)
    nope = code.to(tl.float8e4nv, bitcast=True).to(tl.float32) * (sb << 23).to(tl.float32, bitcast=True)[:, :, None]
    inr = ~isn & (piece * SUB < NOPE + 64)  # RoPE dims (a chunk may reach past the row's D = NOPE + 64: zeros)
    rope = tl.load(b16_ptr + (rows // 2)[:, None, None] + (NOPE // 2 + col - NOPE)[None, :, :],
                   mask=ok[:, None, None] & inr[None, :, None], other=0.0)
    return tl.reshape(tl.where(isn[None, :, None], nope, rope.to(tl.float32)), (R, DC))


@triton.jit
def e2m1_f16(n):
    """e2m1 codes n (int32 0..15, bit 3 the sign) -> their values times 2^-14 in fp32, exact: the code's bits placed
    as fp16 bits (2 exponent bits, 1 mantissa bit, e2m1's subnormal 0.5 landing on fp16's), widened."""
    bits = ((n & 7) << 9) | ((n & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def packed_key_tile(u8_ptr, rows, ok, R: tl.constexpr, D: tl.constexpr):
    """Packed FP4 keys of D dims (dsv4/ops/kv_pack.py) at byte offsets rows [R] from u8_ptr -> their values [R, D]
    fp32, exact (0 where not ok): the codes as [R, D / 32 blocks, 16 bytes], each block's scale byte loaded once."""
    NB: tl.constexpr = D // 32
    blk = tl.arange(0, NB)
    col = blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    b = tl.load(u8_ptr + rows[:, None, None] + col[None, :, :], mask=ok[:, None, None], other=0).to(tl.int32)
    sb = tl.load(u8_ptr + rows[:, None] + (D // 2 + blk)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    s = (sb << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2^(byte - 127) (byte 0: a zero row, 0)
    # times 2^14 (exact, the fp16 embedding's factor), then the scale: both exact for every scale byte 1..254
    return tl.reshape(tl.join(e2m1_f16(b & 15) * 16384.0 * s, e2m1_f16(b >> 4) * 16384.0 * s), (R, D))


@triton.jit
def store_packed_kv(u8_ptr, b16_ptr, off, y, D: tl.constexpr, NOPE: tl.constexpr, ROW: tl.constexpr):
    """One K = V row y [ROW] (fp32 holding bf16 values, D <= ROW of them) -> packed at byte offset `off`: the first
    NOPE dims FP8-quantized in blocks of 64 (act_quant's scale; the same values as that simulation), then the bf16
    RoPE dims, the scale bytes and the row's zero padding (D - 64 a multiple of 64)."""
    NB: tl.constexpr = ROW // 64
    v = tl.reshape(y, (NB, 64))
    s, _ = ue8m0_scale(tl.max(tl.abs(v), axis=1))
    q = e4m3_round(tl.minimum(tl.maximum(v / s[:, None], -448.0), 448.0))
    blk = tl.arange(0, NB)
    col = blk[:, None] * 64 + tl.arange(0, 64)[None, :]
    is_n = (blk < NOPE // 64)[:, None]
    tl.store(u8_ptr + off + col, e4m3_bits(q).to(tl.uint8), mask=is_n)
    is_r = (col >= NOPE) & (col < D)
    tl.store(b16_ptr + off // 2 + NOPE // 2 + (col - NOPE), v.to(tl.bfloat16), mask=is_r)
    PAD: tl.constexpr = ((NOPE // 64 + 15) // 16) * 16  # the scale bytes and the padding (16 up to 1024 codes)
    k = tl.arange(0, PAD)
    sbyte = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    sv = tl.sum(tl.where(blk[None, :] == k[:, None], sbyte[None, :], 0), axis=1)  # byte k: block k's scale
    sv = tl.where(k < NOPE // 64, sv, 0)
    tl.store(u8_ptr + off + NOPE + 128 + k, sv.to(tl.uint8))


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
