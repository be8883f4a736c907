"""Sparse MQA attention with a per-head sink over index lists (SPEC §2.3.5), reference in PyTorch.

One shared K = V vector per key. Each query attends to the keys its index list names: first the
window part (rows of `kv_win`: the ring followed by the chunk's own kv), then the compressed part
(rows of `kv_comp`: HCA's visible entries ascending, CSA's indexer top-k in score order); -1 marks
an empty slot. The list is walked in blocks of 64 slots with DeepSeek's online softmax:
per block m_new = max(m, max s); p = exp(s - m_new) (fp32); Z = Z e^(m - m_new) + sum p (unrounded);
acc = acc e^(m - m_new) + P.V with P rounded to the KV dtype (bf16) and the products summed in fp32.
At the end Z += exp(sink - m) (the sink adds to the denominator only; the max excludes it) and
o = acc / Z in fp32, rounded once. A query with no valid slot gets an all-zero output. Block
boundaries count the -1 slots too, so the layout of the list is part of the numerics.

K = V rows come in q's dtype, or both parts as packed FP8 rows (dsv4/ops/kv_pack.py: uint8 [B, N,
kv_row_bytes(D)], the state's form under reference numerics), which are read as their exact bf16 values.

Since K = V carries RoPE on its last dims, the output's RoPE dims are rotated back to the query's own
position: given (cos, sin) at the queries' positions, the rounded output goes through
`rope_ref(o, cos, sin, inverse=True)` (fp32 math, rounded again), as the model did after the attention.
"""

from __future__ import annotations

import torch

from dsv4.ops.kv_pack import is_packed, kv_unpack_ref
from dsv4.ops.rope import rope_ref

BLOCK = 64  # slots per online-softmax step, as DeepSeek's kernel


def gather_rows(kv: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """kv [B, N, D], idx [B, S, L] int (-1 = none) -> [B, S, L, D] (rows of -1 are row 0; mask them)."""
    B, S, L = idx.shape
    flat = idx.clamp_min(0).long().reshape(B, S * L)
    return torch.gather(kv, 1, flat[..., None].expand(-1, -1, kv.shape[-1])).view(B, S, L, -1)


def sparse_attn_ref(q: torch.Tensor, kv_win: torch.Tensor, idx_win: torch.Tensor, kv_comp: torch.Tensor | None,
                    idx_comp: torch.Tensor | None, sink: torch.Tensor, scale: float, cos: torch.Tensor | None = None,
                    sin: torch.Tensor | None = None) -> torch.Tensor:
    """q [B,S,H,D]; kv_win [B,Nw,D] + idx_win [B,S,Lw]; kv_comp [B,Nc,D] + idx_comp [B,S,Lc] (or None);
    sink [H] fp32 -> o [B,S,H,D] in q.dtype; cos, sin [S, rd/2] fp32 (or None): the last rd dims of o
    RoPE-inverted at the queries' positions. kv_win / kv_comp may be packed FP8 rows (both), read as bf16."""
    keys, idx = [gather_rows(kv_win, idx_win)], [idx_win]
    if idx_comp is not None and idx_comp.shape[-1] > 0:
        keys.append(gather_rows(kv_comp, idx_comp))
        idx.append(idx_comp)
    k = torch.cat(keys, 2)  # [B,S,L,D] in the KV dtype
    if is_packed(k):
        k = kv_unpack_ref(k, q.shape[-1])
    valid = torch.cat(idx, 2) >= 0  # [B,S,L]
    s = torch.einsum("bshd,bsld->bshl", q.float(), k.float()) * scale  # fp32 logits
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    B, S, H, D = q.shape
    m = torch.full((B, S, H), float("-inf"), device=q.device)
    z = torch.zeros(B, S, H, device=q.device)
    acc = torch.zeros(B, S, H, D, device=q.device)
    base = torch.zeros_like(m)  # the running max, 0 while no slot was valid (keeps exp() finite)
    for b0 in range(0, s.shape[-1], BLOCK):
        sb = s[..., b0:b0 + BLOCK]
        m_new = torch.maximum(m, sb.amax(-1))
        base_new = torch.where(torch.isinf(m_new), 0.0, m_new)
        alpha = torch.exp(m - base_new)  # 0 while nothing was valid (acc and z are still 0)
        p = torch.exp(sb - base_new[..., None])  # fp32
        z = z * alpha + p.sum(-1)
        pv = torch.einsum("bshl,bsld->bshd", p.to(k.dtype).float(), k[:, :, b0:b0 + BLOCK].float())
        acc = acc * alpha[..., None] + pv
        m, base = m_new, base_new
    z = z + torch.exp(sink.float() - base)
    o = (acc / z[..., None]).to(q.dtype)
    return o if cos is None else rope_ref(o, cos, sin, True)


def make_fast(triton_fast):
    """The fast `sparse_attn`: the CUDA kernels (dsv4/ops/sparse_attn_cuda.py) for the calls they take (bf16, D = 512:
    decode, 1-8 queries, one launch for lists up to 1536 slots, three past it; prefill chunks, H a multiple of 64, one
    launch), the Triton kernels for everything else."""
    if triton_fast is None:
        return None
    from dsv4.ops import sparse_attn_cuda

    def sparse_attn_fast(q, kv_win, idx_win, kv_comp, idx_comp, sink, scale, cos=None, sin=None):
        if sparse_attn_cuda.applies(q, kv_win, idx_win, kv_comp, idx_comp, sink, cos, sin):
            return sparse_attn_cuda.sparse_attn(q, kv_win, idx_win, kv_comp, idx_comp, sink, scale, cos, sin)
        return triton_fast(q, kv_win, idx_win, kv_comp, idx_comp, sink, scale, cos, sin)

    sparse_attn_fast.__doc__ = triton_fast.__doc__
    return sparse_attn_fast


def register_ops(register) -> None:
    try:  # the Triton fast path; without Triton the reference runs and ops.configure lists it so
        from dsv4.ops.sparse_attn_triton import sparse_attn as triton_fast
    except ImportError:
        triton_fast = None
    register("sparse_attn", sparse_attn_ref, make_fast(triton_fast), interpretable=True,
             doc="MQA over window + compressed index lists, 64-slot online softmax with sink, output RoPE-inverted",
             cuda="D = 512: decode (1-8 queries) in one launch for lists <= 1536 slots, three for longer ones; "
                  "prefill chunks (H a multiple of 64) in one launch, wgmma")
