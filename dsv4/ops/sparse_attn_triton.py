"""Triton fast path of `sparse_attn` (same signature and numerics as `sparse_attn_ref`, SPEC §2.3.5).

Owns two kernels and the shape -> config choice; touches nothing else.
- `_attn_kernel`: programs over (query, head group of BH heads, split of the index list). A program holds
  its heads' q rows (heads are the M dimension of both dots), gathers the K = V rows its list names 64
  slots at a time (window part from `kv_win`, compressed part from `kv_comp`, addressed from kv_win's base;
  a block may straddle the two; -1 slots are masked, never read) and runs DeepSeek's online softmax over
  those 64-slot blocks in list order: s = (q.k) fp32 * scale, m_new = max(m, max s), p = exp(s - m_new),
  Z = Z e^(m - m_new) + sum p, acc = acc e^(m - m_new) + bf16(p).v (tl.dot, fp32 accumulation).
  STAGE 0 (prefill, or any call with enough programs): one program walks the whole list and finishes in
  place: Z += exp(sink - m), o = acc / Z (IEEE division), one rounding.
  Decode split-KV (few queries: a block's index load -> row gather latency then overlaps across splits
  of one block each): STAGE 1 writes each split's maximum logit per head; STAGE 2 walks each split starting
  from the running maximum of the splits before it, which is the sequential walk's m at that point, so
  every p and bf16(p) is exactly the walk's; it writes its partial (m, Z, acc).
- `_combine_kernel`: m* = max m_i, Z = sum Z_i e^(m_i - m*), acc = sum acc_i e^(m_i - m*), then the sink and
  o = acc / Z. Against the sequential walk only the fp32 rescaling of the partials differs (one exp of a
  sum instead of a product of exps, ~1e-7 relative), which flips an output rounding very rarely.
Given (cos, sin), the kernel that writes o rotates its last rd dims back (rope_ref's inverse, on the rounded
output). Both launches agree with the reference up to fp32 summation order (tolerance `op_attention`). No host sync;
indices and counts are read on the device; configs are fixed functions of the shapes (CUDA-graph safe).
The wrapper validates, allocates the output (and the split scratch) and launches.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv4.ops.kv_pack import ROPE, is_packed, packed_dim
from dsv4.ops.triton_util import JitTwins, packed_kv_chunk, rne_bf16, rope_pairs

BLOCK = 64  # slots per online-softmax step, as sparse_attn_ref and DeepSeek's kernel

_KV_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


# ---------------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _round_kind(x, KIND: tl.constexpr):
    """fp32 -> the nearest value of the KV dtype (bf16 / fp16 / fp32, ties to even), still fp32."""
    if KIND == 0:
        return rne_bf16(x)
    elif KIND == 1:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _to_kind(x, KIND: tl.constexpr):
    """fp32 -> the KV dtype, rounded to nearest-even (the cast after _round_kind is exact)."""
    if KIND == 0:
        return rne_bf16(x).to(tl.bfloat16)
    elif KIND == 1:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def _out_tile(v, c0, cs_ptr, sn_ptr, s, BH: tl.constexpr, BC: tl.constexpr, D: tl.constexpr, RD2: tl.constexpr,
              OUT_KIND: tl.constexpr):
    """The output tile v [BH, BC] (fp32, columns c0 .. c0 + BC of D) in the output dtype: rounded, and where
    RD2 > 0 the columns among the last 2 * RD2 RoPE-inverted as rope_ref(o, cos, sin, True) does, from
    the rounded values in fp32 (pairs (2i, 2i + 1), angles of token s), rounded again."""
    r = _round_kind(v, OUT_KIND)
    if RD2 > 0:
        a, b = tl.split(tl.reshape(r, [BH, BC // 2, 2]))
        off = c0 + 2 * tl.arange(0, BC // 2) - (D - 2 * RD2)  # column of the pair's first value in the RoPE dims
        inr = (off >= 0) & (off < 2 * RD2)
        k = tl.where(inr, off // 2, 0)
        cs = tl.load(cs_ptr + s * RD2 + k, mask=inr, other=1.0)[None, :]
        sn = tl.load(sn_ptr + s * RD2 + k, mask=inr, other=0.0)[None, :]
        ra, rb = rope_pairs(a, b, cs, sn, True)
        ra = tl.where(inr[None, :], _round_kind(ra, OUT_KIND), a)
        rb = tl.where(inr[None, :], _round_kind(rb, OUT_KIND), b)
        r = tl.reshape(tl.join(ra, rb), [BH, BC])
    return _to_kind(r, OUT_KIND)


@triton.jit
def _dot(a, b, OPT: tl.constexpr):
    """a @ b with fp32 accumulation, operands in OPT (values exact in it); fp32 operands in full precision."""
    if OPT == tl.float32:
        return tl.dot(a.to(OPT), b.to(OPT), input_precision="ieee")
    else:
        return tl.dot(a.to(OPT), b.to(OPT))


@triton.jit
def _dot_acc(a, b, c, OPT: tl.constexpr):
    """c + a @ b, accumulated in fp32 (see _dot)."""
    if OPT == tl.float32:
        return tl.dot(a.to(OPT), b.to(OPT), c, input_precision="ieee")
    else:
        return tl.dot(a.to(OPT), b.to(OPT), c)


# ---------------------------------------------------------------------------------------------------------
# the walk over the index list


@triton.jit
def _slots(blk, iw_row, ic_row, Lw, Lc, siw_l, sic_l, w_off, c_off, skw_n, skc_n, BLOCK: tl.constexpr,
           HAS_COMP: tl.constexpr, ALIGNED: tl.constexpr):
    """Block `blk` of the list (window part, then compressed part) -> (valid [BLOCK], K = V row offsets
    [BLOCK] from kv_win's base). Compressed rows are reached from kv_win's base too (c_off = their distance
    in elements): one pointer tensor keeps its 16-byte alignment visible to Triton, so the gathers stay
    vectorized (a select between two pointer tensors hides it)."""
    l = blk * BLOCK + tl.arange(0, BLOCK)
    in_w = l < Lw
    iw = tl.load(iw_row + l.to(tl.int64) * siw_l, mask=in_w, other=-1).to(tl.int64)
    if HAS_COMP:
        lc = l - Lw
        in_c = (lc >= 0) & (lc < Lc)
        ic = tl.load(ic_row + lc.to(tl.int64) * sic_l, mask=in_c, other=-1).to(tl.int64)
        valid = (iw >= 0) | (ic >= 0)  # at most one of the two lists covers a slot
        rows = tl.where(in_w, w_off + iw * skw_n, c_off + ic * skc_n)
    else:
        valid = iw >= 0
        rows = w_off + iw * skw_n
    if ALIGNED:  # every row offset is a multiple of 16 elements (checked by the wrapper): 16-byte vectors
        rows = tl.multiple_of(rows, 16)
    return valid, rows


@triton.jit
def _k_chunk(kw_ptr, k16_ptr, rows, valid, offs_c, c_ok, j: tl.constexpr, DC: tl.constexpr, PACKED: tl.constexpr,
             NOPE: tl.constexpr):
    """Column chunk j (DC columns) of a block's K = V rows: loaded as they are, or the exact values of packed rows."""
    if PACKED:
        # bf16 like the rows it stands for (exact), so that both forms meet the dots in the same dtype
        return packed_kv_chunk(kw_ptr, k16_ptr, rows, valid, valid.shape[0], j * DC, DC, NOPE).to(tl.bfloat16)
    else:
        return tl.load(kw_ptr + rows[:, None] + j * DC + offs_c[None, :], mask=valid[:, None] & c_ok[None, :],
                       other=0.0)


@triton.jit
def _logits(kw_ptr, k16_ptr, rows, valid, q0, q1, q2, q3, offs_c, c_ok0, c_ok1, c_ok2, c_ok3, scale, DC: tl.constexpr,
            OPT: tl.constexpr, PACKED: tl.constexpr, NOPE: tl.constexpr):
    """Gather a block's K = V rows (four column chunks) and its logits s = (q.k) * scale, -inf where invalid."""
    k0 = _k_chunk(kw_ptr, k16_ptr, rows, valid, offs_c, c_ok0, 0, DC, PACKED, NOPE)
    k1 = _k_chunk(kw_ptr, k16_ptr, rows, valid, offs_c, c_ok1, 1, DC, PACKED, NOPE)
    k2 = _k_chunk(kw_ptr, k16_ptr, rows, valid, offs_c, c_ok2, 2, DC, PACKED, NOPE)
    k3 = _k_chunk(kw_ptr, k16_ptr, rows, valid, offs_c, c_ok3, 3, DC, PACKED, NOPE)
    sc = _dot(q0, tl.trans(k0), OPT)
    sc = _dot_acc(q1, tl.trans(k1), sc, OPT)
    sc = _dot_acc(q2, tl.trans(k2), sc, OPT)
    sc = _dot_acc(q3, tl.trans(k3), sc, OPT) * scale  # [BH, BLOCK] fp32 logits
    return tl.where(valid[None, :], sc, float("-inf")), k0, k1, k2, k3


@triton.jit
def _block(kw_ptr, k16_ptr, rows, valid, q0, q1, q2, q3, m, z, acc0, acc1, acc2, acc3, offs_c, c_ok0, c_ok1, c_ok2,
           c_ok3, scale, DC: tl.constexpr, KIND: tl.constexpr, OPT: tl.constexpr, PACKED: tl.constexpr,
           NOPE: tl.constexpr):
    """One 64-slot step of DeepSeek's online softmax: m_new = max(m, max s), p = exp(s - m_new),
    Z = Z e^(m - m_new) + sum p, acc = acc e^(m - m_new) + round(p).v."""
    sc, k0, k1, k2, k3 = _logits(kw_ptr, k16_ptr, rows, valid, q0, q1, q2, q3, offs_c, c_ok0, c_ok1, c_ok2, c_ok3,
                                 scale, DC, OPT, PACKED, NOPE)
    m_new = tl.maximum(m, tl.max(sc, 1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # 0 while nothing was valid: exp() stays finite
    alpha = tl.exp(m - base)
    p = tl.exp(sc - base[:, None])
    z = z * alpha + tl.sum(p, 1)
    pr = _round_kind(p, KIND)  # P rounded to the KV dtype; P.V accumulates in fp32
    acc0 = _dot_acc(pr, k0, acc0 * alpha[:, None], OPT)
    acc1 = _dot_acc(pr, k1, acc1 * alpha[:, None], OPT)
    acc2 = _dot_acc(pr, k2, acc2 * alpha[:, None], OPT)
    acc3 = _dot_acc(pr, k3, acc3 * alpha[:, None], OPT)
    return m_new, z, acc0, acc1, acc2, acc3


def _attn_kernel(q_ptr, kw_ptr, k16_ptr, iw_ptr, kc_delta, ic_ptr, sink_ptr, o_ptr, bm_ptr, pm_ptr, pz_ptr, pa_ptr,
                 cs_ptr, sn_ptr, scale, S, H, Lw, Lc, NBS, NSPLIT,
                 sq_b, sq_s, sq_h, skw_b, skw_n, siw_b, siw_s, siw_l, skc_b, skc_n, sic_b, sic_s, sic_l,
                 so_b, so_s, so_h,
                 D: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_COMP: tl.constexpr, STAGE: tl.constexpr, TS: tl.constexpr, KIND: tl.constexpr,
                 OUT_KIND: tl.constexpr, OPT: tl.constexpr, ALIGNED: tl.constexpr, RD2: tl.constexpr,
                 PACKED: tl.constexpr, NOPE: tl.constexpr):
    """STAGE 0: the whole list, finished in place. Split lists: STAGE 1 writes each split's maximum logit
    per head (bm); STAGE 2 walks its split from the running maximum of the splits before it (the
    sequential walk's own m at that point, so every p and bf16(p) is the walk's) and writes (m, Z, acc)."""
    qi = tl.program_id(0)
    hg = tl.program_id(1)
    sp = tl.program_id(2)
    b = (qi // S).to(tl.int64)
    s = (qi % S).to(tl.int64)
    offs_h = hg * BH + tl.arange(0, BH)
    h_ok = offs_h < H
    # D in four column chunks of DC: the dots chain over them, each K chunk goes to shared memory on its own
    # (a whole [64, 512] K tile staged in registers next to the [BH, 512] fp32 accumulator would spill)
    DC: tl.constexpr = DP // 4
    offs_c = tl.arange(0, DC)
    c_ok0 = offs_c < D
    c_ok1 = offs_c + DC < D
    c_ok2 = offs_c + 2 * DC < D
    c_ok3 = offs_c + 3 * DC < D
    q_rows = q_ptr + b * sq_b + s * sq_s + offs_h[:, None].to(tl.int64) * sq_h + offs_c[None, :]
    q0 = tl.load(q_rows, mask=h_ok[:, None] & c_ok0[None, :], other=0.0)
    q1 = tl.load(q_rows + DC, mask=h_ok[:, None] & c_ok1[None, :], other=0.0)
    q2 = tl.load(q_rows + 2 * DC, mask=h_ok[:, None] & c_ok2[None, :], other=0.0)
    q3 = tl.load(q_rows + 3 * DC, mask=h_ok[:, None] & c_ok3[None, :], other=0.0)
    L = Lw + Lc
    nblk = tl.cdiv(L, BLOCK)
    blk0 = sp * NBS
    blk1 = tl.minimum(blk0 + NBS, nblk)
    iw_row = iw_ptr + b * siw_b + s * siw_s
    ic_row = ic_ptr + b * sic_b + s * sic_s
    w_off = b * skw_b  # element offsets from kv_win's base
    c_off = kc_delta + b * skc_b
    m = tl.full([BH], float("-inf"), tl.float32)
    if STAGE == 2:  # the running maximum after the splits before this one (TS splits a load; a maximum is exact)
        offs_p = tl.arange(0, TS)
        for p0 in range(0, sp, TS):
            bm = tl.load(bm_ptr + (qi.to(tl.int64) * NSPLIT + p0 + offs_p[:, None]) * H + offs_h[None, :],
                         mask=(p0 + offs_p[:, None] < sp) & h_ok[None, :], other=float("-inf"))
            m = tl.maximum(m, tl.max(bm, 0))
    z = tl.zeros([BH], tl.float32)
    acc0 = tl.zeros([BH, DC], tl.float32)
    acc1 = tl.zeros([BH, DC], tl.float32)
    acc2 = tl.zeros([BH, DC], tl.float32)
    acc3 = tl.zeros([BH, DC], tl.float32)
    for blk in range(blk0, blk1):
        valid, rows = _slots(blk, iw_row, ic_row, Lw, Lc, siw_l, sic_l, w_off, c_off, skw_n, skc_n, BLOCK,
                             HAS_COMP, ALIGNED)
        # a block without a valid slot leaves (m, Z, acc) exactly as they are (alpha = 1, p = 0): split
        # programs (decode, whose lists end in long -1 runs) skip it; whole-list programs keep a branch-free
        # loop body, which Triton can software-pipeline
        if STAGE == 0:
            m, z, acc0, acc1, acc2, acc3 = _block(kw_ptr, k16_ptr, rows, valid, q0, q1, q2, q3, m, z, acc0, acc1, acc2,
                                                  acc3, offs_c, c_ok0, c_ok1, c_ok2, c_ok3, scale, DC, KIND, OPT,
                                                  PACKED, NOPE)
        elif tl.max(valid.to(tl.int32), 0) > 0:
            if STAGE == 1:
                sc, _, _, _, _ = _logits(kw_ptr, k16_ptr, rows, valid, q0, q1, q2, q3, offs_c, c_ok0, c_ok1, c_ok2,
                                         c_ok3, scale, DC, OPT, PACKED, NOPE)
                m = tl.maximum(m, tl.max(sc, 1))
            else:
                m, z, acc0, acc1, acc2, acc3 = _block(kw_ptr, k16_ptr, rows, valid, q0, q1, q2, q3, m, z, acc0, acc1,
                                                      acc2, acc3, offs_c, c_ok0, c_ok1, c_ok2, c_ok3, scale, DC, KIND,
                                                      OPT, PACKED, NOPE)
    h2 = h_ok[:, None]
    prow = (qi * NSPLIT + sp).to(tl.int64) * H + offs_h
    if STAGE == 1:
        tl.store(bm_ptr + prow, m, mask=h_ok)
    elif STAGE == 2:
        tl.store(pm_ptr + prow, m, mask=h_ok)
        tl.store(pz_ptr + prow, z, mask=h_ok)
        pa = pa_ptr + prow[:, None] * D + offs_c[None, :]
        tl.store(pa, acc0, mask=h2 & c_ok0[None, :])
        tl.store(pa + DC, acc1, mask=h2 & c_ok1[None, :])
        tl.store(pa + 2 * DC, acc2, mask=h2 & c_ok2[None, :])
        tl.store(pa + 3 * DC, acc3, mask=h2 & c_ok3[None, :])
    else:
        base = tl.where(m == float("-inf"), 0.0, m)
        sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
        zz = (z + tl.exp(sink - base))[:, None]
        o = o_ptr + b * so_b + s * so_s + offs_h[:, None].to(tl.int64) * so_h + offs_c[None, :]
        # each chunk that reaches into the RoPE dims (a compile-time test) rotates them back
        RA: tl.constexpr = RD2 if DC > D - 2 * RD2 else 0
        RB: tl.constexpr = RD2 if 2 * DC > D - 2 * RD2 else 0
        RC: tl.constexpr = RD2 if 3 * DC > D - 2 * RD2 else 0
        tl.store(o, _out_tile(tl.math.div_rn(acc0, zz), 0, cs_ptr, sn_ptr, s, BH, DC, D, RA, OUT_KIND),
                 mask=h2 & c_ok0[None, :])
        tl.store(o + DC, _out_tile(tl.math.div_rn(acc1, zz), DC, cs_ptr, sn_ptr, s, BH, DC, D, RB, OUT_KIND),
                 mask=h2 & c_ok1[None, :])
        tl.store(o + 2 * DC, _out_tile(tl.math.div_rn(acc2, zz), 2 * DC, cs_ptr, sn_ptr, s, BH, DC, D, RC, OUT_KIND),
                 mask=h2 & c_ok2[None, :])
        tl.store(o + 3 * DC, _out_tile(tl.math.div_rn(acc3, zz), 3 * DC, cs_ptr, sn_ptr, s, BH, DC, D, RD2, OUT_KIND),
                 mask=h2 & c_ok3[None, :])


def _combine_kernel(pm_ptr, pz_ptr, pa_ptr, sink_ptr, o_ptr, cs_ptr, sn_ptr, S, H, NSPLIT, so_b, so_s, so_h,
                    D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, TS: tl.constexpr,
                    OUT_KIND: tl.constexpr, RD2: tl.constexpr):
    """One program per (query, BH heads, BD output columns): m* = max m_i, Z = sum Z_i e^(m_i - m*),
    acc = sum acc_i e^(m_i - m*) over the splits, then the sink and o = acc / Z. The splits go TS at a time (a
    [TS, BH, BD] load of partials, summed, then added in split order): for a given split count the same sums
    whatever else the call's shapes are, and one compile serves every count."""
    qi = tl.program_id(0)
    hg = tl.program_id(1)
    dg = tl.program_id(2)
    b = (qi // S).to(tl.int64)
    s = (qi % S).to(tl.int64)
    offs_h = hg * BH + tl.arange(0, BH)
    h_ok = offs_h < H
    offs_d = dg * BD + tl.arange(0, BD)
    d_ok = offs_d < D
    offs_p = tl.arange(0, TS)
    row0 = qi.to(tl.int64) * NSPLIT
    m = tl.full([BH], float("-inf"), tl.float32)
    for p0 in range(0, NSPLIT, TS):
        pidx = (row0 + p0 + offs_p[:, None]) * H + offs_h[None, :]  # [TS, BH]
        pmask = (p0 + offs_p[:, None] < NSPLIT) & h_ok[None, :]
        m = tl.maximum(m, tl.max(tl.load(pm_ptr + pidx, mask=pmask, other=float("-inf")), 0))
    base = tl.where(m == float("-inf"), 0.0, m)
    z = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    for p0 in range(0, NSPLIT, TS):
        pidx = (row0 + p0 + offs_p[:, None]) * H + offs_h[None, :]
        pmask = (p0 + offs_p[:, None] < NSPLIT) & h_ok[None, :]
        wgt = tl.exp(tl.load(pm_ptr + pidx, mask=pmask, other=float("-inf")) - base[None, :])  # 0 past the splits
        z = z + tl.sum(tl.load(pz_ptr + pidx, mask=pmask, other=0.0) * wgt, 0)
        a = tl.load(pa_ptr + pidx[:, :, None] * D + offs_d[None, None, :],
                    mask=pmask[:, :, None] & d_ok[None, None, :], other=0.0)  # [TS, BH, BD]
        acc = acc + tl.sum(a * wgt[:, :, None], 0)
    sink = tl.load(sink_ptr + offs_h, mask=h_ok, other=0.0)
    z = z + tl.exp(sink - base)
    o = _out_tile(tl.math.div_rn(acc, z[:, None]), dg * BD, cs_ptr, sn_ptr, s, BH, BD, D, RD2, OUT_KIND)
    tl.store(o_ptr + b * so_b + s * so_s + offs_h[:, None].to(tl.int64) * so_h + offs_d[None, :], o,
             mask=h_ok[:, None] & d_ok[None, :])


# a prefill chunk's length, its lists' widths (window and compressed slots: they grow with the position), the blocks a
# program walks, the split count and the list strides that follow them change from chunk to chunk: not specialized
# outside the decode graphs (triton_util.JitTwins), so a request compiles nothing the engine's warm-up did not. The
# batch strides go in as 0 for one sequence. Splits are read TS at a time (a split count is not a constexpr).
_attn = JitTwins(_attn_kernel, ["S", "Lw", "Lc", "NBS", "NSPLIT", "siw_s", "sic_s"])
_combine = JitTwins(_combine_kernel, ["S", "NSPLIT"])
TS = 16


# ---------------------------------------------------------------------------------------------------------
# configs: fixed functions of the shapes


def _pow2_ge(v: int) -> int:
    return 1 << max(int(v) - 1, 0).bit_length()


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the Triton interpreter: as few programs as still exercise the split path for S <= 3
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


# Tunables (the GPU bench may override). A query with few programs (decode: H / bh head groups) splits
# its list into splits of `blocks_per_split` 64-slot blocks, one program each, merged by _combine_kernel:
# a block's latency (index load -> K row gather) then overlaps across the splits. Enough queries (prefill
# chunks) walk their whole list in one program each, exact to the sequential walk.
CONFIG = {
    "split": {"bh": 16, "warps": 4, "stages": 1, "blocks_per_split": 1},
    "whole": {"bh": 64, "warps": 8, "stages": 2},
    "programs_per_sm": 1.0,  # no split once the split kernel's (query, head group) programs alone fill the SMs
}


def config(B: int, S: int, H: int, L: int, device: torch.device) -> dict:
    """{bh, warps, stages, nsplit, bps}: the launch for a call (a fixed function of the shapes)."""
    nblk = max(triton.cdiv(L, BLOCK), 1)
    sp, w = CONFIG["split"], CONFIG["whole"]
    sbh = max(16, min(sp["bh"], _pow2_ge(H)))
    if B * S * triton.cdiv(H, sbh) >= _num_sms(device) * CONFIG["programs_per_sm"] or nblk < 2:
        return dict(bh=max(16, min(w["bh"], _pow2_ge(H))), warps=w["warps"], stages=w["stages"], nsplit=1,
                    bps=nblk)
    bps = max(1, sp["blocks_per_split"])
    return dict(bh=sbh, warps=sp["warps"], stages=sp["stages"], nsplit=triton.cdiv(nblk, bps), bps=bps)


# ---------------------------------------------------------------------------------------------------------
# wrapper


def _check(q, kv_win, idx_win, kv_comp, idx_comp, sink):
    if q.dim() != 4:
        raise ValueError(f"sparse_attn: q must be [B,S,H,D], got {tuple(q.shape)}")
    B, S, H, D = q.shape
    if q.dtype not in _KV_KIND:
        raise ValueError(f"sparse_attn: q dtype {q.dtype} not supported (bf16, fp16, fp32)")
    packed = is_packed(kv_win)
    if packed:  # packed FP8 rows (both parts), bf16 queries
        if q.dtype != torch.bfloat16 or kv_win.dim() != 3 or kv_win.shape[0] != B or (
                kv_comp is not None and not is_packed(kv_comp)):
            raise ValueError(f"sparse_attn: packed rows need bf16 q and packed kv_win / kv_comp [B={B}, N, bytes], got "
                             f"q {q.dtype}, kv_win {tuple(kv_win.shape)}, kv_comp "
                             f"{None if kv_comp is None else kv_comp.dtype}")
        for t in (kv_win, kv_comp):
            if t is not None:
                packed_dim(t, D)
    elif kv_win.dim() != 3 or kv_win.shape[0] != B or kv_win.shape[2] != D or kv_win.dtype != q.dtype:
        raise ValueError(f"sparse_attn: kv_win {kv_win.dtype}{tuple(kv_win.shape)} does not match q "
                         f"{q.dtype}{tuple(q.shape)} (want [B, N, D] in q's dtype)")
    if idx_win.dim() != 3 or tuple(idx_win.shape[:2]) != (B, S) or idx_win.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sparse_attn: idx_win {idx_win.dtype}{tuple(idx_win.shape)} must be int [B={B}, S={S}, L]")
    if (kv_comp is None) != (idx_comp is None):
        raise ValueError("sparse_attn: kv_comp and idx_comp must both be given or both be None")
    if kv_comp is not None:
        if kv_comp.dim() != 3 or kv_comp.shape[0] != B or (not packed and (kv_comp.shape[2] != D
                                                                            or kv_comp.dtype != q.dtype)):
            raise ValueError(f"sparse_attn: kv_comp {kv_comp.dtype}{tuple(kv_comp.shape)} does not match q "
                             f"{q.dtype}{tuple(q.shape)}")
        if (idx_comp.dim() != 3 or tuple(idx_comp.shape[:2]) != (B, S)
                or idx_comp.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"sparse_attn: idx_comp {idx_comp.dtype}{tuple(idx_comp.shape)} must be int "
                             f"[B={B}, S={S}, L]")
    if sink.shape != (H,) or sink.dtype != torch.float32:
        raise ValueError(f"sparse_attn: sink must be fp32 [{H}], got {sink.dtype}{tuple(sink.shape)}")
    for name, t in (("q", q), ("kv_win", kv_win), ("kv_comp", kv_comp)):
        if t is not None and t.shape[-1] > 0 and t.stride(-1) != 1:
            raise ValueError(f"sparse_attn: {name} needs a unit stride on its last dim, strides {t.stride()}")
    devs = {t.device for t in (q, kv_win, idx_win, kv_comp, idx_comp, sink) if t is not None}
    if len(devs) != 1:
        raise ValueError(f"sparse_attn: tensors on several devices {sorted(map(str, devs))}")


def _rope_tables(cos, sin, S: int, D: int, unused: torch.Tensor):
    """(cos, sin, rd/2) for the kernels: fp32 contiguous [S, rd/2] tables, or (unused, unused, 0) without RoPE."""
    if cos is None and sin is None:
        return unused, unused, 0
    if (cos is None or sin is None or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != S
            or not 1 <= 2 * cos.shape[1] <= D or D % 2 or cos.device != unused.device):
        raise ValueError(f"sparse_attn: cos / sin must both be [S={S}, rd/2] with rd <= D={D} (even) on "
                         f"{unused.device}, got {None if cos is None else tuple(cos.shape)} / "
                         f"{None if sin is None else tuple(sin.shape)}")
    return cos.float().contiguous(), sin.float().contiguous(), cos.shape[1]


def sparse_attn(q: torch.Tensor, kv_win: torch.Tensor, idx_win: torch.Tensor, kv_comp: torch.Tensor | None,
                idx_comp: torch.Tensor | None, sink: torch.Tensor, scale: float, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None, *, cfg: dict | None = None) -> torch.Tensor:
    """q [B,S,H,D]; kv_win [B,Nw,D] + idx_win [B,S,Lw]; kv_comp [B,Nc,D] + idx_comp [B,S,Lc] (or None);
    sink [H] fp32 -> o [B,S,H,D] in q.dtype, its last 2 * cos.shape[1] dims RoPE-inverted when cos, sin
    [S, rd/2] are given (sparse_attn_ref's contract; kv_win / kv_comp may both be packed FP8 rows, with bf16 q).
    `cfg` overrides the launch config (benchmarks)."""
    _check(q, kv_win, idx_win, kv_comp, idx_comp, sink)
    B, S, H, D = q.shape
    cs, sn, rd2 = _rope_tables(cos, sin, S, D, sink)
    has_comp = idx_comp is not None and idx_comp.shape[-1] > 0
    Lw = idx_win.shape[-1]
    Lc = idx_comp.shape[-1] if has_comp else 0
    o = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
    if o.numel() == 0:
        return o
    c = cfg or config(B, S, H, Lw + Lc, q.device)
    bh, nsplit, bps = c["bh"], c["nsplit"], c["bps"]
    kc = kv_comp if has_comp else kv_win
    ic = idx_comp if has_comp else idx_win
    kind = _KV_KIND[q.dtype]
    # OPT: the dtype the dot operands travel in. The Triton interpreter multiplies 16-bit float operands as
    # raw integers, so there they travel as fp32 (the same values).
    opt = tl.float32 if (kind == 2 or not q.is_cuda) else (tl.bfloat16 if kind == 0 else tl.float16)
    DP = max(64, _pow2_ge(D))  # four column chunks of >= 16
    grid = (B * S, triton.cdiv(H, bh), nsplit)
    split = nsplit > 1
    if split:
        bm = torch.empty(B * S * nsplit * H, dtype=torch.float32, device=q.device)
        pm = torch.empty_like(bm)
        pz = torch.empty_like(bm)
        pa = torch.empty(B * S * nsplit * H * D, dtype=torch.float32, device=q.device)
    else:
        bm = pm = pz = pa = sink  # unused
    opts = {"num_warps": c["warps"], "num_stages": c["stages"]} if q.is_cuda else {}
    # compressed rows are addressed from kv_win's base: their distance in elements (same dtype, so exact); packed
    # rows are bytes, and their RoPE dims are read through a bf16 view of the same memory (k16)
    packed = is_packed(kv_win)
    k16 = kv_win.view(torch.bfloat16) if packed else kv_win
    kc_delta = (kc.data_ptr() - kv_win.data_ptr()) // kv_win.element_size()
    aligned = all(v % 16 == 0 for v in (kc_delta, kv_win.stride(0), kv_win.stride(1), kc.stride(0), kc.stride(1)))
    one = B == 1  # batch strides of 0 (b is 0): theirs would follow S
    args = (q, kv_win, k16, idx_win, kc_delta, ic, sink, o, bm, pm, pz, pa, cs, sn,
            float(scale), S, H, Lw, Lc, bps, nsplit,
            0 if one else q.stride(0), q.stride(1), q.stride(2), kv_win.stride(0), kv_win.stride(1),
            0 if one else idx_win.stride(0), idx_win.stride(1), idx_win.stride(2),
            kc.stride(0), kc.stride(1), 0 if one else ic.stride(0), ic.stride(1), ic.stride(2),
            0 if one else o.stride(0), o.stride(1), o.stride(2))
    meta = dict(D=D, DP=DP, BH=bh, BLOCK=BLOCK, HAS_COMP=has_comp, TS=TS, KIND=kind, OUT_KIND=kind,
                OPT=opt, ALIGNED=aligned, RD2=rd2, PACKED=packed, NOPE=D - ROPE if packed else 0, **opts)
    for stage in ((1, 2) if split else (0,)):  # split: the splits' maxima first, then the seeded walks
        _attn[grid](*args, STAGE=stage, **meta)
    if split:
        # combine tiles: TS splits of 8 heads x 64 columns a load (8K fp32 values)
        cbh, cbd = 8, 64
        copts = {"num_warps": 4} if q.is_cuda else {}
        _combine[(B * S, triton.cdiv(H, cbh), triton.cdiv(D, cbd))](
            pm, pz, pa, sink, o, cs, sn, S, H, nsplit, 0 if one else o.stride(0), o.stride(1), o.stride(2),
            D=D, BH=cbh, BD=cbd, TS=TS, OUT_KIND=kind, RD2=rd2, **copts)
    return o


def describe(B: int, S: int, H: int, L: int, device: torch.device) -> str:
    """The launch a call of these shapes gets, for bench/ab_compare listings."""
    c = config(B, S, H, L, device)
    return (f"bh={c['bh']} warps={c['warps']} splits={c['nsplit']}x{c['bps']} blocks "
            f"(list {L} slots = {math.ceil(L / BLOCK)} blocks)")
