"""Sparse MQA attention with a per-head sink (SPEC §2.3.5), reference in PyTorch.

One shared K = V vector per key; each query attends to the keys its mask marks visible. The sink
logit adds exp(sink - m) to the softmax denominator only (no value), and the max m excludes it.
Probabilities enter the P.V product in the KV dtype (bf16 in DeepSeek's kernel), the division by
the denominator runs in fp32. A query with no visible key gets an all-zero output.
"""

from __future__ import annotations

import torch


def sparse_attn_ref(q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q: [B,S,H,D], kv: [B,N,D], visible: [B,S,N] bool, sink: [H] fp32 -> o: [B,S,H,D] in q.dtype."""
    if kv.shape[1] != visible.shape[-1]:
        raise ValueError(f"mask covers {visible.shape[-1]} keys but kv has {kv.shape[1]}")
    s = torch.einsum("bshd,bnd->bshn", q.float(), kv.float()) * scale  # fp32 logits
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # rows with no visible key
    p = torch.exp(s - m)  # [B,S,H,N]
    z = p.sum(-1, keepdim=True) + torch.exp(sink.float()[None, None, :, None] - m)
    o = torch.einsum("bshn,bnd->bshd", p.to(kv.dtype), kv).float() / z
    return o.to(q.dtype)
