"""Triton fast path of the compressor update: the decode step (S = 1) in one launch, a chunk (S > 1) in two, and a
whole window from its start (window=True: a decode step that closes a window after steps that only kept their input)
in the decode step's one launch (WIN: its rows read through their strides).

Same signature and result as `compressor_ref` (dsv4/ops/compressor.py). The decode step is `_pool_kernel`, grid
(B, d / BLOCK) (more than MAX_ROWS batch rows run the reference; the indexer's FP4 keys at a width that is not a
power of two finish through reference ops after the pool):
1. for its channels, assemble the open window's rows (the state's rows before the token, the token's projection
   (+ ape) at its slot, empty rows after it; CSA: the previous window's A halves first), pool them (softmax over the
   rows per channel, as torch: max, exp, sum, divide), write the pooled value to a scratch row, and write the new
   state (the open rows as assembled; CSA: the window becomes the previous one when it closes);
2. when the window closes, the last of a row's programs to arrive (an arrival counter per batch row, left zero)
   finishes the whole row (`_finish_row`): bf16 cast, weighted RMSNorm, RoPE at the window's first position, the
   FP8 simulation of the no-RoPE dims (block 64) or, for the indexer's keys, the Hadamard rotation + FP4
   simulation of the row (dsv4/ops/hadamard_triton.py's helpers, bit for bit rotate_fp4_ref), and the insert at
   the window's entry (uint8 entries: packed rows, the simulation's FP8 or FP4 codes and scales, kv_pack.py). It
   reads the complete scratch row, so the bits do not depend on which program is last. A window that stays open
   leaves its entry row as it is.
The kernel runs beside the layer's large GEMVs, whose weight streams make every dependent round trip to memory
slow, so it keeps those few: all loads issued up front, the new state written from registers, the finished row kept
in registers from its scratch load to its one store.

A prefill chunk (any S > 1, any start) runs `_chunk_pool_kernel`, grid (B x T windows it can touch, d / BLOCK):
each program assembles its window's rows as compressor_ref does (chunk rows + ape, state rows before the chunk,
empty rows after it; CSA: the previous window's A halves, from the state for the first window) and pools them with
the decode kernel's softmax and sums into a scratch row; then `_chunk_finish_kernel`, grid (B, T + 1): program t < T
finishes window t's entry with `_finish_row` when the window closes in the chunk, program T writes the state after
the chunk (the open window's rows; CSA: the last window that closed). Two launches in place of the reference's
~150 torch kernels (two compressors of a CSA layer: ~300 launches per chunk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.compressor import compressor_ref, finish_entries
from dsv4.ops.hadamard_triton import fp4_sim_rows, hadamard_rows, hadamard_scale, store_packed_key
from dsv4.ops.kv_pack import is_packed, key_row_bytes, kv_row_bytes
from dsv4.ops.triton_util import (JitTwins, arrival_counters, cast, e4m3_round, round_to, store_packed_kv,
                                  ue8m0_scale)

MAX_ROWS = 256  # batch rows with an arrival counter (the decode step runs one); more run the reference


def _block(ratio: int, overlap: bool) -> int:
    """Channels per program: the rows x channels tiles stay ~2K elements (HCA pools 128 rows)."""
    rows = triton.next_power_of_2(ratio) * (2 if overlap else 1)
    return max(16, min(64, 4096 // rows))


@triton.jit
def _pool_rows(v, gt, pv, pg, OVERLAP: tl.constexpr):
    """A window's pooled value per channel: the softmax over its rows' gates gt (CSA: the previous window's A rows'
    gates pg join it) as torch computes it (max, exp, sum, divide), times the values v (pv), summed over the rows."""
    if OVERLAP:
        mx = tl.maximum(tl.max(gt, axis=0), tl.max(pg, axis=0))
        ex = tl.exp(gt - mx[None, :])
        ep = tl.exp(pg - mx[None, :])
        den = tl.sum(ep, axis=0) + tl.sum(ex, axis=0)
        e = tl.sum(pv * (ep / den[None, :]), axis=0) + tl.sum(v * (ex / den[None, :]), axis=0)
    else:
        mx = tl.max(gt, axis=0)
        ex = tl.exp(gt - mx[None, :])
        e = tl.sum(v * (ex / tl.sum(ex, axis=0)[None, :]), axis=0)
    return e


@triton.jit
def _pool_kernel(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, e_ptr, start_ptr, C, d, scb, scs, sgb, sgs, cnt_ptr,
                 w_ptr, cos_ptr, sin_ptr, ent_ptr, ent16_ptr, n_rows, eps, n_pos,
                 R: tl.constexpr, OVERLAP: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr,
                 RD2: tl.constexpr, NOPE: tl.constexpr, NB_P: tl.constexpr, QUANT: tl.constexpr,
                 ROW: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr, PACK: tl.constexpr, RB: tl.constexpr,
                 WIN: tl.constexpr):
    # Every load is issued at the start and every result is stored from registers: the step runs beside the layer's
    # large GEMVs, whose streams make each dependent round trip to memory slow. WIN: c / g hold a whole window's R rows
    # ([B, R, C]) from its start (start_ptr), so the window closes at its last row and no open row comes from the state
    b = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = ch < d
    if WIN:
        pos = tl.load(start_ptr) + (R - 1)
    else:
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
    if OVERLAP:
        a_off = (OFF + rows[:, None]) * C + ch[None, :]
        p_off = rows[:, None] * C + ch[None, :]
        pv = tl.load(base + p_off, mask=m2, other=0.0)  # the previous window's A halves (in the softmax)
        pg = tl.load(sbase + p_off, mask=m2, other=float("-inf"))
    if WIN:  # the window's rows (+ ape), as given
        cw = c_ptr + b * scb + rows[:, None] * scs
        gw = g_ptr + b * sgb + rows[:, None] * sgs
        ap = ape_ptr + rows[:, None] * C
        v = tl.load(cw + col[None, :], mask=m2, other=0.0)
        gs = tl.load(gw + col[None, :], mask=m2, other=0.0) + tl.load(ap + col[None, :], mask=m2, other=0.0)
        if OVERLAP:
            va = tl.load(cw + ch[None, :], mask=m2, other=0.0)
            ga = tl.load(gw + ch[None, :], mask=m2, other=0.0) + tl.load(ap + ch[None, :], mask=m2, other=0.0)
    else:
        old_v = tl.load(base + st_off, mask=m2, other=0.0)
        old_g = tl.load(sbase + st_off, mask=m2, other=float("-inf"))
        new_v = tl.load(c_ptr + b * C + col, mask=cm, other=0.0)
        new_g = tl.load(g_ptr + b * C + col, mask=cm, other=0.0) + tl.load(ape_ptr + k0 * C + col, mask=cm, other=0.0)
        if OVERLAP:  # CSA: the open rows' A halves (state only)
            old_va = tl.load(base + a_off, mask=m2, other=0.0)
            old_ga = tl.load(sbase + a_off, mask=m2, other=float("-inf"))
            new_va = tl.load(c_ptr + b * C + ch, mask=cm, other=0.0)
            new_ga = tl.load(g_ptr + b * C + ch, mask=cm, other=0.0) + tl.load(ape_ptr + k0 * C + ch, mask=cm,
                                                                             other=0.0)
        is_new = (rows == k0)[:, None]
        before = (rows < k0)[:, None]
        v = tl.where(is_new, new_v[None, :], tl.where(before, old_v, 0.0))
        gs = tl.where(is_new, new_g[None, :], tl.where(before, old_g, float("-inf")))  # the state's (unmasked)
        if OVERLAP:
            va = tl.where(is_new, new_va[None, :], tl.where(before, old_va, 0.0))
            ga = tl.where(is_new, new_ga[None, :], tl.where(before, old_ga, float("-inf")))
    gt = tl.where(m2, gs, float("-inf"))
    if OVERLAP:  # the previous window's A halves join the softmax
        e = _pool_rows(v, gt, pv, pg, OVERLAP)
    else:
        e = _pool_rows(v, gt, v, gt, OVERLAP)
    tl.store(e_ptr + b * d + ch, e, mask=cm)
    # ---- the new state: the open rows as assembled (all C columns: this program's A and B columns); CSA: the window
    # becomes the previous one when it closes
    closes = k0 == R - 1
    tl.debug_barrier()  # (every load of the state above is done before it is overwritten)
    tl.store(base + st_off, v, mask=m2)
    tl.store(sbase + st_off, gs, mask=m2)
    if OVERLAP:
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
            _finish_row(e_ptr, b, w_ptr, cos_ptr, sin_ptr, ent_ptr, ent16_ptr, b, pos, d, n_rows, eps, n_pos, R, RD2,
                        NOPE, NB_P, QUANT, ROW, LOG2D, HSCALE, PACK, RB)
            tl.atomic_xchg(cnt_ptr + b, 0)


@triton.jit
def _finish_row(e_ptr, erow, w_ptr, cos_ptr, sin_ptr, ent_ptr, ent16_ptr, b, pos, d, n_rows, eps, n_pos,
                R: tl.constexpr, RD2: tl.constexpr, NOPE: tl.constexpr, NB_P: tl.constexpr,
                QUANT: tl.constexpr, BLOCK: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr,
                PACK: tl.constexpr, RB: tl.constexpr):
    # the closed window's entry (its pooled row in e_ptr): norm, RoPE, quantization simulation, insert; the row stays
    # in registers (one load, one store), each step rounded to the entries' dtype as the reference stores it (PACK:
    # bf16, stored as a packed FP8 row of RB bytes, ent16_ptr the same memory as bf16)
    DT: tl.constexpr = tl.bfloat16 if PACK else ent_ptr.dtype.element_ty
    w = pos // R
    row = tl.minimum(w, n_rows - 1)
    out = ent_ptr + (b * n_rows + row) * d
    i = tl.arange(0, BLOCK)
    m = i < d
    x = round_to(tl.load(e_ptr + erow * d + i, mask=m, other=0.0, cache_modifier=".cg"), DT)  # e.to(dtype)
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
        if PACK:  # the simulation's e2m1 codes and scale bytes, one packed key
            store_packed_key(ent_ptr, (b * n_rows + row).to(tl.int64) * RB, tl.reshape(r, (BLOCK,)), BLOCK,
                             RB - BLOCK // 2)
        else:
            tl.store(out + i[None, :], cast(fp4_sim_rows(r, 1, BLOCK), DT))
    elif PACK:  # the FP8 codes of the no-RoPE dims, the bf16 RoPE dims and the scales, one packed row
        store_packed_kv(ent_ptr, ent16_ptr, (b * n_rows + row).to(tl.int64) * RB, y.to(tl.float32), BLOCK, NOPE, BLOCK)
    else:
        if QUANT == 1:  # FP8-simulate the no-RoPE dims in blocks of 64
            v = tl.reshape(y.to(tl.float32), (BLOCK // 64, 64))
            s, _ = ue8m0_scale(tl.max(tl.abs(v), axis=1))
            q = e4m3_round(tl.minimum(tl.maximum(v / s[:, None], -448.0), 448.0))
            nope = (tl.arange(0, BLOCK // 64) < NOPE // 64)[:, None]
            y = tl.reshape(tl.where(nope, cast(q * s[:, None], DT), tl.reshape(y, (BLOCK // 64, 64))), (BLOCK,))
        tl.store(out + i, y, mask=m)


# ---- chunks (S > 1): two launches, the pool of every touched window, then the emitted windows' finish + the state


@triton.jit
def _window_rows(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, b, w, pos0, S, C, scb, scs, sgb, sgs, cols, cm, rows, rm,
                 R: tl.constexpr, OFF: tl.constexpr, SR: tl.constexpr):
    """Window w's rows (positions w R + rows) at columns cols, as compressor_ref assembles them: a row in the chunk
    is its projection (gate + ape), a row before the chunk the state's open row, a row after it empty (0 / -inf)."""
    q = w * R + rows
    in_chunk = (q >= pos0) & (q < pos0 + S) & rm
    in_state = (q < pos0) & rm
    ci = tl.where(in_chunk, q - pos0, 0).to(tl.int64)
    mc = in_chunk[:, None] & cm[None, :]
    ms = in_state[:, None] & cm[None, :]
    cv = tl.load(c_ptr + b * scb + ci[:, None] * scs + cols[None, :], mask=mc, other=0.0)
    cg = tl.load(g_ptr + b * sgb + ci[:, None] * sgs + cols[None, :], mask=mc, other=0.0) + \
        tl.load(ape_ptr + rows[:, None] * C + cols[None, :], mask=mc, other=0.0)
    so = (b * SR + OFF + rows[:, None]) * C + cols[None, :]
    sv = tl.load(kv_ptr + so, mask=ms, other=0.0)
    sg = tl.load(sc_ptr + so, mask=ms, other=float("-inf"))
    v = tl.where(mc, cv, tl.where(ms, sv, 0.0))
    g = tl.where(mc, cg, tl.where(ms, sg, float("-inf")))
    return v, g


def _chunk_pool_kernel(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, e_ptr, start_ptr, S, T, C, d, scb, scs, sgb, sgs,
                       R: tl.constexpr, OVERLAP: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr):
    # program (b T + t, channel block): window w0 + t's pooled values of BLOCK channels -> e[b, t] (fp32 scratch);
    # the same softmax and sums as the decode step's `_pool_kernel`
    bt = tl.program_id(0)
    b = bt // T
    t = bt % T
    ch = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cm = ch < d
    pos0 = tl.load(start_ptr)
    w = pos0 // R + t
    rows = tl.arange(0, RP)
    rm = rows < R
    OFF: tl.constexpr = R if OVERLAP else 0
    SR: tl.constexpr = 2 * R if OVERLAP else R
    HB: tl.constexpr = 1 if OVERLAP else 0  # CSA: this window's values are the B halves (columns d..2d)
    v, gs = _window_rows(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, b, w, pos0, S, C, scb, scs, sgb, sgs, ch + HB * d,
                         cm, rows, rm, R, OFF, SR)
    gt = tl.where(rm[:, None] & cm[None, :], gs, float("-inf"))
    if OVERLAP:  # the previous window's A halves: the state's last closed window (t = 0), else assembled as above
        m2 = rm[:, None] & cm[None, :]
        first = (rows * 0 + t) == 0  # (tensors: the interpreter's masks must be)
        p_off = (b * SR + rows[:, None]) * C + ch[None, :]
        sv = tl.load(kv_ptr + p_off, mask=m2 & first[:, None], other=0.0)
        sg = tl.load(sc_ptr + p_off, mask=m2 & first[:, None], other=float("-inf"))
        av, ag = _window_rows(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, b, w - 1, pos0, S, C, scb, scs, sgb, sgs, ch,
                              cm & ((ch * 0 + t) > 0), rows, rm, R, OFF, SR)
        pv = tl.where(first[:, None], sv, av)
        pg = tl.where(m2, tl.where(first[:, None], sg, ag), float("-inf"))
        e = _pool_rows(v, gt, pv, pg, OVERLAP)
    else:
        e = _pool_rows(v, gt, v, gt, OVERLAP)
    tl.store(e_ptr + bt * d + ch, e, mask=cm)


def _chunk_finish_kernel(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, e_ptr, start_ptr, S, T, C, d, scb, scs, sgb, sgs,
                         w_ptr, cos_ptr, sin_ptr, ent_ptr, ent16_ptr, n_rows, eps, n_pos,
                         R: tl.constexpr, OVERLAP: tl.constexpr, RP: tl.constexpr, CB: tl.constexpr,
                         RD2: tl.constexpr, NOPE: tl.constexpr, NB_P: tl.constexpr, QUANT: tl.constexpr,
                         ROW: tl.constexpr, LOG2D: tl.constexpr, HSCALE: tl.constexpr, PACK: tl.constexpr,
                         RB: tl.constexpr):
    # program (b, t < T): window w0 + t's entry when the window closes in the chunk (`_finish_row` of e[b, t]);
    # program (b, T): the state after the chunk: the open window's rows and (CSA) the last window that closed
    b = tl.program_id(0)
    t = tl.program_id(1)
    pos0 = tl.load(start_ptr)
    w0 = pos0 // R
    end = pos0 + S
    if t < T:
        w = w0 + t
        if (w + 1) * R <= end:
            _finish_row(e_ptr, b * T + t, w_ptr, cos_ptr, sin_ptr, ent_ptr, ent16_ptr, b, w * R, d, n_rows, eps, n_pos,
                        R, RD2, NOPE, NB_P, QUANT, ROW, LOG2D, HSCALE, PACK, RB)
    else:
        OFF: tl.constexpr = R if OVERLAP else 0
        SR: tl.constexpr = 2 * R if OVERLAP else R
        rows = tl.arange(0, RP)
        rm = rows < R
        wn = w0 + tl.minimum(tl.maximum(end // R - w0, 0), T - 1)  # the open window after the chunk
        jc = end // R - 1 - w0  # the last closed window, if it closed in this chunk
        wc = w0 + tl.minimum(tl.maximum(jc, 0), T - 1)
        for c0 in range(0, C, CB):
            cols = c0 + tl.arange(0, CB)
            cm = cols < C
            m2 = rm[:, None] & cm[None, :]
            closed = (cols * 0 + jc) >= 0  # (a tensor: the interpreter's masks must be)
            v, g = _window_rows(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, b, wn, pos0, S, C, scb, scs, sgb, sgs, cols,
                                cm, rows, rm, R, OFF, SR)
            if OVERLAP:
                vc, gc = _window_rows(c_ptr, g_ptr, ape_ptr, kv_ptr, sc_ptr, b, wc, pos0, S, C, scb, scs, sgb, sgs,
                                      cols, cm & closed, rows, rm, R, OFF, SR)
            tl.debug_barrier()  # every read of the state's rows is done before they are overwritten
            so = (b * SR + OFF + rows[:, None]) * C + cols[None, :]
            tl.store(kv_ptr + so, v, mask=m2)
            tl.store(sc_ptr + so, g, mask=m2)
            if OVERLAP:
                po = (b * SR + rows[:, None]) * C + cols[None, :]
                tl.store(kv_ptr + po, vc, mask=m2 & closed[None, :])
                tl.store(sc_ptr + po, gc, mask=m2 & closed[None, :])
            tl.debug_barrier()


# a prefill chunk's length S and the windows T it touches change with the chunk: not specialized outside the decode
# graphs (triton_util.JitTwins). T = 16 or 32 (ratio 4, S = 58-61 or 122-125) is the only 16-divisible T of a chunk
# (S is then not): such a chunk compiled both kernels during its request (2 s of time to first token; 70th pass)
_chunk_pool = JitTwins(_chunk_pool_kernel, ["S", "T"])
_chunk_finish = JitTwins(_chunk_finish_kernel, ["S", "T"])


def _chunk(c, g, ape, norm_w, eps, cos_tab, sin_tab, kv_state, score_state, entries, start, ratio, overlap, quant):
    B, S, C = c.shape
    d = C // 2 if overlap else C
    T = (S + ratio - 2) // ratio + 1  # windows the chunk can touch
    e = torch.empty(B, T, d, dtype=torch.float32, device=c.device)
    blk = _block(ratio, overlap)
    rp = triton.next_power_of_2(ratio)
    common = (c, g, ape.contiguous(), kv_state, score_state, e, start, S, T, C, d, c.stride(0), c.stride(1),
              g.stride(0), g.stride(1))
    _chunk_pool[(B * T, triton.cdiv(d, blk))](*common, R=ratio, OVERLAP=overlap, RP=rp, BLOCK=blk)
    rd2 = cos_tab.shape[-1]
    nope = d - 2 * rd2
    _chunk_finish[(B, T + 1)](
        *common, norm_w, cos_tab.contiguous(), sin_tab.contiguous(), entries, _view16(entries), entries.shape[1], eps,
        cos_tab.shape[0], R=ratio, OVERLAP=overlap, RP=rp, CB=max(16, min(triton.next_power_of_2(C), 8192 // rp)), RD2=rd2,
        NOPE=nope, NB_P=triton.next_power_of_2(max(nope // 64, 1)), QUANT={None: 0, "fp8": 1, "fp4": 2}[quant],
        ROW=triton.next_power_of_2(d), LOG2D=triton.next_power_of_2(d).bit_length() - 1,
        HSCALE=hadamard_scale(triton.next_power_of_2(d)), **_pack_meta(entries, d, quant))


def _view16(entries: torch.Tensor) -> torch.Tensor:
    """Packed entries as bf16 (the same memory: their RoPE dims are stored through it); other entries as they are."""
    return entries.view(torch.bfloat16) if is_packed(entries) else entries


def _pack_meta(entries: torch.Tensor, d: int, quant: str | None) -> dict:
    if not is_packed(entries):
        return dict(PACK=False, RB=0)
    rb = {"fp8": kv_row_bytes, "fp4": key_row_bytes}.get(quant)
    if rb is None or entries.shape[-1] != rb(d) or d & (d - 1):
        raise ValueError(f"compressor: packed entries need quant 'fp8' or 'fp4' and rows of kv_row_bytes({d}) / "
                         f"key_row_bytes({d}) bytes (d a power of two), got {quant!r} and {entries.shape[-1]}")
    return dict(PACK=True, RB=entries.shape[-1])


def compressor(c: torch.Tensor, g: torch.Tensor, ape: torch.Tensor, norm_w: torch.Tensor, eps: float,
               cos_tab: torch.Tensor, sin_tab: torch.Tensor, kv_state: torch.Tensor, score_state: torch.Tensor,
               entries: torch.Tensor, start: torch.Tensor, ratio: int, overlap: bool, quant: str | None,
               window: bool = False) -> None:
    B, S, C = c.shape
    d = C // 2 if overlap else C
    if window and S != ratio:
        raise ValueError(f"compressor: window=True needs one window's {ratio} rows, got {S}")
    # rotate_fp4 needs a power-of-two width: other widths finish through the reference after the pool (no counter)
    odd_fp4 = quant == "fp4" and (d & (d - 1) or d < 32)
    if not (kv_state.is_contiguous() and score_state.is_contiguous() and entries.is_contiguous()) or \
            (S > 1 and (odd_fp4 or c.stride(2) != 1 or g.stride(2) != 1)):
        return compressor_ref(c, g, ape, norm_w, eps, cos_tab, sin_tab, kv_state, score_state, entries, start,
                              ratio, overlap, quant)
    win = window and S > 1 and B <= MAX_ROWS  # one window from its start: the decode launch over its given rows
    if S > 1 and not win:
        return _chunk(c, g, ape, norm_w, eps, cos_tab, sin_tab, kv_state, score_state, entries, start, ratio, overlap,
                      quant)
    # a window's rows are read through their strides (views of the fused projection); one row as a contiguous copy
    c2, g2 = (c, g) if win else (c.reshape(B, C).contiguous(), g.reshape(B, C).contiguous())
    ref_finish = odd_fp4
    if B > MAX_ROWS:
        return compressor_ref(c, g, ape, norm_w, eps, cos_tab, sin_tab, kv_state, score_state, entries, start,
                              ratio, overlap, quant)
    e = torch.empty(B, d, dtype=torch.float32, device=c.device)
    blk = _block(ratio, overlap)
    rd2 = cos_tab.shape[-1]
    nope = d - 2 * rd2
    cos_c, sin_c = cos_tab.contiguous(), sin_tab.contiguous()
    _pool_kernel[(B, triton.cdiv(d, blk))](
        c2, g2, ape.contiguous(), kv_state, score_state, e, start, C, d, c.stride(0) if win else 0,
        c.stride(1) if win else 0, g.stride(0) if win else 0, g.stride(1) if win else 0,
        e if ref_finish else arrival_counters(c.device, "compressor", MAX_ROWS),
        norm_w, cos_c, sin_c, entries, _view16(entries), entries.shape[1], eps, cos_tab.shape[0],
        R=ratio, OVERLAP=overlap, RP=triton.next_power_of_2(ratio), BLOCK=blk, RD2=rd2, NOPE=nope,
        NB_P=triton.next_power_of_2(max(nope // 64, 1)),
        QUANT=-1 if ref_finish else {None: 0, "fp8": 1, "fp4": 2}[quant],
        ROW=triton.next_power_of_2(d), LOG2D=triton.next_power_of_2(d).bit_length() - 1,
        HSCALE=hadamard_scale(triton.next_power_of_2(d)), WIN=win, **_pack_meta(entries, d, quant))
    if ref_finish:
        w = start // ratio
        emit = (start + 1) % ratio == 0
        slot = w.clamp_max(entries.shape[1] - 1)
        pos = (w * ratio).clamp_max(cos_tab.shape[0] - 1)
        out = finish_entries(e.view(B, 1, d), norm_w, eps, cos_tab[pos], sin_tab[pos], quant, entries.dtype)
        entries.index_copy_(1, slot, torch.where(emit, out, entries.index_select(1, slot)))
    return None
