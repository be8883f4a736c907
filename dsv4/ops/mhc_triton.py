"""Triton fast paths of the mHC ops (same signatures as dsv4/ops/mhc.py's references).

mhc_pre / mhc_head take two launches per call, whatever the token count T:
1. `_mix_partial`: grid (T, K/BLOCK_K) over the flattened streams (K = hc*D): each program takes one
   K-slice of one token and writes its partial dot products with every mixer row (fn [mix, K], fp32)
   and its partial sum of squares (so the 1.5 MB mixer is streamed by many CTAs, not one);
2. `_pre_finish` / `_head_finish`: grid (T, D/BLOCK_D): reduce the partials in a fixed order (same
   input, same bits), scale by rsqrt(mean(x^2) + eps) after the projection (DeepSeek's order), the
   sigmoids, for mhc_pre the Sinkhorn normalisation of the hc x hc comb in registers (row softmax + eps,
   column first, then iters-1 x (row, column), every division by sum + hc_eps), then the weighted stream
   sum y = sum_j pre_j X_j for its D-slice. Program (t, 0) writes post and comb.
mhc_post is one launch: out_k = sum_j comb[j,k] X_j + post_k f, fp32, cast to the streams' dtype.
The fused forms (what the model runs), two launches each:
- mhc_pre_norm: `_mix_partial`, then `_pre_norm_finish`: two programs per token side by side, one for post and
  the Sinkhorn comb (a serial chain of small reductions), one for the weighted sum over the whole row and the
  sublayer's RMSNorm of y (y rounded to the streams' dtype first, as mhc_pre returns it);
- mhc_post_pre_norm: `_post_partial` writes the post's columns of every stream and, from the stored values,
  the next pre's partials (K sliced by columns: HC x POST_BLOCK per program); then `_pre_norm_finish`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.ops.act_quant import QuantAct
from dsv4.ops.triton_util import cast, round_to, store_act_quant

# measured at Flash shapes, one token, in CUDA graphs with the mixer streamed from HBM (H200, 2026-11-23): the
# pre's partials over 128-element slices of K (128 programs: 8.4 us for mhc_pre_norm against 9.3 with 512), the
# post's over 128 columns of every stream (9.1 us for mhc_post_pre_norm against 11.1 with 32); 4 warps per finish
BLOCK_K = 128
POST_BLOCK = 128
BLOCK_D = 512
FINISH_WARPS = 4


@triton.jit
def _mix_partial(x_ptr, fn_ptr, part_ptr, sq_ptr, K, NCH,
                 MIX: tl.constexpr, MIX_P: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    ks = c * BLOCK + tl.arange(0, BLOCK)
    km = ks < K
    x = tl.load(x_ptr + t * K + ks, mask=km, other=0.0).to(tl.float32)
    rows = tl.arange(0, MIX_P)
    w = tl.load(fn_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < MIX) & km[None, :], other=0.0)
    dots = tl.sum(w * x[None, :], axis=1)  # [MIX_P]
    tl.store(part_ptr + (t * NCH + c) * MIX_P + rows, dots)
    tl.store(sq_ptr + t * NCH + c, tl.sum(x * x, axis=0))


@triton.jit
def _mixes(part_ptr, sq_ptr, t, K, NCH, eps, OFF: tl.constexpr, N: tl.constexpr, MIX_P: tl.constexpr,
           NCH_P: tl.constexpr):
    # the N mixes starting at OFF of token t: reduced partials, scaled by the rsqrt statistic
    ch = tl.arange(0, NCH_P)
    cm = ch < NCH
    cols = OFF + tl.arange(0, N)
    p = tl.load(part_ptr + (t * NCH + ch[:, None]) * MIX_P + cols[None, :], mask=cm[:, None], other=0.0)
    sq = tl.sum(tl.load(sq_ptr + t * NCH + ch, mask=cm, other=0.0), axis=0)
    r = 1.0 / tl.sqrt(sq / K + eps)
    return tl.sum(p, axis=0) * r


@triton.jit
def _weighted_sum(x_ptr, y_ptr, pre, t, D, HC: tl.constexpr, BLOCK: tl.constexpr):
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    j = tl.arange(0, HC)
    x = tl.load(x_ptr + (t * HC + j[:, None]) * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    y = tl.sum(pre[:, None] * x, axis=0)
    tl.store(y_ptr + t * D + d, cast(y, y_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, t, K, NCH, hc_eps, norm_eps,
                 HC: tl.constexpr, MIX_P: tl.constexpr, NCH_P: tl.constexpr):
    m_pre = _mixes(part_ptr, sq_ptr, t, K, NCH, norm_eps, 0, HC, MIX_P, NCH_P)
    return tl.sigmoid(m_pre * tl.load(scale_ptr) + tl.load(base_ptr + tl.arange(0, HC))) + hc_eps


@triton.jit
def _post_comb(part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, t, K, NCH, iters, hc_eps, norm_eps,
               HC: tl.constexpr, MIX_P: tl.constexpr, NCH_P: tl.constexpr):
    # token t's post and its Sinkhorn-normalised comb, stored
    j = tl.arange(0, HC)
    m_post = _mixes(part_ptr, sq_ptr, t, K, NCH, norm_eps, HC, HC, MIX_P, NCH_P)
    post = 2.0 * tl.sigmoid(m_post * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + j))
    tl.store(post_ptr + t * HC + j, post)
    m_c = _mixes(part_ptr, sq_ptr, t, K, NCH, norm_eps, 2 * HC, HC * HC, MIX_P, NCH_P)
    cc = tl.reshape(m_c * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + tl.arange(0, HC * HC)), (HC, HC))
    e = tl.exp(cc - tl.max(cc, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)  # column normalisation first
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
    tl.store(comb_ptr + t * HC * HC + j[:, None] * HC + j[None, :], comb)


@triton.jit
def _pre_finish(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, y_ptr, post_ptr, comb_ptr, D, K, NCH, iters,
                hc_eps, norm_eps, HC: tl.constexpr, MIX_P: tl.constexpr, NCH_P: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    pre = _pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, t, K, NCH, hc_eps, norm_eps, HC, MIX_P, NCH_P)
    if tl.program_id(1) == 0:
        _post_comb(part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, t, K, NCH, iters, hc_eps, norm_eps,
                   HC, MIX_P, NCH_P)
    _weighted_sum(x_ptr, y_ptr, pre, t, D, HC, BLOCK)


@triton.jit
def _pre_norm_finish(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, q_ptr, s_ptr, post_ptr, comb_ptr, D,
                     K, NCH, iters, hc_eps, norm_eps, eps, HC: tl.constexpr, MIX_P: tl.constexpr, NCH_P: tl.constexpr,
                     BLOCK: tl.constexpr, QUANT: tl.constexpr):
    # two programs per token, side by side: (t, 0) post and the Sinkhorn comb (a serial chain of 2 x iters small
    # reductions); (t, 1) y = sum_j pre_j X_j over the whole row, rounded to the streams' dtype (the y mhc_pre
    # returns), then the RMSNorm of that y (rmsnorm's statistic and scaling), and with QUANT its act_quant
    t = tl.program_id(0)
    if tl.program_id(1) == 0:
        _post_comb(part_ptr, sq_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, t, K, NCH, iters, hc_eps, norm_eps,
                   HC, MIX_P, NCH_P)
        return
    pre = _pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, t, K, NCH, hc_eps, norm_eps, HC, MIX_P, NCH_P)
    d = tl.arange(0, BLOCK)
    dm = d < D
    j = tl.arange(0, HC)
    x = tl.load(x_ptr + (t * HC + j[:, None]) * D + d[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
    y = round_to(tl.sum(pre[:, None] * x, axis=0), y_ptr.dtype.element_ty)
    y = y * (1.0 / tl.sqrt(tl.sum(y * y, axis=0) / D + eps))
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    yo = round_to(w * y, y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * D + d, yo.to(y_ptr.dtype.element_ty), mask=dm)
    if QUANT:
        store_act_quant(yo, q_ptr, s_ptr, t, D, BLOCK)


@triton.jit
def _head_finish(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, y_ptr, D, K, NCH, hc_eps, norm_eps,
                 HC: tl.constexpr, MIX_P: tl.constexpr, NCH_P: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    j = tl.arange(0, HC)
    m = _mixes(part_ptr, sq_ptr, t, K, NCH, norm_eps, 0, HC, MIX_P, NCH_P)
    pre = tl.sigmoid(m * tl.load(scale_ptr) + tl.load(base_ptr + j)) + hc_eps
    _weighted_sum(x_ptr, y_ptr, pre, t, D, HC, BLOCK)


@triton.jit
def _post_block(f_ptr, x_ptr, post_ptr, comb_ptr, t, d, dm, D, HC: tl.constexpr, BLOCK: tl.constexpr):
    # token t's new streams at columns d, fp32 [HC, BLOCK]: sum_j comb[j, k] X_j + post_k f
    k = tl.arange(0, HC)
    acc = tl.zeros((HC, BLOCK), dtype=tl.float32)
    for jj in tl.static_range(HC):
        xj = tl.load(x_ptr + (t * HC + jj) * D + d, mask=dm, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + (t * HC + jj) * HC + k)  # comb[j, :]
        acc += cj[:, None] * xj[None, :]
    f = tl.load(f_ptr + t * D + d, mask=dm, other=0.0).to(tl.float32)
    return acc + tl.load(post_ptr + t * HC + k)[:, None] * f[None, :]


@triton.jit
def _post_kernel(f_ptr, x_ptr, post_ptr, comb_ptr, o_ptr, D, HC: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    k = tl.arange(0, HC)
    out = _post_block(f_ptr, x_ptr, post_ptr, comb_ptr, t, d, dm, D, HC, BLOCK)
    tl.store(o_ptr + (t * HC + k[:, None]) * D + d[None, :], cast(out, o_ptr.dtype.element_ty), mask=dm[None, :])


@triton.jit
def _post_partial(f_ptr, x_ptr, post_ptr, comb_ptr, o_ptr, fn_ptr, part_ptr, sq_ptr, D, K, NCH,
                  HC: tl.constexpr, MIX: tl.constexpr, MIX_P: tl.constexpr, BLOCK: tl.constexpr):
    # program (t, c): _post_kernel's columns d in [c*BLOCK, (c+1)*BLOCK) of every stream, stored; then, from the
    # stored values, the next pre's partial mixes and sum of squares over those HC*BLOCK elements of K
    t = tl.program_id(0)
    c = tl.program_id(1)
    d = c * BLOCK + tl.arange(0, BLOCK)
    dm = d < D
    k = tl.arange(0, HC)
    out = round_to(_post_block(f_ptr, x_ptr, post_ptr, comb_ptr, t, d, dm, D, HC, BLOCK), o_ptr.dtype.element_ty)
    tl.store(o_ptr + (t * HC + k[:, None]) * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=dm[None, :])
    rows = tl.arange(0, MIX_P)
    dots = tl.zeros((MIX_P,), dtype=tl.float32)
    for jj in tl.static_range(HC):
        xo = tl.sum(tl.where(k[:, None] == jj, out, 0.0), axis=0)  # stream jj (the other rows add exact zeros)
        w = tl.load(fn_ptr + rows[:, None] * K + jj * D + d[None, :], mask=(rows[:, None] < MIX) & dm[None, :],
                    other=0.0)
        dots += tl.sum(w * xo[None, :], axis=1)
    tl.store(part_ptr + (t * NCH + c) * MIX_P + rows, dots)
    tl.store(sq_ptr + t * NCH + c, tl.sum(tl.sum(out * out, axis=1), axis=0))


def _check(x: torch.Tensor, fn: torch.Tensor, hc: int, mix: int, name: str) -> None:
    if x.dim() != 4 or x.shape[2] != hc:
        raise ValueError(f"{name}: x must be [B, S, {hc}, D], got {tuple(x.shape)}")
    if hc & (hc - 1):
        raise ValueError(f"{name}: hc={hc} must be a power of two")
    K = hc * x.shape[3]
    if tuple(fn.shape) != (mix, K) or fn.dtype != torch.float32:
        raise ValueError(f"{name}: fn must be float32 [{mix}, {K}], got {fn.dtype}{tuple(fn.shape)}")


def _partials(x: torch.Tensor, fn: torch.Tensor, mix: int):
    T, K = x.shape[0] * x.shape[1], x.shape[2] * x.shape[3]
    nch = triton.cdiv(K, BLOCK_K)
    mix_p = triton.next_power_of_2(mix)
    part = torch.empty(T, nch, mix_p, dtype=torch.float32, device=x.device)
    sq = torch.empty(T, nch, dtype=torch.float32, device=x.device)
    _mix_partial[(T, nch)](x, fn, part, sq, K, nch, MIX=mix, MIX_P=mix_p, BLOCK=BLOCK_K)
    return T, K, nch, mix_p, part, sq


def mhc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
            hc_eps: float, norm_eps: float):
    """x: [B,S,hc,D] -> y: [B,S,D] (x.dtype), post: [B,S,hc] fp32, comb: [B,S,hc,hc] fp32."""
    mix = (2 + hc) * hc
    _check(x, fn, hc, mix, "mhc_pre")
    if iters < 1:
        raise ValueError(f"mhc_pre: iters must be >= 1, got {iters}")
    x = x.contiguous()
    B, S, _, D = x.shape
    T, K, nch, mix_p, part, sq = _partials(x, fn.contiguous(), mix)
    y = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    post = torch.empty(B, S, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(B, S, hc, hc, dtype=torch.float32, device=x.device)
    _pre_finish[(T, triton.cdiv(D, BLOCK_D))](
        x, part, sq, base.float().contiguous(), scale.float().contiguous(), y, post, comb, D, K, nch, iters,
        hc_eps, norm_eps, HC=hc, MIX_P=mix_p, NCH_P=triton.next_power_of_2(nch), BLOCK=BLOCK_D)
    return y, post, comb


def _finish_norm(x, part, sq, nch, mix_p, base, scale, w, hc, iters, hc_eps, norm_eps, eps, quant):
    B, S, _, D = x.shape
    if tuple(w.shape) != (D,):
        raise ValueError(f"mhc norm: weight {tuple(w.shape)} does not match D={D}")
    if quant and D % 128:
        raise ValueError(f"mhc norm: quant needs D={D} a multiple of 128")
    y = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    q = torch.empty(B * S, D, dtype=torch.float8_e4m3fn, device=x.device) if quant else y
    qs = torch.empty(B * S, D // 128, dtype=torch.float32, device=x.device) if quant else y
    post = torch.empty(B, S, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(B, S, hc, hc, dtype=torch.float32, device=x.device)
    opts = {"num_warps": FINISH_WARPS} if x.is_cuda else {}
    _pre_norm_finish[(B * S, 2)](
        x, part, sq, base.float().contiguous(), scale.float().contiguous(), w.contiguous(), y, q, qs, post, comb, D,
        hc * D, nch, iters, hc_eps, norm_eps, eps, HC=hc, MIX_P=mix_p, NCH_P=triton.next_power_of_2(nch),
        BLOCK=triton.next_power_of_2(D), QUANT=quant, **opts)
    return (QuantAct(y, q, qs) if quant else y), post, comb


def mhc_pre_norm(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                 hc_eps: float, norm_eps: float, w: torch.Tensor, eps: float, quant: bool = False):
    """mhc_pre + RMSNorm(w, eps) of y -> (normed y [B,S,D] in x.dtype, post, comb): two launches. With quant, y comes
    as a QuantAct (its act_quant written by the same launch)."""
    mix = (2 + hc) * hc
    _check(x, fn, hc, mix, "mhc_pre_norm")
    if iters < 1:
        raise ValueError(f"mhc_pre_norm: iters must be >= 1, got {iters}")
    x = x.contiguous()
    _, _, nch, mix_p, part, sq = _partials(x, fn.contiguous(), mix)
    return _finish_norm(x, part, sq, nch, mix_p, base, scale, w, hc, iters, hc_eps, norm_eps, eps, quant)


def mhc_post_pre_norm(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                      base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float,
                      w: torch.Tensor, eps: float, quant: bool = False):
    """One boundary: mhc_post, then mhc_pre_norm of the new streams -> (streams, normed y, post', comb'). Two
    launches: the post with the next pre's partial mixes (from the stored streams), then the finish + RMSNorm (and
    with quant, y's act_quant: y comes as a QuantAct)."""
    mix = (2 + hc) * hc
    _check(x, fn, hc, mix, "mhc_post_pre_norm")
    if f.shape != x.shape[:2] + x.shape[3:]:
        raise ValueError(f"mhc_post_pre_norm: f {tuple(f.shape)} and x {tuple(x.shape)} must be [B,S,D] and [B,S,hc,D]")
    if iters < 1:
        raise ValueError(f"mhc_post_pre_norm: iters must be >= 1, got {iters}")
    B, S, _, D = x.shape
    x, f = x.contiguous(), f.contiguous()
    out = torch.empty_like(x)
    block = POST_BLOCK
    nch = triton.cdiv(D, block)
    mix_p = triton.next_power_of_2(mix)
    part = torch.empty(B * S, nch, mix_p, dtype=torch.float32, device=x.device)
    sq = torch.empty(B * S, nch, dtype=torch.float32, device=x.device)
    _post_partial[(B * S, nch)](f, x, post.float().contiguous(), comb.float().contiguous(), out, fn.contiguous(), part,
                                sq, D, hc * D, nch, HC=hc, MIX=mix, MIX_P=mix_p, BLOCK=block)
    return (out, *_finish_norm(out, part, sq, nch, mix_p, base, scale, w, hc, iters, hc_eps, norm_eps, eps, quant))


def mhc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
             norm_eps: float) -> torch.Tensor:
    """x: [B,S,hc,D] -> [B,S,D] (x.dtype)."""
    hc = x.shape[2] if x.dim() == 4 else -1
    _check(x, fn, hc, hc, "mhc_head")
    x = x.contiguous()
    B, S, _, D = x.shape
    T, K, nch, mix_p, part, sq = _partials(x, fn.contiguous(), hc)
    y = torch.empty(B, S, D, dtype=x.dtype, device=x.device)
    _head_finish[(T, triton.cdiv(D, BLOCK_D))](
        x, part, sq, base.float().contiguous(), scale.float().contiguous(), y, D, K, nch, hc_eps, norm_eps,
        HC=hc, MIX_P=mix_p, NCH_P=triton.next_power_of_2(nch), BLOCK=BLOCK_D)
    return y


def mhc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """f: [B,S,D], x: [B,S,hc,D] -> [B,S,hc,D] in x.dtype."""
    if x.dim() != 4 or f.shape != x.shape[:2] + x.shape[3:]:
        raise ValueError(f"mhc_post: f {tuple(f.shape)} and x {tuple(x.shape)} must be [B,S,D] and [B,S,hc,D]")
    B, S, hc, D = x.shape
    x, f = x.contiguous(), f.contiguous()
    out = torch.empty_like(x)
    _post_kernel[(B * S, triton.cdiv(D, BLOCK_D))](f, x, post.float().contiguous(), comb.float().contiguous(), out,
                                                   D, HC=hc, BLOCK=BLOCK_D)
    return out
