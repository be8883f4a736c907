"""Triton fast paths of the norm / RoPE ops (same signatures as dsv4/ops/norm.py and dsv4/ops/rope.py).

One launch each, one program per row (a token, or a token's head), the whole row in registers:
- rmsnorm: fp32 statistic and scaling by the fp32-upcast weight, one rounding to the input dtype;
  rmsnorm_quant adds the rounded row's FP8 1x128 quantization (codes + power-of-two scales, act_quant_ref's);
- rope: interleaved pairs on the last 2*len(cos) dims, fp32 math, inverse = conjugate;
- qkv_norm_rope: the attention's prologue in one launch, the query heads' rows then the kv rows:
  the query's per-head unweighted RMS (under reference numerics the statistic is taken in the activation dtype
  with its roundings: bf16(q*q), bf16(mean), bf16(rsqrt(bf16(mean + eps))), bf16(q*r)), then RoPE; kv's
  weighted RMSNorm, RoPE, then the FP8 simulation of the first `fp8_nope` dims in blocks of 64 (amax floored at
  1e-4, scale 2^ceil(log2(amax/448)) from the exponent bits, e4m3 RNE), optionally straight into the window ring.
  On CUDA it is launched as a programmatic dependent (it waits on griddepcontrol before reading) where the
  installed Triton supports it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.act_quant import QuantAct
from dsv4.ops.kv_pack import is_packed, kv_row_bytes
from dsv4.ops.rope import check_pack
from dsv4.ops.triton_util import (PDL, cast, e4m3_round, gdc_launch_dependents, gdc_wait, pdl_launch, rope_pairs,
                                  round_to, store_act_quant, store_packed_kv, ue8m0_scale)


@triton.jit
def _apply_rope(row_ptr, out_ptr, cs_ptr, sn_ptr, t, D, RD2: tl.constexpr, INVERSE: tl.constexpr, x_base, o_base):
    # rotate the last 2*RD2 dims of a row (already written to out) in fp32 and store them
    i = tl.arange(0, RD2)
    a = tl.load(row_ptr + x_base + D - 2 * RD2 + 2 * i).to(tl.float32)
    b = tl.load(row_ptr + x_base + D - 2 * RD2 + 2 * i + 1).to(tl.float32)
    c = tl.load(cs_ptr + t * RD2 + i)
    s = tl.load(sn_ptr + t * RD2 + i)
    ra, rb = rope_pairs(a, b, c, s, INVERSE)
    tl.store(out_ptr + o_base + D - 2 * RD2 + 2 * i, cast(ra, out_ptr.dtype.element_ty))
    tl.store(out_ptr + o_base + D - 2 * RD2 + 2 * i + 1, cast(rb, out_ptr.dtype.element_ty))


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, q_ptr, s_ptr, D, eps, BLOCK: tl.constexpr, QUANT: tl.constexpr):
    r = tl.program_id(0)
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = cast(w * x, o_ptr.dtype.element_ty)
    tl.store(o_ptr + r * D + d, y, mask=m)
    if QUANT:  # the rounded row's FP8 1x128 quantization (act_quant_ref): D % 128 == 0
        store_act_quant(y.to(tl.float32), q_ptr, s_ptr, r, D, BLOCK)


@triton.jit
def _rope_kernel(x_ptr, cs_ptr, sn_ptr, o_ptr, S, H, D, RD2: tl.constexpr, INVERSE: tl.constexpr,
                 BLOCK: tl.constexpr):
    r = tl.program_id(0)  # row = (batch * S + token) * H + head
    t = (r // H) % S
    d = tl.arange(0, BLOCK)
    m = d < D - 2 * RD2
    tl.store(o_ptr + r * D + d, tl.load(x_ptr + r * D + d, mask=m), mask=m)  # the no-RoPE dims
    _apply_rope(x_ptr, o_ptr, cs_ptr, sn_ptr, t, D, RD2, INVERSE, r * D, r * D)


@triton.jit
def _q_norm_rope_row(r, x_ptr, cs_ptr, sn_ptr, o_ptr, S, H, D, eps, RD2: tl.constexpr, LOW: tl.constexpr,
                     BLOCK: tl.constexpr):
    # row r = (batch * S + token) * H + head of q: the per-head RMS (no weight), then RoPE
    t = (r // H) % S
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + r * D + d, mask=m, other=0.0)
    if LOW:  # the statistic in the activation dtype, rounding where DeepSeek's bf16 ops round
        dt: tl.constexpr = x.dtype
        xf = x.to(tl.float32)
        sq = round_to(xf * xf, dt)
        mean = round_to(tl.sum(sq, axis=0) / D, dt)
        rs = round_to(1.0 / tl.sqrt(round_to(mean + eps, dt)), dt)
        y = cast(xf * rs, dt)
    else:
        xf = x.to(tl.float32)
        rs = round_to(1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps), x.dtype)
        y = cast(xf * rs, x.dtype)
    tl.store(o_ptr + r * D + d, y, mask=m)
    tl.debug_barrier()
    _apply_rope(o_ptr, o_ptr, cs_ptr, sn_ptr, t, D, RD2, False, r * D, r * D)


@triton.jit
def _kv_norm_rope_row(r, x_ptr, w_ptr, cs_ptr, sn_ptr, o_ptr, slot_ptr, so_b, so_n, S, D, eps, NOPE: tl.constexpr,
                      RD2: tl.constexpr, BLOCK: tl.constexpr, QB: tl.constexpr, NB_P: tl.constexpr,
                      RING: tl.constexpr):
    # row r = batch * S + token of kv: kv_norm, RoPE, the FP8 simulation of the first NOPE dims; into the ring
    t = r % S
    if RING:  # row (b, t) goes to ring[b, slots[t]]
        ob = (r // S).to(tl.int64) * so_b + tl.load(slot_ptr + t).to(tl.int64) * so_n
    else:
        ob = r.to(tl.int64) * D
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    y = cast(w * x, o_ptr.dtype.element_ty)
    tl.store(o_ptr + ob + d, y, mask=m)
    tl.debug_barrier()
    _apply_rope(o_ptr, o_ptr, cs_ptr, sn_ptr, t, D, RD2, False, ob, ob)
    if NOPE > 0:  # FP8-simulate the no-RoPE dims in blocks of QB (they are untouched by the RoPE)
        tl.debug_barrier()
        nb = tl.arange(0, NB_P)
        j = tl.arange(0, QB)
        bm = (nb < NOPE // QB)[:, None]
        off = ob + nb[:, None] * QB + j[None, :]
        v = tl.load(o_ptr + off, mask=bm, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        s, _ = ue8m0_scale(amax)
        q = e4m3_round(tl.clamp(v / s[:, None], -448.0, 448.0))
        tl.store(o_ptr + off, cast(q * s[:, None], o_ptr.dtype.element_ty), mask=bm)


@triton.jit
def _kv_packed_row(r, x_ptr, w_ptr, cs_ptr, sn_ptr, o_ptr, o16_ptr, slot_ptr, so_b, so_n, S, D: tl.constexpr, eps,
                   NOPE: tl.constexpr, RD2: tl.constexpr, BLOCK: tl.constexpr, RING: tl.constexpr):
    # row r = batch * S + token of kv: kv_norm, RoPE (pairs in registers), stored as a packed FP8 row (byte offset
    # from o_ptr; o16_ptr is the same memory as bf16): the same codes and scales as the simulation of the rows above
    t = r % S
    if RING:
        ob = (r // S).to(tl.int64) * so_b + tl.load(slot_ptr + t).to(tl.int64) * so_n
    else:
        ob = r.to(tl.int64) * so_n
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + r * D + d, mask=m, other=0.0).to(tl.float32)
    x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps))
    y = round_to(tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32) * x, tl.bfloat16)
    ya, yb = tl.split(tl.reshape(y, (BLOCK // 2, 2)))
    pair = tl.arange(0, BLOCK // 2)
    j = pair - (D // 2 - RD2)
    rot = (j >= 0) & (pair < D // 2)
    c = tl.load(cs_ptr + t * RD2 + j, mask=rot, other=0.0)
    sn = tl.load(sn_ptr + t * RD2 + j, mask=rot, other=0.0)
    ra, rb = rope_pairs(ya, yb, c, sn, False)
    ya = tl.where(rot, round_to(ra, tl.bfloat16), ya)
    yb = tl.where(rot, round_to(rb, tl.bfloat16), yb)
    store_packed_kv(o_ptr, o16_ptr, ob, tl.reshape(tl.join(ya, yb), (BLOCK,)), D, NOPE, BLOCK)


@triton.jit
def _qkv_norm_rope_kernel(q_ptr, qo_ptr, kv_ptr, w_ptr, kvo_ptr, kvo16_ptr, slot_ptr, so_b, so_n, cs_ptr, sn_ptr, NQ,
                          S, H, DQ, DKV, eps, RD2: tl.constexpr, LOW: tl.constexpr, QBLOCK: tl.constexpr,
                          NOPE: tl.constexpr, KVBLOCK: tl.constexpr, NB_P: tl.constexpr, RING: tl.constexpr,
                          PDL: tl.constexpr, PACK: tl.constexpr, DKVC: tl.constexpr):
    # programs [0, NQ): the query heads' rows; [NQ, NQ + B * S): the kv rows (one launch for the attention's prologue)
    if PDL:  # programmatic dependent launch: started early, wait for the kernel that writes q and kv
        gdc_launch_dependents()
        gdc_wait()
    r = tl.program_id(0)
    if r < NQ:
        _q_norm_rope_row(r, q_ptr, cs_ptr, sn_ptr, qo_ptr, S, H, DQ, eps, RD2, LOW, QBLOCK)
    elif PACK:
        _kv_packed_row(r - NQ, kv_ptr, w_ptr, cs_ptr, sn_ptr, kvo_ptr, kvo16_ptr, slot_ptr, so_b, so_n, S, DKVC, eps,
                       NOPE, RD2, KVBLOCK, RING)
    else:
        _kv_norm_rope_row(r - NQ, kv_ptr, w_ptr, cs_ptr, sn_ptr, kvo_ptr, slot_ptr, so_b, so_n, S, DKV, eps, NOPE,
                          RD2, KVBLOCK, 64, NB_P, RING)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], w [D] -> [..., D] in x.dtype."""
    D = x.shape[-1]
    if w.shape != (D,):
        raise ValueError(f"rmsnorm: weight {tuple(w.shape)} does not match D={D}")
    x = _rows(x)
    out = torch.empty_like(x)
    _rmsnorm_kernel[(x.numel() // D,)](x, w, out, out, out, D, eps, BLOCK=triton.next_power_of_2(D), QUANT=False)
    return out


def rmsnorm_quant(x: torch.Tensor, w: torch.Tensor, eps: float) -> QuantAct:
    """x [..., D] (D % 128 == 0), w [D] -> QuantAct(rmsnorm of x in x.dtype, its e4m3 codes [M, D], fp32 scales
    [M, D / 128]), one launch."""
    D = x.shape[-1]
    if w.shape != (D,) or D % 128:
        raise ValueError(f"rmsnorm_quant: weight {tuple(w.shape)} must be [D] with D={D} a multiple of 128")
    x = _rows(x)
    M = x.numel() // D
    out = torch.empty_like(x)
    q = torch.empty((M, D), dtype=torch.float8_e4m3fn, device=x.device)
    sc = torch.empty((M, D // 128), dtype=torch.float32, device=x.device)
    if M:
        _rmsnorm_kernel[(M,)](x, w, out, q, sc, D, eps, BLOCK=triton.next_power_of_2(D), QUANT=True)
    return QuantAct(out, q, sc)


def _tables(cos: torch.Tensor, sin: torch.Tensor, T: int):
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != T:
        raise ValueError(f"rope: cos/sin must be [S={T}, rd/2], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    return cos.float().contiguous(), sin.float().contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [B, S, (H,) D] -> rotated copy (last 2*cos.shape[-1] dims)."""
    if x.dim() not in (3, 4):
        raise ValueError(f"rope: x must be [B, S, (H,) D], got {tuple(x.shape)}")
    S, D = x.shape[1], x.shape[-1]
    H = x.shape[2] if x.dim() == 4 else 1
    cs, sn = _tables(cos, sin, S)
    x = _rows(x)
    out = torch.empty_like(x)
    _rope_kernel[(x.numel() // D,)](x, cs, sn, out, S, H, D, RD2=cs.shape[1], INVERSE=inverse,
                           BLOCK=triton.next_power_of_2(max(D - 2 * cs.shape[1], 1)))
    return out


def qkv_norm_rope(q: torch.Tensor, kv: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor, low_precision_stat: bool, fp8_nope: int, ring: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None, pack: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, S, H, Dq], kv [B, S, Dkv] -> (q per-head RMS-normalised and RoPE'd, kv normed (weight w), RoPE'd and
    FP8-simulated on its first fp8_nope dims (0: none)), one launch; with ring [B, W, Dkv] (kv's dtype, unit stride
    on Dkv) and slots [S] int the kv rows go to ring[:, slots] instead and None is returned for them (slots distinct
    and within W: the caller's plan). A packed ring (uint8 [B, W, kv_row_bytes(Dkv)]), or pack=True, takes /
    returns the kv rows as packed FP8 rows (dsv4/ops/kv_pack.py)."""
    if q.dim() != 4 or kv.dim() != 3 or kv.shape[:2] != q.shape[:2]:
        raise ValueError(f"qkv_norm_rope: q must be [B, S, H, D] and kv [B, S, D], got {tuple(q.shape)} / "
                         f"{tuple(kv.shape)}")
    B, S, H, DQ = q.shape
    DKV = kv.shape[2]
    if fp8_nope % 64 or fp8_nope + 2 * cos.shape[-1] > DKV:
        raise ValueError(f"qkv_norm_rope: fp8_nope={fp8_nope} must be a multiple of 64 within D={DKV} minus RoPE")
    if (ring is None) != (slots is None):
        raise ValueError("qkv_norm_rope: ring and slots come together")
    pack = pack or is_packed(ring)
    if pack:
        check_pack(kv, fp8_nope, cos)
    width, rdtype = (kv_row_bytes(DKV), torch.uint8) if pack else (DKV, kv.dtype)
    if ring is not None and (ring.dim() != 3 or ring.shape[0] != B or ring.shape[2] != width or ring.dtype != rdtype
                             or ring.stride(2) != 1 or ring.device != kv.device or slots.shape != (S,)
                             or slots.dtype not in (torch.int32, torch.int64) or slots.device != kv.device
                             or (pack and (ring.stride(0) % 16 or ring.stride(1) % 16))):
        raise ValueError(f"qkv_norm_rope: ring must be [B={B}, W, {width}] {rdtype} with unit stride on its last dim "
                         f"and slots int [S={S}] on kv's device, got {ring.dtype}{tuple(ring.shape)} / "
                         f"{slots.dtype}{tuple(slots.shape)}")
    cs, sn = _tables(cos, sin, S)
    q, kv = _rows(q), _rows(kv)
    qo = torch.empty_like(q)
    if ring is None:
        kvo = torch.empty((B, S, width), dtype=rdtype, device=kv.device)
        so_b, so_n = (S * width, width) if pack else (0, 0)
    else:
        kvo = ring
        so_b, so_n = ring.stride(0), ring.stride(1)
    nq = q.numel() // DQ
    pdl = PDL and q.is_cuda
    _qkv_norm_rope_kernel[(nq + B * S,)](q, qo, kv, w, kvo, kvo.view(torch.bfloat16) if pack else kvo,
                                         cs if slots is None else slots, so_b, so_n, cs, sn, nq, S,
                                         H, DQ, DKV, eps, RD2=cs.shape[1],
                                         LOW=low_precision_stat and q.dtype != torch.float32,
                                         QBLOCK=triton.next_power_of_2(DQ), NOPE=fp8_nope,
                                         KVBLOCK=triton.next_power_of_2(DKV),
                                         NB_P=triton.next_power_of_2(max(fp8_nope // 64, 1)), RING=ring is not None,
                                         PDL=pdl, PACK=pack, DKVC=DKV, **pdl_launch(pdl))
    return qo, (None if ring is not None else kvo)
