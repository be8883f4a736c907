"""Triton fast path of `linear` and `wo_a` (same signatures and numerics as `linear_ref` / `wo_a_ref`).

Owns the kernels over the `PreparedLinear` layouts of dsv4/ops/linear.py (dense bf16/f16/f32, FP8 128x128
blocks with fp32 scales, MXFP4 1x32 E8M0 bytes, NVFP4 1x16 e4m3 + fp32 global) and the shape -> config
choice (fixed functions of the shape: deterministic, nothing benchmarked at first call). Touches nothing else.
- `_gemv_kernel` (decode of 1-4 tokens on short weights, `_use_gemv`): one CTA per BN weight rows over the
  whole K (no split-K: each output is written once, deterministically), fp32 FMAs on a [BM, BN, BK/V, V]
  tile (V contiguous elements = one 16-byte load per thread); the activation is FP8-quantized in-kernel.
- `_mm_kernel` (everything else): tl.dot, one 128-K block per step, swap-AB for M <= 16 (weight rows fill the
  MMA M dimension). Decode tiles quantize x in-kernel; prefill shapes first run `_act_quant_kernel` once
  (e4m3 [M, K] + fp32 [M, K/128] scratch, allocated beside the output: stream-ordered, CUDA-graph safe),
  since in-kernel quantization would be redone for every weight tile.
Numerics: with act_quant and a quantized weight, x is quantized exactly as act_quant_ref (amax floor 1e-4,
s = 2^ceil(log2(amax*fp32(1/448))) from the exponent bits, q = e4m3_RNE(clamp(x/s, +-448))). Products are
exact in fp32 (e4m3, e2m1 and bf16 values are exact in the 16-bit dot types; fp32 x against a bf16-exact
weight is split into three bf16 parts; fp32/f16 weights use fp32 FMA dots), power-of-two scales are applied
per 128-K block, accumulation is fp32 and the output is rounded once: linear_ref up to summation order.
Exception: FP8 weights with bf16 output on sm_90+ use the FP8 tensor-core dot, whose accumulation inside each
128-K block has the Hopper FP8 MMA's reduced precision (DeepGEMM/vLLM pattern); fp32 outputs never do.
Wrappers validate (messages carry the values), allocate and launch; no host sync.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4.ops.triton_util import arrival_counters, rne_bf16, ue8m0_scale

from dsv4.ops.linear import ACT_BLOCK, PreparedLinear, check_codes

FP8_DOT = True  # fp8 x fp8 tensor-core dots for FP8 weights with bf16 output (sm_90+)

_FMTS = {"dense": 0, "fp8": 1, "mxfp4": 2, "nvfp4": 3}  # the kernels' FMT constexpr
_GROUP = {"mxfp4": 32, "nvfp4": 16}  # fp4 scale group along K
_X_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float32)

# _mm_kernel dot modes
_DOT_BF16, _DOT_FP8, _DOT_SPLIT3, _DOT_IEEE = 0, 1, 2, 3


# ---------------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _e4m3_grid(x, inv):
    """x * (1/s) clamped to +-448 and rounded to the nearest e4m3 value, ties to even, as fp32 (exact).

    Adding c = 1.5 * 2^(e + 20), e = max(exponent(v), -6), leaves the sum an ulp of 2^(e - 3), the e4m3
    spacing at v (normals; 2^-9 below 2^-6, the subnormal grid), so fp32's RNE rounds v onto the e4m3 grid
    and subtracting c is exact. Written out rather than a cast: same result as cvt.rn.satfinite on GPU, and
    the Triton interpreter's fp32 -> fp8 cast mis-rounds a carry into the exponent (124.6 -> 64)."""
    v = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    e = tl.maximum((v.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
    c = (((e + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + c) - c


@triton.jit
def _e4m3(x, inv, HW_CVT: tl.constexpr):
    """As _e4m3_grid, as float8e4nv codes; HW_CVT: by the GPU's cvt.rn.satfinite (same values)."""
    if HW_CVT:
        return tl.minimum(tl.maximum(x * inv, -448.0), 448.0).to(tl.float8e4nv)
    else:
        return _e4m3_grid(x, inv).to(tl.float8e4nv)


@triton.jit
def _e2m1_pair(b):
    """Packed bytes -> (low-nibble value, high-nibble value) in fp32, each = e2m1 * 2^-14 (exact).

    The 3 magnitude bits land in the low exponent bits / top mantissa bit of an fp16 (bias 15), which
    makes code 1 an fp16 subnormal (2^-15) and every other code e2m1 * 2^-14; fp16 -> fp32 is exact."""
    b16 = b.to(tl.int16)
    lo = ((b16 & 0x7) << 9) | ((b16 & 0x8) << 12)
    hi = ((b16 & 0x70) << 5) | ((b16 & 0x80) << 8)
    return (lo.to(tl.float16, bitcast=True).to(tl.float32),
            hi.to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _fp4_scale(sc, FMT: tl.constexpr):
    """Loaded fp4 block scales -> fp32: MXFP4 E8M0 bytes b -> 2^(b - 127) (b = 0: 2^-127, 255: NaN), exact;
    NVFP4 e4m3 -> fp32, exact."""
    if FMT == 2:
        b = sc.to(tl.int32)
        bits = tl.where(b == 0, 0x00400000, tl.where(b == 255, 0x7FC00000, b << 23))
        return bits.to(tl.float32, bitcast=True)
    else:
        return sc.to(tl.float32)


@triton.jit
def _out(v, o_ptr):
    """fp32 -> the output dtype, rounded once to nearest-even (bf16: triton_util.rne_bf16, then the cast is exact)."""
    if o_ptr.dtype.element_ty == tl.bfloat16:
        v = rne_bf16(v)
    return v.to(o_ptr.dtype.element_ty)


# ---------------------------------------------------------------------------------------------------------
# decode GEMV: CUDA-core FMAs, 1-4 tokens


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, g_ptr, o_ptr, M, N, K,
                 sx_g, sx_m, sw_g, sw_n, ss_g, ss_n, so_g, so_m,
                 FMT: tl.constexpr, ACT_QUANT: tl.constexpr, GROUP: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, V: tl.constexpr):
    pid_n = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    x_ptr += g * sx_g
    w_ptr += g * sw_g
    s_ptr += g * ss_g
    o_ptr += g * so_g
    KV: tl.constexpr = BK // V
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m4 = offs_m[:, None, None, None]
    n4 = offs_n[None, :, None, None]
    c4 = tl.arange(0, KV)[None, None, :, None]
    n_ok4 = n4 < N
    w_row4 = w_ptr + n4.to(tl.int64) * sw_n
    nb = (pid_n * BN) // 128  # fp8 scale row block: BN divides 128, so one per CTA
    FULL_ACC: tl.constexpr = BM == 1 and FMT < 2
    if FULL_ACC:
        acc = tl.zeros([BM, BN, KV, V], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN, KV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        # ---- activation chunk -> fp32 [BM, 1, KV, V], quantized and (fp8) times the weight block scale
        if ACT_QUANT:
            R: tl.constexpr = BK // 128
            m3 = offs_m[:, None, None]
            r3 = tl.arange(0, R)[None, :, None]
            k3 = k0 + r3 * 128 + tl.arange(0, 128)[None, None, :]
            xb = tl.load(x_ptr + m3 * sx_m + k3, mask=(m3 < M) & (k3 < K), other=0.0).to(tl.float32)
            s, inv = ue8m0_scale(tl.max(tl.abs(xb), axis=2))
            xq = _e4m3_grid(xb, inv[:, :, None]) * s[:, :, None]
            if FMT == 1:
                kb = k0 // 128 + tl.arange(0, R)
                sw = tl.load(s_ptr + nb * ss_n + kb, mask=k0 + tl.arange(0, R) * 128 < K, other=0.0)
                xq = xq * sw[None, :, None]
            xv = tl.reshape(xq, [BM, 1, KV, V])
        else:
            k4 = k0 + c4 * V + tl.arange(0, V)[None, None, None, :]
            xv = tl.load(x_ptr + m4 * sx_m + k4, mask=(m4 < M) & (k4 < K), other=0.0).to(tl.float32)
            if FMT == 1:
                kb4 = (k0 + c4 * V) // 128
                sw = tl.load(s_ptr + nb * ss_n + kb4, mask=k0 + c4 * V < K, other=0.0)
                xv = xv * sw
        # ---- weight chunk [1, BN, KV, V] and the in-thread sums over V
        if FMT >= 2:
            VB: tl.constexpr = V // 2
            kb4 = k0 // 2 + c4 * VB + tl.arange(0, VB)[None, None, None, :]
            b = tl.load(w_row4 + kb4, mask=n_ok4 & (kb4 < K // 2), other=0)
            lo, hi = _e2m1_pair(b)
            wv = tl.reshape(tl.join(lo, hi), [1, BN, KV, V])
            part = tl.sum(wv * xv, axis=3)  # [BM, BN, KV], one scale group per (n, c): V == GROUP
            c3 = tl.arange(0, KV)[None, None, :]
            n3 = offs_n[None, :, None]
            sc = tl.load(s_ptr + n3.to(tl.int64) * ss_n + k0 // GROUP + c3,
                         mask=(n3 < N) & (k0 + c3 * V < K), other=0.0)
            # 2^14 undoes the fp16 placement (exact); the MXFP4 power-of-two scale is exact too, the NVFP4 e4m3
            # scale rounds once (as the reference's own dequantization does)
            acc += (part * 16384.0) * _fp4_scale(sc, FMT)
        else:
            k4 = k0 + c4 * V + tl.arange(0, V)[None, None, None, :]
            wv = tl.load(w_row4 + k4, mask=n_ok4 & (k4 < K), other=0.0).to(tl.float32)
            if FULL_ACC:
                acc += wv * xv  # one FFMA per weight element; reduced after the loop
            else:
                acc += tl.sum(wv * xv, axis=3)
    if FULL_ACC:
        res = tl.sum(tl.sum(acc, axis=3), axis=2)
    else:
        res = tl.sum(acc, axis=2)  # [BM, BN]
    if FMT == 3:
        res = res * tl.load(g_ptr)
    om = offs_m[:, None]
    on = offs_n[None, :]
    tl.store(o_ptr + om * so_m + on, _out(res, o_ptr), mask=(om < M) & (on < N))


# ---------------------------------------------------------------------------------------------------------
# activation quantization for the tensor-core kernel: once per call, not once per weight tile


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, sx_m, R: tl.constexpr, BMQ: tl.constexpr,
                      HW_CVT: tl.constexpr):
    """x [M, K] (row stride sx_m) -> q [M, K] e4m3, s [M, K/128] fp32: act_quant_ref's 1x128 blocks."""
    m3 = tl.program_id(0) * BMQ + tl.arange(0, BMQ)[:, None, None]
    r3 = tl.program_id(1) * R + tl.arange(0, R)[None, :, None]
    k3 = r3 * 128 + tl.arange(0, 128)[None, None, :]
    ok = (m3 < M) & (k3 < K)
    xb = tl.load(x_ptr + m3.to(tl.int64) * sx_m + k3, mask=ok, other=0.0).to(tl.float32)
    s, inv = ue8m0_scale(tl.max(tl.abs(xb), axis=2))
    tl.store(q_ptr + m3.to(tl.int64) * K + k3, _e4m3(xb, inv[:, :, None], HW_CVT), mask=ok)
    m2 = tl.program_id(0) * BMQ + tl.arange(0, BMQ)[:, None]
    r2 = tl.program_id(1) * R + tl.arange(0, R)[None, :]
    tl.store(s_ptr + m2.to(tl.int64) * (K // 128) + r2, s, mask=(m2 < M) & (r2 * 128 < K))


# ---------------------------------------------------------------------------------------------------------
# tensor-core kernel: one 128-K block per step


@triton.jit
def _mm_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, g_ptr, o_ptr, p_ptr, c_ptr, M, N, K, KS, SPLIT,
               sx_g, sx_m, sw_g, sw_n, ss_g, ss_n, so_g, so_m,
               FMT: tl.constexpr, ACT_QUANT: tl.constexpr, XQ: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr,
               SWAP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, NUM_STAGES: tl.constexpr,
               OPT: tl.constexpr, SPLITK: tl.constexpr):
    BK: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = (pid_z // SPLIT).to(tl.int64)
    ks = pid_z % SPLIT  # this program's K range: [ks * KS, (ks + 1) * KS), KS a multiple of BK
    x_ptr += g * sx_g
    w_ptr += g * sw_g
    s_ptr += g * ss_g
    o_ptr += g * so_g
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m2 = offs_m[:, None]
    n2 = offs_n[:, None]
    x_rows = x_ptr + m2.to(tl.int64) * sx_m
    w_rows = w_ptr + n2.to(tl.int64) * sw_n
    nb = (pid_n * BN) // 128
    SCALED: tl.constexpr = ACT_QUANT or FMT == 1
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(ks * KS, tl.minimum(ks * KS + KS, K), BK, num_stages=NUM_STAGES):
        kk = k0 + offs_k[None, :]
        x = tl.load(x_rows + kk, mask=(m2 < M) & (kk < K), other=0.0)
        # ---- activation operand(s); XQ: x is already e4m3 (_act_quant_kernel) with scales s_a [M, K/128]
        if ACT_QUANT and XQ:
            sa = tl.load(xs_ptr + offs_m.to(tl.int64) * (K // 128) + k0 // 128, mask=offs_m < M, other=0.0)
            if DOT == 1:
                xa = x
            else:
                xa = x.to(OPT)
        elif ACT_QUANT:
            xf = x.to(tl.float32)
            sa, inv = ue8m0_scale(tl.max(tl.abs(xf), axis=1))  # [BM]
            q = _e4m3_grid(xf, inv[:, None])
            if DOT == 1:
                xa = q.to(tl.float8e4nv)  # exact: q is on the e4m3 grid
            else:
                xa = q.to(OPT)
        elif DOT == 2:
            xf = x.to(tl.float32)  # = xa + xb + xc exactly, each part bf16
            xa = xf.to(tl.bfloat16).to(tl.float32)
            r1 = xf - xa
            xb = r1.to(tl.bfloat16).to(tl.float32)
            xc = (r1 - xb).to(tl.bfloat16).to(OPT)
            xa = xa.to(OPT)
            xb = xb.to(OPT)
        elif DOT == 3:
            xa = x.to(tl.float32)
        else:
            xa = x.to(OPT)
        # ---- weight operand [BN, BK], exact in its dot type
        if FMT >= 2:
            NG: tl.constexpr = BK // GROUP
            j3 = tl.arange(0, NG)[None, :, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, None, :]
            n3 = offs_n[:, None, None]
            b = tl.load(w_ptr + n3.to(tl.int64) * sw_n + k0 // 2 + j3, mask=(n3 < N) & (k0 // 2 + j3 < K // 2),
                        other=0)
            lo, hi = _e2m1_pair(b)
            sc = tl.load(s_ptr + n2.to(tl.int64) * ss_n + k0 // GROUP + tl.arange(0, NG)[None, :],
                         mask=(n2 < N) & (k0 + tl.arange(0, NG)[None, :] * GROUP < K), other=0.0)
            wv = tl.reshape(tl.join(lo, hi), [BN, NG, GROUP]) * 16384.0 * _fp4_scale(sc, FMT)[:, :, None]
            wa = tl.reshape(wv, [BN, BK]).to(OPT)
        else:
            wl = tl.load(w_rows + kk, mask=(n2 < N) & (kk < K), other=0.0)
            if DOT == 1:
                wa = wl
            elif DOT == 3:
                wa = wl.to(tl.float32)
            else:
                wa = wl.to(OPT)
        # ---- the block product
        if SWAP:
            if DOT == 3:
                p = tl.dot(wa, tl.trans(xa), input_precision="ieee")
            else:
                p = tl.dot(wa, tl.trans(xa))
            if DOT == 2:
                p = tl.dot(wa, tl.trans(xb), p)
                p = tl.dot(wa, tl.trans(xc), p)
        else:
            if DOT == 3:
                p = tl.dot(xa, tl.trans(wa), input_precision="ieee")
            else:
                p = tl.dot(xa, tl.trans(wa))
            if DOT == 2:
                p = tl.dot(xb, tl.trans(wa), p)
                p = tl.dot(xc, tl.trans(wa), p)
        if SCALED:
            if FMT == 1:
                f = tl.load(s_ptr + nb * ss_n + k0 // 128)
                if ACT_QUANT:
                    f = sa * f
            else:
                f = sa
            if ACT_QUANT:
                if SWAP:
                    acc += p * f[None, :]
                else:
                    acc += p * f[:, None]
            else:
                acc += p * f
        else:
            acc += p
    if SWAP:
        om = offs_m[None, :]
        on = offs_n[:, None]
    else:
        om = offs_m[:, None]
        on = offs_n[None, :]
    ok = (om < M) & (on < N)
    if SPLITK:  # SPLIT > 1
        # split-K: every program stores its fp32 partial [G, SPLIT, M, N]; the last of a tile's SPLIT programs
        # (a per-tile arrival counter) sums them in split order, so the bits do not depend on which one is
        # last, and resets the counter for the next launch (graph replays included)
        part = p_ptr + ((g * SPLIT) * M + om.to(tl.int64)) * N + on
        tl.store(part + ks * M * N, acc, mask=ok)
        tl.debug_barrier()  # every thread's partial is stored before the (release) arrival
        tile = (g * tl.num_programs(1) + pid_m) * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(c_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            acc = tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
            for t in range(1, SPLIT):
                acc += tl.load(part + t * M * N, mask=ok, other=0.0, cache_modifier=".cg")
            if FMT == 3:
                acc = acc * tl.load(g_ptr)
            tl.store(o_ptr + om.to(tl.int64) * so_m + on, _out(acc, o_ptr), mask=ok)
            tl.atomic_xchg(c_ptr + tile, 0)
    else:
        if FMT == 3:
            acc = acc * tl.load(g_ptr)
        tl.store(o_ptr + om.to(tl.int64) * so_m + on, _out(acc, o_ptr), mask=ok)


# ---------------------------------------------------------------------------------------------------------
# configs: fixed functions of the shape (deterministic, no benchmarking at first call)

_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the Triton interpreter: few, large programs run fastest
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _pow2_le(v: int) -> int:
    return 1 << (max(int(v), 1).bit_length() - 1)


_ELEM_BYTES = {"fp8": 1.0, "mxfp4": 0.5, "nvfp4": 0.5}


@functools.lru_cache(maxsize=None)
def _gemv_config(fmt: str, wbytes: float, M: int, N: int, K: int, G: int, sms: int, act_quant: bool):
    """(BM, BN, BK, V, num_warps) for the FMA GEMV. A step reads a [BN, BK] weight tile of <= 16 KB (8 x
    16-byte loads per thread with 4 warps); BK spans >= 512 contiguous bytes of a row (one warp of 16-byte
    loads); BN (a power of two <= 128, so an fp8 CTA sits in one 128-row scale block) shrinks until there is
    a CTA per SM; the fp32 accumulator stays <= 64 registers a thread."""
    BM = triton.next_power_of_2(M)
    V = 32 if fmt == "mxfp4" else 16 if fmt in ("fp8", "nvfp4") else int(16 // wbytes)
    full_acc = BM == 1 and fmt in ("dense", "fp8")  # accumulates [BN, BK] without per-step sums
    kpow = triton.next_power_of_2(K)
    kmin = max(V, 128 if act_quant else V)
    BK = max(min(kpow, int(512 / wbytes)), kmin)
    BN = min(128, _pow2_le(max(int(16384 / (BK * wbytes)), 1)))
    while BN > 1 and G * triton.cdiv(N, BN) < sms:
        BN //= 2
    BK = max(BK, min(kpow, _pow2_le(max(int(16384 / (BN * wbytes)), 1))))

    def acc_regs(bn, bk):
        return BM * bn * bk // (1 if full_acc else V) // 128

    while acc_regs(BN, BK) > 64 and BK > kmin:
        BK //= 2
    while acc_regs(BN, BK) > 64 and BN > 1:
        BN //= 2
    return BM, BN, BK, V, 4


MAX_SPLIT_TILES = 4096  # output tiles a split-K launch may have (the size of the per-device arrival counters)


@functools.lru_cache(maxsize=None)
def _mm_config(fmt: str, M: int, N: int, K: int, G: int, sms: int, dot: int):
    """(SWAP, BM, BN, num_warps, num_stages, SPLIT) for the tensor-core kernel. M <= 16: swap-AB, weight rows
    fill the MMA M dimension (tokens padded to >= 4), BN shrinks (>= 16) until there is a CTA per SM.
    Larger M, from the H200 sweep at M = 128 (tools/bench_ops.py --sweep-mm, docs/performance.md): 128 x 128
    tiles, 8 warps, where they alone give every SM a tile, else 64 x 64 tiles with 4 warps; 4 stages for the
    FP8 dot, 3 otherwise (shared memory). Split-K (SPLIT programs share a tile's K): 2 for quantized weights
    with >= 32 blocks of K on fewer than 2 tiles per SM (wo_b, wq_a || wkv, shared w1); dense weights (more
    MMA work per weight byte: split bf16 dots) up to 8 while each split keeps >= 4 blocks of K and there are
    <= 4 programs per SM; bf16 weights on bf16 x on 64 x 64 tiles (one dot per tile; swept on the compressor
    projections at M = 32 / 128) while there are <= 1 program per SM, with 4 stages."""
    if M <= 16:
        BM = max(4, triton.next_power_of_2(M))  # 1-2 rows ran slower than 4 (padded rows are masked)
        BN = 128
        while BN > 16 and G * triton.cdiv(N, BN) < sms:
            BN //= 2
        return True, BM, BN, 4, 4, 1
    if M > 64 and dot not in (_DOT_SPLIT3, _DOT_IEEE) and G * triton.cdiv(N, 128) * triton.cdiv(M, 128) >= sms:
        BM, BN, warps = 128, 128, 8
    else:
        BM, BN, warps = 64, 64, 4
    stages = 4 if dot == _DOT_FP8 or (fmt == "dense" and dot == _DOT_BF16 and BM == 64) else 3
    tiles = G * triton.cdiv(N, BN) * triton.cdiv(M, BM)
    kb = triton.cdiv(K, 128)
    split = 1
    if tiles <= MAX_SPLIT_TILES:
        if fmt == "dense" and dot == _DOT_BF16 and BM == 64:  # one bf16 dot per 64 x 64 tile: <= 1 program / SM
            while split < 8 and kb >= 4 * 2 * split and tiles * 2 * split <= sms:
                split *= 2
        elif fmt == "dense":
            while split < 8 and kb >= 4 * 2 * split and tiles * 2 * split <= 4 * sms:
                split *= 2
        elif tiles < 2 * sms and kb >= 32:
            split = 2
    return False, BM, BN, warps, stages, split


def _split_counters(device: torch.device) -> torch.Tensor:
    """MAX_SPLIT_TILES int32 zeros: the split-K arrival counters of `device` (each launch leaves them zero)."""
    return arrival_counters(device, "linear split-K", MAX_SPLIT_TILES)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _dot_mode(x: torch.Tensor, w: PreparedLinear, act_quant: bool, out_dtype: torch.dtype) -> int:
    if w.fmt == "dense" and w.weight.dtype != torch.bfloat16:
        return _DOT_IEEE
    if act_quant and w.quantized:
        if (w.fmt == "fp8" and out_dtype == torch.bfloat16 and x.is_cuda and FP8_DOT
                and _capability(x.device.index if x.device.index is not None else torch.cuda.current_device())[0] >= 9):
            return _DOT_FP8
        return _DOT_BF16
    return _DOT_SPLIT3 if x.dtype == torch.float32 else _DOT_BF16


# ---------------------------------------------------------------------------------------------------------
# launch


def _use_gemv(fmt: str, M: int, N: int, G: int) -> bool:
    """Decode dispatch, from H200 timings (tests/ops/test_linear.py bench): the FMA GEMV wins for one token
    on weights of < 8192 rows (x groups) and for 2-4 tokens on dense/FP8 weights of <= 2048 rows; elsewhere the
    tensor-core kernel streams faster (and the FP4 decode of 2+ tokens spills in the GEMV)."""
    rows = G * N
    if M == 1:
        return rows < 8192
    return M <= 4 and fmt in ("dense", "fp8") and rows <= 2048


def _launch(x2, w: PreparedLinear, out, M, N, K, G, xs, ws, ss, os_, act_quant: bool, out_dtype, force=None,
            mm_cfg=None, pre=None):
    """x2 / out: base tensors; xs = (group stride, row stride), ws = (group stride, row stride) of the weight,
    ss = same for the scale, os_ = (group stride, row stride) of the output. `force` (benchmarks only):
    "gemv" | "mm" | "mm16" (tensor-core kernel with 16-bit operands, no FP8 dot); `mm_cfg` (benchmarks and
    tests) overrides _mm_config's tile choice. `pre`: x2's quantization already made (e4m3 [M, K], fp32
    [M, K / 128], contiguous), read where the kernel would launch _act_quant_kernel first."""
    fmt = w.fmt
    aq = bool(act_quant and w.quantized)
    s = w.scale if w.scale is not None else w.weight
    gsc = w.global_scale if w.global_scale is not None else w.weight
    sms = _num_sms(x2.device)
    group = _GROUP.get(fmt, 0)
    wargs = (w.weight, s, gsc, out, M, N, K, xs[0], xs[1], ws[0], ws[1], ss[0], ss[1], os_[0], os_[1])
    if force == "gemv" or (force is None and _use_gemv(fmt, M, N, G)):
        wbytes = _ELEM_BYTES.get(fmt, w.weight.element_size())
        BM, BN, BK, V, warps = _gemv_config(fmt, wbytes, M, N, K, G, sms, aq)
        _gemv_kernel[(triton.cdiv(N, BN), G)](x2, *wargs, FMT=_FMTS[fmt], ACT_QUANT=aq, GROUP=group, BM=BM, BN=BN,
                                               BK=BK, V=V, num_warps=warps)
        return
    dot = _dot_mode(x2, w, aq, out_dtype)
    if force == "mm16" and dot == _DOT_FP8:
        dot = _DOT_BF16
    swap, BM, BN, warps, stages, split = mm_cfg or _mm_config(fmt, M, N, K, G, sms, dot)
    ks = K
    if split > 1:
        ks = triton.cdiv(triton.cdiv(K, split), 128) * 128
        split = triton.cdiv(K, ks)  # every split has work
    tiles = triton.cdiv(N, BN) * triton.cdiv(M, BM) * G
    if split > 1 and tiles > MAX_SPLIT_TILES:
        raise ValueError(f"linear: split-K over {tiles} tiles (at most {MAX_SPLIT_TILES})")
    # x is quantized in the kernel for decode tiles (<= 4 tokens, or 128-row weight tiles: measured faster,
    # one launch); otherwise once up front (per weight tile it would be redone N / BN times)
    xq_first = aq and not (swap and (M <= 4 or BN == 128))
    xq = xsc = x2
    if xq_first and pre is not None:
        xq, xsc = pre
        wargs = wargs[:7] + (0, K) + wargs[9:]
    elif xq_first:  # scratch: e4m3 q [M, K] and s [M, K/128]
        xq = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
        xsc = torch.empty((M, K // ACT_BLOCK), dtype=torch.float32, device=x2.device)
        BMQ, R = min(16, triton.next_power_of_2(M)), min(4, triton.next_power_of_2(K // ACT_BLOCK))
        _act_quant_kernel[(triton.cdiv(M, BMQ), triton.cdiv(K // ACT_BLOCK, R))](
            x2, xq, xsc, M, K, xs[1], R=R, BMQ=BMQ, HW_CVT=x2.is_cuda, num_warps=4)
        wargs = wargs[:7] + (0, K) + wargs[9:]
    part = cnt = out
    if split > 1:  # fp32 partials [G, split, M, N]: stream-ordered scratch, CUDA-graph safe
        part = torch.empty((G, split, M, N), dtype=torch.float32, device=x2.device)
        cnt = _split_counters(x2.device)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM), G * split)
    # OPT: the dtype of the exact 16-bit operands: fp16 for e4m3 x e4m3 (e4m3 -> fp16 is one cvt per two
    # values; -> bf16 goes through fp16 and a quarter-rate F2F), bf16 otherwise. The Triton interpreter
    # multiplies bf16 dot operands as raw 16-bit integers, so there they travel as fp32 (same values).
    if not x2.is_cuda:
        opt = tl.float32
    elif dot == _DOT_BF16 and fmt == "fp8" and aq:
        opt = tl.float16
    else:
        opt = tl.bfloat16
    _mm_kernel[grid](xq, xsc, *wargs[:4], part, cnt, *wargs[4:7], ks, split, *wargs[7:], FMT=_FMTS[fmt],
                     ACT_QUANT=aq, XQ=xq_first, GROUP=group, DOT=dot, SWAP=swap, BM=BM, BN=BN, NUM_STAGES=stages,
                     OPT=opt, SPLITK=split > 1, num_warps=warps)


# ---------------------------------------------------------------------------------------------------------
# validation


def _check_weight(w: PreparedLinear, device: torch.device) -> None:
    if not isinstance(w, PreparedLinear):
        raise TypeError(f"linear: w must be a PreparedLinear, got {type(w).__name__}")
    n, k, t = w.n, w.k, w.weight
    want = {
        "dense": ((n, k), (torch.bfloat16, torch.float16, torch.float32)),
        "fp8": ((n, k), (torch.float8_e4m3fn,)),
        "mxfp4": ((n, k // 2), (torch.uint8,)),
        "nvfp4": ((n, k // 2), (torch.uint8,)),
    }
    if w.fmt not in want:
        raise ValueError(f"linear: unknown weight format {w.fmt!r}")
    shape, dtypes = want[w.fmt]
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        raise ValueError(f"linear: {w.fmt} weight {t.dtype}{tuple(t.shape)}, expected {dtypes} {shape}")
    if w.fmt in _GROUP and k % _GROUP[w.fmt]:
        raise ValueError(f"linear: {w.fmt} K={k} must be a multiple of {_GROUP[w.fmt]}")
    sshape = {"fp8": (triton.cdiv(n, 128), triton.cdiv(k, 128)), "mxfp4": (n, k // 32), "nvfp4": (n, k // 16)}
    for name, tt in (("weight", t), ("scale", w.scale), ("global_scale", w.global_scale)):
        if tt is None:
            continue
        if tt.device != device:
            raise ValueError(f"linear: {name} on {tt.device}, x on {device}")
        if not tt.is_contiguous():
            raise ValueError(f"linear: {name} {tuple(tt.shape)} must be contiguous (strides {tt.stride()})")
    sdtype = {"fp8": torch.float32, "mxfp4": torch.uint8, "nvfp4": torch.float8_e4m3fn}
    if w.fmt in sshape:
        sc = w.scale
        if sc is None or sc.dtype != sdtype[w.fmt] or tuple(sc.shape) != sshape[w.fmt]:
            got = None if sc is None else f"{sc.dtype}{tuple(sc.shape)}"
            raise ValueError(f"linear: {w.fmt} scale {got}, expected {sdtype[w.fmt]}{sshape[w.fmt]}")
    if w.fmt == "nvfp4":
        gs = w.global_scale
        if gs is None or gs.dtype != torch.float32 or gs.numel() != 1:
            got = None if gs is None else f"{gs.dtype}{tuple(gs.shape)}"
            raise ValueError(f"linear: nvfp4 global_scale {got}, expected a float32 scalar")


def _rows(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    """x [..., k] -> [M, k] view with unit stride along k (no copy)."""
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"{name}: x dtype {x.dtype}, expected one of {_X_DTYPES}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"{name}: x {tuple(x.shape)} does not match K={k}")
    if x.stride(-1) != 1 and k > 1:
        raise ValueError(f"{name}: x {tuple(x.shape)} needs unit stride along K (strides {x.stride()})")
    try:
        return x.view(-1, k)
    except RuntimeError:
        raise ValueError(f"{name}: x {tuple(x.shape)} strides {x.stride()} cannot be viewed as rows "
                         f"without a copy") from None


# ---------------------------------------------------------------------------------------------------------
# public ops


def linear(x: torch.Tensor, w: PreparedLinear, act_quant: bool, out_dtype: torch.dtype,
           pre: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp32) -> x @ W^T [..., N] in out_dtype; `linear_ref` numerics (module doc). `pre`:
    act_quant_ref(x) as [M, K] e4m3 / [M, K / 128] fp32 rows (a QuantAct's), read instead of quantizing again."""
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"linear: out_dtype {out_dtype}, expected one of {_OUT_DTYPES}")
    _check_weight(w, x.device)
    n, k = w.n, w.k
    x2 = _rows(x, k, "linear")
    aq = bool(act_quant and w.quantized)
    if aq and k % ACT_BLOCK:
        raise ValueError(f"linear: K={k} must be a multiple of {ACT_BLOCK} for activation quantization")
    if aq and pre is not None:
        check_codes(x2, *pre)
    out = torch.empty((*x.shape[:-1], n), dtype=out_dtype, device=x.device)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    sn = w.scale.stride(0) if w.scale is not None else 0
    _launch(x2, w, out, m, n, k, 1, (0, x2.stride(0)), (0, w.weight.stride(0)), (0, sn), (0, n), aq, out_dtype,
            pre=pre if aq else None)
    return out


def wo_a(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """o [..., G, Dg], w [G, R, Dg] -> z [..., G, R] in o.dtype: z[g, r] = sum_d o[g, d] w[g, r, d]."""
    if o.dtype not in _X_DTYPES:
        raise ValueError(f"wo_a: o dtype {o.dtype}, expected one of {_X_DTYPES}")
    if w.dim() != 3:
        raise ValueError(f"wo_a: w must be [G, R, Dg], got {tuple(w.shape)}")
    G, R, D = w.shape
    if o.dim() < 2 or tuple(o.shape[-2:]) != (G, D):
        raise ValueError(f"wo_a: o {tuple(o.shape)} does not match w {tuple(w.shape)} (expected [..., {G}, {D}])")
    if w.dtype not in (torch.bfloat16, o.dtype):
        raise ValueError(f"wo_a: w dtype {w.dtype} with o dtype {o.dtype}: expected bf16 or o's dtype")
    if w.device != o.device:
        raise ValueError(f"wo_a: w on {w.device}, o on {o.device}")
    if not w.is_contiguous():
        raise ValueError(f"wo_a: w {tuple(w.shape)} must be contiguous (strides {w.stride()})")
    if o.stride(-1) != 1 and D > 1:
        raise ValueError(f"wo_a: o {tuple(o.shape)} needs unit stride along Dg (strides {o.stride()})")
    try:
        o3 = o.view(-1, G, D)
    except RuntimeError:
        raise ValueError(f"wo_a: o {tuple(o.shape)} strides {o.stride()} cannot be viewed without a copy") from None
    out = torch.empty((*o.shape[:-1], R), dtype=o.dtype, device=o.device)
    m = o3.shape[0]
    if m == 0 or R == 0 or G == 0:
        return out
    if D == 0:
        return out.zero_()
    pw = PreparedLinear("dense", R, D, w)  # [G, R, Dg]: group g's rows start at g * R * Dg
    _launch(o3, pw, out, m, R, D, G, (o3.stride(1), o3.stride(0)), (R * D, D), (0, 0), (R, G * R), False, o.dtype)
    return out


def _linear_variant(x, w: PreparedLinear, act_quant: bool, out_dtype, variant: str, mm_cfg=None) -> torch.Tensor:
    """`linear` with the kernel forced (benchmarks and A/B only; see _launch's `force` and `mm_cfg`)."""
    x2 = x.reshape(-1, w.k)
    out = torch.empty((x2.shape[0], w.n), dtype=out_dtype, device=x.device)
    sn = w.scale.stride(0) if w.scale is not None else 0
    _launch(x2, w, out, x2.shape[0], w.n, w.k, 1, (0, x2.stride(0)), (0, w.weight.stride(0)), (0, sn), (0, w.n),
            bool(act_quant and w.quantized), out_dtype, force=variant, mm_cfg=mm_cfg)
    return out


def mm_candidates(M: int, N: int, K: int, dot: int) -> list[tuple]:
    """Tile configs (SWAP, BM, BN, num_warps, num_stages, SPLIT) of the tensor-core kernel for M > 16 that
    tools/bench_ops.py --sweep-mm times: BM 64/128 (64 for the 16-bit split / fp32 dots), BN 64/128/256,
    3 or 4 stages, split-K 1-16 while each split keeps >= 2 blocks of 128."""
    out = []
    for bm in ((64,) if dot in (_DOT_SPLIT3, _DOT_IEEE) or M <= 64 else (64, 128)):
        for bn in (64, 128, 256):
            if bn == 256 and (bm == 64 or dot in (_DOT_SPLIT3, _DOT_IEEE)):
                continue
            for stages in (3, 4):
                split = 1
                while split <= 16 and triton.cdiv(K, 128) >= 2 * split:
                    out.append((False, bm, bn, 8 if bm == 128 else 4, stages, split))
                    split *= 2
    return out
