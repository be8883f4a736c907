"""Triton fast path of `rotate_fp4` (dsv4/ops/hadamard.py): the Lightning Indexer's Hadamard rotation and FP4
simulation in one launch, bit for bit `rotate_fp4_ref` (the reference runs ~60 small torch kernels).

The jit helpers are shared with the compressor's decode finish (dsv4/ops/compressor_triton.py), which rotates
and FP4-simulates the indexer keys it emits:
- `hadamard_rows(y, R, N)`: [R, N] fp32 -> y @ H_N (Sylvester order, unscaled) by the reference's log2(N)
  butterfly stages, each (a, b) -> (a + b, a - b) over the pairs (j, j + h) of every 2h-chunk, in the same
  order: the same fp32 sums, so the same bits;
- `fp4_sim_rows(x, R, N)`: FP4 e2m1 simulation in 1 x 32 blocks as fp4_act_quant_sim_ref (amax floored at
  6 * 2^-126, power-of-two scale 2^ceil(log2(amax * fp32(1/6))) read off the exponent bits, RNE onto the
  e2m1 grid with the sign bit kept, times the scale), in fp32.
- `store_packed_key(u8_ptr, off, x, N, PAD)`: the same rounding of one key stored as a packed FP4 key (codes and
  scale bytes, dsv4/ops/kv_pack.py), for the compressor's packed indexer keys.
Between the two the rotation is scaled by fp32(N^-0.5) and rounded to the input dtype, as hadamard_ref
returns it. No host sync; graph safe. On CUDA `rotate_fp4` is launched as a programmatic dependent (triton_util.PDL):
the indexer's decode chain (rotation -> scores -> top-k) then starts each kernel during its predecessor's tail.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.fp4_quant import FP4_AMAX_FLOOR, FP4_MAX_INV
from dsv4.ops.triton_util import PDL, cast, gdc_launch_dependents, gdc_wait, pdl_launch, rope_pairs, round_to

_FP4_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)
_FP4_INV6 = tl.constexpr(FP4_MAX_INV)


@triton.jit
def hadamard_rows(y, R: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    for st in tl.static_range(LOG2N):  # h = 2^st
        y4 = tl.permute(tl.reshape(y, [R, N // (2 << st), 2, 1 << st]), (0, 1, 3, 2))  # [R, chunks, h, pair]
        a, b = tl.split(y4)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [R, N])
    return y


@triton.jit
def _fp4_scaled(xb):
    """Blocks xb [R, NB, 32] -> (e [R, NB]: each block scale's E8M0 byte, s = 2^(e - 127) >= amax / 6 with amax
    floored; v [R, NB, 32]: xb / s clamped to [-6, 6], exact)."""
    amax = tl.maximum(tl.max(tl.abs(xb), axis=2), _FP4_FLOOR) * _FP4_INV6
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 1 / s, exact (x * inv == x / s)
    return e, tl.minimum(tl.maximum(xb * inv, -6.0), 6.0)


@triton.jit
def fp4_sim_rows(x, R: tl.constexpr, N: tl.constexpr):
    e, v = _fp4_scaled(tl.reshape(x, [R, N // 32, 32]))
    s = (e << 23).to(tl.float32, bitcast=True)[:, :, None]
    a = tl.abs(v)
    # RNE onto {0, .5, 1, 1.5, 2, 3, 4, 6}: ties go to the even code (up at .75, 1.75, 3.5; down at .25, 1.25,
    # 2.5, 5), as e2m1_encode_ref counts its midpoints
    m = tl.where(a > 0.25, 0.5, 0.0)
    m = tl.where(a >= 0.75, 1.0, m)
    m = tl.where(a > 1.25, 1.5, m)
    m = tl.where(a >= 1.75, 2.0, m)
    m = tl.where(a > 2.5, 3.0, m)
    m = tl.where(a >= 3.5, 4.0, m)
    m = tl.where(a > 5.0, 6.0, m)
    # the sign bit of v put back on m * s (>= 0), so -0.1 -> -0.0 as the reference; not `-m`: Triton negates
    # as 0 - m, which gives +0.0
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return tl.reshape(((m * s).to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True), [R, N])


@triton.jit
def store_packed_key(u8_ptr, off, x, N: tl.constexpr, PAD: tl.constexpr):
    """One key x [N] fp32 -> a packed FP4 key at byte offset `off` (dsv4/ops/kv_pack.py): fp4_sim_rows' rounding as
    e2m1 codes (the count of its thresholds passed, the sign bit as bit 3), two a byte, then the blocks' E8M0 scale
    bytes and zeros to the row's end (PAD: the row's bytes past the codes, a power of two)."""
    e, v = _fp4_scaled(tl.reshape(x, [1, N // 32, 32]))
    e = tl.reshape(e, [N // 32])
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    code = code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)
    lo, hi = tl.split(tl.reshape(code, [N // 2, 2]))
    tl.store(u8_ptr + off + tl.arange(0, N // 2), (lo | (hi << 4)).to(tl.uint8))
    k = tl.arange(0, PAD)
    sv = tl.sum(tl.where(tl.arange(0, N // 32)[None, :] == k[:, None], e[None, :], 0), axis=1)  # byte k: block k's
    tl.store(u8_ptr + off + N // 2 + k, sv.to(tl.uint8))


@triton.jit
def _rope_rows(y, r, cs_ptr, sn_ptr, HS, S, R: tl.constexpr, N: tl.constexpr, RD2: tl.constexpr,
               DT: tl.constexpr):
    """Rows y [R, N] fp32 (row r of token (r // HS) % S): the last 2 * RD2 dims RoPE-rotated as rope_ref (pairs
    (2i, 2i + 1), fp32), the tile rounded to DT."""
    a, b = tl.split(tl.reshape(y, [R, N // 2, 2]))
    # [R, N / 2]: each pair's index in the RoPE dims (< 0: before them)
    k = tl.broadcast_to(tl.arange(0, N // 2)[None, :] - (N // 2 - RD2), [R, N // 2])
    inr = k >= 0
    t = (r // HS) % S
    idx = t * RD2 + tl.where(k >= 0, k, 0)
    c = tl.load(cs_ptr + idx, mask=inr, other=1.0)
    s = tl.load(sn_ptr + idx, mask=inr, other=0.0)
    ra, rb = rope_pairs(a, b, c, s, False)
    ra = tl.where(inr, ra, a)
    rb = tl.where(inr, rb, b)
    return round_to(tl.reshape(tl.join(ra, rb), [R, N]), DT)


@triton.jit
def _rotate_fp4_kernel(x_ptr, o_ptr, cs_ptr, sn_ptr, rows, HS, S, scale, R: tl.constexpr, N: tl.constexpr,
                       LOG2N: tl.constexpr, RD2: tl.constexpr, PDL: tl.constexpr):
    DT: tl.constexpr = o_ptr.dtype.element_ty
    if PDL:  # started early: let the next kernel start, wait for the one that writes x
        gdc_launch_dependents()
        gdc_wait()
    r = tl.program_id(0) * R + tl.arange(0, R)[:, None]
    off = r.to(tl.int64) * N + tl.arange(0, N)[None, :]
    ok = r < rows
    y = tl.load(x_ptr + off, mask=ok, other=0.0).to(tl.float32)
    if RD2 > 0:  # the queries' RoPE first (rope_ref's result, in x's dtype)
        y = _rope_rows(y, r, cs_ptr, sn_ptr, HS, S, R, N, RD2, DT)
    y = round_to(hadamard_rows(y, R, N, LOG2N) * scale, DT)  # hadamard_ref's result, in x's dtype
    tl.store(o_ptr + off, cast(fp4_sim_rows(y, R, N), DT), mask=ok)


def hadamard_scale(n: int) -> float:
    """fp32(n^-0.5): the factor hadamard_ref multiplies by (a Python float, rounded to fp32 by torch)."""
    return torch.tensor(n ** -0.5, dtype=torch.float32).item()


def rotate_fp4(x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., n] (n a power of two, 32..1024; bf16/fp16/fp32) -> fp4_act_quant_sim_ref(hadamard_ref(x), 32); with
    cos, sin [S, rd/2] (x [B, S, (H,) n]) rope_ref(x, cos, sin) first, in the same launch. Compiled without fused
    multiply-adds (the RoPE's products and sums rounded one by one, as rope_ref's): bit for bit the reference."""
    n = x.shape[-1] if x.dim() else 0
    if n < 32 or n > 1024 or n & (n - 1):
        raise ValueError(f"rotate_fp4: last dim must be a power of two in [32, 1024], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"rotate_fp4: dtype {x.dtype} not supported")
    if (cos is None) != (sin is None):
        raise ValueError("rotate_fp4: cos and sin come together")
    S = HS = 1
    if cos is not None:
        if (x.dim() not in (3, 4) or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != x.shape[1]
                or not 1 <= 2 * cos.shape[1] <= n):
            raise ValueError(f"rotate_fp4: cos / sin must be [S, rd/2] with rd <= n for x [B, S, (H,) n], got "
                             f"{tuple(cos.shape)} / {tuple(sin.shape)} for x {tuple(x.shape)}")
        S, HS = x.shape[1], (x.shape[2] if x.dim() == 4 else 1)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
    xc = x.contiguous()
    out = torch.empty_like(xc)
    rows = xc.numel() // n
    if rows == 0:
        return out
    R = max(1, min(16, 4096 // n))
    pdl = PDL and x.is_cuda
    _rotate_fp4_kernel[(triton.cdiv(rows, R),)](xc, out, xc if cos is None else cos, xc if sin is None else sin, rows,
                                                  HS, S, hadamard_scale(n), R=R, N=n, LOG2N=n.bit_length() - 1,
                                                  RD2=0 if cos is None else cos.shape[1], PDL=pdl, num_warps=4,
                                                  **({"enable_fp_fusion": False} if x.is_cuda else {}),
                                                  **pdl_launch(pdl))
    return out
