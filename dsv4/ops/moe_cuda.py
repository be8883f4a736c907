"""CUDA fast paths of the decode MoE: `moe_experts` / `moe_post` (dsv4/kernels/cuda/moe.cu) and `router`
(router.cu, below). The experts: one token, MXFP4 routed experts with FP8
1x128 activation quantization (DeepSeek's FP4 path), an FP8 block-scaled shared expert (or none), bf16 activations.
Two launches (w1 / w3 + SwiGLU, then w2 + the ordered weighted sum); numerics as `moe_experts_ref` up to fp32
summation order and the FP8 MMA's accumulation inside each 32-value MXFP4 group / 128-value FP8 block.

`applies(...)` says whether a call takes this path (else the Triton kernels run: more tokens, NVFP4 or dense experts,
no activation quantization, other shapes, no CUDA build); `moe_decode(...)` launches it, with the FFN's mHC post in
its epilogue where `post_applies(...)` (the `moe_post` op), and after the post the next sublayer's mHC pre + RMSNorm
where `pre_applies(...)` (the `moe_post_pre` op: partial mixes in every down CTA, the last one finishes the token as the
boundary kernel does). No host sync, graph-safe: the expert ids are read on the device.

The decode router (dsv4/kernels/cuda/router.cu), 1-8 bf16 tokens: `router_applies(...)` / `router(...)`. One launch
whose CTAs copy their gate rows into shared memory before waiting on the kernel that writes x (programmatic dependent
launch), then form the fp32 logits; the last CTA to arrive scores and selects (router_ref's numerics up to fp32
summation order and a few ulp of expf / log1pf; ties to the lowest expert id, as the Triton router).
"""

from __future__ import annotations

import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.act_quant import QuantAct
from dsv4.ops.linear import PreparedLinear
from dsv4.ops.linear_cuda import PDL, _capability

MAX_K = 6  # routed experts per token (one warp each in the down kernel; two more take the shared expert)
ROUTER_MAX_T, ROUTER_MAX_E, ROUTER_MAX_K, ROUTER_MAX_D = 8, 512, 16, 8192  # router.h
ROUTER_FUNCS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


def _fp4_stack(w: PreparedLinear, n: int, k: int) -> bool:
    return (w.fmt == "mxfp4" and w.n == n and w.k == k and w.weight.dim() == 3 and w.weight.is_contiguous()
            and w.scale is not None and w.scale.is_contiguous())


def _fp8(w: PreparedLinear, n: int, k: int) -> bool:
    return (w.fmt == "fp8" and w.n == n and w.k == k and w.weight.dim() == 2 and w.weight.is_contiguous()
            and w.scale is not None and w.scale.is_contiguous())


def applies(x: torch.Tensor | QuantAct, weights: torch.Tensor, idx: torch.Tensor, w1: PreparedLinear,
            w2: PreparedLinear, w3: PreparedLinear, shared: tuple | None, act_quant: bool) -> bool:
    """True when the CUDA kernels run this call: CUDA sm_90+, one bf16 token, 1..6 routed MXFP4 experts with
    activation quantization, D a multiple of 2048 (<= 8192), inter a multiple of 512 (<= 2048), an FP8 shared expert
    or none, the module built. x may come with its quantization (a QuantAct), which the kernels then read."""
    if isinstance(x, QuantAct):
        if not _codes_fit(x):
            return False
        x = x.x
    if not (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and act_quant):
        return False
    if not (idx.dim() == 2 and idx.shape[0] == 1 and 1 <= idx.shape[1] <= MAX_K and weights.shape == idx.shape
            and idx.device == x.device and weights.device == x.device):
        return False
    D, N = x.shape[1], w1.n
    if not (D % 2048 == 0 and D <= 8192 and N % 512 == 0 and N <= 2048):
        return False
    if not (_fp4_stack(w1, N, D) and _fp4_stack(w3, N, D) and _fp4_stack(w2, D, N)):
        return False
    if shared is not None and not (_fp8(shared[0], N, D) and _fp8(shared[1], D, N) and _fp8(shared[2], N, D)):
        return False
    idx_dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if _capability(idx_dev)[0] < 9:
        return False
    return cuda_kernels.load() is not None


def _codes_fit(x: QuantAct) -> bool:
    return (x.q.dtype == torch.float8_e4m3fn and x.q.is_contiguous() and x.q.data_ptr() % 16 == 0
            and x.q.numel() == x.x.numel() and x.s.dtype == torch.float32 and x.s.is_contiguous()
            and x.s.numel() * 128 == x.x.numel() and x.q.device == x.x.device and x.s.device == x.x.device)


def post_applies(x: torch.Tensor | QuantAct, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> bool:
    """True when moe_decode can also run the FFN's mHC post (moe_post): bf16 streams of the one token [1, 1, 4, D]
    (x [1, D]), fp32 post [.., 4] and comb [.., 4, 4], all on x's device."""
    D = x.shape[-1]
    x = x.x if isinstance(x, QuantAct) else x
    return (streams.dtype == torch.bfloat16 and tuple(streams.shape) == (1, 1, 4, D) and post.dtype == torch.float32
            and post.numel() == 4 and comb.dtype == torch.float32 and comb.numel() == 16
            and all(t.device == x.device for t in (streams, post, comb)))


def _down_smem(inter: int) -> int:
    """Dynamic shared memory of one down CTA (mirrors moe.cu's smem_bytes(I): 8 warps x (ring, x, scales))."""
    return 8 * (3 * 2 * 1024 + 2 * inter + 16 * 4 + 1024 + 16 * 4)


def pre_applies(x: torch.Tensor | QuantAct, inter: int, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                hc: int, iters: int, w: torch.Tensor) -> bool:
    """True when moe_decode can also run the next sublayer's mHC pre + RMSNorm on the new streams (moe_post_pre, with
    post_applies): hc = 4, iters >= 1, contiguous 16-byte aligned fp32 fn [24, 4 D], base [24], scale [3] and bf16
    norm weight [D] on x's device, and room for the row in the down kernel's shared memory (10 D bytes)."""
    x = x.x if isinstance(x, QuantAct) else x
    D = x.shape[-1]
    if not (hc == 4 and iters >= 1 and 10 * D <= _down_smem(inter)):
        return False
    want = ((fn, torch.float32, 24 * 4 * D), (base, torch.float32, 24), (scale, torch.float32, 3), (w, torch.bfloat16, D))
    return all(t.dtype == dt and t.numel() == n and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.device == x.device
               for t, dt, n in want)


def moe_decode(x: torch.Tensor | QuantAct, weights: torch.Tensor, idx: torch.Tensor, w1: PreparedLinear,
               w2: PreparedLinear, w3: PreparedLinear, shared: tuple | None, limit: float,
               post: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, pre: tuple | None = None):
    """y [1, D] bf16 = the routed experts' weighted sum plus the shared expert's (see applies()); with post =
    (streams, post, comb) (see post_applies()) the new streams [1, 1, 4, D] = mhc_post(y, streams, post, comb),
    computed in the down kernel's epilogue; with pre = (fn, base, scale, iters, hc_eps, norm_eps, w, eps) as well (see
    pre_applies()) -> (new streams, y' [1, 1, D], post' [1, 1, 4], comb' [1, 1, 4, 4]) = the streams and
    mhc_pre_norm of them, finished by the down kernel's last CTA. Given a QuantAct, the up kernel copies its codes
    instead of quantizing x (the same codes: act_quant's)."""
    from dsv4.ops.triton_util import arrival_counters

    mod = cuda_kernels.load()
    k, N = idx.shape[1], w1.n
    codes = (x.q, x.s) if isinstance(x, QuantAct) else (None, None)
    x = (x.x if isinstance(x, QuantAct) else x).contiguous()
    h = torch.empty((k + 1, N), dtype=torch.bfloat16, device=x.device)  # stream-ordered scratch: graph-safe
    y = torch.empty_like(x)
    s = (None,) * 6 if shared is None else (shared[0].weight, shared[0].scale, shared[2].weight, shared[2].scale,
                                           shared[1].weight, shared[1].scale)
    fused = (None,) * 4
    if post is not None:
        streams, p, c = (t.contiguous() for t in post)
        out = torch.empty_like(streams)
        fused = (streams, p, c, out)
    nxt, scalars = (None,) * 10, (1, 0.0, 0.0, 0.0)
    if pre is not None:
        fn, base, scale, iters, hc_eps, norm_eps, w, eps = pre
        D, dev = x.shape[1], x.device
        ny = torch.empty((1, 1, D), dtype=torch.bfloat16, device=dev)
        npost = torch.empty((1, 1, 4), dtype=torch.float32, device=dev)
        ncomb = torch.empty((1, 1, 4, 4), dtype=torch.float32, device=dev)
        part = torch.empty((24, D // 16), dtype=torch.float32, device=dev)
        sq = torch.empty(D // 16, dtype=torch.float32, device=dev)
        nxt = (fn, base, scale, w, ny, npost, ncomb, part, sq, arrival_counters(dev, "moe next pre", 1))
        scalars = (int(iters), float(hc_eps), float(norm_eps), float(eps))
    mod.moe_decode(x, weights.contiguous().float(), idx.contiguous().long(), w1.weight, w1.scale, w3.weight,
                   w3.scale, w2.weight, w2.scale, *s, h, y, float(limit), PDL, *fused, *codes, *nxt, *scalars)
    if pre is not None:
        return fused[3], nxt[4], nxt[5], nxt[6]
    return y if post is None else fused[3]


def router_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
                   ids: torch.Tensor, func: str, topk: int) -> bool:
    """True when the CUDA router runs this call: CUDA sm_90+, 1-8 contiguous bf16 tokens and a contiguous bf16 gate
    [E, D] (16-byte aligned as given: the gate is read before the previous kernel completes, so no copy is made),
    E a multiple of 32 up to 512, D a multiple of 8 up to 8192, 1 <= k <= min(E, 16), a known scoring function, an
    16-byte aligned fp32 bias [E] or int64 tid2eid [vocab, k] + ids [T], every tensor on x's device, the module
    built."""
    if not (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= ROUTER_MAX_T and x.dtype == torch.bfloat16):
        return False
    if not (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.shape[1] == x.shape[1]):
        return False
    E, D = weight.shape
    if not (E % 32 == 0 and 32 <= E <= ROUTER_MAX_E and D % 8 == 0 and 8 <= D <= ROUTER_MAX_D
            and 1 <= topk <= min(E, ROUTER_MAX_K) and func in ROUTER_FUNCS):
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.device == x.device for t in (x, weight)):
        return False
    if tid2eid is not None:
        if not (tid2eid.dtype == torch.int64 and tid2eid.dim() == 2 and tid2eid.shape[1] == topk
                and tid2eid.stride(1) == 1 and ids.dtype == torch.int64 and ids.shape == (x.shape[0],)
                and tid2eid.device == x.device and ids.device == x.device):
            return False
    elif bias is None or not (bias.dtype == torch.float32 and bias.shape == (E,) and bias.is_contiguous()
                              and bias.data_ptr() % 16 == 0 and bias.device == x.device):
        return False
    idx_dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if _capability(idx_dev)[0] < 9:
        return False
    return cuda_kernels.load() is not None


def router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
           ids: torch.Tensor, func: str, topk: int, norm_topk: bool, route_scale: float):
    """(weights [T, k] fp32, experts [T, k] int64), as router_ref (see router_applies())."""
    from dsv4.ops.triton_util import arrival_counters

    mod = cuda_kernels.load()
    T, E = x.shape[0], weight.shape[0]
    dev = x.device
    logits = torch.empty((T, E), dtype=torch.float32, device=dev)
    wts = torch.empty((T, topk), dtype=torch.float32, device=dev)
    idx = torch.empty((T, topk), dtype=torch.int64, device=dev)
    hashed = tid2eid is not None
    mod.router(x, weight, None if hashed else bias, tid2eid, ids.contiguous() if hashed else None, logits,
               arrival_counters(dev, "router decode", 1), wts, idx, ROUTER_FUNCS[func],
               bool(norm_topk and func != "softmax"), float(route_scale), PDL)
    return wts, idx
