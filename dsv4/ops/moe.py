"""MoE router and experts (SPEC §2.7), references in PyTorch.

`router_ref`: fp32 gate logits, sqrtsoftplus / sigmoid / softmax scores, experts from `tid2eid[ids]`
(hash layers) or the top-k of scores + bias (the bias selects only); weights are the un-biased scores
of the chosen experts, normalised, times the route scale.
`moe_experts_ref`: for each token its routed experts (stacked [E, ...] prepared weights) and the shared
expert: gate = w1(x), up = w3(x), each rounded to the activation dtype (DeepSeek's GEMMs write bf16);
up clamped to [-limit, limit], gate to <= limit; h = silu(gate) * up in fp32, times the routing weight
BEFORE w2 (routed only); w2's output rounded to the activation dtype; routed outputs summed in fp32 in
ascending expert order, then the shared expert's; the sum cast to the activation dtype.
x may come as a `QuantAct` (x with its act_quant, made by the op that wrote it): its codes are x's own quantization,
so the references (and the Triton kernels) read x; the CUDA decode kernels read the codes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.ops.act_quant import QuantAct
from dsv4.ops.linear import PreparedLinear, linear_ref
from dsv4.ops.mhc import mhc_post_ref, mhc_pre_norm_ref


def router_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
               ids: torch.Tensor, func: str, topk: int, norm_topk: bool, route_scale: float):
    """x [T,D], weight [E,D], ids [T] -> (weights [T,k] fp32, experts [T,k] int64)."""
    logits = x.float() @ weight.float().T
    if func == "softmax":
        scores = logits.softmax(-1)
    elif func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    if tid2eid is not None:
        idx = tid2eid[ids].long()
    else:
        idx = (scores + bias.float()).topk(topk, dim=-1).indices
    w = scores.gather(1, idx)
    if norm_topk and func != "softmax":
        w = w / w.sum(-1, keepdim=True)
    return w * route_scale, idx


def expert_ref(x: torch.Tensor, w1: PreparedLinear, w2: PreparedLinear, w3: PreparedLinear, limit: float,
               act_quant: bool, weight: torch.Tensor | None = None) -> torch.Tensor:
    """One clamped-SwiGLU expert: x [T,D] -> [T,D] fp32 (values rounded to x.dtype, see module doc)."""
    gate = linear_ref(x, w1, act_quant, x.dtype).float()
    up = linear_ref(x, w3, act_quant, x.dtype).float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)  # asymmetric: the gate has an upper bound only
    h = F.silu(gate) * up
    if weight is not None:
        h = h * weight[:, None]
    return linear_ref(h.to(x.dtype), w2, act_quant, x.dtype).float()


def _plain(x: torch.Tensor | QuantAct) -> torch.Tensor:
    return x.x if isinstance(x, QuantAct) else x


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w1: PreparedLinear,
                    w2: PreparedLinear, w3: PreparedLinear, shared: tuple | None, limit: float,
                    act_quant: bool) -> torch.Tensor:
    """x [T,D] (or a QuantAct of it), weights/idx [T,k], stacked w1/w2/w3 [E,...], shared (w1, w2, w3) -> [T,D]
    in x.dtype."""
    x = _plain(x)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if x.shape[0] == 1:  # decode: experts gathered by device index, no host sync (graph-safe)
        order = idx[0].sort().indices
        for j in range(idx.shape[1]):
            slot = order[j:j + 1]
            e = idx[0].index_select(0, slot)
            y = y + expert_ref(x, w1.gather(e), w2.gather(e), w3.gather(e), limit, act_quant,
                               weights[0].index_select(0, slot))
    else:  # a chunk: loop over the experts hit, ascending
        for e in torch.unique(idx).tolist():
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            y.index_add_(0, tok, expert_ref(x[tok], w1.select(e), w2.select(e), w3.select(e), limit, act_quant,
                                            weights[tok, slot]))
    if shared is not None:
        y = y + expert_ref(x, *shared, limit, act_quant)
    return y.to(x.dtype)


def moe_post_ref(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w1: PreparedLinear, w2: PreparedLinear,
                 w3: PreparedLinear, shared: tuple | None, limit: float, act_quant: bool, streams: torch.Tensor,
                 post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The FFN's output expanded back into the residual streams: mhc_post_ref(moe_experts_ref(x, ...), streams, post,
    comb). x [T, D] are the tokens of streams [B, S, hc, D] (T = B S) -> new streams [B, S, hc, D]."""
    f = moe_experts_ref(x, weights, idx, w1, w2, w3, shared, limit, act_quant)
    return mhc_post_ref(f.view(*streams.shape[:2], f.shape[-1]), streams, post, comb)


def moe_post_pre_ref(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w1: PreparedLinear,
                     w2: PreparedLinear, w3: PreparedLinear, shared: tuple | None, limit: float, act_quant: bool,
                     streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
                     scale: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float, w: torch.Tensor,
                     eps: float):
    """moe_post_ref, then the next sublayer's mhc_pre_norm_ref on the new streams (its mixer fn / base / scale and
    RMSNorm weight w): -> (new streams [B, S, hc, D], rmsnorm(y) [B, S, D], post' [B, S, hc], comb' [B, S, hc, hc]).
    A layer's FFN with the next layer's attention input: in a decode step one launch fewer."""
    x_new = moe_post_ref(x, weights, idx, w1, w2, w3, shared, limit, act_quant, streams, post, comb)
    return (x_new, *mhc_pre_norm_ref(x_new, fn, base, scale, hc, iters, hc_eps, norm_eps, w, eps))


def load_triton_module():
    """dsv4.ops.moe_triton, or None where it cannot be imported (no Triton on this machine): then the references
    run and `ops.configure` lists the ops as such."""
    try:
        from dsv4.ops import moe_triton
    except ImportError:
        return None
    return moe_triton


def make_fast_moe_experts(moe_triton):
    """The fast `moe_experts`: the CUDA decode kernels (dsv4/ops/moe_cuda.py) for the calls they take (one token,
    MXFP4 routed experts, FP8 shared expert), the Triton kernels for everything else."""
    if moe_triton is None:
        return None
    from dsv4.ops import moe_cuda

    def moe_experts_fast(x, weights, idx, w1, w2, w3, shared, limit, act_quant):
        if moe_cuda.applies(x, weights, idx, w1, w2, w3, shared, act_quant):
            return moe_cuda.moe_decode(x, weights, idx, w1, w2, w3, shared, limit)
        return moe_triton.moe_experts(_plain(x), weights, idx, w1, w2, w3, shared, limit, act_quant)

    moe_experts_fast.__doc__ = moe_triton.moe_experts.__doc__
    return moe_experts_fast


def make_fast_router(moe_triton):
    """The fast `router`: the CUDA decode kernel (dsv4/ops/moe_cuda.py, 1-8 bf16 tokens) for the calls it takes, the
    Triton kernels for everything else."""
    if moe_triton is None:
        return None
    from dsv4.ops import moe_cuda

    def router_fast(x, weight, bias, tid2eid, ids, func, topk, norm_topk, route_scale):
        if moe_cuda.router_applies(x, weight, bias, tid2eid, ids, func, topk):
            return moe_cuda.router(x, weight, bias, tid2eid, ids, func, topk, norm_topk, route_scale)
        return moe_triton.router(x, weight, bias, tid2eid, ids, func, topk, norm_topk, route_scale)

    router_fast.__doc__ = moe_triton.router.__doc__
    return router_fast


def make_fast_moe_post(moe_triton, experts_fast):
    """The fast `moe_post`: one token on the CUDA decode kernels, the post in the down kernel's epilogue (one launch
    fewer); otherwise the fast experts, then Triton's mhc_post."""
    if moe_triton is None or experts_fast is None:
        return None
    from dsv4.ops import mhc_triton, moe_cuda

    def moe_post_fast(x, weights, idx, w1, w2, w3, shared, limit, act_quant, streams, post, comb):
        if moe_cuda.applies(x, weights, idx, w1, w2, w3, shared, act_quant) and \
                moe_cuda.post_applies(x, streams, post, comb):
            return moe_cuda.moe_decode(x, weights, idx, w1, w2, w3, shared, limit, (streams, post, comb))
        f = experts_fast(x, weights, idx, w1, w2, w3, shared, limit, act_quant)
        return mhc_triton.mhc_post(f.view(*streams.shape[:2], f.shape[-1]), streams, post, comb)

    moe_post_fast.__doc__ = moe_post_ref.__doc__
    return moe_post_fast


def make_fast_moe_post_pre(post_fast):
    """The fast `moe_post_pre`: one token on the CUDA decode kernels, the post and the next pre in the down kernel
    (its last CTA finishes the pre); otherwise moe_post, then mhc_pre_norm, each as bound now (ops.configure, per-op
    overrides included): the same kernels as the two ops called apart."""
    if post_fast is None:  # no Triton here (mhc_pre_norm's fast path is Triton too): the reference runs
        return None
    from dsv4 import ops
    from dsv4.ops import moe_cuda

    def moe_post_pre_fast(x, weights, idx, w1, w2, w3, shared, limit, act_quant, streams, post, comb, fn, base, scale,
                          hc, iters, hc_eps, norm_eps, w, eps):
        if moe_cuda.applies(x, weights, idx, w1, w2, w3, shared, act_quant) and \
                moe_cuda.post_applies(x, streams, post, comb) and \
                moe_cuda.pre_applies(x, w1.n, fn, base, scale, hc, iters, w):
            return moe_cuda.moe_decode(x, weights, idx, w1, w2, w3, shared, limit, (streams, post, comb),
                                       (fn, base, scale, iters, hc_eps, norm_eps, w, eps))
        x_new = ops.OPS["moe_post"].impl(x, weights, idx, w1, w2, w3, shared, limit, act_quant, streams, post, comb)
        return (x_new, *ops.OPS["mhc_pre_norm"].impl(x_new, fn, base, scale, hc, iters, hc_eps, norm_eps, w, eps))

    moe_post_pre_fast.__doc__ = moe_post_pre_ref.__doc__
    return moe_post_pre_fast


def register_ops(register) -> None:
    moe_triton = load_triton_module()
    experts_fast = make_fast_moe_experts(moe_triton)
    register("router", router_ref, make_fast_router(moe_triton), interpretable=True,
             doc="gate scores, hash or bias-corrected top-k, normalised weights",
             cuda="decode, 1-8 tokens: one launch, the gate read while the previous kernel runs")
    register("moe_experts", moe_experts_ref, experts_fast, interpretable=True,
             doc="routed + shared clamped-SwiGLU experts, weighted sum",
             cuda="decode experts, one token: MXFP4 routed + FP8 shared")
    post_fast = make_fast_moe_post(moe_triton, experts_fast)
    register("moe_post", moe_post_ref, post_fast, interpretable=True,
             doc="moe_experts, then the FFN's mhc_post into the residual streams",
             cuda="decode, one token: the post in the experts' down kernel")
    register("moe_post_pre", moe_post_pre_ref, make_fast_moe_post_pre(post_fast),
             interpretable=True, doc="moe_post, then the next sublayer's mhc_pre_norm on the new streams",
             cuda="decode, one token: the post and the next pre in the experts' down kernel")
