"""Triton fast path of `router` and `moe_experts` (SPEC §2.7): same signatures and numerics as `router_ref` /
`moe_experts_ref` in dsv4/ops/moe.py. Owns the MoE kernels and their launch plans; touches nothing else (the weights
are read in the PreparedLinear layouts of dsv4/ops/linear.py, never copied or re-encoded).

Router: `_router_logits_mma_kernel` for 16+ tokens on a bf16 gate (tensor-core GEMM, exact products, fp32
accumulation; fp32 x split in three bf16 parts), then `_router_select_kernel`; otherwise (decode, or an fp32 gate)
`_router_fused_kernel`: fp32 FMAs over many small CTAs, and the last CTA of each block of <= 16 tokens to finish (an
acq_rel arrival counter) runs that block's selection (past ROUTER_COUNTERS blocks: the logits kernel, then the
selection kernel). The selection:
sqrtsoftplus / sigmoid / softmax, hash experts from tid2eid or a k-step argmax of score + bias (ties to the lowest
expert id), weights from the unbiased scores, normalised, times the route scale.

Experts, decode (T <= DECODE_MAX_T = 1 token), two launches:
- `_moe_up_kernel`: one CTA per (routed pair, BN rows of w1 and w3) and per (shared expert, BNS rows); experts are
  read from `idx` on the device (the CTAs of a later pair naming the same expert exit), x is FP8-quantized in the
  kernel; epilogue: gate/up rounded to x.dtype, clamp, SwiGLU in fp32, times the routing weight, rounded -> h.
- `_moe_down_decode_kernel`: one CTA per BN output rows. The w2 rows of all (token, slot) pairs are stacked into
  one [NP*BN, BK] tile per K step against the pairs' h rows as columns (one MMA N tile for 6 pairs): the diagonal
  blocks are the pair outputs, rounded to x.dtype and summed per token in fp32 in ascending expert order; the
  shared expert's K is cut into chunks stacked the same way and added last. Fixed order, no atomics.
Experts, T > DECODE_MAX_T (MTP verification, prefill): `_moe_sort_kernel` (one CTA: stable sort of the (token,
slot) pairs by expert into a bounded work list, on the device: one tl.sort for up to SORT_PAIRS pairs, else a
counting sort in chunks), `_act_sim_kernel` (x, later h, FP8-simulated once), `_moe_up_kernel` over the work
list (each hit expert's weights read once per BMT pairs), `_moe_down_grouped_kernel` (per-pair w2 outputs,
rounded), `_moe_combine_kernel` (per token: ascending expert order, then the shared expert). The decode kernels also run T <= 4 (CONFIG_OVERRIDES["decode_max_t"] = 4, tested),
but at T = 4 the sorted path measured 164 us against 489 us on an H200.

Weight tiles: FP4 bytes are loaded as int32 words (8 values; 16-byte vectors per thread) and expanded in registers
to bf16 with the scale folded in (inline PTX on the GPU: the e2m1 bits placed in a bf16 pattern, one bf16x2
multiply by scale * 2^(126-8); an exact integer emulation under the interpreter). The 8 values of a word come out
as (v0,v4),(v1,v5),(v2,v6),(v3,v7) pairs; the K order of the tile is permuted accordingly and x is loaded with the
same permutation (a dot product does not depend on the order of K). FP8 weights are widened to fp16 against the
e4m3 grid values of x (both exact; x's and the block's scales applied after each 128-K dot) when x is quantized in
the kernel, else to bf16 against q*s; dense weights must be bf16. Products are exact, accumulation fp32, and the
2^8 offset (times the NVFP4 global scale) is applied once at the end: the reference up to fp32 summation order.
MXFP4 scales must lie in [2^-117, 2^9] (real checkpoints: ~2^-10). Under TRITON_INTERPRET=1 the operands travel as
fp32 (the interpreter multiplies bf16 dot operands as integers). Wrappers validate, allocate, launch: no host
sync, graph-safe; configs are fixed functions of the shapes (CONFIG_OVERRIDES: benchmarking only).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsv4.ops.triton_util import arrival_counters, e4m3_round, rne_bf16, ue8m0_scale

from dsv4.ops.linear import ACT_BLOCK, PreparedLinear

DECODE_MAX_T = 1  # tokens up to this take the two-launch decode kernels; more take the sorted path

_FMTS = {"dense": 0, "fp8": 1, "mxfp4": 2, "nvfp4": 3}
_FUNCS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
# FP4 tiles hold value * 2^-8 (the multiplier scale * 2^(126-8) then fits bf16); 2^8 is applied at the end
_TWO118 = tl.constexpr(2.0 ** 118)


# ---------------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _act_sim(xv, R: tl.constexpr, C: tl.constexpr, HW: tl.constexpr):
    """fp32 [R, C], C a multiple of 128 -> q * s per 1x128 block (act_quant_sim_ref), fp32 (exact in bf16).
    Blocks are 128 consecutive columns; a permutation inside groups of 8 columns keeps them."""
    xb = tl.reshape(xv, [R, C // 128, 128])
    s, inv = ue8m0_scale(tl.max(tl.abs(xb), axis=2))
    v = xb * inv[:, :, None]
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    q = v.to(tl.float8e4nv).to(tl.float32) if HW else e4m3_round(v)
    return tl.reshape(q * s[:, :, None], [R, C])


@triton.jit
def _round_to(v, BF16: tl.constexpr):
    """fp32 -> fp32 rounded to the nearest bf16 (ties to even, NaN kept: triton_util.rne_bf16) when BF16, else v."""
    if BF16:
        v = rne_bf16(v)
    return v


@triton.jit
def _fp4_asm(wd, sc):
    """int32 words of 8 packed e2m1 (nibble i = element i, low first) and a bf16 multiplier -> 8 bf16 in the order
    v0, v4, v1, v5, v2, v6, v3, v7. Nibble i = (s, e1, e0, m) lands as sign -> bit 15 and e1 e0 m -> bits 8..6 of
    a bf16 half (= e2m1 * 2^-126, the 0.5 code a bf16 subnormal), two halves per shift, then one mul.bf16x2 by
    sc = scale * 2^(126-8) (subnormal inputs are exact in mul.bf16x2; the product is exact)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 a, b, r0, r1, r2, r3, sc;
        mov.b32 sc, {$9, $9};
        shl.b32 a, $8, 12;
        shl.b32 b, $8, 6;
        and.b32 a, a, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 r0, a, b;
        shl.b32 a, $8, 8;
        shl.b32 b, $8, 2;
        and.b32 a, a, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 r1, a, b;
        shl.b32 a, $8, 4;
        shr.b32 b, $8, 2;
        and.b32 a, a, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 r2, a, b;
        shr.b32 b, $8, 6;
        and.b32 a, $8, 0x80008000;
        and.b32 b, b, 0x01C001C0;
        or.b32 r3, a, b;
        mul.rn.bf16x2 r0, r0, sc;
        mul.rn.bf16x2 r1, r1, sc;
        mul.rn.bf16x2 r2, r2, sc;
        mul.rn.bf16x2 r3, r3, sc;
        mov.b32 {$0, $1}, r0;
        mov.b32 {$2, $3}, r1;
        mov.b32 {$4, $5}, r2;
        mov.b32 {$6, $7}, r3;
        }
        """,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h",
        args=[wd, sc], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _fp4_half(r, sh: tl.constexpr, sc):
    """Interpreter twin of one asm output half: the bf16 pattern at bit offset sh of r, as fp32, times sc."""
    h = (((r >> sh) & 0xFFFF) << 16).to(tl.float32, bitcast=True)  # the bf16 pattern widened (subnormals kept)
    return h * sc


@triton.jit
def _fp4_emul(wd, sc):
    """Exact integer/fp32 emulation of _fp4_asm (same bit placement, same order), fp32 outputs."""
    r0 = ((wd << 12) & -2147450880) | ((wd << 6) & 0x01C001C0)  # -2147450880 = 0x80008000 as int32
    r1 = ((wd << 8) & -2147450880) | ((wd << 2) & 0x01C001C0)
    r2 = ((wd << 4) & -2147450880) | ((wd >> 2) & 0x01C001C0)
    r3 = (wd & -2147450880) | ((wd >> 6) & 0x01C001C0)
    return (_fp4_half(r0, 0, sc), _fp4_half(r0, 16, sc), _fp4_half(r1, 0, sc), _fp4_half(r1, 16, sc),
            _fp4_half(r2, 0, sc), _fp4_half(r2, 16, sc), _fp4_half(r3, 0, sc), _fp4_half(r3, 16, sc))


@triton.jit
def _fp4_tile(w_ptr, s_ptr, woff, soff, row_ok, kb, k0, K,
              FMT: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
              DT: tl.constexpr, ASM: tl.constexpr):
    """FP4 tile [R, BK] in DT = value * 2^-8, columns in the permuted order of _fp4_perm. Row r: int32 words at
    w_ptr + woff[r], scales at s_ptr + soff[r], columns kb[r] + k0 .. + BK."""
    G: tl.constexpr = 32 if FMT == 2 else 16
    BKW: tl.constexpr = BK // 8
    kw = (kb + k0) // 8
    cw = kw[:, None] + tl.arange(0, BKW)[None, :]
    if EVEN_K:
        wmask = row_ok[:, None]
    else:
        wmask = row_ok[:, None] & (cw < K // 8)
    wd = tl.load(w_ptr + woff[:, None] + cw, mask=wmask, other=0)
    cg = ((kb + k0) // G)[:, None] + tl.arange(0, BK // G)[None, :]
    if EVEN_K:
        smask = row_ok[:, None]
    else:
        smask = row_ok[:, None] & (cg < K // G)
    if FMT == 2:  # E8M0 byte b -> 2^(b - 127) * 2^(126 - 8) = 2^(b - 9)
        sg = tl.load(s_ptr + soff[:, None] + cg, mask=smask, other=0)
        m = ((sg.to(tl.int32) + 118) << 23).to(tl.float32, bitcast=True)
    else:  # e4m3 * 2^118 (exact; <= 448 * 2^118 fits bf16)
        sg = tl.load(s_ptr + soff[:, None] + cg, mask=smask, other=0.0)
        m = sg.to(tl.float32) * _TWO118
    m = tl.reshape(tl.broadcast_to(m[:, :, None], [R, BK // G, G // 8]), [R, BKW])
    if ASM:
        o0, o1, o2, o3, o4, o5, o6, o7 = _fp4_asm(wd, m.to(tl.bfloat16))
    else:
        o0, o1, o2, o3, o4, o5, o6, o7 = _fp4_emul(wd, m)
    # [R, BKW, 2, 2, 2] with [.., i, j, l] = o_{4i + 2j + l}: column c of the word = output o_c
    ab = tl.join(tl.join(o0, o4), tl.join(o2, o6))
    cd = tl.join(tl.join(o1, o5), tl.join(o3, o7))
    return tl.reshape(tl.join(ab, cd), [R, BK]).to(DT)


@triton.jit
def _fp4_perm(c):
    """Tile column c of an FP4 tile -> its K offset: outputs o0..o7 of a word hold v0, v4, v1, v5, v2, v6, v3, v7."""
    return (c & -8) | ((c & 7) >> 1) | ((c & 1) << 2)


@triton.jit
def _dot_x(tile, xo, acc, XS: tl.constexpr, DT: tl.constexpr):
    """acc += tile [R, BK] @ xo^T (xo fp32 [BM, BK]); XS = 3 splits a non-bf16-exact fp32 xo into three bf16."""
    if XS == 1:
        acc = tl.dot(tile, tl.trans(xo.to(DT)), acc)
    else:
        xa = xo.to(tl.bfloat16).to(tl.float32)
        r = xo - xa
        xb = r.to(tl.bfloat16).to(tl.float32)
        xc = r - xb
        acc = tl.dot(tile, tl.trans(xa.to(DT)), acc)
        acc = tl.dot(tile, tl.trans(xb.to(DT)), acc)
        acc = tl.dot(tile, tl.trans(xc.to(DT)), acc)
    return acc


@triton.jit
def _x_tile(x_ptr, xoff, xkb, xok, cols, K, IN_Q: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr,
            BK: tl.constexpr, EVEN_K: tl.constexpr, HW: tl.constexpr):
    """Activation rows [BM] (element offsets xoff, K base xkb) at K offsets cols [BK] -> (fp32 [BM, BK], scale [BM]).
    IN_Q: FP8-simulated; with SPLIT (BK == 128, one block) the e4m3 grid values q and their scale s
    (q * s = the simulation), else q * s and 1."""
    if EVEN_K:
        msk = xok[:, None]
    else:
        msk = xok[:, None] & (xkb[:, None] + cols[None, :] < K)
    xv = tl.load(x_ptr + xoff[:, None] + cols[None, :], mask=msk, other=0.0).to(tl.float32)
    sa = tl.full([BM], 1.0, tl.float32)
    if IN_Q:
        if SPLIT:
            sa, inv = ue8m0_scale(tl.max(tl.abs(xv), axis=1))
            v = xv * inv[:, None]
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            xv = v.to(tl.float8e4nv).to(tl.float32) if HW else e4m3_round(v)
        else:
            xv = _act_sim(xv, BM, BK, HW)
    return xv, sa


@triton.jit
def _step(acc, w_ptr, s_ptr, woff, soff, row_ok, kb, k0, K, xo, sa,
          FMT: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
          XS: tl.constexpr, F16: tl.constexpr, DT: tl.constexpr, DH: tl.constexpr, ASM: tl.constexpr):
    """acc [R, BM] += W[rows, kb + k0 : kb + k0 + BK] @ (xo * sa)^T (xo in the format's column order).
    FP8 rows: soff = the row's 128-row scale block; F16 (xo = e4m3 grid values): fp16 operands, both exact,
    scales applied after the dot."""
    if FMT >= 2:
        tile = _fp4_tile(w_ptr, s_ptr, woff, soff, row_ok, kb, k0, K, FMT, R, BK, EVEN_K, DT, ASM)
        acc = _dot_x(tile, xo, acc, XS, DT)
    else:
        cols = (kb + k0)[:, None] + tl.arange(0, BK)[None, :]
        if EVEN_K:
            msk = row_ok[:, None]
        else:
            msk = row_ok[:, None] & (cols < K)
        wv = tl.load(w_ptr + woff[:, None] + cols, mask=msk, other=0.0)
        if FMT == 1:  # one 128x128 block scale per row per step: BK == 128, kb a multiple of 128
            sc = tl.load(s_ptr + soff + (kb + k0) // 128, mask=row_ok, other=0.0)
            if F16:
                p = tl.dot(wv.to(DH), tl.trans(xo.to(DH)))
                acc += p * (sc[:, None] * sa[None, :])
            else:
                acc += _dot_x(wv.to(DT), xo, tl.zeros(acc.shape, tl.float32), XS, DT) * sc[:, None]
        else:
            acc = _dot_x(wv.to(DT), xo, acc, XS, DT)
    return acc


@triton.jit
def _offs(e, rows, sw_e, sw_n, ss_e, ss_n, FMT: tl.constexpr):
    """(weight, scale) element offsets of rows of expert e (e scalar or per row)."""
    woff = e * sw_e + rows.to(tl.int64) * sw_n
    if FMT == 1:
        soff = e * ss_e + (rows // 128).to(tl.int64) * ss_n
    else:
        soff = e * ss_e + rows.to(tl.int64) * ss_n
    return woff, soff


@triton.jit
def _post(g_ptr, e, FMT: tl.constexpr):
    """Factor applied once to a finished accumulator: 2^8 for FP4 tiles, times the NVFP4 global scale of e."""
    if FMT == 3:
        return tl.load(g_ptr + e) * 256.0
    elif FMT == 2:
        return 256.0
    else:
        return 1.0


# ---------------------------------------------------------------------------------------------------------
# router


@triton.jit
def _logits_tile(x_ptr, w_ptr, o_ptr, pe, pt, T, E, D, sx, sw, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """logits [T, E] fp32 = x.float() @ W.float()^T for tile (pe, pt), fp32 FMAs over [BT, BE, BK] steps."""
    offs_t = pt * BT + tl.arange(0, BT)
    offs_e = pe * BE + tl.arange(0, BE)
    t_ok = offs_t < T
    e_ok = offs_e < E
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < D
        xv = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * sx + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * sw + kk[None, :], mask=e_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * wv[None, :, :], axis=2)
    tl.store(o_ptr + offs_t[:, None] * E + offs_e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, o_ptr, T, E, D, sx, sw,
                          BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    _logits_tile(x_ptr, w_ptr, o_ptr, tl.program_id(0), tl.program_id(1), T, E, D, sx, sw, BT, BE, BK)


@triton.jit
def _router_logits_mma_kernel(x_ptr, w_ptr, o_ptr, T, E, D, sx, sw, XS: tl.constexpr, DT: tl.constexpr,
                              BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr):
    """logits [T, E] fp32 = x @ W^T on the tensor cores: bf16 W and bf16 x (fp32 x split in three bf16 parts) are
    exact operands, products exact, fp32 accumulation (the reference up to summation order)."""
    pe = tl.program_id(0)
    pt = tl.program_id(1)
    offs_t = pt * BT + tl.arange(0, BT)
    offs_e = pe * BE + tl.arange(0, BE)
    t_ok = offs_t < T
    e_ok = offs_e < E
    acc = tl.zeros([BE, BT], dtype=tl.float32)
    for k0 in tl.range(0, D, BK, num_stages=3):
        kk = k0 + tl.arange(0, BK)
        k_ok = kk < D
        wv = tl.load(w_ptr + offs_e[:, None].to(tl.int64) * sw + kk[None, :], mask=e_ok[:, None] & k_ok[None, :],
                     other=0.0)
        xv = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * sx + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        acc = _dot_x(wv.to(DT), xv, acc, XS, DT)
    tl.store(o_ptr + offs_t[None, :] * E + offs_e[:, None], acc, mask=t_ok[None, :] & e_ok[:, None])


@triton.jit
def _log1p(y):
    """log(1 + y) for y >= 0, accurate to a few ulps also for tiny y (u = 1 + y; log(u) * y / (u - 1))."""
    u = 1.0 + y
    d = u - 1.0
    return tl.where(d == 0.0, y, tl.log(u) * (y / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _select(l_ptr, b_ptr, tid_ptr, ids_ptr, w_ptr, i_ptr, pt, T, E, route_scale, s_tid,
            KTOP: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr,
            BT: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr, LCM: tl.constexpr):
    """Scores, expert choice and weights for tokens [pt * BT, (pt + 1) * BT) (one row of E logits each, loaded
    with cache modifier LCM)."""
    offs_t = pt * BT + tl.arange(0, BT)
    offs_e = tl.arange(0, BE)
    offs_j = tl.arange(0, KP)
    t_ok = offs_t < T
    e_ok = offs_e < E
    ninf = float("-inf")
    lg = tl.load(l_ptr + offs_t[:, None] * E + offs_e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0,
                 cache_modifier=LCM)
    if FUNC == 0:
        z = tl.where(e_ok[None, :], lg, ninf)
        z = tl.exp(z - tl.max(z, axis=1)[:, None])
        sc = z / tl.sum(z, axis=1)[:, None]
    elif FUNC == 1:
        sc = 1.0 / (1.0 + tl.exp(-lg))
    else:
        sp = tl.where(lg > 20.0, lg, _log1p(tl.exp(tl.minimum(lg, 20.0))))
        sc = tl.sqrt_rn(sp)
    idx = tl.zeros([BT, KP], dtype=tl.int64)
    wts = tl.zeros([BT, KP], dtype=tl.float32)
    if HASH:
        tok = tl.load(ids_ptr + offs_t, mask=t_ok, other=0)
        idx = tl.load(tid_ptr + tok[:, None].to(tl.int64) * s_tid + offs_j[None, :],
                      mask=t_ok[:, None] & (offs_j[None, :] < KTOP), other=0).to(tl.int64)
        for j in tl.static_range(KTOP):
            ej = tl.sum(tl.where(offs_j[None, :] == j, idx, 0), axis=1)
            wj = tl.sum(tl.where(offs_e[None, :] == ej[:, None], sc, 0.0), axis=1)
            wts = tl.where(offs_j[None, :] == j, wj[:, None], wts)
    else:
        bias = tl.load(b_ptr + offs_e, mask=e_ok, other=0.0)
        v = tl.where(e_ok[None, :], sc + bias[None, :], ninf)
        for j in tl.static_range(KTOP):
            mx = tl.max(v, axis=1)
            sel = tl.min(tl.where(v == mx[:, None], offs_e[None, :], BE), axis=1)  # ties: lowest id
            hit = offs_e[None, :] == sel[:, None]
            wj = tl.sum(tl.where(hit, sc, 0.0), axis=1)
            v = tl.where(hit, ninf, v)
            idx = tl.where(offs_j[None, :] == j, sel[:, None].to(tl.int64), idx)
            wts = tl.where(offs_j[None, :] == j, wj[:, None], wts)
    if NORM:
        wts = wts / tl.sum(wts, axis=1)[:, None]
    wts = wts * route_scale
    om = t_ok[:, None] & (offs_j[None, :] < KTOP)
    tl.store(w_ptr + offs_t[:, None] * KTOP + offs_j[None, :], wts, mask=om)
    tl.store(i_ptr + offs_t[:, None] * KTOP + offs_j[None, :], idx, mask=om)


@triton.jit
def _router_select_kernel(l_ptr, b_ptr, tid_ptr, ids_ptr, w_ptr, i_ptr, T, E, route_scale, s_tid,
                          KTOP: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr,
                          BT: tl.constexpr, BE: tl.constexpr, KP: tl.constexpr):
    _select(l_ptr, b_ptr, tid_ptr, ids_ptr, w_ptr, i_ptr, tl.program_id(0), T, E, route_scale, s_tid,
            KTOP, FUNC, HASH, NORM, BT, BE, KP, "")


@triton.jit
def _router_fused_kernel(x_ptr, w_ptr, l_ptr, c_ptr, b_ptr, tid_ptr, ids_ptr, wo_ptr, io_ptr, T, E, D, sx, sw,
                         route_scale, s_tid, BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                         KTOP: tl.constexpr, FUNC: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr,
                         BEA: tl.constexpr, KP: tl.constexpr):
    """One launch: program (pe, pt) writes its tile of logits; the last program of token block pt to arrive
    (acq_rel counter, left at zero) runs the selection for those BT tokens over all E logits."""
    pe = tl.program_id(0)
    pt = tl.program_id(1)
    _logits_tile(x_ptr, w_ptr, l_ptr, pe, pt, T, E, D, sx, sw, BT, BE, BK)
    tl.debug_barrier()  # every thread's logits are stored before the (release) arrival
    arrived = tl.atomic_add(c_ptr + pt, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        _select(l_ptr, b_ptr, tid_ptr, ids_ptr, wo_ptr, io_ptr, pt, T, E, route_scale, s_tid,
                KTOP, FUNC, HASH, NORM, BT, BEA, KP, ".cg")
        tl.atomic_xchg(c_ptr + pt, 0)


def router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
           ids: torch.Tensor, func: str, topk: int, norm_topk: bool, route_scale: float):
    """x [T,D], weight [E,D], ids [T] -> (weights [T,k] fp32, experts [T,k] int64); router_ref numerics."""
    if func not in _FUNCS:
        raise ValueError(f"router: func must be one of {tuple(_FUNCS)}, got {func!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, D] and [E, D]")
    T, D = x.shape
    E = weight.shape[0]
    if not 1 <= topk <= E:
        raise ValueError(f"router: topk={topk} must be in [1, E={E}]")
    if tid2eid is None and bias is None:
        raise ValueError("router: a score layer needs a bias (or pass tid2eid for hash routing)")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("router: x and weight need unit stride along D")
    dev = x.device
    for name, t in (("weight", weight), ("bias", bias), ("tid2eid", tid2eid), ("ids", ids)):
        if t is not None and t.device != dev:
            raise ValueError(f"router: {name} on {t.device}, x on {dev}")
    if tid2eid is not None:
        if tid2eid.dim() != 2 or tid2eid.shape[1] != topk or tid2eid.stride(1) != 1:
            raise ValueError(f"router: tid2eid {tuple(tid2eid.shape)} must be [vocab, {topk}] with unit inner stride")
        if ids.shape != (T,):
            raise ValueError(f"router: ids {tuple(ids.shape)} must be [{T}]")
    elif bias.shape != (E,) or bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError(f"router: bias {bias.dtype}{tuple(bias.shape)} must be contiguous float32 [{E}]")
    wts = torch.empty((T, topk), dtype=torch.float32, device=dev)
    idx = torch.empty((T, topk), dtype=torch.int64, device=dev)
    if T == 0:
        return wts, idx
    logits = torch.empty((T, E), dtype=torch.float32, device=dev)
    if T >= _cfg("router_mma_t", 16) and weight.dtype == torch.bfloat16:  # a GEMM: tensor cores
        gpu = _native(dev)
        xs = 1 if (not gpu or x.dtype == torch.bfloat16) else 3
        BT = min(triton.next_power_of_2(T), 32)
        _router_logits_mma_kernel[(triton.cdiv(E, 32), triton.cdiv(T, BT))](
            x, weight, logits, T, E, D, x.stride(0), weight.stride(0), XS=xs, DT=tl.bfloat16 if gpu else tl.float32,
            BT=BT, BE=32, BK=128, num_warps=2)
    else:  # a GEMV: fp32 FMAs over many small CTAs
        BT, BE, BK = _router_config(T, E, D, _num_sms(dev))
        nt = triton.cdiv(T, BT)
        if nt > ROUTER_COUNTERS:
            _router_logits_kernel[(triton.cdiv(E, BE), nt)](
                x, weight, logits, T, E, D, x.stride(0), weight.stride(0), BT=BT, BE=BE, BK=BK, num_warps=4)
            return _router_select(logits, bias, tid2eid, ids, wts, idx, T, E, func, topk, norm_topk, route_scale)
        hashed = tid2eid is not None  # one launch: the selection runs in the last program to finish
        _router_fused_kernel[(triton.cdiv(E, BE), nt)](
            x, weight, logits, arrival_counters(dev, "router", ROUTER_COUNTERS), bias if bias is not None else logits,
            tid2eid if hashed else idx, ids if hashed else idx, wts, idx, T, E, D, x.stride(0), weight.stride(0),
            float(route_scale), tid2eid.stride(0) if hashed else 0, BT=BT, BE=BE, BK=BK,
            KTOP=topk, FUNC=_FUNCS[func], HASH=hashed, NORM=bool(norm_topk and func != "softmax"),
            BEA=triton.next_power_of_2(E), KP=triton.next_power_of_2(topk), num_warps=ROUTER_WARPS)
        return wts, idx
    return _router_select(logits, bias, tid2eid, ids, wts, idx, T, E, func, topk, norm_topk, route_scale)


ROUTER_COUNTERS = 64  # token blocks of a fused router launch (its arrival counters)
# warps of a fused router program: 1, 2, 4 and 8 all ran 6.0-7.7 us at Flash shapes, one token (H200, CUDA graphs)
ROUTER_WARPS = 4


def _router_select(logits, bias, tid2eid, ids, wts, idx, T, E, func, topk, norm_topk, route_scale):
    hashed = tid2eid is not None
    BTS = 4 if E <= 512 else 1
    _router_select_kernel[(triton.cdiv(T, BTS),)](
        logits, bias if bias is not None else logits, tid2eid if hashed else idx, ids if hashed else idx, wts, idx,
        T, E, float(route_scale), tid2eid.stride(0) if hashed else 0,
        KTOP=topk, FUNC=_FUNCS[func], HASH=hashed, NORM=bool(norm_topk and func != "softmax"),
        BT=BTS, BE=triton.next_power_of_2(E), KP=triton.next_power_of_2(topk), num_warps=4)
    return wts, idx


@functools.lru_cache(maxsize=None)
def _router_config(T: int, E: int, D: int, sms: int):
    """(BT, BE, BK): tokens x experts x K per FMA step (~4K products), BE small enough for >= 1 CTA per SM."""
    BT = min(triton.next_power_of_2(T), 16)
    BE = 16
    while BE > 1 and triton.cdiv(E, BE) * triton.cdiv(T, BT) < sms:
        BE //= 2
    BK = max(16, min(triton.next_power_of_2(D), 4096 // (BT * BE)))
    return BT, BE, BK


# ---------------------------------------------------------------------------------------------------------
# shared machinery

_NUM_SMS: dict[int, int] = {}


def _native(device: torch.device) -> bool:
    """Compiled Triton (inline PTX, bf16 dot operands) rather than the interpreter."""
    return device.type == "cuda"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _NUM_SMS:
        _NUM_SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _NUM_SMS[i]


# ---------------------------------------------------------------------------------------------------------
# experts: work items


@triton.jit
def _decode_item(idx_ptr, wts_ptr, item, T, KTOP: tl.constexpr, BM: tl.constexpr, KP: tl.constexpr,
                 TKP: tl.constexpr):
    """Decode pair `item` (= t * k + j) -> (valid, e, hit [BM, KP], weights [BM, KP]): the CTA of the first pair
    naming expert e serves every (token, slot) routed to e (the other pairs naming e exit)."""
    offs_p = tl.arange(0, TKP)
    pv = tl.load(idx_ptr + offs_p, mask=offs_p < T * KTOP, other=-1)
    e = tl.load(idx_ptr + item)
    valid = tl.sum(((pv == e) & (offs_p < item)).to(tl.int32)) == 0
    toks = tl.arange(0, BM)
    offs_j = tl.arange(0, KP)
    tmask = (toks[:, None] < T) & (offs_j[None, :] < KTOP)
    it = tl.load(idx_ptr + toks[:, None] * KTOP + offs_j[None, :], mask=tmask, other=-1)
    wv = tl.load(wts_ptr + toks[:, None] * KTOP + offs_j[None, :], mask=tmask, other=0.0)
    return valid, e, it == e, wv


@triton.jit
def _sorted_item(srt_ptr, seg_ptr, toff_ptr, wts_ptr, item, KTOP: tl.constexpr, NE, LOGE: tl.constexpr,
                 BM: tl.constexpr):
    """Work item `item` of the sorted list -> (valid, e, toks, rows_out, has, wt): up to BM pairs of expert e."""
    total = tl.load(toff_ptr + NE)
    valid = item < total
    lo = item * 0
    hi = lo + NE
    for _ in tl.static_range(LOGE):  # largest e with toff[e] <= item (toff[0] = 0 <= item < toff[NE])
        mid = (lo + hi) // 2
        go = tl.load(toff_ptr + mid) <= item
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    e = lo
    start = tl.load(seg_ptr + e) + (item - tl.load(toff_ptr + e)) * BM
    end = tl.where(valid, tl.load(seg_ptr + e + 1), start)
    pos = start + tl.arange(0, BM)
    has = pos < end
    rows_out = tl.load(srt_ptr + pos, mask=has, other=0)
    wt = tl.load(wts_ptr + rows_out, mask=has, other=0.0)
    return valid, e.to(tl.int64), rows_out // KTOP, rows_out, has, wt


@triton.jit
def _up_loop(x_ptr, toks, tok_ok, sx, w1_ptr, w1s_ptr, w3_ptr, w3s_ptr, woff, soff, row_ok, K,
             FMT: tl.constexpr, IN_Q: tl.constexpr, XS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, EVEN_K: tl.constexpr, DT: tl.constexpr, DH: tl.constexpr, ASM: tl.constexpr,
             HW: tl.constexpr, NUM_STAGES: tl.constexpr):
    """gate/up accumulators [BN, BM] of one expert over all of K (w1 and w3 share offsets)."""
    F16: tl.constexpr = FMT == 1 and IN_Q
    acc1 = tl.zeros([BN, BM], dtype=tl.float32)
    acc3 = tl.zeros([BN, BM], dtype=tl.float32)
    kb = tl.zeros([BN], dtype=tl.int32)
    xoff = toks.to(tl.int64) * sx
    xkb = tl.zeros([BM], dtype=tl.int32)
    for k0 in tl.range(0, K, BK, num_stages=NUM_STAGES):
        c = k0 + tl.arange(0, BK)
        if FMT >= 2:
            c = _fp4_perm(c)
        xo, sa = _x_tile(x_ptr, xoff, xkb, tok_ok, c, K, IN_Q, F16, BM, BK, EVEN_K, HW)
        acc1 = _step(acc1, w1_ptr, w1s_ptr, woff, soff, row_ok, kb, k0, K, xo, sa, FMT, BN, BK, EVEN_K, XS, F16,
                     DT, DH, ASM)
        acc3 = _step(acc3, w3_ptr, w3s_ptr, woff, soff, row_ok, kb, k0, K, xo, sa, FMT, BN, BK, EVEN_K, XS, F16,
                     DT, DH, ASM)
    return acc1, acc3


@triton.jit
def _swiglu(acc1, acc3, p1, p3, limit, HAS_LIMIT: tl.constexpr, BF16: tl.constexpr):
    """gate/up rounded to x.dtype, clamped (up to [-limit, limit], gate <= limit), silu(gate) * up in fp32."""
    g = _round_to(acc1 * p1, BF16)
    u = _round_to(acc3 * p3, BF16)
    if HAS_LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _store_h(h_ptr, a, wt, rows_out, has, n0, N, ROUTED: tl.constexpr, BF16: tl.constexpr, BN: tl.constexpr):
    """h rows rows_out[t] (columns n0 ..) = a[:, t] times the routing weight wt[t], rounded to x.dtype."""
    if ROUTED:
        a = a * wt[None, :]
    h = _round_to(a, BF16)
    offs_n = n0 + tl.arange(0, BN)
    ptrs = h_ptr + rows_out[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(ptrs, h.to(h_ptr.dtype.element_ty), mask=has[None, :] & (offs_n[:, None] < N))


@triton.jit
def _moe_up_kernel(xr_ptr, xs_ptr, wts_ptr, idx_ptr, srt_ptr, seg_ptr, toff_ptr,
                   w1_ptr, w1s_ptr, w1g_ptr, w3_ptr, w3s_ptr, w3g_ptr,
                   v1_ptr, v1s_ptr, v1g_ptr, v3_ptr, v3s_ptr, v3g_ptr,
                   h_ptr, T, K, N, limit, sx, NE,
                   sw_e, sw_n, ss_e, ss_n, sv_n, svs_n, n_items_s, nt_s, nt_r,
                   KTOP: tl.constexpr, KP: tl.constexpr, TKP: tl.constexpr, LOGE: tl.constexpr,
                   SORTED: tl.constexpr, HAS_SHARED: tl.constexpr, FMT: tl.constexpr, SFMT: tl.constexpr,
                   QR: tl.constexpr, QS: tl.constexpr, XSR: tl.constexpr, XSS: tl.constexpr,
                   HAS_LIMIT: tl.constexpr, BF16: tl.constexpr,
                   BM: tl.constexpr, BMS: tl.constexpr, BN: tl.constexpr, BNS: tl.constexpr,
                   BK: tl.constexpr, BKS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_KS: tl.constexpr,
                   DT: tl.constexpr, DH: tl.constexpr, ASM: tl.constexpr, HW: tl.constexpr,
                   NUM_STAGES: tl.constexpr):
    """w1/w3 + SwiGLU for routed work items and shared-expert token tiles (1-D grid, shared tiles first)."""
    pid = tl.program_id(0)
    n_s = n_items_s * nt_s
    if HAS_SHARED and pid < n_s:
        s_n0 = (pid // n_items_s) * BNS  # token tiles of one n-tile adjacent: the weight tile is read once
        s_toks = (pid % n_items_s) * BMS + tl.arange(0, BMS)
        s_ok = s_toks < T
        s_rows = s_n0 + tl.arange(0, BNS)
        s_woff, s_soff = _offs(0, s_rows, 0, sv_n, 0, svs_n, SFMT)
        s_a1, s_a3 = _up_loop(xs_ptr, s_toks, s_ok, sx, v1_ptr, v1s_ptr, v3_ptr, v3s_ptr, s_woff, s_soff,
                              s_rows < N, K, SFMT, QS, XSS, BMS, BNS, BKS, EVEN_KS, DT, DH, ASM, HW, NUM_STAGES)
        s_a = _swiglu(s_a1, s_a3, _post(v1g_ptr, 0, SFMT), _post(v3g_ptr, 0, SFMT), limit, HAS_LIMIT, BF16)
        _store_h(h_ptr, s_a, s_ok.to(tl.float32), T * KTOP + s_toks, s_ok, s_n0, N, False, BF16, BNS)
    else:
        q = pid - n_s if HAS_SHARED else pid
        item = q // nt_r
        n0 = (q % nt_r) * BN
        rows = n0 + tl.arange(0, BN)
        if SORTED:
            valid, e, toks, rows_out, has, wt = _sorted_item(srt_ptr, seg_ptr, toff_ptr, wts_ptr, item, KTOP, NE,
                                                              LOGE, BM)
            if valid:
                woff, soff = _offs(e, rows, sw_e, sw_n, ss_e, ss_n, FMT)
                acc1, acc3 = _up_loop(xr_ptr, toks, has, sx, w1_ptr, w1s_ptr, w3_ptr, w3s_ptr, woff, soff, rows < N,
                                      K, FMT, QR, XSR, BM, BN, BK, EVEN_K, DT, DH, ASM, HW, NUM_STAGES)
                a = _swiglu(acc1, acc3, _post(w1g_ptr, e, FMT), _post(w3g_ptr, e, FMT), limit, HAS_LIMIT, BF16)
                _store_h(h_ptr, a, wt, rows_out, has, n0, N, True, BF16, BN)
        else:
            valid, e, hit, wv = _decode_item(idx_ptr, wts_ptr, item, T, KTOP, BM, KP, TKP)
            if valid:
                toks = tl.arange(0, BM)
                offs_j = tl.arange(0, KP)
                woff, soff = _offs(e, rows, sw_e, sw_n, ss_e, ss_n, FMT)
                acc1, acc3 = _up_loop(xr_ptr, toks, tl.max(hit.to(tl.int32), axis=1) > 0, sx, w1_ptr, w1s_ptr,
                                      w3_ptr, w3s_ptr, woff, soff, rows < N, K, FMT, QR, XSR, BM, BN, BK, EVEN_K, DT,
                                      DH, ASM, HW, NUM_STAGES)
                a = _swiglu(acc1, acc3, _post(w1g_ptr, e, FMT), _post(w3g_ptr, e, FMT), limit, HAS_LIMIT, BF16)
                for j in tl.static_range(KTOP):  # every slot of every token naming e (a token may name e twice)
                    hj = tl.sum(tl.where(offs_j[None, :] == j, hit.to(tl.int32), 0), axis=1) > 0
                    wj = tl.sum(tl.where(offs_j[None, :] == j, wv, 0.0), axis=1)
                    _store_h(h_ptr, a, wj, toks * KTOP + j, hj, n0, N, True, BF16, BN)


@triton.jit
def _down_loop(x_ptr, xoff, xkb, xok, w_ptr, ws_ptr, woff, soff, row_ok, kb, K,
               FMT: tl.constexpr, IN_Q: tl.constexpr, XS: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
               BK: tl.constexpr, KLEN, EVEN_K: tl.constexpr, DT: tl.constexpr, DH: tl.constexpr,
               ASM: tl.constexpr, HW: tl.constexpr, NUM_STAGES: tl.constexpr):
    """acc [R, BM] = W rows (offsets woff/soff, K bases kb) @ x rows (xoff / xkb)^T over K offsets [0, KLEN)."""
    F16: tl.constexpr = FMT == 1 and IN_Q
    acc = tl.zeros([R, BM], dtype=tl.float32)
    for k0 in tl.range(0, KLEN, BK, num_stages=NUM_STAGES):
        c = k0 + tl.arange(0, BK)
        if FMT >= 2:
            c = _fp4_perm(c)
        xo, sa = _x_tile(x_ptr, xoff, xkb, xok, c, K, IN_Q, F16, BM, BK, EVEN_K, HW)
        acc = _step(acc, w_ptr, ws_ptr, woff, soff, row_ok, kb, k0, K, xo, sa, FMT, R, BK, EVEN_K, XS, F16, DT, DH,
                    ASM)
    return acc


@triton.jit
def _moe_down_decode_kernel(h_ptr, idx_ptr, w2_ptr, w2s_ptr, w2g_ptr, v2_ptr, v2s_ptr, v2g_ptr, y_ptr,
                            T, K, D, sw_e, sw_n, ss_e, ss_n, sv_n, svs_n, CK,
                            KTOP: tl.constexpr, KP: tl.constexpr, NP: tl.constexpr, NSC: tl.constexpr,
                            HAS_SHARED: tl.constexpr, FMT: tl.constexpr, SFMT: tl.constexpr, QR: tl.constexpr,
                            QS: tl.constexpr, XSR: tl.constexpr, XSS: tl.constexpr, BF16: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                            EVEN_K: tl.constexpr, EVEN_KS: tl.constexpr, DT: tl.constexpr, DH: tl.constexpr,
                            ASM: tl.constexpr, HW: tl.constexpr, NUM_STAGES: tl.constexpr):
    """y rows n0 .. n0+BN of every token. The w2 rows of all T*k (token, slot) pairs are stacked into one
    [NP*BN, BK] tile per K step against the pairs' h rows as columns (one MMA N tile for T*k <= 8): the diagonal
    blocks are the per-pair outputs, rounded to x.dtype and added per token in ascending expert order. The
    shared expert's K is cut into NSC chunks stacked the same way, summed over chunks, rounded, added last."""
    n0 = tl.program_id(0) * BN
    P = T * KTOP
    R: tl.constexpr = NP * BN
    r = tl.arange(0, R)
    pr = r // BN
    nr = n0 + r % BN
    e_r = tl.load(idx_ptr + pr, mask=pr < P, other=0)
    woff, soff = _offs(e_r, nr, sw_e, sw_n, ss_e, ss_n, FMT)
    offs_q = tl.arange(0, NP)
    acc = _down_loop(h_ptr, offs_q.to(tl.int64) * K, tl.zeros([NP], tl.int32), offs_q < P, w2_ptr, w2s_ptr, woff,
                     soff, (pr < P) & (nr < D), tl.zeros([R], tl.int32), K, FMT, QR, XSR, NP, R, BK, K, EVEN_K,
                     DT, DH, ASM, HW, NUM_STAGES)
    d = tl.sum(tl.where(offs_q[:, None, None] == offs_q[None, None, :], tl.reshape(acc, [NP, BN, NP]), 0.0), axis=2)
    if FMT == 3:
        d = d * (tl.load(w2g_ptr + tl.load(idx_ptr + offs_q, mask=offs_q < P, other=0)) * 256.0)[:, None]
    else:
        d = d * _post(w2g_ptr, 0, FMT)
    d = _round_to(d, BF16)  # [NP, BN]: the pair outputs
    # per token, its k pair outputs in ascending expert order (ties by slot), fp32
    toks = tl.arange(0, BM)
    offs_j = tl.arange(0, KP)
    tj_ok = (toks[:, None] < T) & (offs_j[None, :] < KTOP)
    ev = tl.load(idx_ptr + toks[:, None] * KTOP + offs_j[None, :], mask=tj_ok, other=0)
    before = (ev[:, None, :] < ev[:, :, None]) | ((ev[:, None, :] == ev[:, :, None])
                                                  & (offs_j[None, None, :] < offs_j[None, :, None]))
    rank = tl.sum((before & tj_ok[:, None, :]).to(tl.int32), axis=2)  # [BM, KP]
    acc_y = tl.zeros([BN, BM], dtype=tl.float32)
    for rr in tl.static_range(KTOP):
        q = toks * KTOP + tl.sum(tl.where((rank == rr) & tj_ok, offs_j[None, :], 0), axis=1)  # [BM] pair index
        acc_y += tl.sum(tl.where(offs_q[:, None, None] == q[None, None, :], d[:, :, None], 0.0), axis=0)
    if HAS_SHARED:
        # stacked row s*BN + n: output row n0 + n over K chunk s; columns (chunk s, token t)
        RS: tl.constexpr = NSC * BN
        NC: tl.constexpr = NSC * BM
        rs = tl.arange(0, RS)
        ns = n0 + rs % BN
        kbs = (rs // BN) * CK
        s_woff, s_soff = _offs(0, ns, 0, sv_n, 0, svs_n, SFMT)
        cs = tl.arange(0, NC)
        ct = cs % BM
        ckb = (cs // BM) * CK
        s_acc = _down_loop(h_ptr, (P + ct).to(tl.int64) * K + ckb, ckb, ct < T, v2_ptr, v2s_ptr, s_woff, s_soff,
                           ns < D, kbs, K, SFMT, QS, XSS, NC, RS, BKS, CK, EVEN_KS, DT, DH, ASM, HW, NUM_STAGES)
        s4 = tl.reshape(s_acc, [NSC, BN, NSC, BM])
        sel = tl.arange(0, NSC)[:, None, None, None] == tl.arange(0, NSC)[None, None, :, None]
        s_y = tl.sum(tl.sum(tl.where(sel, s4, 0.0), axis=2), axis=0)  # [BN, BM]: the chunks' sum
        acc_y += _round_to(s_y * _post(v2g_ptr, 0, SFMT), BF16)
    acc_y = _round_to(acc_y, BF16)
    rows = n0 + tl.arange(0, BN)
    ptrs = y_ptr + toks[None, :] * D + rows[:, None]
    tl.store(ptrs, acc_y.to(y_ptr.dtype.element_ty), mask=(toks[None, :] < T) & (rows[:, None] < D))


@triton.jit
def _moe_down_grouped_kernel(h_ptr, wts_ptr, srt_ptr, seg_ptr, toff_ptr, w2_ptr, w2s_ptr, w2g_ptr,
                             v2_ptr, v2s_ptr, v2g_ptr, ys_ptr, T, K, D, NE,
                             sw_e, sw_n, ss_e, ss_n, sv_n, svs_n, n_items_s, nt_s, nt_r,
                             KTOP: tl.constexpr, LOGE: tl.constexpr, HAS_SHARED: tl.constexpr,
                             FMT: tl.constexpr, SFMT: tl.constexpr, XSR: tl.constexpr, XSS: tl.constexpr,
                             BF16: tl.constexpr, BM: tl.constexpr, BMS: tl.constexpr, BN: tl.constexpr,
                             BNS: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, EVEN_K: tl.constexpr,
                             EVEN_KS: tl.constexpr, DT: tl.constexpr, DH: tl.constexpr, ASM: tl.constexpr,
                             HW: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Per-row w2 outputs ys[r] = round(w2[e] @ h[r]) for the work items (h already FP8-simulated)."""
    pid = tl.program_id(0)
    n_s = n_items_s * nt_s
    if HAS_SHARED and pid < n_s:
        s_n0 = (pid // n_items_s) * BNS  # token tiles of one n-tile adjacent: the weight tile is read once
        s_toks = (pid % n_items_s) * BMS + tl.arange(0, BMS)
        s_ok = s_toks < T
        s_rows = s_n0 + tl.arange(0, BNS)
        s_woff, s_soff = _offs(0, s_rows, 0, sv_n, 0, svs_n, SFMT)
        s_acc = _down_loop(h_ptr, (T * KTOP + s_toks).to(tl.int64) * K, tl.zeros([BMS], tl.int32), s_ok, v2_ptr,
                           v2s_ptr, s_woff, s_soff, s_rows < D, tl.zeros([BNS], tl.int32), K, SFMT, False, XSS,
                           BMS, BNS, BKS, K, EVEN_KS, DT, DH, ASM, HW, NUM_STAGES)
        s_out = _round_to(s_acc * _post(v2g_ptr, 0, SFMT), BF16)
        s_ptrs = ys_ptr + (T * KTOP + s_toks[None, :]).to(tl.int64) * D + s_rows[:, None]
        tl.store(s_ptrs, s_out.to(ys_ptr.dtype.element_ty), mask=s_ok[None, :] & (s_rows[:, None] < D))
    else:
        q = pid - n_s if HAS_SHARED else pid
        item = q // nt_r
        n0 = (q % nt_r) * BN
        valid, e, toks, rows_out, has, wt = _sorted_item(srt_ptr, seg_ptr, toff_ptr, wts_ptr, item, KTOP, NE,
                                                          LOGE, BM)
        if valid:
            rows = n0 + tl.arange(0, BN)
            woff, soff = _offs(e, rows, sw_e, sw_n, ss_e, ss_n, FMT)
            acc = _down_loop(h_ptr, rows_out.to(tl.int64) * K, tl.zeros([BM], tl.int32), has, w2_ptr, w2s_ptr, woff,
                             soff, rows < D, tl.zeros([BN], tl.int32), K, FMT, False, XSR, BM, BN, BK, K, EVEN_K,
                             DT, DH, ASM, HW, NUM_STAGES)
            out = _round_to(acc * _post(w2g_ptr, e, FMT), BF16)
            ptrs = ys_ptr + rows_out[None, :].to(tl.int64) * D + rows[:, None]
            tl.store(ptrs, out.to(ys_ptr.dtype.element_ty), mask=has[None, :] & (rows[:, None] < D))


@triton.jit
def _moe_sort_kernel(idx_ptr, srt_ptr, seg_ptr, toff_ptr, P, NE, BMT: tl.constexpr, EP: tl.constexpr,
                     CH: tl.constexpr, PP: tl.constexpr):
    """One CTA: stable counting sort of the P (token, slot) pairs by expert. seg [E+1]: pair offsets per expert;
    toff [E+1]: work-item offsets (ceil(count / BMT) items per expert); srt [P]: pair rows t*k+j by expert.
    P <= PP (a power of two, PP * EP < 2^31): one histogram and one tl.sort of the keys expert * PP + pair (distinct,
    so the sort is the stable one); else (PP = 0) chunks of CH pairs, each placed after the earlier chunks' pairs."""
    offs_e = tl.arange(0, EP)
    if PP > 0:
        p = tl.arange(0, PP)
        ev = tl.load(idx_ptr + p, mask=p < P, other=0).to(tl.int32)
        counts = tl.histogram(ev, EP, mask=p < P)
    else:
        counts = tl.zeros([EP], dtype=tl.int32)
        for c0 in range(0, P, CH):
            pc = c0 + tl.arange(0, CH)
            evc = tl.load(idx_ptr + pc, mask=pc < P, other=0).to(tl.int32)
            counts += tl.histogram(evc, EP, mask=pc < P)
    seg = tl.cumsum(counts, axis=0) - counts
    tiles = (counts + BMT - 1) // BMT
    toff = tl.cumsum(tiles, axis=0) - tiles
    e_ok = offs_e < NE
    tl.store(seg_ptr + offs_e, seg, mask=e_ok)
    tl.store(toff_ptr + offs_e, toff, mask=e_ok)
    tl.store(seg_ptr + NE, tl.sum(counts))
    tl.store(toff_ptr + NE, tl.sum(tiles))
    if PP > 0:
        keys = tl.sort(tl.where(p < P, ev * PP + p, EP * PP), 0)  # pairs past P sort last
        tl.store(srt_ptr + p, keys & (PP - 1), mask=p < P)
    else:
        run = seg
        offs_c = tl.arange(0, CH)
        for c0 in range(0, P, CH):
            pc = c0 + offs_c
            ok = pc < P
            evc = tl.load(idx_ptr + pc, mask=ok, other=0).to(tl.int32)
            same = (evc[:, None] == evc[None, :]) & (offs_c[None, :] < offs_c[:, None])
            pos = tl.gather(run, evc, 0) + tl.sum(same.to(tl.int32), axis=1)  # earlier pairs of this expert first
            tl.store(srt_ptr + pos, pc, mask=ok)
            run += tl.histogram(evc, EP, mask=ok)


@triton.jit
def _act_sim_kernel(x_ptr, y_ptr, R, K, sx, sy, BK: tl.constexpr, HW: tl.constexpr):
    """y[r] = act_quant_sim_ref(x[r]) (FP8 1x128) for one row block of BK columns."""
    r = tl.program_id(0)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    xv = tl.load(x_ptr + r.to(tl.int64) * sx + k[None, :], mask=k[None, :] < K, other=0.0).to(tl.float32)
    q = _act_sim(xv, 1, BK, HW)
    tl.store(y_ptr + r.to(tl.int64) * sy + k[None, :], q.to(y_ptr.dtype.element_ty), mask=k[None, :] < K)


@triton.jit
def _moe_combine_kernel(ys_ptr, idx_ptr, y_ptr, T, D, KTOP: tl.constexpr, KP: tl.constexpr,
                        HAS_SHARED: tl.constexpr, BF16: tl.constexpr, BD: tl.constexpr):
    """y[t] = sum of its k routed outputs in ascending expert order (ties by slot), then the shared one."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BD + tl.arange(0, BD)
    n_ok = offs_n < D
    offs_j = tl.arange(0, KP)
    j_ok = offs_j < KTOP
    ev = tl.load(idx_ptr + t * KTOP + offs_j, mask=j_ok, other=0)
    before = (ev[None, :] < ev[:, None]) | ((ev[None, :] == ev[:, None]) & (offs_j[None, :] < offs_j[:, None]))
    rank = tl.sum((before & j_ok[None, :]).to(tl.int32), axis=1)
    acc = tl.zeros([BD], dtype=tl.float32)
    for r in tl.static_range(KTOP):
        j = tl.sum(tl.where((rank == r) & j_ok, offs_j, 0))
        acc += tl.load(ys_ptr + (t * KTOP + j).to(tl.int64) * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        acc += tl.load(ys_ptr + (T * KTOP + t).to(tl.int64) * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    acc = _round_to(acc, BF16)
    tl.store(y_ptr + t.to(tl.int64) * D + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


# ---------------------------------------------------------------------------------------------------------
# experts: host side

SORT_PAIRS = 1024  # (token, slot) pairs the prefill sort takes in one tl.sort: a 128-token chunk of k <= 8
CONFIG_OVERRIDES: dict[str, int] = {}  # tools/benchmarks may pin a config key (see _cfg); empty in production


def _cfg(key: str, default: int) -> int:
    return CONFIG_OVERRIDES.get(key, default)


def _pow2_divisor(k: int, cap: int) -> int:
    """Largest power of two <= cap dividing k (>= 16 when k % 16 == 0)."""
    b = cap
    while b > 16 and k % b:
        b //= 2
    return b


def _bk(fmt: str, k: int, aq: bool) -> int:
    if fmt == "fp8":
        return 128
    if fmt == "dense":
        return _pow2_divisor(k, 128) if k % 16 == 0 else 64
    bk = _pow2_divisor(k, _cfg("bk", 256))
    return max(bk, 128) if aq else bk


def _wargs(w: PreparedLinear, stacked: bool):
    """(weight view, scale, global scale, weight expert / row strides, scale expert / row strides). FP4 weights are
    read as int32 words; the FP8 scale "row" stride is that of its 128-row blocks."""
    t = w.weight.view(torch.int32) if w.fmt in ("mxfp4", "nvfp4") else w.weight
    s = w.scale if w.scale is not None else t
    g = w.global_scale if w.global_scale is not None else t
    o = 1 if stacked else 0
    sw_e = t.stride(0) if stacked else 0
    ss_e = s.stride(0) if (stacked and w.scale is not None) else 0
    ss_n = s.stride(o) if w.scale is not None and s.dim() > o else 0
    return t, s, g, sw_e, t.stride(o), ss_e, ss_n


def _check_expert_weights(name: str, w: PreparedLinear, stacked: bool, n: int, k: int, device) -> None:
    if not isinstance(w, PreparedLinear):
        raise TypeError(f"moe_experts: {name} must be a PreparedLinear, got {type(w).__name__}")
    if w.fmt not in _FMTS:
        raise ValueError(f"moe_experts: {name} format {w.fmt!r} unknown")
    if (w.n, w.k) != (n, k):
        raise ValueError(f"moe_experts: {name} is [{w.n}, {w.k}], expected [{n}, {k}]")
    lead = 1 if stacked else 0
    if w.weight.dim() != 2 + lead:
        want = "[E, N, K]" if stacked else "[N, K]"
        raise ValueError(f"moe_experts: {name} weight {tuple(w.weight.shape)} must be {want}")
    if w.fmt == "dense" and w.weight.dtype != torch.bfloat16:
        raise ValueError(f"moe_experts: dense {name} must be bf16 for the fast path, got {w.weight.dtype}")
    if w.fmt in ("mxfp4", "nvfp4") and k % 32:
        raise ValueError(f"moe_experts: {w.fmt} {name} K={k} must be a multiple of 32")
    if w.fmt == "nvfp4" and (w.global_scale is None or w.global_scale.dtype != torch.float32):
        raise ValueError(f"moe_experts: nvfp4 {name} needs a float32 global_scale")
    for t in w.tensors():
        if t.device != device:
            raise ValueError(f"moe_experts: {name} on {t.device}, x on {device}")
        if not t.is_contiguous():
            raise ValueError(f"moe_experts: {name} tensors must be contiguous")


def moe_experts(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w1: PreparedLinear,
                w2: PreparedLinear, w3: PreparedLinear, shared: tuple | None, limit: float,
                act_quant: bool) -> torch.Tensor:
    """x [T,D], weights/idx [T,k], stacked w1/w2/w3 [E,...], shared (w1, w2, w3) -> [T,D] in x.dtype."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"moe_experts: x must be [T, D] bf16/fp32, got {x.dtype}{tuple(x.shape)}")
    T, D = x.shape
    if idx.dim() != 2 or idx.shape[0] != T or weights.shape != idx.shape:
        raise ValueError(f"moe_experts: idx {tuple(idx.shape)} / weights {tuple(weights.shape)} must be [{T}, k]")
    k = idx.shape[1]
    dev = x.device
    N = w1.n
    _check_expert_weights("w1", w1, True, N, D, dev)
    _check_expert_weights("w3", w3, True, N, D, dev)
    _check_expert_weights("w2", w2, True, D, N, dev)
    if not (w1.fmt == w2.fmt == w3.fmt):
        raise ValueError(f"moe_experts: routed formats differ ({w1.fmt}, {w2.fmt}, {w3.fmt})")
    E = w1.weight.shape[0]
    if shared is not None:
        s1, s2, s3 = shared
        _check_expert_weights("shared w1", s1, False, N, D, dev)
        _check_expert_weights("shared w3", s3, False, N, D, dev)
        _check_expert_weights("shared w2", s2, False, D, N, dev)
        if not (s1.fmt == s2.fmt == s3.fmt):
            raise ValueError(f"moe_experts: shared formats differ ({s1.fmt}, {s2.fmt}, {s3.fmt})")
    fmt = w1.fmt
    sfmt = shared[0].fmt if shared is not None else fmt
    aq_r = bool(act_quant) and fmt != "dense"
    aq_s = bool(act_quant) and sfmt != "dense"
    if (aq_r or aq_s) and (D % ACT_BLOCK or N % ACT_BLOCK):
        raise ValueError(f"moe_experts: D={D} and inter={N} must be multiples of {ACT_BLOCK} for activation "
                         f"quantization")
    if x.stride(1) != 1 or idx.device != dev or weights.device != dev:
        raise ValueError("moe_experts: x needs unit stride along D; idx and weights on x's device")
    x = x.contiguous()
    idx = idx.contiguous()
    weights = weights.contiguous().float()
    y = torch.empty_like(x)
    if T == 0:
        return y
    gpu = _native(dev)
    bf16 = x.dtype == torch.bfloat16
    com = dict(DT=tl.bfloat16 if gpu else tl.float32, DH=tl.float16 if gpu else tl.float32, ASM=gpu, HW=gpu,
               BF16=bf16)
    xsr = 1 if (not gpu or aq_r or bf16) else 3
    xss = 1 if (not gpu or aq_s or bf16) else 3
    has_shared = shared is not None
    r1, r2, r3 = (_wargs(w, True) for w in (w1, w2, w3))
    if has_shared:
        q1, q2, q3 = (_wargs(w, False) for w in shared)
    else:
        q1, q2, q3 = r1, r2, r3
    h = torch.empty((T * (k + 1), N), dtype=x.dtype, device=dev)
    bk1, bks1 = _bk(fmt, D, aq_r), _bk(sfmt, D, aq_s)
    KP = triton.next_power_of_2(k)
    ew = dict(FMT=_FMTS[fmt], SFMT=_FMTS[sfmt], XSR=xsr, XSS=xss, HAS_SHARED=has_shared, KTOP=k)
    if T <= _cfg("decode_max_t", DECODE_MAX_T):
        bn1, bns1 = _cfg("up_bn", 32), _cfg("up_bns", 32)  # 2 warps, 16 rows each
        BM = triton.next_power_of_2(T)
        NP = triton.next_power_of_2(T * k)
        nt_r, nt_s = triton.cdiv(N, bn1), triton.cdiv(N, bns1)
        n_s = nt_s if has_shared else 0
        xr = xs = x
        upq = bool(_cfg("up_preq", 0)) and (aq_r or aq_s)  # FP8-simulate x in its own launch, not in every CTA
        if upq:
            xq = torch.empty_like(x)
            _act_sim_kernel[(T, triton.cdiv(D, 128))](x, xq, T, D, x.stride(0), xq.stride(0), BK=128, HW=gpu,
                                                      num_warps=4)
            xr = xq if aq_r else x
            xs = xq if aq_s else x
        _moe_up_kernel[(n_s + T * k * nt_r,)](
            xr, xs, weights, idx, idx, idx, idx, *r1[:3], *r3[:3], *q1[:3], *q3[:3], h, T, D, N, float(limit),
            x.stride(0), E, *r1[3:], q1[4], q1[6], 1, nt_s, nt_r,
            KP=KP, TKP=NP, LOGE=1, SORTED=False, QR=aq_r and not upq, QS=aq_s and not upq, HAS_LIMIT=limit > 0,
            BM=BM, BMS=BM,
            BN=bn1, BNS=bns1, BK=bk1, BKS=bks1, EVEN_K=D % bk1 == 0, EVEN_KS=D % bks1 == 0,
            num_warps=_cfg("up_warps", 2), NUM_STAGES=_cfg("stages", 4), **ew, **com)
        preq = bool(_cfg("down_preq", 0))  # FP8-simulate h in its own launch instead of in every down CTA
        if preq:
            bkq = 512 if N % 512 == 0 else 128
            if aq_r:
                _act_sim_kernel[(T * k, triton.cdiv(N, bkq))](h, h, T * k, N, N, N, BK=bkq, HW=gpu, num_warps=4)
            if aq_s and has_shared:
                hs = h[T * k:]
                _act_sim_kernel[(T, triton.cdiv(N, bkq))](hs, hs, T, N, N, N, BK=bkq, HW=gpu, num_warps=4)
        rows = _cfg("down_rows", 128)
        bn2 = max(1, rows // NP)
        bk2 = _bk(fmt, N, aq_r) if fmt == "dense" else min(_bk(fmt, N, aq_r), _cfg("down_bk", 128))
        bks2 = _bk(sfmt, N, aq_s) if sfmt == "dense" else min(_bk(sfmt, N, aq_s), _cfg("down_bk", 128))
        nsc = 1
        while 2 * nsc * bn2 <= rows and N % (2 * nsc * bks2) == 0:
            nsc *= 2
        _moe_down_decode_kernel[(triton.cdiv(D, bn2),)](
            h, idx, *r2[:3], *q2[:3], y, T, N, D, *r2[3:], q2[4], q2[6], N // nsc,
            KP=KP, NP=NP, NSC=nsc, QR=aq_r and not preq, QS=aq_s and not preq, BM=BM, BN=bn2, BK=bk2, BKS=bks2,
            EVEN_K=N % bk2 == 0, EVEN_KS=(N // nsc) % bks2 == 0, num_warps=_cfg("down_warps", 4),
            NUM_STAGES=_cfg("stages", 4), **ew, **com)
        return y
    # ---- prefill: device sort into a bounded work list, grouped GEMMs, ordered combine
    P = T * k
    BM = _cfg("bmt", 8)  # token rows per routed work item: 8 keeps the mma.sync path (N = 16 goes to wgmma)
    BMS = _cfg("bms", 16)  # token rows per shared tile: more rows cost registers (occupancy) in every CTA
    bn1, bns1 = _cfg("p_up_bn", 64), _cfg("p_up_bns", 64)
    # warps and pipeline stages of the up and the down kernel apart (H200, 128 tokens: 2 stages for both, 2 warps for
    # the down's 64 x 8 tiles; 1365 -> 1268 us, docs/performance.md sixteenth pass)
    pu_w, pu_s = _cfg("pu_warps", 4), _cfg("pu_stages", 2)
    pd_w, pd_s = _cfg("pd_warps", 2), _cfg("pd_stages", 2)
    srt = torch.empty((P,), dtype=torch.int32, device=dev)
    seg = torch.empty((E + 1,), dtype=torch.int32, device=dev)
    toff = torch.empty((E + 1,), dtype=torch.int32, device=dev)
    EP = triton.next_power_of_2(E)
    PP = SORT_PAIRS if P <= SORT_PAIRS and SORT_PAIRS * EP < 2 ** 31 else 0  # a fixed PP: no shape per chunk length
    _moe_sort_kernel[(1,)](idx, srt, seg, toff, P, E, BMT=BM, EP=EP, CH=64, PP=PP, num_warps=4)
    w_max = triton.cdiv(P, BM) + min(E, P)
    items_s = triton.cdiv(T, BMS) if has_shared else 0
    loge = max(1, (E - 1).bit_length())
    xq = None
    if aq_r or aq_s:
        xq = torch.empty_like(x)
        bkq = 512 if D % 512 == 0 else 128
        _act_sim_kernel[(T, triton.cdiv(D, bkq))](x, xq, T, D, x.stride(0), xq.stride(0), BK=bkq, HW=gpu,
                                                  num_warps=4)
    xr = xq if aq_r else x
    xs = xq if aq_s else x
    nt_r, nt_s = triton.cdiv(N, bn1), triton.cdiv(N, bns1)
    _moe_up_kernel[(items_s * nt_s + w_max * nt_r,)](
        xr, xs, weights, idx, srt, seg, toff, *r1[:3], *r3[:3], *q1[:3], *q3[:3], h, T, D, N, float(limit),
        x.stride(0), E, *r1[3:], q1[4], q1[6], items_s, nt_s, nt_r,
        KP=KP, TKP=1, LOGE=loge, SORTED=True, QR=False, QS=False, HAS_LIMIT=limit > 0, BM=BM, BMS=BMS,
        BN=bn1, BNS=bns1, BK=bk1, BKS=bks1, EVEN_K=D % bk1 == 0, EVEN_KS=D % bks1 == 0,
        num_warps=pu_w, NUM_STAGES=pu_s, **ew, **com)
    bkq = 512 if N % 512 == 0 else 128
    if aq_r:
        _act_sim_kernel[(P, triton.cdiv(N, bkq))](h, h, P, N, N, N, BK=bkq, HW=gpu, num_warps=4)
    if aq_s and has_shared:
        hs = h[P:]
        _act_sim_kernel[(T, triton.cdiv(N, bkq))](hs, hs, T, N, N, N, BK=bkq, HW=gpu, num_warps=4)
    ys = torch.empty((T * (k + 1), D), dtype=x.dtype, device=dev)
    bk2, bks2 = _bk(fmt, N, aq_r), _bk(sfmt, N, aq_s)
    bn2 = _cfg("p_down_bn", 64)
    nt_r, nt_s = triton.cdiv(D, bn2), triton.cdiv(D, bn2)
    _moe_down_grouped_kernel[(items_s * nt_s + w_max * nt_r,)](
        h, weights, srt, seg, toff, *r2[:3], *q2[:3], ys, T, N, D, E, *r2[3:], q2[4], q2[6], items_s, nt_s, nt_r,
        LOGE=loge, BM=BM, BMS=BMS, BN=bn2, BNS=bn2, BK=bk2, BKS=bks2, EVEN_K=N % bk2 == 0, EVEN_KS=N % bks2 == 0,
        num_warps=pd_w, NUM_STAGES=pd_s, **ew, **com)
    BD = min(1024, triton.next_power_of_2(D))
    _moe_combine_kernel[(T, triton.cdiv(D, BD))](ys, idx, y, T, D, KTOP=k, KP=KP, HAS_SHARED=has_shared,
                                                  BF16=bf16, BD=BD, num_warps=4)
    return y
