"""Manifold-constrained hyper-connections (SPEC §2.2, §2.8): the 4 residual streams' mixing, in fp32.

mhc_pre collapses the streams into a block input (weights `pre`) and derives `post` and the
Sinkhorn-normalised `comb`; mhc_post expands the block output back: X'_k = post_k f + sum_j comb[j,k] X_j
(comb transposed: the contraction runs over its FIRST index). mhc_head collapses for the final norm.
The fused forms the model runs: mhc_pre_norm (pre + the sublayer's RMSNorm) and mhc_post_pre_norm (one
boundary: a sublayer's post, the next one's pre + RMSNorm), each the composition of the references.
"""

from __future__ import annotations

import torch

from dsv4.ops.act_quant import quant_act_ref
from dsv4.ops.norm import rmsnorm_ref


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [B,S,hc,D] -> [B,S,mix] = (flatten(x) @ fn^T) * rsqrt(mean(flatten(x)^2) + eps), fp32; the
    # projection first, then the scaling by the statistic, in DeepSeek's order (SPEC §2.2 step 3)
    xf = x.flatten(2).float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf @ fn.float().T) * r


def mhc_pre_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           iters: int, hc_eps: float, norm_eps: float):
    """x: [B,S,hc,D] -> y: [B,S,D] (x.dtype), post: [B,S,hc] fp32, comb: [B,S,hc,hc] fp32."""
    m = hc_mixes(x, fn, norm_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = (m[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.softmax(c, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)  # column normalisation first
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(2)
    return y.to(x.dtype), post, comb


def mhc_post_ref(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """f: [B,S,D], x: [B,S,hc,D] -> [B,S,hc,D]: post_k f + (comb^T @ x)_k, fp32, cast to x.dtype."""
    out = post.unsqueeze(-1) * f.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x.float())
    return out.to(x.dtype)


def mhc_head_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """x: [B,S,hc,D] -> [B,S,D] (x.dtype): sigmoid-weighted stream sum, no Sinkhorn."""
    m = hc_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(m * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(2).to(x.dtype)


def mhc_pre_norm_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                     iters: int, hc_eps: float, norm_eps: float, w: torch.Tensor, eps: float, quant: bool = False,
                     keep: tuple | None = None):
    """mhc_pre, then the sublayer's RMSNorm (weight w, eps) of its input: -> (rmsnorm(y), post, comb). With quant
    the normed y comes as a QuantAct (with its act_quant, for the sublayer's first quantizing linear). keep = (ring
    [B, r, D], slots [m] int64): the normed rows of the last m tokens are also written to ring[:, slots] (a compressor's
    kept input rows, dsv4/model/attention.py)."""
    y, post, comb = mhc_pre_ref(x, fn, base, scale, hc, iters, hc_eps, norm_eps)
    y = rmsnorm_ref(y, w, eps)
    keep_rows(y, keep)
    return (quant_act_ref(y) if quant else y), post, comb


def keep_rows(y: torch.Tensor, keep: tuple | None) -> None:
    """y's last m rows [B, m, D] into ring[:, slots] for keep = (ring, slots [m]) (mhc_pre_norm's keep)."""
    if keep is not None:
        ring, slots = keep
        ring.index_copy_(1, slots, y[:, y.shape[1] - slots.shape[0]:].to(ring.dtype))


def mhc_post_pre_norm_ref(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                          fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
                          hc_eps: float, norm_eps: float, w: torch.Tensor, eps: float, quant: bool = False):
    """One mHC boundary: the post of a sublayer (output f), the pre of the next and its RMSNorm:
    -> (streams x', rmsnorm(y), post', comb'); with quant, rmsnorm(y) as a QuantAct."""
    x = mhc_post_ref(f, x, post, comb)
    return (x, *mhc_pre_norm_ref(x, fn, base, scale, hc, iters, hc_eps, norm_eps, w, eps, quant))


def make_fast_boundaries(mhc_triton):
    """The fast `mhc_pre_norm` / `mhc_post_pre_norm`: the CUDA decode kernel (dsv4/ops/mhc_cuda.py, one launch) for
    the calls it takes (1-8 tokens, bf16 streams), the Triton kernels (two launches) for everything else."""
    if mhc_triton is None:
        return None, None
    from dsv4.ops import mhc_cuda

    def mhc_pre_norm_fast(x, fn, base, scale, hc, iters, hc_eps, norm_eps, w, eps, quant=False, keep=None):
        if mhc_cuda.applies(x, fn, base, scale, hc, iters, w, quant=quant):
            if keep is None or mhc_cuda.keeps(x, keep):  # the ring row written by the same launch
                return mhc_cuda.boundary(x, fn, base, scale, iters, hc_eps, norm_eps, w, eps, quant=quant, keep=keep)
            out = mhc_cuda.boundary(x, fn, base, scale, iters, hc_eps, norm_eps, w, eps, quant=quant)
        else:
            out = mhc_triton.mhc_pre_norm(x, fn, base, scale, hc, iters, hc_eps, norm_eps, w, eps, quant)
        keep_rows(out[0].x if quant else out[0], keep)
        return out

    def mhc_post_pre_norm_fast(f, x, post, comb, fn, base, scale, hc, iters, hc_eps, norm_eps, w, eps, quant=False):
        if mhc_cuda.applies(x, fn, base, scale, hc, iters, w, f, post, comb, quant):
            return mhc_cuda.boundary(x, fn, base, scale, iters, hc_eps, norm_eps, w, eps, f, post, comb, quant)
        return mhc_triton.mhc_post_pre_norm(f, x, post, comb, fn, base, scale, hc, iters, hc_eps, norm_eps, w, eps,
                                            quant)

    mhc_pre_norm_fast.__doc__ = mhc_triton.mhc_pre_norm.__doc__
    mhc_post_pre_norm_fast.__doc__ = mhc_triton.mhc_post_pre_norm.__doc__
    return mhc_pre_norm_fast, mhc_post_pre_norm_fast


def register_ops(register) -> None:
    try:
        from dsv4.ops import mhc_triton as fast
    except ImportError:  # no Triton here: the references run
        fast = None
    pre_norm_fast, post_pre_norm_fast = make_fast_boundaries(fast)
    register("mhc_pre", mhc_pre_ref, getattr(fast, "mhc_pre", None), interpretable=True,
             doc="mHC pre: mixes, Sinkhorn, stream collapse (fp32)")
    register("mhc_post", mhc_post_ref, getattr(fast, "mhc_post", None), interpretable=True,
             doc="mHC post: post * f + comb^T @ streams (fp32)")
    register("mhc_head", mhc_head_ref, getattr(fast, "mhc_head", None), interpretable=True,
             doc="head hyper-connection: sigmoid-weighted stream sum")
    register("mhc_pre_norm", mhc_pre_norm_ref, pre_norm_fast, interpretable=True,
             doc="mHC pre + the sublayer's RMSNorm (keep: its rows also into a ring)",
             cuda="decode, 1-8 tokens: one launch (and the kept row)")
    register("mhc_post_pre_norm", mhc_post_pre_norm_ref, post_pre_norm_fast,
             interpretable=True, doc="mHC boundary: post of one sublayer, pre + RMSNorm of the next",
             cuda="decode, 1-8 tokens: one launch")
