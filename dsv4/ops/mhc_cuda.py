"""CUDA fast path of the fused mHC ops for decode (dsv4/kernels/cuda/mhc.cu): one launch per boundary.

`mhc_post_pre_norm` (a sublayer's post, the next pre, its RMSNorm) and `mhc_pre_norm` (no post) of 1-8 tokens with
bf16 streams and norm weight, hc = 4, D a multiple of 64: 64-column CTAs write the new streams (mhc_post's bits) and
their partial mixes; the last CTA of each token to arrive reduces them in a fixed order and finishes the token (the
Sinkhorn comb in one warp beside y = sum_j pre_j X_j and its RMSNorm in the others). Same input, same bits; no host
sync, graph-safe (the arrival counters reset themselves). `applies(...)` says whether a call takes this path (else
the Triton kernels run: prefill chunks, other shapes or dtypes, no CUDA build). mhc_pre_norm's keep (a decode step's
row of a compressor's kept input, `keeps(...)`) is one more store of the finished row, at a slot read on the device.
"""

from __future__ import annotations

import torch

from dsv4.kernels import cuda as cuda_kernels
from dsv4.ops.act_quant import QuantAct
from dsv4.ops.linear_cuda import PDL, _capability, _index

MAX_T = 8  # tokens per launch (the arrival counters); larger calls are prefill chunks: Triton
COLS = 64  # columns of every stream per CTA
MAX_D = 7168  # the finishing CTA holds a row of up to 7168 in registers (Flash 4096, Pro 7168)


def _f32(*ts) -> bool:
    return all(t.dtype == torch.float32 for t in ts)


def applies(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int,
            w: torch.Tensor, f: torch.Tensor | None = None, post: torch.Tensor | None = None,
            comb: torch.Tensor | None = None, quant: bool = False) -> bool:
    """True when the CUDA kernel runs this call: CUDA sm_90+, contiguous 16-byte aligned bf16 streams [B, S, 4, D]
    with B * S <= 8, D % 64 == 0 (% 128 with quant) and 64 <= D <= 7168; a contiguous aligned fp32 mixer and bf16
    norm weight; fp32 base / scale (and post / comb), a bf16 sublayer output [B, S, D]; the module built."""
    if not (x.is_cuda and x.dim() == 4 and hc == 4 and x.shape[2] == 4 and x.dtype == torch.bfloat16 and iters >= 1):
        return False
    T, D = x.shape[0] * x.shape[1], x.shape[3]
    if not (1 <= T <= MAX_T and D % COLS == 0 and COLS <= D <= MAX_D and not (quant and D % 128)):
        return False
    if not (_f32(fn, base, scale) and tuple(fn.shape) == (24, 4 * D) and base.numel() == 24 and scale.numel() == 3):
        return False
    if w.dtype != torch.bfloat16 or tuple(w.shape) != (D,):
        return False
    # contiguous and 16-byte aligned as given: the weights are read before the previous kernel completes (a copy
    # made here would be that kernel's output), the streams as 16-byte vectors
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (x, fn, w)):
        return False
    if f is not None and not (f.dtype == torch.bfloat16 and tuple(f.shape) == tuple(x.shape[:2]) + (D,)
                              and _f32(post, comb) and post.numel() == T * 4 and comb.numel() == T * 16):
        return False
    if any(t.device != x.device for t in (fn, base, scale, w) + ((f, post, comb) if f is not None else ())):
        return False
    if _capability(_index(x))[0] < 9:
        return False
    return cuda_kernels.load() is not None


def keeps(x: torch.Tensor, keep: tuple) -> bool:
    """Whether the launch itself writes mhc_pre_norm's keep = (ring, slots) (see dsv4/ops/mhc.py): one token per
    sequence (S = 1, one slot), a bf16 ring [B, r, D] on x's device, rows contiguous and 16-byte aligned, slots int64."""
    ring, slots = keep
    B, S, _, D = x.shape
    return (S == 1 and slots.numel() == 1 and slots.dtype == torch.int64 and slots.device == x.device
            and ring.dtype == torch.bfloat16 and ring.device == x.device and ring.dim() == 3
            and ring.shape[0] == B and ring.shape[2] == D and ring.stride(2) == 1 and ring.stride(1) == D
            and ring.stride(0) % 8 == 0 and ring.data_ptr() % 16 == 0)


def boundary(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
             norm_eps: float, w: torch.Tensor, eps: float, f: torch.Tensor | None = None,
             post: torch.Tensor | None = None, comb: torch.Tensor | None = None, quant: bool = False,
             keep: tuple | None = None):
    """mhc_pre_norm (f is None) -> (y, post', comb'), or mhc_post_pre_norm -> (streams, y, post', comb'), as the
    Triton ops return them (see applies()); with quant, y comes as a QuantAct whose codes the same launch wrote. keep
    (where keeps() holds): y's row also written to ring[b, slots[0]] by the same launch."""
    from dsv4.ops.triton_util import arrival_counters

    mod = cuda_kernels.load()
    B, S, hc, D = x.shape
    T, nch = B * S, D // COLS
    x = x.contiguous()
    dev = x.device
    y = torch.empty(B, S, D, dtype=x.dtype, device=dev)
    post_out = torch.empty(B, S, hc, dtype=torch.float32, device=dev)
    comb_out = torch.empty(B, S, hc, hc, dtype=torch.float32, device=dev)
    part = torch.empty(T, 24, nch, dtype=torch.float32, device=dev)
    sq = torch.empty(T, nch, dtype=torch.float32, device=dev)
    out = None
    yq = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=dev) if quant else None
    yqs = torch.empty(T, D // 128, dtype=torch.float32, device=dev) if quant else None
    if f is not None:
        f, post, comb = f.contiguous(), post.contiguous(), comb.contiguous()
        out = torch.empty_like(x)
    mod.mhc_boundary(f, x.view(T, hc, D), post, comb, fn.contiguous(), base.contiguous(), scale.contiguous(),
                     w.contiguous(), None if out is None else out.view(T, hc, D), y, post_out, comb_out, part, sq,
                     arrival_counters(dev, "mhc boundary", MAX_T), int(iters), float(hc_eps), float(norm_eps),
                     float(eps), PDL, yq, yqs, None if keep is None else keep[0], None if keep is None else keep[1])
    if quant:
        y = QuantAct(y, yq, yqs)
    if out is None:
        return y, post_out, comb_out
    return out, y, post_out, comb_out
