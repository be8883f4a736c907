"""Triton fast path of the compressor update for the decode step (S = 1); chunks (S > 1) run the reference.

Same signature and result as `compressor_ref` (dsv4/ops/compressor.py). One launch per call, `_pool_kernel`,
grid (B, d / BLOCK) (more than MAX_ROWS batch rows run the reference; the indexer's FP4 keys at a width that is not a
power of two finish through reference ops after the pool):
1. for its channels, assemble the open window's rows (the state's rows before the token, the token's projection
   (+ ape) at its slot, empty rows after it; CSA: the previous window's A halves first), pool them (softmax over the
   rows per channel, as torch: max, exp, sum, divide), write the pooled value to a scratch row, and write the new
   state (the open rows as assembled; CSA: the window becomes the previous one when it closes);
2. when the window closes, the last of a row's programs to arrive (an arrival counter per batch row, left zero)
   finishes the whole row (`_finish_row`): bf16 cast, weighted RMSNorm, RoPE at the window's first position, the
   FP8 simulation of the no-RoPE dims (block 64) or, for the indexer's keys, the Hadamard rotation + FP4
   simulation of the row (dsv4/ops/hadamard_triton.py's helpers, bit for bit rotate_fp4_ref), and the insert at
   the window's entry. It reads the complete scratch row, so the bits do not depend on which program is last. A
   window that stays open leaves its entry row as it is.
The kernel runs beside the layer's large GEMVs, whose weight streams make every dependent round trip to memory
slow, so it keeps those few: all loads issued up front, the new state written from registers, the finished row kept
in registers from its scratch load to its one store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.compressor import compressor_ref, finish_entries
from dsv4.ops.hadamard_triton import fp4_sim_rows, hadamard_rows, hadamard_scale
from dsv4.ops.triton_util import arrival_counters, cast, e4m3_round, round_to, ue8m0_scale

MAX_ROWS = 256  # batch rows with an arrival counter (the decode step runs one); more run the reference


def _block(ratio: int, overlap: bool) -> int:
    """Channels per program: the rows x channels tiles stay ~2K elements (HCA pools 128 rows)."""
    rows = triton.next_power_of_2(ratio) * (2 if overlap else 1)
    return max(16, min(64, 4096 // rows))


@triton.jit
def _pool_kernel(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, e_ptr, start_ptr, C, d, cnt_ptr,
                 w_ptr, cos_ptr, sin_ptr, ent_ptr, n_rows, eps, n_pos,
                 R: tl.constexpr, OVERLAP: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr,
                 RD2: tl.constexpr, NOPE: tl.constexpr, NB_P: tl.constexpr, QUANT: tl.constexpr,
                 ROW: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr):
    # Every load is issued at the start and every result is stored from registers: the step runs beside the layer's
    # large GEMVs, whose streams make each dependent round trip to memory slow
    b = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = ch < d
    pos = tl.load(start_ptr)
    k0 = (pos % R).to(tl.int32)
    rows = tl.arange(0, RP)  # open-window rows 0..R-1 (padded to RP)
    rm = rows < R
    OFF: tl.constexpr = R if OVERLAP else 0
    HB: tl.constexpr = 1 if OVERLAP else 0  # CSA: this window's values are the B halves (columns d..2d)
    base = kv_ptr + b * (2 * R if OVERLAP else R) * C
    sbase = sc_ptr + b * (2 * R if OVERLAP else R) * C
    m2 = rm[:, None] & cm[None, :]
    # the window's half (B for CSA): the open rows before the token, the token's projection (+ ape) at its slot
    col = ch + HB * d
    st_off = (OFF + rows[:, None]) * C + col[None, :]
    old_v = tl.load(base + st_off, mask=m2, other=0.0)
    old_g = tl.load(sbase + st_off, mask=m2, other=float("-inf"))
    new_v = tl.load(c_ptr + b * C + col, mask=cm, other=0.0)
    new_g = tl.load(g_ptr + b * C + col, mask=cm, other=0.0) + tl.load(ape_ptr + k0 * C + col, mask=cm, other=0.0)
    if OVERLAP:  # CSA: the open rows' A halves (state only) and the previous window's A halves (in the softmax)
        a_off = (OFF + rows[:, None]) * C + ch[None, :]
        old_va = tl.load(base + a_off, mask=m2, other=0.0)
        old_ga = tl.load(sbase + a_off, mask=m2, other=float("-inf"))
        new_va = tl.load(c_ptr + b * C + ch, mask=cm, other=0.0)
        new_ga = tl.load(g_ptr + b * C + ch, mask=cm, other=0.0) + tl.load(ape_ptr + k0 * C + ch, mask=cm,
                                                                         other=0.0)
        p_off = rows[:, None] * C + ch[None, :]
        pv = tl.load(base + p_off, mask=m2, other=0.0)
        pg = tl.load(sbase + p_off, mask=m2, other=float("-inf"))
    is_new = (rows == k0)[:, None]
    before = (rows < k0)[:, None]
    v = tl.where(is_new, new_v[None, :], tl.where(before, old_v, 0.0))
    gs = tl.where(is_new, new_g[None, :], tl.where(before, old_g, float("-inf")))  # the state's (unmasked)
    gt = tl.where(m2, gs, float("-inf"))
    if OVERLAP:  # the previous window's A halves join the softmax
        mx = tl.maximum(tl.max(gt, axis=0), tl.max(pg, axis=0))
        ex = tl.exp(gt - mx[None, :])
        ep = tl.exp(pg - mx[None, :])
        den = tl.sum(ep, axis=0) + tl.sum(ex, axis=0)
        e = tl.sum(pv * (ep / den[None, :]), axis=0) + tl.sum(v * (ex / den[None, :]), axis=0)
    else:
        mx = tl.max(gt, axis=0)
        ex = tl.exp(gt - mx[None, :])
        e = tl.sum(v * (ex / tl.sum(ex, axis=0)[None, :]), axis=0)
    tl.store(e_ptr + b * d + ch, e, mask=cm)
    # ---- the new state: the open rows as assembled (all C columns: this program's A and B columns); CSA: the window
    # becomes the previous one when it closes
    closes = k0 == R - 1
    tl.debug_barrier()  # (every load of the state above is done before it is overwritten)
    tl.store(base + st_off, v, mask=m2)
    tl.store(sbase + st_off, gs, mask=m2)
    if OVERLAP:
        va = tl.where(is_new, new_va[None, :], tl.where(before, old_va, 0.0))
        ga = tl.where(is_new, new_ga[None, :], tl.where(before, old_ga, float("-inf")))
        tl.store(base + a_off, va, mask=m2)
        tl.store(sbase + a_off, ga, mask=m2)
        if closes:
            prev_b = rows[:, None] * C + col[None, :]
            tl.store(base + p_off, va, mask=m2)
            tl.store(sbase + p_off, ga, mask=m2)
            tl.store(base + prev_b, v, mask=m2)
            tl.store(sbase + prev_b, gs, mask=m2)
    if QUANT >= 0 and closes:  # the row's last program to arrive finishes it (the whole scratch row is written)
        tl.debug_barrier()  # every thread's scratch values are stored before the (release) arrival
        arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            _finish_row(e_ptr, w_ptr, cos_ptr, sin_ptr, ent_ptr, b, pos, d, n_rows, eps, n_pos, R, RD2, NOPE, NB_P,
                        QUANT, ROW, LOG2D, HSCALE)
            tl.atomic_xchg(cnt_ptr + b, 0)


@triton.jit
def _finish_row(e_ptr, w_ptr, cos_ptr, sin_ptr, ent_ptr, b, pos, d, n_rows, eps, n_pos,
                R: tl.constexpr, RD2: tl.constexpr, NOPE: tl.constexpr, NB_P: tl.constexpr,
                QUANT: tl.constexpr, BLOCK: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr):
    # the closed window's entry (its pooled row in e_ptr): norm, RoPE, quantization simulation, insert; the row stays
    # in registers (one load, one store), each step rounded to the entries' dtype as the reference stores it
    DT: tl.constexpr = ent_ptr.dtype.element_ty
    w = pos // R
    row = tl.minimum(w, n_rows - 1)
    out = ent_ptr + (b * n_rows + row) * d
    i = tl.arange(0, BLOCK)
    m = i < d
    x = round_to(tl.load(e_ptr + b * d + i, mask=m, other=0.0, cache_modifier=".cg"), DT)  # e.to(dtype)
    x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps))
    y = cast(tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32) * x, DT)
    # RoPE at the window's first position w * R on the pairs (2j, 2j + 1) of the last 2 RD2 dims
    p = tl.minimum(w * R, n_pos - 1)
    ya, yb = tl.split(tl.reshape(y, (BLOCK // 2, 2)))
    pair = tl.arange(0, BLOCK // 2)
    j = pair - (d // 2 - RD2)
    rot = (j >= 0) & (pair < d // 2)
    cs = tl.load(cos_ptr + p * RD2 + j, mask=rot, other=0.0)
    sn = tl.load(sin_ptr + p * RD2 + j, mask=rot, other=0.0)
    a = ya.to(tl.float32)
    bb = yb.to(tl.float32)
    ya = tl.where(rot, cast(a * cs - bb * sn, DT), ya)
    yb = tl.where(rot, cast(a * sn + bb * cs, DT), yb)
    y = tl.reshape(tl.join(ya, yb), (BLOCK,))
    if QUANT == 2:  # the indexer's keys: Hadamard rotation + FP4 simulation of the whole row (d a power of 2)
        r = round_to(hadamard_rows(y.to(tl.float32)[None, :], 1, BLOCK, LOG2D) * HSCALE, DT)
        tl.store(out + i[None, :], cast(fp4_sim_rows(r, 1, BLOCK), DT))
    else:
        if QUANT == 1:  # FP8-simulate the no-RoPE dims in blocks of 64
            v = tl.reshape(y.to(tl.float32), (BLOCK // 64, 64))
            s, _ = ue8m0_scale(tl.max(tl.abs(v), axis=1))
            q = e4m3_round(tl.minimum(tl.maximum(v / s[:, None], -448.0), 448.0))
            nope = (tl.arange(0, BLOCK // 64) < NOPE // 64)[:, None]
            y = tl.reshape(tl.where(nope, cast(q * s[:, None], DT), tl.reshape(y, (BLOCK // 64, 64))), (BLOCK,))
        tl.store(out + i, y, mask=m)


def compressor(c: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, norm_w: torch.Tensor, eps: float,
               cos_tab: torch.Tensor, sin_tab: torch.Tensor, kv_state: torch.Tensor, score_state: torch.Tensor,
               entries: torch.Tensor, start: torch.Tensor, ratio: int, overlap: bool, quant: str | None) -> None:
    B, S, C = c.shape
    if S != 1 or not (kv_state.is_contiguous() and score_state.is_contiguous() and entries.is_contiguous()):
        return compressor_ref(c, g, ape, norm_w, eps, cos_tab, sin_tab, kv_state, score_state, entries, start,
                              ratio, overlap, quant)
    d = C // 2 if overlap else C
    c2, g2 = c.reshape(B, C).contiguous(), g.reshape(B, C).contiguous()
    # rotate_fp4 needs a power-of-two width: other widths finish through the reference after the pool (no counter)
    ref_finish = quant == "fp4" and (d & (d - 1) or d < 32)
    if B > MAX_ROWS:
        return compressor_ref(c, g, ape, norm_w, eps, cos_tab, sin_tab, kv_state, score_state, entries, start,
                              ratio, overlap, quant)
    e = torch.empty(B, d, dtype=torch.float32, device=c.device)
    blk = _block(ratio, overlap)
    rd2 = cos_tab.shape[-1]
    nope = d - 2 * rd2
    cos_c, sin_c = cos_tab.contiguous(), sin_tab.contiguous()
    _pool_kernel[(B, triton.cdiv(d, blk))](
        c2, g2, ape.contiguous(), kv_state, score_state, e, start, C, d,
        e if ref_finish else arrival_counters(c.device, "compressor", MAX_ROWS),
        norm_w, cos_c, sin_c, entries, entries.shape[1], eps, cos_tab.shape[0],
        R=ratio, OVERLAP=overlap, RP=triton.next_power_of_2(ratio), BLOCK=blk, RD2=rd2, NOPE=nope,
        NB_P=triton.next_power_of_2(max(nope // 64, 1)),
        QUANT=-1 if ref_finish else {None: 0, "fp8": 1, "fp4": 2}[quant],
        ROW=triton.next_power_of_2(d), LOG2D=triton.next_power_of_2(d).bit_length() - 1,
        HSCALE=hadamard_scale(triton.next_power_of_2(d)))
    if ref_finish:
        w = start // ratio
        emit = (start + 1) % ratio == 0
        slot = w.clamp_max(entries.shape[1] - 1)
        pos = (w * ratio).clamp_max(cos_tab.shape[0] - 1)
        out = finish_entries(e.view(B, 1, d), norm_w, eps, cos_tab[pos], sin_tab[pos], quant, entries.dtype)
        entries.index_copy_(1, slot, torch.where(emit, out, entries.index_select(1, slot)))
    return None
