"""Triton fast paths of `indexer_scores` and `topk_select` (same signatures and numerics as the references
in dsv4/ops/indexer.py, SPEC §2.5). Owns two kernels and their configs; touches nothing else.

- `_scores_kernel`: one program per (BN entries, block of SB queries): the entries' key tile is loaded once;
  per query it computes the [BN, H] head logits with one tl.dot (entries as the M dimension, heads as N;
  fp32 accumulation), then ReLU, times the per-head weight, and the sum over heads. Low precision (reference
  numerics) reproduces the bf16 einsum step by step: each head logit rounded to the activation dtype, relu,
  times w (rounded to that dtype), rounded, summed in fp32, rounded once (on the GPU each rounding is one
  cvt.rn). Otherwise all fp32. Only the dot's summation order differs from the reference (tolerances
  `op_bf16_out` / `op_fp32_out`). Packed FP4 keys (dsv4/ops/kv_pack.py; bf16 q, low precision, d a power of two)
  are decoded in registers to their exact bf16 values, so they score as the bf16 keys they stand for.
- `_topk_kernel`: exact top-k, bit for bit the reference's set and order. A row is cut into chunks of
  TOPK_TILE entries; each chunk's program keeps its k best (entries past the visible count are -inf), then
  merge rounds keep the k best of TOPK_MERGE candidates per program until one program per row is left,
  which sorts them. Selection is a radix select over an order-preserving integer key of the fp32 score,
  4 bits a pass (a 32-bin tl.histogram, one bin per lane): 4 passes for bf16 scores (16 significant key
  bits), 8 for fp32; ties at the k-th key go to the lowest entries, so the kept set is the reference's.
  The final order (descending score, ties to the lower entry) comes from tl.sort on (key, -place) packed
  in an int32 for bf16 scores, in an int64 (key, -entry) otherwise. -0.0 counts as +0.0 (torch compares
  them equal); -inf scores give -1. NaN scores are outside the contract. When k = N (a row that fits in one
  chunk and keeps every entry: decode up to 2K tokens of context at k = 512) the selection is skipped and only the
  final sort runs.
No host sync; counts are read on the device; configs are fixed functions of the shapes (CUDA-graph safe). On CUDA
both are launched as programmatic dependents (triton_util.PDL): each starts during the tail of the kernel before it,
lets its own dependent start, and waits for the kernel before it before reading anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4 import ops
from dsv4.ops.indexer import indexer_scores_ref
from dsv4.ops.kv_pack import KEY_BLOCK, is_packed, key_row_bytes, packed_key_dim
from dsv4.ops.triton_util import (PDL, JitTwins, gdc_launch_dependents, gdc_wait, packed_key_tile, pdl_launch,
                                  rne_bf16)

_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def _pow2_ge(v: int) -> int:
    return 1 << max(int(v) - 1, 0).bit_length()


# ---------------------------------------------------------------------------------------------------------
# scores


@triton.jit
def _round_kind(x, KIND: tl.constexpr, HW: tl.constexpr):
    """fp32 -> the nearest value of bf16 / fp16 / fp32 (ties to even), still fp32. On the GPU (HW) one cvt.rn
    (the widening back is exact); in the Triton interpreter, whose fp32 -> bf16 cast truncates, rne_bf16."""
    if KIND == 0:
        if HW:
            return x.to(tl.bfloat16).to(tl.float32)
        return rne_bf16(x)
    elif KIND == 1:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


def _scores_kernel(q_ptr, w_ptr, k_ptr, o_ptr, S, H, N, d,
                   sq_b, sq_s, sq_h, sw_b, sw_s, sk_b, sk_n, so_b, so_s, w_scale,
                   HP: tl.constexpr, DP: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, STAGES: tl.constexpr,
                   LOW: tl.constexpr, KIND: tl.constexpr, OPT: tl.constexpr, HW: tl.constexpr,
                   PACKED: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # started early: let the top-k start, wait for the kernel that writes q (the rotation)
        gdc_launch_dependents()
        gdc_wait()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    offs_h = tl.arange(0, HP)
    h_ok = offs_h < H
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < d
    if PACKED:  # packed FP4 keys (d = DP): their exact bf16 values
        kt = packed_key_tile(k_ptr + b * sk_b, offs_n.to(tl.int64) * sk_n, n_ok, BN, DP).to(tl.bfloat16).to(OPT)
    else:
        kt = tl.load(k_ptr + b * sk_b + offs_n[:, None].to(tl.int64) * sk_n + offs_d[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if LOW:
            kt = _round_kind(kt.to(tl.float32), KIND, HW)  # k.to(q.dtype)
        kt = kt.to(OPT)
    s0 = pid_s * SB
    # one K tile serves SB queries; queries past S are masked, not branched around (STAGES: the loop's
    # software-pipeline stages, 1 = not pipelined)
    for j in tl.range(0, SB, num_stages=STAGES):
        s = s0 + j
        hs_ok = h_ok & (offs_h * 0 + s < S)  # (a tensor: the interpreter's masks must be)
        qj = tl.load(q_ptr + b * sq_b + s * sq_s + offs_h[:, None] * sq_h + offs_d[None, :],
                     mask=hs_ok[:, None] & d_ok[None, :], other=0.0).to(OPT)
        wj = tl.load(w_ptr + b * sw_b + s * sw_s + offs_h, mask=hs_ok, other=0.0).to(tl.float32)
        if LOW:  # w.to(q.dtype) * w_scale, rounded to q's dtype (torch computes it in fp32)
            wj = _round_kind(_round_kind(wj, KIND, HW) * w_scale, KIND, HW)
        else:
            wj = wj * w_scale
        if OPT == tl.float32:
            t = tl.dot(kt, tl.trans(qj), input_precision="ieee")  # [BN, HP] fp32
        else:
            t = tl.dot(kt, tl.trans(qj))
        if LOW:
            t = tl.maximum(_round_kind(t, KIND, HW), 0.0)
            u = _round_kind(t * wj[None, :], KIND, HW)
            res = _round_kind(tl.sum(u, 1), KIND, HW)
        else:
            res = tl.sum(tl.maximum(t, 0.0) * wj[None, :], 1)
        tl.store(o_ptr + b * so_b + s * so_s + offs_n, res.to(o_ptr.dtype.element_ty), mask=n_ok & (offs_n * 0 + s < S))


# a prefill chunk's length S changes with the chunk: not specialized outside the decode graphs
# (triton_util.JitTwins). N, the row strides and the batch strides (0 for one sequence: theirs would follow S) stay
# specialized: a stride of unknown divisibility makes its tensor's loads scalar (N unspecialized, or the batch strides
# of q and w, cost a 128-query chunk 2x: 69 instead of 36 us at 4K entries, 316 instead of 217 at 32K), and the
# engine's warm-up meets their classes
_scores = JitTwins(_scores_kernel, ["S"])

# entries per program (BN: `bn_small` up to `large_n` entries, else `bn_large`), queries per program (one K tile
# serves SB queries), software-pipeline stages of the query loop, warps. Measured on an H200 (docs/performance.md,
# sixteenth pass): 64 entries up to 8192 (decode at 4096: 3.0 us against 3.4 with 128; a 128-query prefill there
# would take 33.3 instead of 36.0), 128 beyond (decode at 32768: 5.2 against 5.8); more queries per tile and
# pipelining the next query's loads both cost more than they save. Packed FP4 keys are decoded once per tile, so
# they take 16 queries a tile (thirty-fourth pass, 128-query prefill: 306 -> 270 us at 32K entries, 2387 -> 2052 at
# 262K; 8 and 32 measured as well)
SCORES_CFG = {"bn_small": 64, "bn_large": 128, "large_n": 8192, "sb": 4, "sb_packed": 16, "stages": 1, "warps": 4}


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, low_precision: bool,
                   w_scale: float = 1.0) -> torch.Tensor:
    """q [B,S,H,d], w [B,S,H], k [B,N,d] (or packed FP4 keys [B,N,key_row_bytes(d)] uint8) -> [B,S,N]
    (indexer_scores_ref's contract)."""
    packed = is_packed(k)
    if q.dim() != 4:
        raise ValueError(f"indexer_scores: q {tuple(q.shape)} is not [B,S,H,d]")
    kw = key_row_bytes(q.shape[3]) if packed and q.shape[3] % KEY_BLOCK == 0 else q.shape[3]
    if w.shape != q.shape[:3] or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != kw:
        raise ValueError(f"indexer_scores: q {tuple(q.shape)}, w {tuple(w.shape)}, k {tuple(k.shape)} do not "
                         f"match [B,S,H,d], [B,S,H], [B,N,d] (packed keys: [B,N,key_row_bytes(d)] uint8)")
    if packed:
        packed_key_dim(k, q.shape[3])  # unit stride on the bytes
        if q.dtype != torch.bfloat16 or not low_precision or q.shape[3] & (q.shape[3] - 1):
            return indexer_scores_ref(q, w, k, low_precision, w_scale)  # packed keys outside the kernel's cases
    for name, t in (("q", q), ("w", w)) + (() if packed else (("k", k),)):
        if t.dtype not in _KIND:
            raise ValueError(f"indexer_scores: {name} dtype {t.dtype} not supported")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"indexer_scores: {name} needs a unit stride on its last dim, strides {t.stride()}")
    B, S, H, d = q.shape
    N = k.shape[1]
    out_dtype = q.dtype if low_precision else torch.float32
    o = torch.empty(B, S, N, dtype=out_dtype, device=q.device)
    if o.numel() == 0:
        return o
    kind = _KIND[q.dtype]
    # dot operands: exact in OPT. bf16/fp16 values stay 16-bit on the GPU; fp32 values (and everything in the
    # Triton interpreter, which multiplies 16-bit operands as raw integers) go as fp32 with IEEE products.
    k_exact_in_q = low_precision or k.dtype == q.dtype
    if q.is_cuda and kind != 2 and k_exact_in_q:
        opt = tl.bfloat16 if kind == 0 else tl.float16
    else:
        opt = tl.float32
    pdl = PDL and q.is_cuda
    if q.is_cuda:
        cfg = SCORES_CFG
        BN = cfg["bn_large"] if N > cfg["large_n"] else cfg["bn_small"]
        SB, stages = cfg["sb_packed" if packed else "sb"], cfg["stages"]
        # a graph's few queries (decode) and one query: blocks of that many; other eager calls (a prefill chunk of any
        # length) mask the block's queries past S, so one compile serves every length
        if ops.shapes_fixed() or S == 1:
            SB = min(SB, S)
        opts = {"num_warps": cfg["warps"], **pdl_launch(pdl)}
    else:
        BN, SB, stages, opts = 64, min(SCORES_CFG["sb"], S), 1, {}  # interpreted: blocks of up to 4 queries
    grid = (triton.cdiv(N, BN), triton.cdiv(S, SB), B)
    one = B == 1  # batch strides of 0 (b is 0): their class would follow S
    _scores[grid](q, w, k, o, S, H, N, d, 0 if one else q.stride(0), q.stride(1), q.stride(2),
                  0 if one else w.stride(0), w.stride(1), 0 if one else k.stride(0), k.stride(1),
                  0 if one else o.stride(0), o.stride(1), float(w_scale), HP=max(16, _pow2_ge(H)),
                  DP=max(16, _pow2_ge(d)), BN=BN, SB=SB, STAGES=stages, LOW=bool(low_precision), KIND=kind, OPT=opt,
                  HW=q.is_cuda, PACKED=packed, PDL=pdl, **opts)
    return o


# ---------------------------------------------------------------------------------------------------------
# top-k: chunks of a row select their k best in parallel, merge rounds select the k best of those


PAD = tl.constexpr(-9223372036854775807 - 1)  # int64 min: an empty candidate slot, below every pair


@triton.jit
def _select(u, valid, K, WB: tl.constexpr):
    """u [T] int64 keys in [0, 2^WB), valid [T] -> take [T]: the min(K, #valid) largest valid keys, ties to
    the lower position. Radix select, 4 bits a pass (a 32-bin histogram: one bin per lane of a warp):
    `prefix` grows to the K-th largest key, `krem` ends as the number of keys equal to it to keep."""
    bins = tl.arange(0, 32)
    prefix = tl.zeros([], tl.int64)
    krem = tl.minimum(tl.sum(valid.to(tl.int32), 0), K)
    for shift in tl.static_range(WB - 4, -1, -4):
        on = valid & ((u >> (shift + 4)) == (prefix >> (shift + 4)))
        dig = ((u >> shift) & 15).to(tl.int32)
        hist = tl.histogram(tl.where(on, dig, 16 + dig), 32)  # bins 16..31: off the prefix (ignored)
        hist = tl.where(bins < 16, hist, 0)
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys on the prefix with digit >= bin
        dsel = tl.max(tl.where((ge >= krem) & (bins < 16), bins, -1), 0)
        krem -= tl.sum(tl.where(bins > dsel, hist, 0), 0)
        prefix = prefix | (dsel.to(tl.int64) << shift)
    eq = (valid & (u == prefix)).to(tl.int32)
    rank = tl.cumsum(eq, 0) - eq
    return valid & ((u > prefix) | ((eq == 1) & (rank < krem)))


def _topk_kernel(x_ptr, nvis_ptr, src_ptr, dst_ptr, o_ptr, S, N, K, P_IN, sx_b, sx_s, so_b, so_s,
                 T: tl.constexpr, KP: tl.constexpr, WB: tl.constexpr, FROM_SCORES: tl.constexpr,
                 FINAL: tl.constexpr, ALL: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:  # started early: let the next kernel start, wait for the one that writes the scores (or candidates)
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)  # b * S + s
    c = tl.program_id(1)  # the chunk of the row (scores) or the group of chunks (merge round)
    lanes = tl.arange(0, T)
    if FROM_SCORES:
        b = (row // S).to(tl.int64)
        s = (row % S).to(tl.int64)
        offs = c * T + lanes
        nvis = tl.minimum(tl.load(nvis_ptr + s), N)
        x = tl.load(x_ptr + b * sx_b + s * sx_s + offs, mask=offs < nvis, other=float("-inf")).to(tl.float32)
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 == +0.0, as torch compares
        bits = x.to(tl.int32, bitcast=True)
        skey = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed int order = float order
        # (key, 2^32 - 1 - index) in one int64: signed order = descending score, then lower index
        pair = (skey.to(tl.int64) << 32) | (4294967295 - offs.to(tl.int64))
        valid = offs < N
    else:  # T = G * KP pairs: the candidates of G chunks, each in index order, chunks in row order
        j = c * T + lanes
        pair = tl.load(src_ptr + row.to(tl.int64) * P_IN * KP + j, mask=j < P_IN * KP, other=PAD)
        valid = pair != PAD
    # WB = 16 (bf16 scores): the low 16 bits of a key are the same for all keys of one sign, so the high
    # 16 decide; two 8-bit passes instead of four
    if ALL:  # k = N: every entry is kept (the selection would take them all), only the order is left
        take = valid
    else:
        take = _select((pair >> (64 - WB)) + (1 << (WB - 1)), valid, K, WB)
    t = take.to(tl.int32)
    pos = tl.cumsum(t, 0) - t  # kept pairs stay in index order
    n_take = tl.sum(t, 0)
    jj = tl.arange(0, KP)
    if FINAL:
        # the kept pairs (in index order) to scratch, then sorted: descending score, ties to the lower index
        scr = dst_ptr + row.to(tl.int64) * KP
        tl.store(scr + pos, pair, mask=take)
        tl.debug_barrier()
        live = jj < n_take
        kept = tl.load(scr + jj, mask=live, other=PAD)
        if WB == 16:  # (16-bit score key, -place in the kept list) sorts as an int32: cheaper than int64
            okey = (((kept >> 48).to(tl.int32)) << 16) | (65535 - jj)
            okey = tl.sort(tl.where(live, okey, -2147483648), 0, descending=True)
            kept = tl.load(scr + (65535 - (okey & 65535)), mask=live, other=PAD)
        else:
            kept = tl.sort(kept, 0, descending=True)
        idx = (4294967295 - (kept & 4294967295)).to(tl.int32)
        idx = tl.where((kept >> 32) <= -2139095041, -1, idx)  # key of -inf (0x807FFFFF) and below: -1
        b = (row // S).to(tl.int64)
        s = (row % S).to(tl.int64)
        tl.store(o_ptr + b * so_b + s * so_s + jj, idx, mask=jj < K)
    else:
        dst = dst_ptr + (row.to(tl.int64) * tl.num_programs(1) + c) * KP
        tl.store(dst + pos, pair, mask=take)
        tl.store(dst + jj, tl.full([KP], PAD, tl.int64), mask=jj >= n_take)


# a prefill chunk's length S, the top-k's k and the merge rounds' inputs change with the chunk: not specialized outside
# the decode graphs (triton_util.JitTwins). N and the row strides stay specialized (16-divisible rows load in vectors:
# not specializing them cost 1.4x at 32K entries) and the engine's warm-up meets their classes; the batch strides,
# which follow S, are passed as 0 for one sequence
_topk = JitTwins(_topk_kernel, ["S", "K", "P_IN"])

# keys per program: a chunk of a row (TOPK_TILE) and the candidates one merge program takes (TOPK_MERGE)
TOPK_TILE = {"cuda": 4096, "cpu": 1024}
TOPK_MERGE = {"cuda": 4096, "cpu": 1024}
TOPK_WARPS = 8


def topk_select(scores: torch.Tensor, n_visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B,S,N], n_visible [S] int64 -> idx [B,S,k] int32 (topk_select_ref's contract)."""
    if scores.dim() != 3 or scores.dtype not in _KIND:
        raise ValueError(f"topk_select: scores must be float [B,S,N], got {scores.dtype}{tuple(scores.shape)}")
    B, S, N = scores.shape
    if n_visible.shape != (S,) or n_visible.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_select: n_visible must be int [{S}], got {n_visible.dtype}{tuple(n_visible.shape)}")
    if not 0 <= k <= N:
        raise ValueError(f"topk_select: k={k} outside [0, N={N}]")
    if N and scores.stride(-1) != 1:
        raise ValueError(f"topk_select: scores need a unit stride on the entry dim, strides {scores.stride()}")
    dev = scores.device
    o = torch.empty(B, S, k, dtype=torch.int32, device=dev)
    if o.numel() == 0:
        return o
    rows = B * S
    KP = max(16, _pow2_ge(k))
    tile = max(TOPK_TILE["cuda" if scores.is_cuda else "cpu"], 2 * KP)
    T0 = min(tile, max(16, _pow2_ge(N)))
    P = triton.cdiv(N, T0)
    pdl = PDL and scores.is_cuda
    opts = {"num_warps": TOPK_WARPS, "PDL": pdl, **pdl_launch(pdl)} if scores.is_cuda else {}
    wb = 16 if scores.dtype == torch.bfloat16 else 32  # significant bits of the order-preserving score key
    sort_scr = torch.empty(rows * KP, dtype=torch.int64, device=dev)
    one = B == 1  # batch strides of 0 (b is 0): their class would follow S
    strides = (0 if one else scores.stride(0), scores.stride(1), 0 if one else o.stride(0), o.stride(1))
    if P == 1:
        _topk[(rows, 1)](scores, n_visible, sort_scr, sort_scr, o, S, N, k, 1, *strides,
                         T=T0, KP=KP, WB=wb, FROM_SCORES=True, FINAL=True, ALL=k == N, **opts)
        return o
    cand = torch.empty(rows * P * KP, dtype=torch.int64, device=dev)
    _topk[(rows, P)](scores, n_visible, cand, cand, o, S, N, k, P, *strides,
                     T=T0, KP=KP, WB=wb, FROM_SCORES=True, FINAL=False, **opts)
    G = max(2, TOPK_MERGE["cuda" if scores.is_cuda else "cpu"] // KP)  # chunks' candidates merged per program
    while True:
        Pn = triton.cdiv(P, G)
        final = Pn == 1
        dst = sort_scr if final else torch.empty(rows * Pn * KP, dtype=torch.int64, device=dev)
        _topk[(rows, Pn)](scores, n_visible, cand, dst, o, S, N, k, P, *strides,
                          T=G * KP, KP=KP, WB=wb, FROM_SCORES=False, FINAL=final, **opts)
        if final:
            return o
        cand, P = dst, Pn
